"""``calibrate``: model → capture → streaming statistics → rotations → clips → artifact.

The pipeline passes its state explicitly; the CLI gives it a progress callback and renders the
result. Accumulators are checkpointed every ``checkpoint_every`` batches into
``<out>/.oscar-checkpoint.pt`` (atomic); ``resume=True`` continues from it when the settings,
model fingerprint and token ids match, and gives a byte-identical ``oscar.safetensors``.

This is the single-process algorithm. Where data parallelism changes it, it calls a hook of a
:class:`~oscar_calib.calibrate.ranks.Ranks` (no-ops for one process): ``calibrate`` started as one
rank of a job (torchrun, accelerate launch, ``oscar calibrate --nproc``) joins it through
:func:`oscar_calib.calibrate.parallel.data_parallel`; a plain run never starts a process group.
Starting ranks is :mod:`oscar_calib.jobs.launch`; big models, :mod:`oscar_calib.model.placement`.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import FORMAT_VERSION, __version__
from ..contract.artifact import Artifact, LayerRotations
from ..contract.config import CalibrationConfig, stable_hash
from ..contract.defaults import BASELINE_CLIPS, check_group_size, default_group_size
from ..contract.layout import (
    FORMAT_NAME,
    MODEL_SOURCE_METADATA,
    REPORT_NAME,
    TEXT_CONFIG_METADATA,
    WEIGHTS_NAME,
)
from ..contract.settings import ArtifactSettings, GroupPair
from ..data.corpus import TokenPlan, load_texts, plan_tokens
from ..errors import InputError, OscarWarning, UnsupportedModelError
from ..jobs.env import launched
from ..model.capture import Capture, call_window, capture_forward
from ..model.geometry import Geometry, context_length
from ..model.load import LoadedModel, load_model, load_tokenizer
from ..model.placement import Placement, input_device
from ..numerics.clip import HeldoutLayer, fit_k_clip, fit_v_clip, heldout_errors
from ..numerics.refine import RefineSettings, refine_layer, split_sequences
from ..numerics.rotation import (
    K_OBJECTIVES,
    V_OBJECTIVES,
    compose,
    orthogonality_error,
    rotations_from_covariance,
)
from ..progress import ProgressFn, counter, report, step
from .checkpoint import (
    CHECKPOINT_NAME,
    failing_cleanly,
    interruptible,
    load_checkpoint,
    other_world_checkpoints,
    remove_checkpoints,
    save_checkpoint,
)
from .ranks import Ranks
from .report import build_report, check_output_dir, write_outputs
from .shared import fit_shared, in_layer_order
from .stats import LayerStats, Reservoir, check_finite, require_finite, rows_on


def prepare_model(cfg: CalibrationConfig, *, device: str | None = None, placement: Placement | None = None,
                  progress: ProgressFn | None = None, tokenizer=None) -> LoadedModel:
    """Load ``cfg.model`` as ``cfg`` says (dtype, device unless ``device``, remote code), or spread
    it with ``placement``; ``tokenizer``: its tokenizer, loaded already."""
    return load_model(cfg.model, dtype=cfg.dtype, device=device or cfg.device,
                      trust_remote_code=cfg.trust_remote_code, placement=placement, progress=progress,
                      tokenizer=tokenizer)


@dataclass
class StatsRun:
    """Accumulators of every layer plus the held-out reservoir."""

    stats: list[LayerStats]
    reservoir: list[Reservoir]
    batches_done: int = 0
    checkpointed: int = 0        # batches in the newest checkpoint (0: none)
    layer_info: dict = field(default_factory=dict)    # layer -> {"scaling", "sliding_window", "softcap", "sinks", "chunk"}
    fit_device: str = "cpu"      # where the clips and held-out errors are fitted (see fit_device)
    fitting: list[int] | None = None    # the layers whose held-out rows this process keeps (None: all)

    def observer(self, collect: str):
        def observe(layer, module, q, k, v, o, kwargs):
            if layer not in self.layer_info:
                sw = call_window(module, kwargs)
                cfg = getattr(module, "config", None)
                sinks = kwargs.get("s_aux")           # gpt-oss: a learned sink logit per query head
                types = getattr(cfg, "layer_types", None) or ()
                chunked = layer < len(types) and types[layer] == "chunked_attention"
                self.layer_info[layer] = {
                    "scaling": float(getattr(module, "scaling", q.shape[-1] ** -0.5)),
                    "sliding_window": sw,
                    "softcap": getattr(cfg, "attn_logit_softcapping", None),
                    "sinks": None if sinks is None else [float(x) for x in sinks.detach().float().cpu()],
                    "chunk": int(cfg.attention_chunk_size) if chunked else None,
                }
            if collect == "stats":
                s = self.stats[layer]
                if torch.device(s.device) != q.device:          # a device map put this layer elsewhere: follow it
                    s.to(q.device)
                s.update(q, k, v, o)              # finiteness: checked on the small sums (check_finite)
            elif self.fitting is None or layer in self.fitting:
                require_finite(layer, {"k": k, "v": v, "q": q, "s": o})
                self.reservoir[layer].add(q, k, v, o)
        return observe


def collect_statistics(lm: LoadedModel, plan: TokenPlan, cfg: CalibrationConfig, *,
                       checkpoint: Path | None = None, resume: bool = False,
                       progress: ProgressFn | None = None,
                       on_batch: Callable[[int], None] | None = None,
                       ranks: Ranks | None = None) -> tuple[StatsRun, dict]:
    """Stream the calibration batches through the model, then capture the held-out rows.

    ``ranks`` (default: one process) supplies the data-parallel hooks: this process's share of the
    batches, the sst-approx pilot exchange, the sum over ranks, and the layers whose held-out rows it
    keeps (its share of the fitting, ``run.fitting``). The accumulators end on the CPU."""
    geo, model = lm.geometry, lm.model
    ranks = ranks or Ranks()
    dev = input_device(model)
    all_batches = plan.batches(cfg.batch_size)
    batches = [b.to(dev) for b in ranks.shard(all_batches)]     # ids up front: no host sync per batch
    approx = cfg.v_objective == "sst-approx"     # s_approx costs a float64 pass: only when asked for
    pilot = ranks.plan_pilot(all_batches, cfg.pilot_tokens, approx)
    run = StatsRun(
        stats=[LayerStats(geo.num_kv_heads, geo.group, geo.head_dim, pilot, device=dev, approx=approx)
               for _ in range(geo.num_layers)],
        reservoir=[Reservoir(cfg.heldout_tokens) for _ in range(geo.num_layers)],
        fit_device=fit_device(dev),
        fitting=ranks.fit_share(geo.num_layers),
    )
    parts = {"cfg": cfg.fingerprint_fields(), "model": lm.fingerprint, "tokens": plan.sha256(),
             **({} if approx else {"s_approx": False}), **ranks.key_parts()}
    key = stable_hash(parts)
    resumed = bool(resume and checkpoint is not None and load_checkpoint(checkpoint, run, key))
    run.checkpointed = run.batches_done
    total = sum(b.numel() for b in batches)
    done_tokens = sum(b.numel() for b in batches[:run.batches_done])
    report(progress, "capture", done_tokens, total, "tokens")
    t0 = time.perf_counter()
    with torch.no_grad(), Capture(model, [run.observer("stats")]) as cap, interruptible(run, len(batches), checkpoint):
        ranks.after_batch(run.stats, run.batches_done)
        for i in range(run.batches_done, len(batches)):
            capture_forward(model, batches[i])
            if cap.calls == 0:
                raise UnsupportedModelError("the model's attention does not go through transformers' attention "
                                            "interface; its Q/K/V cannot be captured")
            run.batches_done = i + 1
            done_tokens += batches[i].numel()
            report(progress, "capture", done_tokens, total, "tokens")
            # finiteness is checked (one device sync) where a checkpoint is due and at the end
            if (run.batches_done % cfg.checkpoint_every == 0) and run.batches_done < len(batches):
                check_finite(run.stats)
                if checkpoint is not None:
                    save_checkpoint(checkpoint, run, key)
                    run.checkpointed = run.batches_done
            if on_batch:
                on_batch(run.batches_done)
            ranks.after_batch(run.stats, run.batches_done)
        check_finite(run.stats)
    t_stats = time.perf_counter() - t0
    ranks.reduce(run.stats)
    for s in run.stats:
        s.to("cpu")
    t1 = time.perf_counter()
    with step(progress, "held-out rows"), torch.no_grad(), Capture(model, [run.observer("heldout")]):
        for seq in plan.heldout:           # every rank: the rows of the layers it fits
            capture_forward(model, seq.unsqueeze(0).to(dev))
    timing = {"statistics_s": t_stats, "gather_s": t1 - t_stats - t0, "heldout_s": time.perf_counter() - t1,
              "resumed": resumed, "batches": len(all_batches), **ranks.timing(batches)}
    return run, timing


def fit_device(model_device: torch.device) -> str:
    """Where the held-out fits run (attention over every held-out row, a clip grid per head: after
    the capture the largest cost, ~54 s of a 64-layer, 64-head model on 32 CPU cores): the GPU that
    runs the model's first layer when there is one, else the CPU; ``OSCAR_FIT_DEVICE`` (e.g.
    ``cpu`` where the GPUs are full) overrides it."""
    forced = os.environ.get("OSCAR_FIT_DEVICE", "").strip()
    if forced:
        try:
            return str(torch.device(forced))
        except RuntimeError:
            raise InputError(f"OSCAR_FIT_DEVICE={forced!r} is not a device (e.g. cpu, cuda:0)") from None
    return str(model_device) if model_device.type == "cuda" else "cpu"


def heldout_layer(run: StatsRun, layer: int) -> HeldoutLayer:
    """Layer ``layer``'s held-out rows (kept on the CPU), float32 on the run's fitting device."""
    r, info = run.reservoir[layer], run.layer_info[layer]
    dev = run.fit_device
    sinks = info.get("sinks")
    return HeldoutLayer(rows_on(r.q, dev), rows_on(r.k, dev), rows_on(r.v, dev), rows_on(r.o, dev), info["scaling"],
                        info["sliding_window"], info["softcap"],
                        sinks=None if sinks is None else torch.tensor(sinks, device=dev), chunk=info.get("chunk"))


def spread(eig: torch.Tensor) -> float:
    """Eigenvalue spread λ_max / mean λ, averaged over heads (1 = isotropic, d = rank one)."""
    e = eig.double().clamp(min=0)
    return float((e[..., 0] / e.mean(-1).clamp(min=1e-300)).mean())


def layer_rotations(run: StatsRun, cfg: CalibrationConfig, only: list[int] | None = None) -> list[tuple]:
    """Per layer (of ``only``, default all) ``(k_rot, k_eig, v_rot, v_eig)``: the eigenbases of the
    objectives' covariances, composed as ``cfg`` says (float64)."""
    kc, vc = K_OBJECTIVES[cfg.k_objective], V_OBJECTIVES[cfg.v_objective]
    out = []
    for i in range(len(run.stats)) if only is None else only:
        s = run.stats[i]
        k_rot, k_eig = rotations_from_covariance(s.covariance(kc), cfg.composition, cfg.granularity, warn=(i == 0))
        v_rot, v_eig = rotations_from_covariance(s.covariance(vc), cfg.composition, cfg.granularity, warn=False)
        out.append((k_rot, k_eig, v_rot, v_eig))
    return out


def build_rotations(run: StatsRun, cfg: CalibrationConfig, geo: Geometry, group_size: int, *,
                    progress: ProgressFn | None = None, groups: list | None = None,
                    rotations: list | None = None, fitted: list | None = None,
                    only: list[int] | None = None) -> tuple[list, list]:
    """Rotations, clips and per-layer report rows of the layers ``only`` (default: every layer).
    ``groups``: per layer ``(K, V)`` group sizes (a bit budget, :mod:`oscar_calib.calibrate.budget`)
    the clips are fitted for; default ``group_size`` everywhere. ``rotations``: :func:`layer_rotations`
    already computed (for ``only``); ``fitted``: per layer of ``only`` the budget's
    :class:`~oscar_calib.calibrate.budget.LayerFits`, whose clips and held-out records for the
    layer's sizes are taken instead of fitting them again."""
    layers, rows = [], []
    only = list(range(len(run.stats))) if only is None else only
    tick = counter(progress, "rotations + clips", len(only), "layers")
    rotations = rotations if rotations is not None else layer_rotations(run, cfg, only)
    for j, i in enumerate(only):
        s = run.stats[i]
        cq = s.covariance("q")
        k_rot, k_eig, v_rot, v_eig = rotations[j]
        held = heldout_layer(run, i)
        gk, gv = groups[i] if groups else (group_size, group_size)
        if fitted is not None:
            k_clip, k_table, v_clip, v_table = fitted[j].clips(gk, gv)
        else:
            k_clip, k_table, v_clip, v_table = fit_clips(held, k_rot, v_rot, cq, cfg, geo.num_kv_heads, gk, gv)
        refined = None
        if cfg.refine_steps:      # refine with the start's clips on the same held-out rows, then fit them again
            if gk != gv:
                raise InputError("--refine-steps needs one group size for K and V in every layer")
            settings = RefineSettings(steps=cfg.refine_steps, lr=cfg.refine_lr, sink=cfg.sink_tokens)
            k_rot, v_rot, refined = refine_layer(held.to("cpu"), k_rot, k_clip, v_rot, v_clip, gk, settings)
            k_clip, k_table, v_clip, v_table = fit_clips(held, k_rot, v_rot, cq, cfg, geo.num_kv_heads, gk, gv)
        if fitted is not None and refined is None:
            ours = fitted[j].errors[(gk, gv)]
        else:
            ours = heldout_errors(held, k_rot, k_clip, v_rot, v_clip, gk, gv)
        h = compose(torch.eye(geo.head_dim, dtype=torch.float64).expand(geo.num_kv_heads, -1, -1), "h", warn=False)
        base = heldout_errors(held, h, torch.full_like(k_clip, BASELINE_CLIPS[0]), h,
                              torch.full_like(v_clip, BASELINE_CLIPS[1]), gk, gv)
        layers.append(LayerRotations(k_rotation=k_rot.float(), v_rotation=v_rot.float(), k_clip=k_clip.float(),
                                     v_clip=v_clip.float(), k_eigenvalues=k_eig.float(), v_eigenvalues=v_eig.float()))
        rows.append({
            "layer": i,
            "attention": geo.layer_types[i] if i < len(geo.layer_types) else "full_attention",
            "k_spread": spread(k_eig), "v_spread": spread(v_eig),
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
            tables = budget_tables(lambda j: heldout_layer(run, mine[j]), [(r[0], r[2]) for r in rotations],
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


def refine_metadata(cfg: CalibrationConfig, heldout_seqs: int) -> dict:
    """What ``--refine-steps`` did, for the artifact's ``calibration`` metadata."""
    train, valid = split_sequences(heldout_seqs)
    return {"steps": cfg.refine_steps, "lr": cfg.refine_lr, "objective": "attention-output", "sink": cfg.sink_tokens,
            "fit_sequences": len(train), "validation_sequences": len(valid or [])}


def artifact_settings(cfg: CalibrationConfig, geo, group_size: int, shared_clips: tuple[float, float] | None,
                      budget: dict | None = None) -> ArtifactSettings:
    """The typed settings of the artifact a calibration writes (a bit budget's per-layer sizes from
    its record, :mod:`oscar_calib.calibrate.budget`)."""
    groups = ()
    if budget is not None:
        ks = budget["layer_group_sizes"]
        groups = tuple(GroupPair.of(k, v) for k, v in zip(ks, budget.get("layer_v_group_sizes") or ks))
    return ArtifactSettings(
        num_layers=geo.num_layers, num_attention_heads=geo.num_attention_heads, num_kv_heads=geo.num_kv_heads,
        head_dim=geo.head_dim, group_size=group_size, sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens,
        layer_groups=groups, logit_correction=cfg.logit_correction, granularity=cfg.granularity,
        composition=cfg.composition, k_objective=cfg.k_objective, v_objective=cfg.v_objective,
        shared_clips=shared_clips, model_type=geo.model_type)


def artifact_metadata(cfg: CalibrationConfig, lm: LoadedModel, plan: TokenPlan,
                      settings: ArtifactSettings) -> dict[str, str]:
    """The metadata of the artifact: its provenance and ``settings`` (:meth:`ArtifactSettings.metadata`)."""
    calibration = {
        "data": plan.source, "tokens": plan.tokens, "sequences": len(plan.calibration), "seq_len": cfg.seq_len,
        "seed": cfg.seed, "token_sha256": plan.sha256(), "heldout_tokens": sum(len(s) for s in plan.heldout),
        "pilot_tokens": cfg.pilot_tokens, "clip": "fit" if cfg.k_clip is None or cfg.v_clip is None else "fixed",
        **({"refine": refine_metadata(cfg, len(plan.heldout))} if cfg.refine_steps else {}),
    }
    return {
        "format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "model_id": lm.source.model_id,
        "model_fingerprint": lm.fingerprint, "calibration": json.dumps(calibration, sort_keys=True),
        "toolkit_version": __version__,
        **({MODEL_SOURCE_METADATA: json.dumps(lm.source.record(), sort_keys=True)} if lm.source.record() else {}),
        **({TEXT_CONFIG_METADATA: lm.geometry.text_config} if lm.geometry.text_config else {}),
        **settings.metadata(),
    }


@dataclass
class CalibrationResult:
    out: Path
    artifact: Artifact | None           # None on data-parallel ranks other than 0
    report: dict | None
    loaded: LoadedModel | None = None
    stats: StatsRun | None = None       # the (all-reduced) accumulators, on the CPU
    rank: int = 0


def calibrate(cfg: CalibrationConfig, out: Path, *, overwrite: bool = False, resume: bool = False,
              progress: ProgressFn | None = None, on_batch: Callable[[int], None] | None = None,
              loaded: LoadedModel | None = None, placement: Placement | None = None) -> CalibrationResult:
    """Run a whole calibration and write the artifact into ``out``.

    Started as one rank of a data-parallel job (WORLD_SIZE > 1, see :mod:`oscar_calib.calibrate.parallel`),
    it streams this rank's share of the batches, and only rank 0 writes; other ranks return a
    result with ``artifact`` and ``report`` of ``None``. ``placement`` spreads the model with
    accelerate (``device_map``, ``max_memory``)."""
    cfg.validate()
    kw = dict(overwrite=overwrite, resume=resume, progress=progress, on_batch=on_batch, loaded=loaded,
              placement=placement)
    if not launched():
        return _calibrate(cfg, Path(out), Ranks(), **kw)
    from .parallel import data_parallel

    with data_parallel(cfg.device, placement) as ranks:
        return _calibrate(cfg, Path(out), ranks, **kw)


def _calibrate(cfg: CalibrationConfig, out: Path, ranks: Ranks, *, overwrite: bool, resume: bool,
               progress: ProgressFn | None, on_batch: Callable[[int], None] | None,
               loaded: LoadedModel | None, placement: Placement | None) -> CalibrationResult:
    t0 = time.perf_counter()
    ckpt = out / ranks.checkpoint_name(CHECKPOINT_NAME)
    created, lm, plan, group_size = _start(cfg, out, ranks, ckpt, overwrite=overwrite, resume=resume,
                                           loaded=loaded, placement=placement,
                                           progress=progress if ranks.is_main else None)
    t_load = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    with failing_cleanly(out, ckpt, created):
        run, timing = collect_statistics(lm, plan, cfg, checkpoint=ckpt, resume=resume,
                                         progress=progress if ranks.is_main else None, on_batch=on_batch, ranks=ranks)
        t2 = time.perf_counter()
        fitted = fit_layers(run, cfg, lm.geometry, group_size, ranks=ranks,
                            progress=progress if ranks.is_main else None)
        timing.update(rotations_and_clips_s=time.perf_counter() - t2, fitted_layers=len(run.fitting))
    if not ranks.is_main:
        ranks.barrier("rank 0 writing the artifact")     # keep this rank's checkpoint until the artifact exists
        ckpt.unlink(missing_ok=True)
        return CalibrationResult(out, None, None, lm, stats=run, rank=ranks.rank)
    group_size, budget = fitted.group_size, fitted.budget
    settings = artifact_settings(cfg, lm.geometry, group_size, fitted.shared_clips, budget)
    metadata = artifact_metadata(cfg, lm, plan, settings)
    if budget is not None:
        from .budget import budget_calibration

        metadata["calibration"] = budget_calibration(metadata["calibration"], budget)
    artifact = Artifact(layers=fitted.layers, metadata=metadata, settings=settings)
    timing.update(load_s=t_load, total_s=time.perf_counter() - t0)
    report = build_report(cfg, lm, metadata, group_size, fitted.rows, timing, fitted.shared_clips)
    if budget is not None:
        report["bit_budget"] = budget
    with failing_cleanly(out, ckpt, created):
        write_outputs(out, artifact, report)
    ckpt.unlink(missing_ok=True)
    ranks.barrier("rank 0 writing the artifact")
    return CalibrationResult(out, artifact, report, lm, stats=run, rank=ranks.rank)


def _start(cfg: CalibrationConfig, out: Path, ranks: Ranks, ckpt: Path, *, overwrite: bool, resume: bool,
           loaded: LoadedModel | None, placement: Placement | None,
           progress: ProgressFn | None) -> tuple[bool, LoadedModel, TokenPlan, int]:
    """Check the output, read the data, load the tokenizer, plan the tokens, then load the model
    (a data problem is reported before any weights are read): (whether ``out`` is new, model,
    plan, group size). Under data parallelism every rank learns about any rank's start-up error."""
    created, lm, plan, group_size, error, info = False, None, None, None, None, {}
    try:
        if ranks.is_main:
            check_output_dir(out, overwrite, resume)
            created = not out.exists()
            if overwrite and not resume:
                remove_checkpoints(out)                  # start over: the old run's checkpoints go
        if resume:
            others = other_world_checkpoints(out, ckpt.name)
            if others:
                raise InputError(f"{out} holds checkpoints of another number of ranks ({', '.join(others)}); resume "
                                 f"with the same --nproc, or remove them")
        # the data first (file, text, enough tokens), then the weights: a bad --data costs no model load
        documents = load_texts(cfg.data, split=cfg.split, text_field=cfg.text_field)
        tokenizer = loaded.tokenizer if loaded else load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code,
                                                                   progress=progress)
        with step(progress, "tokenising data"):
            plan = plan_tokens(tokenizer, data=cfg.data, split=cfg.split, text_field=cfg.text_field,
                               tokens=cfg.tokens, seq_len=cfg.seq_len, heldout_tokens=cfg.heldout_tokens,
                               heldout_seqs=cfg.heldout_seqs, seed=cfg.seed, documents=documents)
        lm = loaded or prepare_model(cfg, device=ranks.device, placement=ranks.placement(placement),
                                     progress=progress, tokenizer=tokenizer)
        group_size = cfg.group_size or default_group_size(lm.geometry.head_dim)
        check_group_size(lm.geometry.head_dim, group_size)
        _warn_beyond_context(lm, cfg.seq_len)
        if cfg.refine_steps and cfg.heldout_seqs < 2:
            warnings.warn("--refine-steps with one held-out sequence fits and judges the rotations on the same rows, "
                          "which fits that sequence rather than the model (docs/design/numerics.md): use --heldout-seqs 8",
                          OscarWarning, stacklevel=3)
        info = {"fingerprint": lm.fingerprint, "tokens": plan.sha256(),
                "settings": stable_hash({k: v for k, v in cfg.fingerprint_fields().items() if k != "model"})}
    except Exception as e:  # noqa: BLE001 - re-raised by ranks.agree on this rank
        error = e
    ranks.agree(info, error)
    return created, lm, plan, group_size


def _warn_beyond_context(lm: LoadedModel, seq_len: int) -> None:
    n = context_length(lm.model)
    if n is not None and seq_len > n:
        warnings.warn(f"--seq-len {seq_len} is beyond {lm.source.model_id}'s context of {n} positions: the statistics "
                      f"include positions the model was not trained for (use --seq-len {n} or less)",
                      OscarWarning, stacklevel=3)


__all__ = ["calibrate", "CalibrationResult", "prepare_model", "LoadedModel", "collect_statistics", "build_rotations",
           "layer_rotations", "fit_layers", "Fitted", "artifact_metadata", "StatsRun", "check_output_dir", "CHECKPOINT_NAME", "WEIGHTS_NAME",
           "REPORT_NAME"]
