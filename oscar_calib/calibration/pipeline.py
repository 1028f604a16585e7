"""``calibrate``: model → capture → streaming statistics → rotations → clips → artifact.

This module runs a calibration end to end: it checks the output, reads the data, loads the model,
calls the streaming pass (:mod:`.collect`) and the per-layer fitting (:mod:`.fit`), and writes the
artifact with its typed settings and metadata. The pipeline passes its state explicitly; the CLI gives it a progress callback and renders the
result. Accumulators are checkpointed every ``checkpoint_every`` batches into
``<out>/.oscar-checkpoint.pt`` (atomic); ``resume=True`` continues from it when the settings,
model fingerprint and token ids match, and gives a byte-identical ``oscar.safetensors``.

This is the single-process algorithm. Where data parallelism changes it, it calls a hook of a
:class:`~oscar_calib.calibration.ranks.Ranks` (no-ops for one process): ``calibrate`` started as one
rank of a job (torchrun, accelerate launch, ``oscar calibrate --nproc``) joins it through
:func:`oscar_calib.calibration.parallel.data_parallel`; a plain run never starts a process group.
Starting ranks is :mod:`oscar_calib.jobs.launch`; big models, :mod:`oscar_calib.model.placement`.
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import FORMAT_VERSION, __version__
from ..contract.artifact import Artifact
from ..contract.config import CalibrationConfig, stable_hash
from ..contract.defaults import centering_problem, check_group_size, default_group_size
from ..contract.layout import (
    FORMAT_NAME,
    MODEL_SOURCE_METADATA,
    TEXT_CONFIG_METADATA,
)
from ..contract.settings import ArtifactSettings, GroupPair
from ..data.corpus import TokenPlan, load_texts, plan_tokens
from ..errors import InputError, OscarWarning
from ..jobs.env import launched
from ..model.geometry import Geometry, context_length
from ..model.load import LoadedModel, load_model, load_tokenizer
from ..model.placement import Placement
from ..numerics.refine import split_sequences
from ..progress import ProgressFn, step
from .checkpoint import (
    CHECKPOINT_NAME,
    failing_cleanly,
    other_world_checkpoints,
    remove_checkpoints,
)
from .collect import StatsRun, collect_statistics
from .fit import fit_layers
from .ranks import Ranks
from .report import build_report, check_output_dir, write_outputs


def prepare_model(cfg: CalibrationConfig, *, device: str | None = None, placement: Placement | None = None,
                  progress: ProgressFn | None = None, tokenizer=None) -> LoadedModel:
    """Load ``cfg.model`` as ``cfg`` says (dtype, device unless ``device``, remote code), or spread
    it with ``placement``; ``tokenizer``: its tokenizer, loaded already."""
    return load_model(cfg.model, dtype=cfg.dtype, device=device or cfg.device,
                      trust_remote_code=cfg.trust_remote_code, placement=placement, progress=progress,
                      tokenizer=tokenizer)


def refine_metadata(cfg: CalibrationConfig, heldout_seqs: int) -> dict:
    """What ``--refine-steps`` did, for the artifact's ``calibration`` metadata."""
    train, valid = split_sequences(heldout_seqs)
    return {"steps": cfg.refine_steps, "lr": cfg.refine_lr, "objective": "attention-output", "sink": cfg.sink_tokens,
            "fit_sequences": len(train), "validation_sequences": len(valid or [])}


def artifact_settings(cfg: CalibrationConfig, geo, group_size: int, shared_clips: tuple[float, float] | None,
                      budget: dict | None = None) -> ArtifactSettings:
    """The typed settings of the artifact a calibration writes (a bit budget's per-layer sizes from
    its record, :mod:`oscar_calib.calibration.budget`)."""
    groups = ()
    if budget is not None:
        ks = budget["layer_group_sizes"]
        groups = tuple(GroupPair.of(k, v) for k, v in zip(ks, budget.get("layer_v_group_sizes") or ks))
    return ArtifactSettings(
        **geo.settings_fields(), group_size=group_size, sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens,
        layer_groups=groups, logit_correction=cfg.logit_correction, key_centering=cfg.center_keys,
        key_center_fit=cfg.center_fit if cfg.center_keys else "centered",
        granularity=cfg.granularity,
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
        **({"center_seq_len": cfg.mean_seq_len} if cfg.mean_seq_len else {}),
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

    Started as one rank of a data-parallel job (WORLD_SIZE > 1, see :mod:`oscar_calib.calibration.parallel`),
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
    created, lm, plan, group_size, mean_plan = _start(cfg, out, ranks, ckpt, overwrite=overwrite, resume=resume,
                                                      loaded=loaded, placement=placement,
                                                      progress=progress if ranks.is_main else None)
    t_load = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    with failing_cleanly(out, ckpt, created):
        run, timing = collect_statistics(lm, plan, cfg, checkpoint=ckpt, resume=resume,
                                         progress=progress if ranks.is_main else None, on_batch=on_batch, ranks=ranks)
        if mean_plan is not None:       # center_seq_len: the mean key from a pass over longer windows
            t1 = time.perf_counter()
            means, _ = collect_statistics(lm, mean_plan, cfg, progress=progress if ranks.is_main else None,
                                          ranks=ranks)
            run.key_means = [s.key_mean() for s in means.stats]
            timing["mean_pass_s"] = time.perf_counter() - t1
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
           progress: ProgressFn | None) -> tuple[bool, LoadedModel, TokenPlan, int, TokenPlan | None]:
    """Check the output, read the data, load the tokenizer, plan the tokens, then load the model
    (a data problem is reported before any weights are read): (whether ``out`` is new, model,
    plan, group size, the plan of the mean key's pass or None: :attr:`CalibrationConfig.mean_seq_len`,
    the same token budget in windows of that length, no held-out rows). Under data parallelism every
    rank learns about any rank's start-up error."""
    created, lm, plan, group_size, mean_plan, error, info = False, None, None, None, None, None, {}
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
            if cfg.mean_seq_len:
                long = plan_tokens(tokenizer, data=cfg.data, split=cfg.split, text_field=cfg.text_field,
                                   tokens=cfg.tokens, seq_len=cfg.mean_seq_len, heldout_tokens=cfg.heldout_tokens,
                                   heldout_seqs=cfg.heldout_seqs, seed=cfg.seed, documents=documents)
                mean_plan = TokenPlan(calibration=long.calibration, heldout=[], source=long.source)
        lm = loaded or prepare_model(cfg, device=ranks.device, placement=ranks.placement(placement),
                                     progress=progress, tokenizer=tokenizer)
        group_size = calibration_group_size(cfg, lm.geometry)
        why = centering_problem(lm.geometry.model_type) if cfg.center_keys else None
        if why:
            raise InputError(f"--center-keys: {why}")
        _warn_beyond_context(lm, cfg.seq_len)
        if cfg.mean_seq_len:
            _warn_beyond_context(lm, cfg.mean_seq_len, "--center-seq-len")
        if cfg.refine_steps and cfg.heldout_seqs < 2:
            warnings.warn("--refine-steps with one held-out sequence fits and judges the rotations on the same rows, "
                          "which fits that sequence rather than the model (docs/design/numerics.md): use --heldout-seqs 8",
                          OscarWarning, stacklevel=3)
        info = {"fingerprint": lm.fingerprint, "tokens": plan.sha256(),
                "settings": stable_hash({k: v for k, v in cfg.fingerprint_fields().items() if k != "model"})}
    except Exception as e:  # noqa: BLE001 - re-raised by ranks.agree on this rank
        error = e
    ranks.agree(info, error)
    return created, lm, plan, group_size, mean_plan


def calibration_group_size(cfg: CalibrationConfig, geo: Geometry) -> int:
    """``--group-size`` or the default for the model's head sizes (the smallest layer's: a power of
    two that divides every layer's head_dim when they are powers of two), refused in one line where it
    does not divide some layer's head_dim; a bit budget on a model whose layers differ in head_dim is
    refused (its candidate sizes are per head_dim)."""
    dims = sorted(set(geo.head_dims))
    group_size = cfg.group_size or default_group_size(dims[0])
    for d in dims:
        check_group_size(d, group_size, "--group-size" if cfg.group_size else "group size")
    if cfg.bit_budget and len(dims) > 1:
        raise InputError(f"--bit-budget chooses group sizes among one head_dim's divisors; {geo.model_type}'s layers "
                         f"have head_dims {', '.join(map(str, dims))}: pass --group-size instead")
    return group_size


def _warn_beyond_context(lm: LoadedModel, seq_len: int, option: str = "--seq-len") -> None:
    n = context_length(lm.model)
    if n is not None and seq_len > n:
        warnings.warn(f"{option} {seq_len} is beyond {lm.source.model_id}'s context of {n} positions: the statistics "
                      f"include positions the model was not trained for (use {option} {n} or less)",
                      OscarWarning, stacklevel=3)


__all__ = ["CalibrationResult", "artifact_metadata", "artifact_settings", "calibrate", "prepare_model"]
