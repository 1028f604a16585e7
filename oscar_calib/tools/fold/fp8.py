"""``oscar fold-weights`` on a compressed-tensors FP8 checkpoint, worked on its safetensors files the
way the OSCAR SGLang fork absorbs ``R_v`` into FP8 weights (no ``compressed-tensors`` package needed).

Supported (``config.json`` ``quantization_config``): ``quant_method: compressed-tensors`` whose every
config group quantises weights to ``type: float``, ``num_bits: 8``, symmetric, with
``strategy: channel`` (``weight_scale`` float32 ``[out, 1]``) or ``tensor`` (one float32 number);
the weights are ``float8_e4m3fn``, de-quantised as ``fp8 · weight_scale``. Refused with one line:
block or group scales (``strategy: block|group``, or ``quant_method: fp8`` with ``weight_scale_inv``;
the fork refuses them too), other quantisations, and a per-tensor scale on a fused ``qkv_proj``
(re-quantising V would change the scale of Q and K).

For every layer's ``v_proj`` and ``o_proj`` (the fork touches only V; our fold also rotates
``o_proj``'s columns, :mod:`.weights`), :func:`refold_fp8`:

1. de-quantise ``W = fp8 · scale`` (float64);
2. fold exactly as the float path does (:func:`~.weights.fold_layer`: ``W_v,h' = Rᵀ W_v,h``, bias
   ``b_h R``; ``W_o[:, j]' = W_o[:, j] R``);
3. fresh scales ``max(amax(|W'|) / 448, 1e-12)``, per output row (channel) or one (tensor), float32;
4. re-quantise ``clamp(W' / scale, ±448)`` to float8_e4m3fn; write the scales back in their shape.

A projection the quantisation ``ignore``\\ d (no ``weight_scale``) is folded in its own dtype. Every
other tensor and file is copied unchanged, with the source's sharding. The proof, before ``--out``
appears: the de-quantised original (a float32 checkpoint in a temporary directory, loaded with
:func:`~oscar_calib.model.load.load_model`) is folded in memory and checked like a float
checkpoint (:func:`~.proof.fold_and_check`: logits and values to 1e-4, which proves the maths);
then the written FP8 checkpoint is de-quantised, reloaded, and its float32 logits must match the
original's to :data:`FP8_TOLERANCE` (max relative difference; this catches a wrong scale, a missing
tensor, a broken shard). Memory: like the float path, the proof holds the de-quantised model in
float32.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import InputError, NumericalError, UnsupportedModelError
from ...fsutil import apply_umask_mode, staged_dir

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_MIN = 1e-12
#: Max relative logit difference (``max|a−b| / max|a|``, float32), the written FP8 checkpoint
#: de-quantised against the original FP8 checkpoint de-quantised. Re-quantising the folded V and O
#: weights rounds each to FP8 again (e4m3: 3 mantissa bits, up to 2^-4 relative per weight). Measured
#: on tiny random-init Llama/Qwen3 checkpoints (2×64 tokens): 0.035–0.044. It catches a broken file.
FP8_TOLERANCE = 0.15
#: Max relative error of every layer's post-RoPE values, written FP8 checkpoint against the original
#: values times ``R``: the sharp check. Measured 0.032–0.036 (as above); a fold with ``Rᵀ`` in place
#: of ``R`` is off by 1.4.
FP8_VALUE_TOLERANCE = 0.15
SCHEMES = ("channel", "tensor")
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class FP8Checkpoint:
    """A compressed-tensors FP8 checkpoint directory and its weights' scale strategy."""

    path: Path
    strategy: str                       # "channel", "tensor" or "mixed" (of its config groups)
    config: dict


def fp8_strategy(config: dict) -> str | None:
    """``"channel"``/``"tensor"``/``"mixed"`` for a compressed-tensors FP8 ``config.json``, None when it is not
    quantised this way (another quantisation is the float path's to refuse), or one clear
    :class:`UnsupportedModelError` for FP8 layouts that cannot be folded."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        raise UnsupportedModelError("block-wise FP8 (quant_method fp8, weight_scale_inv) cannot be folded: "
                                    "fold-weights takes compressed-tensors FP8 with per-channel or per-tensor scales "
                                    "(the OSCAR SGLang fork absorbs only those too)")
    if method != "compressed-tensors":
        return None
    groups = qc.get("config_groups") or {}
    strategies = set()
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        kind = f"{w.get('type')}{w.get('num_bits')}"
        if kind != "float8":
            raise UnsupportedModelError(f"compressed-tensors group {name!r} quantises weights to {kind}; fold-weights "
                                        "takes FP8 (type float, 8 bits) only")
        if w.get("strategy") not in SCHEMES or w.get("symmetric") is False:
            raise UnsupportedModelError(f"compressed-tensors group {name!r}: {w.get('strategy')} FP8 scales"
                                        f"{'' if w.get('symmetric', True) else ' with a zero point'} cannot be folded; "
                                        "fold-weights takes symmetric per-channel or per-tensor scales")
        strategies.add(w["strategy"])
    if not strategies:
        raise UnsupportedModelError("compressed-tensors config without weight quantisation groups")
    return "tensor" if strategies == {"tensor"} else "channel" if strategies == {"channel"} else "mixed"


def fp8_checkpoint(model_spec: str) -> FP8Checkpoint | None:
    """The local FP8 checkpoint ``model_spec`` names (a directory, or a hub id fetched whole once its
    ``config.json`` says FP8), else None."""
    from ...model.source import ALIASES, resolve_model

    if model_spec in ALIASES:                 # the pip-shipped GGUF models
        return None
    source = resolve_model(model_spec)
    if source.kind == "local":
        cfg_path = Path(source.path) / "config.json"
    elif source.kind == "hub":
        cfg_path = _hub_config(source.path)
        if cfg_path is None:
            return None
    else:
        return None
    config = json.loads(cfg_path.read_text())
    strategy = fp8_strategy(config)
    if strategy is None:
        return None
    path = Path(source.path) if source.kind == "local" else _hub_snapshot(source.path)
    return FP8Checkpoint(path, strategy, config)


def _hub_config(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo_id, "config.json"))
    except Exception:  # noqa: BLE001 - offline or no such repo: the float path reports it
        return None


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id))


# ----------------------------------------------------------------------------- the tensors

def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8 · scale`` in float64 (``scale`` ``[out, 1]``, ``[out]`` or one number)."""
    s = scale.to(torch.float64)
    s = s.reshape(()) if s.numel() == 1 else s.reshape(-1, 1)
    return weight.to(torch.float64) * s


def quantize_fp8(w: torch.Tensor, per_channel: bool, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fork's re-quantisation: fresh scales ``max(amax / 448, 1e-12)`` (per output row or one)
    in float32, ``clamp(W / scale, ±448)`` to float8_e4m3fn. Returns the weight and the scale in
    the shape of ``like`` (the checkpoint's ``weight_scale``)."""
    w32 = w.to(torch.float32)
    amax = w32.abs().amax(dim=1, keepdim=True) if per_channel else w32.abs().max()
    scale = torch.clamp(amax / FP8_MAX, min=SCALE_MIN)
    q = torch.clamp(w32 / scale, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.reshape(like.shape).to(like.dtype)


def _names(attention: str, proj: str) -> tuple[str, str, str]:
    base = f"{attention}.{proj}"
    return f"{base}.weight", f"{base}.weight_scale", f"{base}.bias"


def refold_fp8(tensors: dict[str, torch.Tensor], artifact, geo, spec, paths: list[str]) -> dict[str, torch.Tensor]:
    """The folded replacements of every layer's V and O tensors (``tensors``: the checkpoint's, by
    name; ``paths``: every layer's attention module, as the checkpoint names it), see the module
    docstring. Each weight keeps its own scale layout: a ``weight_scale`` of one number is per
    tensor, else per output channel."""
    from .weights import FoldTarget, fold_layer

    out = {}
    hq = geo.num_attention_heads
    v_proj = spec.fused_qkv or spec.v_proj
    for i, layer in enumerate(artifact.layers):
        hkv, d = geo.kv_heads[i], geo.head_dims[i]
        offset = (hq + hkv) * d if spec.fused_qkv else 0
        lins = []
        for proj in (v_proj, spec.o_proj):
            wname, sname, bname = _names(paths[i], proj)
            if wname not in tensors:
                raise UnsupportedModelError(f"the checkpoint has no tensor {wname}")
            w, scale = tensors[wname], tensors.get(sname)
            if scale is not None and w.dtype != FP8_DTYPE:
                raise UnsupportedModelError(f"{wname} is {w.dtype} beside a weight_scale; expected float8_e4m3fn")
            if proj == spec.fused_qkv and scale is not None and scale.numel() == 1:
                raise UnsupportedModelError(f"{wname}: one FP8 scale for the fused q/k/v rows; re-quantising V would "
                                            "change Q's and K's scale")
            w64 = dequantize_fp8(w, scale) if scale is not None else w.to(torch.float64)
            lin = torch.nn.Linear(w64.shape[1], w64.shape[0], bias=bname in tensors, dtype=torch.float64)
            lin.weight.data = w64
            if bname in tensors:
                lin.bias.data = tensors[bname].to(torch.float64)
            lins.append((lin, w, scale, wname, sname, bname))
        (v_lin, *_), (o_lin, *_) = lins
        fold_layer(FoldTarget(v_lin, offset, o_lin), layer.v_rotation, hq)
        for lin, w, scale, wname, sname, bname in lins:
            if scale is None:
                out[wname] = lin.weight.data.to(w.dtype)
            else:
                out[wname], out[sname] = quantize_fp8(lin.weight.data, scale.numel() > 1, scale)
            if lin.bias is not None:
                out[bname] = lin.bias.data.to(tensors[bname].dtype)
    return out


# ----------------------------------------------------------------------------- files

def weight_files(directory: Path) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index or the single ``model.safetensors``."""
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = directory / "model.safetensors"
    if not single.exists():
        raise InputError(f"{directory}: no model.safetensors or {INDEX_NAME}")
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return {name: single.name for name in f.keys()}


def _read(directory: Path, names: list[str], files: dict[str, str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for fname in sorted({files[n] for n in names if n in files}):
        with safe_open(str(Path(directory) / fname), "pt") as f:
            for n in names:
                if files.get(n) == fname:
                    out[n] = f.get_tensor(n)
    return out


def _rewrite(src: Path, dst: Path, changed: dict[str, torch.Tensor], config: dict) -> list[str]:
    """Copy the checkpoint ``src`` into ``dst`` with ``changed`` tensors replaced and ``config``
    as config.json; returns the safetensors files rewritten."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = weight_files(src)
    touched = sorted({files[n] for n in changed})
    for p in sorted(Path(src).iterdir()):
        if not p.is_file() or p.name.startswith("."):
            continue
        if p.name in touched:
            with safe_open(str(p), "pt") as f:
                meta = f.metadata() or {"format": "pt"}
                tensors = {n: changed.get(n, f.get_tensor(n)) for n in f.keys()}
            save_file(tensors, str(dst / p.name), metadata=meta)
        elif p.name == "config.json":
            (dst / p.name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copy2(p, dst / p.name)
    return touched


def _is_qparam(name: str, names) -> bool:
    """A quantisation parameter rather than a weight: ``X_scale`` / ``X_zero_point`` beside ``X``, or an
    activation scale."""
    for suffix in ("_scale", "_zero_point"):
        if name.endswith(suffix) and name[: -len(suffix)] in names:
            return True
    return name.endswith(".input_scale")


def dequantized_copy(src: Path, dst: Path) -> Path:
    """A float32 checkpoint of the FP8 checkpoint ``src`` in ``dst`` (``fp8 · weight_scale`` for every
    quantised weight; scales dropped; no quantization_config): what its function is, for the proofs."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    files = weight_files(src)
    weight_map = {}
    for fname in sorted(set(files.values())):
        with safe_open(str(Path(src) / fname), "pt") as f:
            names = list(f.keys())
            tensors = {}
            for n in names:
                if _is_qparam(n, names):
                    continue
                t = f.get_tensor(n)
                if n + "_scale" in names:
                    t = dequantize_fp8(t, f.get_tensor(n + "_scale"))
                tensors[n] = t.to(torch.float32) if t.is_floating_point() else t
        save_file(tensors, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
    for p in sorted(Path(src).iterdir()):
        if p.is_file() and not p.name.startswith(".") and not p.name.endswith(".safetensors") and p.name != INDEX_NAME:
            shutil.copy2(p, dst / p.name)
    config = json.loads((Path(src) / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = config["dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (Path(src) / INDEX_NAME).exists():
        (dst / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")
    return dst


# ----------------------------------------------------------------------------- the command

def fold_fp8_checkpoint(ckpt: FP8Checkpoint, artifact, artifact_sha: str, out: Path, *, device: str = "cpu",
                        overwrite: bool = False, progress=None, sample_shape=None) -> dict:
    """Fold ``artifact``'s V rotation into the FP8 checkpoint ``ckpt`` and write it into ``out`` (module
    docstring); returns the report ``oscar fold-weights`` prints. Nothing appears at ``out`` unless
    both proofs pass."""
    from ...model.geometry import decoder_attention, text_config
    from ...model.load import load_model
    from ...model.registry import arch_for
    from .output import ARTIFACT_SUBDIR, check_fold_output, write_artifact_copy
    from .proof import (
        SAMPLE_SHAPE,
        fold_and_check,
        rel_diff,
        run_and_capture,
        sample_input_ids,
        value_errors,
    )
    from .weights import CONFIG_KEY, FOLDED_KEY

    t0 = time.perf_counter()
    check_fold_output(out, overwrite, [ckpt.path, Path(artifact.path)])
    steps = progress or (lambda stage, done, total: None)
    Path(out).resolve().parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".oscar-fp8-", dir=Path(out).resolve().parent) as scratch:
        scratch = Path(scratch)
        steps("dequantize", 0, 1)
        lm = load_model(str(dequantized_copy(ckpt.path, scratch / "original")), dtype="float32", device=device)
        steps("dequantize", 1, 1)
        geo, spec = lm.geometry, arch_for(lm.geometry.model_type)
        paths = [path for path, _ in decoder_attention(lm.model)]
        ids, kind = sample_input_ids(lm.tokenizer, text_config(lm.model.config).vocab_size,
                                     sample_shape or SAMPLE_SHAPE)
        _, values0 = run_and_capture(lm.model, ids)
        check, logits0 = fold_and_check(lm.model, artifact, ids, input_kind=kind, progress=progress,
                                        fingerprint=lm.fingerprint)       # the maths, on the float model
        del lm
        files = weight_files(ckpt.path)
        proj = [spec.fused_qkv or spec.v_proj, spec.o_proj]
        wanted = [n for path in paths for p in proj for n in _names(path, p)]
        changed = refold_fp8(_read(ckpt.path, wanted, files), artifact, geo, spec, paths)
        config = dict(ckpt.config, **{CONFIG_KEY: {FOLDED_KEY: True, "artifact_fingerprint": artifact_sha,
                                                   "model_fingerprint": artifact.metadata.get("model_fingerprint"),
                                                   "artifact": f"{ARTIFACT_SUBDIR}/oscar.safetensors",
                                                   "model_id": artifact.metadata.get("model_id")}})
        with staged_dir(out, overwrite=overwrite, tag="oscar-fold") as tmp:
            steps("save", 0, 1)
            touched = _rewrite(ckpt.path, tmp, changed, config)
            write_artifact_copy(tmp / ARTIFACT_SUBDIR, artifact, artifact_sha)
            steps("save", 1, 1)
            steps("reload", 0, 1)
            from transformers import AutoModelForCausalLM

            m = AutoModelForCausalLM.from_pretrained(dequantized_copy(tmp, scratch / "folded"), dtype=torch.float32)
            logits1, values1 = run_and_capture(m.eval().to(device), ids)
            del m
            diff, v_errs = rel_diff(logits0, logits1), value_errors(values0, values1, artifact)
            steps("reload", 1, 1)
            if not (diff <= FP8_TOLERANCE and max(v_errs) <= FP8_VALUE_TOLERANCE):
                worst = max(range(len(v_errs)), key=v_errs.__getitem__)
                raise NumericalError(f"the folded FP8 checkpoint is off: max relative logit difference {diff:.3g} "
                                     f"(tolerance {FP8_TOLERANCE:g}), values vs original·R {v_errs[worst]:.3g} in layer "
                                     f"{worst} (tolerance {FP8_VALUE_TOLERANCE:g}); nothing written")
            written = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
            apply_umask_mode(tmp, recursive=True)
    fp8 = {"strategy": ckpt.strategy, "tensors_requantized": sum(t.dtype == FP8_DTYPE for t in changed.values()),
           "shards_rewritten": touched}
    return {"out": str(out), "model_id": artifact.metadata.get("model_id"), "artifact": str(artifact.path),
            "artifact_fingerprint": artifact_sha, "model_fingerprint": artifact.metadata.get("model_fingerprint"),
            "input_dtype": "float8_e4m3fn", "dtype": f"float8_e4m3fn ({ckpt.strategy} scales)",
            "num_layers": geo.num_layers, "num_kv_heads": geo.num_kv_heads, "head_dim": geo.head_dim,
            "num_attention_heads": geo.num_attention_heads, "check": check.to_dict(),
            "reload": {"logits_rel_diff": diff, "tolerance": FP8_TOLERANCE, "dtype": "fp8", "ok": True,
                       "value_rel_err": max(v_errs), "value_tolerance": FP8_VALUE_TOLERANCE},
            "fp8": fp8, "files": written, "shards": sum(f.endswith(".safetensors") and "/" not in f for f in written),
            "timings": {"total_s": time.perf_counter() - t0}}
