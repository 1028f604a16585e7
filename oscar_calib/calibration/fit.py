"""Everything after the capture, per layer: rotations from the accumulators' eigenbases
(:func:`layer_rotations`), clips fitted on the held-out rows (:func:`fit_clips`), held-out errors
against the Hadamard baseline and the report rows (:func:`build_rotations`), and, over every layer,
a bit budget's group sizes and the shared rotations with their global clips (:func:`fit_layers`).
Under data parallelism each rank fits its share of the layers (:class:`~.ranks.Ranks`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract.artifact import LayerRotations
from ..contract.config import CalibrationConfig
from ..contract.defaults import BASELINE_CLIPS
from ..errors import InputError
from ..model.geometry import Geometry
from ..numerics.clip import HeldoutLayer, fit_k_clip, fit_v_clip, heldout_errors
from ..numerics.refine import RefineSettings, refine_layer
from ..numerics.rotation import (
    K_OBJECTIVES,
    V_OBJECTIVES,
    compose,
    orthogonality_error,
    rotations_from_covariance,
)
from ..progress import ProgressFn, counter, step
from .collect import StatsRun
from .ranks import Ranks
from .shared import centered_key_objective, fit_shared, in_layer_order
from .stats import rows_on


def heldout_layer(run: StatsRun, layer: int, centered: bool = False) -> HeldoutLayer:
    """Layer ``layer``'s held-out rows (kept on the CPU), float32 on the run's fitting device;
    ``centered``: its keys quantised centered on the statistics' mean key (key centering)."""
    r, info = run.reservoir[layer], run.layer_info[layer]
    dev = run.fit_device
    mean = run.key_mean(layer).to(dev) if centered else None
    sinks = info.get("sinks")
    return HeldoutLayer(rows_on(r.q, dev), rows_on(r.k, dev), rows_on(r.v, dev), rows_on(r.o, dev), info["scaling"],
                        info["sliding_window"], info["softcap"],
                        sinks=None if sinks is None else torch.tensor(sinks, device=dev), chunk=info.get("chunk"),
                        k_mean=mean)


def mean_share(s, mu: torch.Tensor | None = None) -> list[float]:
    """Per KV head, the share of the keys' energy in their mean, ``‖μ‖² / (Σ‖k‖² / n)`` (0: centered
    already; what key centering takes out of the keys), from a layer's statistics (``mu``: the mean
    key, default theirs)."""
    mu = s.key_mean() if mu is None else mu
    energy = s.covariance("k").diagonal(dim1=-2, dim2=-1).sum(-1)
    return [round(float(x), 4) for x in (mu.pow(2).sum(-1) / energy.clamp(min=1e-300))]


def spread(eig: torch.Tensor) -> float:
    """Eigenvalue spread λ_max / mean λ, averaged over heads (1 = isotropic, d = rank one)."""
    e = eig.double().clamp(min=0)
    return float((e[..., 0] / e.mean(-1).clamp(min=1e-300)).mean())


def layer_rotations(run: StatsRun, cfg: CalibrationConfig, only: list[int] | None = None) -> list[tuple]:
    """Per layer (of ``only``, default all) ``(k_rot, k_eig, v_rot, v_eig)``: the eigenbases of the
    objectives' covariances, composed as ``cfg`` says (float64); with key centering the ``ktk``
    objective of the centered keys (:func:`~.shared.centered_key_objective`)."""
    kc, vc = K_OBJECTIVES[cfg.k_objective], V_OBJECTIVES[cfg.v_objective]
    centered = centered_key_objective(cfg)
    out = []
    for i in range(len(run.stats)) if only is None else only:
        s = run.stats[i]
        k_rot, k_eig = rotations_from_covariance(s.covariance(kc, centered=centered), cfg.composition, cfg.granularity,
                                                 warn=(i == 0))
        v_rot, v_eig = rotations_from_covariance(s.covariance(vc), cfg.composition, cfg.granularity, warn=False)
        out.append((k_rot, k_eig, v_rot, v_eig))
    return out


def build_rotations(run: StatsRun, cfg: CalibrationConfig, geo: Geometry, group_size: int, *,
                    progress: ProgressFn | None = None, groups: list | None = None,
                    rotations: list | None = None, fitted: list | None = None,
                    only: list[int] | None = None) -> tuple[list, list]:
    """Rotations, clips and per-layer report rows of the layers ``only`` (default: every layer).
    With key centering the layers hold the statistics' mean key; the fit reads the keys centered on
    it or raw as ``cfg.center_fit`` says, and the report's held-out errors are always those of the
    keys as stored (centered).
    ``groups``: per layer ``(K, V)`` group sizes (a bit budget, :mod:`oscar_calib.calibration.budget`)
    the clips are fitted for; default ``group_size`` everywhere. ``rotations``: :func:`layer_rotations`
    already computed (for ``only``); ``fitted``: per layer of ``only`` the budget's
    :class:`~oscar_calib.calibration.budget.LayerFits`, whose clips and held-out records for the
    layer's sizes are taken instead of fitting them again."""
    layers, rows = [], []
    only = list(range(len(run.stats))) if only is None else only
    tick = counter(progress, "rotations + clips", len(only), "layers")
    rotations = rotations if rotations is not None else layer_rotations(run, cfg, only)
    for j, i in enumerate(only):
        s = run.stats[i]
        cq = s.covariance("q")
        k_rot, k_eig, v_rot, v_eig = rotations[j]
        held = heldout_layer(run, i, cfg.fits_centered_keys)
        gk, gv = groups[i] if groups else (group_size, group_size)
        if fitted is not None:
            k_clip, k_table, v_clip, v_table = fitted[j].clips(gk, gv)
        else:
            k_clip, k_table, v_clip, v_table = fit_clips(held, k_rot, v_rot, cq, cfg, geo.kv_heads[i], gk, gv)
        refined = None
        if cfg.refine_steps:      # refine with the start's clips on the same held-out rows, then fit them again
            if gk != gv:
                raise InputError("--refine-steps needs one group size for K and V in every layer")
            settings = RefineSettings(steps=cfg.refine_steps, lr=cfg.refine_lr, sink=cfg.sink_tokens)
            k_rot, v_rot, refined = refine_layer(held.to("cpu"), k_rot, k_clip, v_rot, v_clip, gk, settings)
            k_clip, k_table, v_clip, v_table = fit_clips(held, k_rot, v_rot, cq, cfg, geo.kv_heads[i], gk, gv)
        if cfg.center_keys and not cfg.fits_centered_keys:      # fitted raw, stored centered: the stored keys' errors
            ours = heldout_errors(heldout_layer(run, i, True), k_rot, k_clip, v_rot, v_clip, gk, gv)
        elif fitted is not None and refined is None:
            ours = fitted[j].errors[(gk, gv)]
        else:
            ours = heldout_errors(held, k_rot, k_clip, v_rot, v_clip, gk, gv)
        h = compose(torch.eye(geo.head_dims[i], dtype=torch.float64).expand(geo.kv_heads[i], -1, -1), "h", warn=False)
        base = heldout_errors(held.uncentered(), h, torch.full_like(k_clip, BASELINE_CLIPS[0]), h,
                              torch.full_like(v_clip, BASELINE_CLIPS[1]), gk, gv)
        layers.append(LayerRotations(k_rotation=k_rot.float(), v_rotation=v_rot.float(), k_clip=k_clip.float(),
                                     v_clip=v_clip.float(), k_eigenvalues=k_eig.float(), v_eigenvalues=v_eig.float(),
                                     k_mean=run.key_mean(i).float() if cfg.center_keys else None))
        rows.append({
            "layer": i, **({"model_layer": geo.ids[i]} if geo.layer_ids is not None else {}),
            "attention": geo.layer_types[i] if i < len(geo.layer_types) else "full_attention",
            "k_spread": spread(k_eig), "v_spread": spread(v_eig), "k_mean_share": mean_share(s, run.key_mean(i)),
            **({"k_group_size": gk, "v_group_size": gv} if groups else {}),
            "k_clip": [round(float(c), 4) for c in k_clip], "v_clip": [round(float(c), 4) for c in v_clip],
            "heldout": {"oscar": ours, "hadamard": base},
            "orthogonality": max(orthogonality_error(k_rot.float()), orthogonality_error(v_rot.float())),
            "clip_tables": {"k": None if k_table is None else k_table.tolist(),
                            "v": None if v_table is None else v_table.tolist()},
            **({} if refined is None else {"refine": refined}),
        })
        tick(j + 1)
    return layers, rows


@dataclass
class Fitted:
    """Every layer's rotations and clips (the artifact's layers), their report rows, the uniform
    group size, the bit budget's record (or None) and the global K/V clip pair."""

    layers: list[LayerRotations]
    rows: list[dict]
    group_size: int
    budget: dict | None
    shared_clips: tuple[float, float]


def fit_layers(run: StatsRun, cfg: CalibrationConfig, geo: Geometry, group_size: int, *,
               ranks: Ranks | None = None, progress: ProgressFn | None = None) -> Fitted | None:
    """Everything after the capture: rotations (eigendecompositions), clip grids, held-out errors,
    a bit budget's group sizes, the shared rotations and global clips. Under data parallelism each
    rank fits its ``ranks.fit_share`` of the layers, the ranks exchange the small tables the global
    decisions need, and rank 0 gets every layer (the other ranks get None)."""
    ranks = ranks or Ranks()
    mine = ranks.fit_share(len(run.stats))
    budget = None
    if cfg.bit_budget:
        from .budget import budget_tables, candidate_sizes, spend_budget

        rotations = layer_rotations(run, cfg, mine)
        fitted: list = []
        with step(progress, "bit budget"):
            tables = budget_tables(lambda j: heldout_layer(run, mine[j], cfg.fits_centered_keys),
                                   [(r[0], r[2]) for r in rotations],
                                   [run.stats[i].covariance("q") for i in mine], cfg, geo.num_kv_heads,
                                   candidate_sizes(geo.head_dim), keep=fitted)
            every = ranks.exchange((mine, tables), "the bit budget's tables")
            alloc, budget = spend_budget(in_layer_order(every, 1), run.layer_info, cfg, geo)
        group_size = budget["uniform_group_size"]
        layers, rows = build_rotations(run, cfg, geo, group_size, progress=progress, groups=alloc.groups,
                                       rotations=rotations, fitted=fitted, only=mine)
    else:
        layers, rows = build_rotations(run, cfg, geo, group_size, progress=progress, only=mine)
    shared_clips = fit_shared(run.stats, lambda i: heldout_layer(run, i), cfg, geo, group_size, layers, rows,
                              exchange=ranks.exchange, progress=progress)
    parts = ranks.gather((mine, layers, rows), "the fitted layers")
    if parts is None:
        return None
    return Fitted(in_layer_order(parts, 1), in_layer_order(parts, 2), group_size, budget, shared_clips)


def fit_clips(held: HeldoutLayer, k_rot: torch.Tensor, v_rot: torch.Tensor, cq: torch.Tensor,
              cfg: CalibrationConfig, heads: int, group_size: int, v_group_size: int | None = None) -> tuple:
    """``(k_clip, k_table, v_clip, v_table)`` of one layer: fitted on the held-out rows (values for
    ``v_group_size`` when given), or the fixed ratios of ``cfg`` (table None)."""
    k_table = v_table = None
    if cfg.k_clip is None:
        k_clip, k_table = fit_k_clip(held.k_rows(), k_rot, cq, group_size)
    else:
        k_clip = torch.full((heads,), cfg.k_clip, dtype=torch.float64)
    if cfg.v_clip is None:
        v_clip, v_table = fit_v_clip(held, v_rot, v_group_size or group_size)
    else:
        v_clip = torch.full((heads,), cfg.v_clip, dtype=torch.float64)
    return k_clip, k_table, v_clip, v_table


__all__ = ["Fitted", "build_rotations", "fit_clips", "fit_layers", "heldout_layer", "layer_rotations", "spread"]
