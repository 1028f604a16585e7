"""The folded checkpoint on disk: sharded safetensors, the artifact copy, the reload check.

:func:`fold_checkpoint` is the whole ``oscar fold-weights`` command: validate the artifact (the
validator's rules, before any model is loaded), load the model (or take a :class:`LoadedModel`),
fold and prove it (:mod:`.proof`), save into a staged directory beside ``--out``
(:func:`oscar_calib.fsutil.staged_dir`), reload the saved checkpoint with plain transformers and
compare its float32 logits with the original's (:data:`RELOAD_TOLERANCE` by saved dtype), and only
then move the directory into place. ``config.json`` records the fold (key ``oscar``) and the
artifact is copied under ``oscar/`` with metadata ``v_folded = "true"``.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ... import FORMAT_VERSION
from ...contract.artifact import (
    WEIGHTS_NAME,
    Artifact,
    load_artifact,
)
from ...errors import InputError, NumericalError, UnsupportedModelError
from ...fsutil import (
    apply_umask_mode,
    staged_dir,
)
from ...model.geometry import Geometry, text_config
from ...model.load import LoadedModel
from ...progress import ProgressFn, step
from .output import ARTIFACT_SUBDIR, check_fold_output, file_sha256, write_artifact_copy
from .proof import (
    SAMPLE_SHAPE,
    FoldCheck,
    fold_and_check,
    logits_of,
    rel_diff,
    sample_input_ids,
)
from .weights import (
    CONFIG_KEY,
    FOLDED_KEY,
    check_artifact_matches,
    fold_targets,
    refuse_folded_artifact,
)

#: Max relative logit difference after reloading the saved checkpoint and running it in float32, by
#: saved dtype. 16-bit dtypes round every folded weight (bf16 keeps 8 significant bits). Measured on
#: SmolLM2-135M (2×64 tokens): folded bf16 5.8e-3, fp16 9.7e-4 -- no worse than casting the
#: *unfolded* model (8.7e-3, 9.8e-4). The bounds leave ~8× room; what they catch is a broken save
#: (missing or mis-tied weights, scrambled shards), which differs by O(1).
RELOAD_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
OUT_DTYPES = ("auto", "float32", "bfloat16", "float16")


# ----------------------------------------------------------------------------- inputs and output

def _parse_shard_size(size: str | int) -> str | int:
    from transformers.utils.hub import convert_file_size_to_int

    try:
        n = convert_file_size_to_int(size if isinstance(size, int) else str(size).strip())
    except (ValueError, TypeError):
        raise InputError(f"shard size {size!r} is not a size like 2GB, 500MB or 1GiB") from None
    if n <= 0:
        raise InputError(f"shard size {size!r} must be positive")
    return size


def _resolve_dtype(name: str) -> torch.dtype | None:
    if name not in OUT_DTYPES:
        raise InputError(f"unknown dtype {name!r}; choose from {', '.join(OUT_DTYPES)}")
    return None if name == "auto" else getattr(torch, name)


def _drop_gguf_marker(model) -> None:
    """A model loaded from GGUF carries a quantiser although transformers de-quantised its weights
    (on CPU); drop it so save_pretrained writes plain safetensors. Any other quantiser is refused."""
    q = getattr(model, "hf_quantizer", None)
    qc = getattr(model.config, "quantization_config", None)
    method = getattr(getattr(q, "quantization_config", None), "quant_method", None) or \
        (qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None))
    method = getattr(method, "value", method)
    if q is None and qc is None:
        return
    if str(method).lower() != "gguf":
        raise UnsupportedModelError(f"the model is quantised ({method}); fold-weights needs a float checkpoint "
                                    "(its weights must be plain float tensors)")
    if q is not None and hasattr(q, "remove_quantization_config"):
        q.remove_quantization_config(model)      # also clears is_quantized, which blocks .float()/.to()
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ----------------------------------------------------------------------------- writing

def _save(model, tokenizer, directory: Path, artifact: Artifact, artifact_sha: str, dtype: torch.dtype,
          shard_size: str | int) -> None:
    from ...model.load import quiet_loading

    if dtype != torch.float32:
        model.to(dtype)
    with quiet_loading():
        model.save_pretrained(directory, max_shard_size=shard_size)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(directory)
    write_artifact_copy(directory / ARTIFACT_SUBDIR, artifact, artifact_sha)


@torch.no_grad()
def reload_check(directory: Path, input_ids: torch.Tensor, logits0: torch.Tensor, dtype: torch.dtype,
                 device="cpu") -> dict:
    """Reload the written checkpoint with plain transformers, run it in float32, compare with the
    original logits; raise :class:`NumericalError` beyond :data:`RELOAD_TOLERANCE`."""
    from transformers import AutoConfig

    from ...model.load import quiet_loading
    from ...model.registry import model_class

    with quiet_loading():
        m = model_class(AutoConfig.from_pretrained(directory)).from_pretrained(directory, dtype=dtype)
    saved = json.loads((Path(directory) / "config.json").read_text()).get(CONFIG_KEY, {})
    if not saved.get(FOLDED_KEY):
        raise NumericalError(f"the saved config.json lacks the '{CONFIG_KEY}' record; nothing written")
    m.eval().float().to(device)
    d = rel_diff(logits0, logits_of(m, input_ids))
    tol = RELOAD_TOLERANCE[dtype]
    del m
    if not d <= tol:
        raise NumericalError(f"the saved checkpoint reloads with max relative logit difference {d:.3g} "
                             f"(> {tol:g} for {_dtype_name(dtype)}); nothing written")
    return {"logits_rel_diff": d, "tolerance": tol, "dtype": _dtype_name(dtype), "ok": True}


# ----------------------------------------------------------------------------- the whole command

@dataclass
class FoldResult:
    out: Path
    report: dict = field(default_factory=dict)


def _load(model_spec: str, artifact: Artifact, out: Path, overwrite: bool, loaded: LoadedModel | None, device: str,
          trust_remote_code: bool, progress: ProgressFn | None = None) -> LoadedModel:
    """Check the output against every input, then load the model (unless ``loaded``)."""
    from ...model.load import load_model
    from ...model.source import resolve_model

    if loaded is not None and not isinstance(loaded, LoadedModel):
        raise TypeError("fold_checkpoint(loaded=...) takes a LoadedModel (LoadedModel.wrap(model, tokenizer, source))")
    source = loaded.source if loaded is not None else resolve_model(model_spec)
    protected = [Path(artifact.path)]
    if source.kind != "hub" and source.path:
        protected.append(Path(source.path) / source.gguf_file if source.gguf_file else Path(source.path))
    check_fold_output(out, overwrite, protected)
    return loaded or load_model(model_spec, dtype="auto", device=device, trust_remote_code=trust_remote_code,
                                progress=progress)


def _prepare(lm: LoadedModel, artifact: Artifact, out_dtype: torch.dtype | None) -> tuple[Geometry, torch.dtype]:
    """Refuse what cannot be folded before any work; leave the model in float32. Returns the
    geometry and the dtype to write."""
    geo = check_artifact_matches(lm.model, artifact, geometry=lm.geometry, fingerprint=lm.fingerprint)
    fold_targets(lm.model, geo)
    _drop_gguf_marker(lm.model)
    out_dtype = out_dtype or lm.model.dtype
    if out_dtype not in RELOAD_TOLERANCE:
        raise InputError(f"cannot write dtype {out_dtype}; choose float32, bfloat16 or float16")
    if lm.model.dtype != torch.float32:
        lm.model.float()
    return geo, out_dtype


def fold_checkpoint(model_spec: str, artifact_path: Path, out: Path, *, dtype: str = "auto", device: str = "cpu",
                    trust_remote_code: bool = False, shard_size: str | int = "2GB", overwrite: bool = False,
                    progress: ProgressFn | None = None, loaded: LoadedModel | None = None,
                    sample_shape: tuple[int, int] = SAMPLE_SHAPE) -> FoldResult:
    """Fold ``artifact_path``'s value rotation into ``model_spec`` and write a Hugging Face
    checkpoint into ``out``.

    ``loaded`` (a :class:`LoadedModel`) uses a model already in memory; it is folded and cast
    **in place**. ``sample_shape`` is the (batch, tokens) of the proof's sample batch. The artifact
    is validated first (``oscar validate``'s rules: a NaN or a non-orthogonal rotation anywhere is
    refused with its line). The input model and artifact are never written to; ``out`` appears
    only when the checkpoint is complete and has passed both checks.
    """
    t0 = time.perf_counter()
    out, artifact_path = Path(out), Path(artifact_path)
    out_dtype = _resolve_dtype(dtype)
    shard_size = _parse_shard_size(shard_size)
    artifact = load_artifact(artifact_path)         # every check of oscar validate, the digest included
    refuse_folded_artifact(artifact)
    if loaded is None:
        from .fp8 import fold_fp8_checkpoint, fp8_checkpoint

        ckpt = fp8_checkpoint(model_spec)           # compressed-tensors FP8: worked on its files
        if ckpt is not None:
            if out_dtype is not None:
                raise InputError("--dtype: an FP8 checkpoint is written back as FP8 (its own scales format); leave "
                                 "--dtype auto")
            report = fold_fp8_checkpoint(ckpt, artifact, file_sha256(Path(artifact.path) / WEIGHTS_NAME), out,
                                         device=device, overwrite=overwrite, progress=progress,
                                         sample_shape=sample_shape)
            return FoldResult(out, {"model": model_spec, **report})
    lm = _load(model_spec, artifact, out, overwrite, loaded, device, trust_remote_code, progress)
    artifact_sha = file_sha256(Path(artifact.path) / WEIGHTS_NAME)
    t_load = time.perf_counter() - t0

    input_dtype = lm.model.dtype
    geo, out_dtype = _prepare(lm, artifact, out_dtype)
    t1 = time.perf_counter()
    input_ids, input_kind = sample_input_ids(lm.tokenizer, text_config(lm.model.config).vocab_size, sample_shape)
    check, logits0 = fold_and_check(lm.model, artifact, input_ids, input_kind=input_kind, progress=progress,
                                    fingerprint=lm.fingerprint)
    t_fold = time.perf_counter() - t1

    lm.model.config.oscar = {FOLDED_KEY: True, "artifact_fingerprint": artifact_sha,
                             "model_fingerprint": lm.fingerprint, "format_version": FORMAT_VERSION,
                             "artifact": f"{ARTIFACT_SUBDIR}/{WEIGHTS_NAME}",
                             "model_id": artifact.metadata.get("model_id")}
    with staged_dir(out, overwrite=overwrite, tag="oscar-fold") as tmp:
        t2 = time.perf_counter()
        with step(progress, "fold: saving"):
            _save(lm.model, lm.tokenizer, tmp, artifact, artifact_sha, out_dtype, shard_size)
        t_save = time.perf_counter() - t2
        t3 = time.perf_counter()
        with step(progress, "fold: reload check"):
            run_device = lm.model.device
            if loaded is None:            # ours: free it before a second copy is loaded from disk
                lm.model = None
                gc.collect()
            reload = reload_check(tmp, input_ids, logits0, out_dtype, device=run_device)
        t_reload = time.perf_counter() - t3
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        apply_umask_mode(tmp, recursive=True)
    timings = {"load_s": t_load, "fold_and_check_s": t_fold, "save_s": t_save, "reload_s": t_reload,
               "total_s": time.perf_counter() - t0}
    return FoldResult(out, _report(out, model_spec, lm, artifact, artifact_sha, geo, input_dtype, out_dtype,
                                   check, reload, files, timings))


def _report(out: Path, model_spec: str, lm: LoadedModel, artifact: Artifact, artifact_sha: str, geo: Geometry,
            input_dtype: torch.dtype, out_dtype: torch.dtype, check: FoldCheck, reload: dict, files: list[str],
            timings: dict) -> dict:
    return {
        "out": str(out), "model": model_spec, "model_id": lm.source.model_id or model_spec,
        "artifact": str(artifact.path), "artifact_fingerprint": artifact_sha, "model_fingerprint": lm.fingerprint,
        "input_dtype": _dtype_name(input_dtype), "dtype": _dtype_name(out_dtype),
        "num_layers": geo.num_layers, "num_kv_heads": geo.num_kv_heads, "head_dim": geo.head_dim,
        "num_attention_heads": geo.num_attention_heads,
        "check": check.to_dict(), "reload": reload, "files": files,
        "shards": sum(f.endswith(".safetensors") and "/" not in f for f in files),
        "timings": timings,
    }
