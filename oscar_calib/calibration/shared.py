"""Shared per-layer rotations and one global K/V clip pair, for engines that take one rotation per
layer and one clip ratio per cache (the OSCAR SGLang fork's main branch).

Decisions (documented in docs/guides/serving.md):

* **Shared rotation**: the layer's KV-head covariances are pooled (their mean, the same pooling as
  ``--granularity layer``) and eigendecomposed once; composed exactly like the per-head rotations
  (``U·H·P_br`` by default), from the uncentered keys' objective (the engines that take one
  rotation per layer do not center keys). It is stored only when it differs from the per-head
  rotations: when those differ between heads, or were fitted on centered keys
  (:func:`centered_key_objective`); for ``--granularity layer`` or one KV head without key centering
  the per-head rotation already is the layer's.
* **Global clips**: one K ratio and one V ratio for the whole model, chosen from the same grid as the
  per-head fit on the same held-out rows, with the shared rotations and uncentered keys (the engines
  that take one rotation per layer do not center keys), by
  :func:`~oscar_calib.numerics.clip.choose_global_clips` (every layer counts the same). Fixed clips
  (``--clip k=..,v=..``) are used as they are.
* **Cost report**: the held-out errors of this scheme (shared rotation, global clips) are added to
  every layer's report row beside OSCAR's own and Hadamard's, so ``calibration.json`` says what
  sharing costs on this model.
"""

from __future__ import annotations

import torch

from ..numerics.clip import choose_global_clips, fit_k_clip, fit_v_clip, heldout_errors
from ..numerics.rotation import K_OBJECTIVES, V_OBJECTIVES, rotations_from_covariance
from ..progress import ProgressFn, counter

# With key centering fitted on the centered keys (``center_keys``, ``center_fit: centered``) the
# ``ktk`` objective is the second moment of the keys as the cache stores them, centered:
# Σ (k − μ)ᵀ(k − μ) / n, instead of the raw Σ kᵀk / n (both with clips fitted on centered keys):
# measured in docs/guides/accuracy.md ("Key centering") by scripts/experiments/centering.py, which
# sets this to compare them.
CENTER_KEY_OBJECTIVE = True


def centered_key_objective(cfg) -> bool:
    """Whether the key rotations of ``cfg`` are fitted on the objective of centered keys: key
    centering fitted on the centered keys (``cfg.fits_centered_keys``), the ``ktk`` objective
    (``qqt`` does not see the keys) and :data:`CENTER_KEY_OBJECTIVE`."""
    return cfg.fits_centered_keys and CENTER_KEY_OBJECTIVE and K_OBJECTIVES[cfg.k_objective] == "k"


def fit_shared(stats: list, held_layers, cfg, geo, group_size: int, layers: list, rows: list, *,
               exchange=None, progress: ProgressFn | None = None) -> tuple[float, float]:
    """Add shared rotations to ``layers`` (when heads differ), fork-scheme held-out errors to
    ``rows``, and return the global ``(k_clip, v_clip)``. ``layers`` and ``rows`` are the layers this
    process fits (``rows[j]["layer"]`` is the index of ``layers[j]``; every layer in one process);
    ``held_layers(i)`` gives layer i's :class:`~oscar_calib.numerics.clip.HeldoutLayer`, its keys
    uncentered (the per-head clip tables are reused only when they were fitted so too).
    ``exchange(obj, what)`` returns every process's ``obj`` (the ranks of a data-parallel job, each
    fitting its own layers; default: this process alone): the per-layer clip tables are put back
    in layer order, so the global clips are chosen from the same tables in the same order wherever
    the layers were fitted."""
    shared_needed = (cfg.granularity == "head" and max(geo.kv_heads) > 1) or centered_key_objective(cfg)
    reuse_k = not shared_needed and not cfg.fits_centered_keys     # the per-head K tables fit these keys
    kc, vc = K_OBJECTIVES[cfg.k_objective], V_OBJECTIVES[cfg.v_objective]
    k_tables, v_tables = [], []
    rots = []
    tick = counter(progress, "shared rotations", 2 * len(rows), "steps")
    for j, row in enumerate(rows):
        i = row["layer"]
        s = stats[i]
        if shared_needed:
            k_rot, k_eig = rotations_from_covariance(s.covariance(kc), cfg.composition, "layer", warn=False)
            v_rot, v_eig = rotations_from_covariance(s.covariance(vc), cfg.composition, "layer", warn=False)
            lr = layers[j]
            lr.k_layer_rotation, lr.k_layer_eigenvalues = k_rot[0].float(), k_eig[0].float()
            lr.v_layer_rotation, lr.v_layer_eigenvalues = v_rot[0].float(), v_eig[0].float()
        else:
            k_rot, v_rot = layers[j].k_rotation.double(), layers[j].v_rotation.double()
        rots.append((k_rot, v_rot))
        tables = row.get("clip_tables") or {}
        held = None
        if cfg.k_clip is None:
            if reuse_k and tables.get("k") is not None:
                kt = torch.tensor(tables["k"], dtype=torch.float64)
            else:
                held = held or held_layers(i)
                _, kt = fit_k_clip(held.k_rows(), k_rot, s.covariance("q"), group_size)
            k_tables.append(kt)
        if cfg.v_clip is None:
            if not shared_needed and tables.get("v") is not None:
                vt = torch.tensor(tables["v"], dtype=torch.float64)
            else:
                held = held or held_layers(i)
                _, vt = fit_v_clip(held, v_rot, group_size)
            v_tables.append(vt)
        tick(j + 1)
    mine = ([r["layer"] for r in rows], [t.cpu() for t in k_tables], [t.cpu() for t in v_tables])
    every = exchange(mine, "the global clip tables") if exchange is not None else [mine]
    k_fit, v_fit = choose_global_clips(*(in_layer_order(every, n) for n in (1, 2)))
    k_clip = cfg.k_clip if cfg.k_clip is not None else k_fit
    v_clip = cfg.v_clip if cfg.v_clip is not None else v_fit
    for j, (k_rot, v_rot) in enumerate(rots):
        h = geo.kv_heads[rows[j]["layer"]]
        full = lambda c: torch.full((h,), float(c), dtype=torch.float64)  # noqa: E731
        rows[j]["heldout"]["fork"] = heldout_errors(held_layers(rows[j]["layer"]), k_rot, full(k_clip), v_rot,
                                                    full(v_clip), group_size)
        tick(len(rows) + j + 1)
    return float(k_clip), float(v_clip)


def in_layer_order(parts: list, field: int) -> list:
    """``parts[p] = (layer indices, values..., )`` from every process: ``field``'s values of all
    layers, sorted by layer index."""
    pairs = [(i, v) for part in parts for i, v in zip(part[0], part[field])]
    return [v for _, v in sorted(pairs, key=lambda p: p[0])]
