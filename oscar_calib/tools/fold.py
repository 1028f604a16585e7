"""Fold an artifact's value rotation into the weights: ``v_proj`` rows and ``o_proj`` columns.

With row vectors (``v = x W_vᵀ + b``) and ``R = v_rotation[h]`` for KV head ``h``:

=====================  ======================================================================
weight                 after folding (math in float64, cast to the weight's dtype)
=====================  ======================================================================
``v_proj`` rows of h   ``W_v,h' = Rᵀ W_v,h``, bias ``b_h' = b_h R``: the projection yields ``v R``
fused ``qkv_proj``     the same on the V rows, which are the last ``num_kv_heads·head_dim`` rows
``o_proj`` columns     for every query head ``j`` reading KV head ``h = j // (Hq/Hkv)``:
                       ``W_o[:, j] ' = W_o[:, j] R``, so ``o_proj(o_rot) = o_proj(o)``, ``o = o_rot Rᵀ``
=====================  ======================================================================

The attention weights ``softmax(q kᵀ)`` do not involve V, so the folded model computes the same
logits; its V cache holds ``v R`` and an INT2 cache quantises that directly, with no run-time
rotation of V. Keys are untouched: ``k_rotation`` is applied online (after RoPE it cannot be
folded). The output checkpoint records what was folded (``config.json`` key ``oscar``, and the
artifact copy under ``oscar/`` with metadata ``v_folded = "true"``), so no engine rotates V twice.

Proof before writing: the original and the folded model (both float32) run on one sample batch
(2×64 tokens of the embedded corpus, or random ids without a tokenizer). The logits must agree to
``max|a−b| / max|a| ≤ 1e-4`` and every layer's post-RoPE values must equal the original values
times ``R`` per KV head to the same bound; otherwise nothing is written. After saving, the
checkpoint is reloaded from disk, run in float32 and compared with the original again, with the
tolerance of its dtype (:data:`RELOAD_TOLERANCE`: rounding the folded weights to 16 bits is the
only new error there).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import FORMAT_VERSION
from ..errors import (
    ArtifactError,
    InputError,
    NumericalError,
    OutputExistsError,
    UnsupportedModelError,
)
from ..fsutil import atomic_write_bytes
from ..model.capture import Capture
from ..model.geometry import (
    Geometry,
    attention_modules,
    geometry_of,
    model_fingerprint,
    text_config,
)
from ..model.registry import ArchSpec, arch_for
from ..spec.artifact import (
    CARD_NAME,
    REPORT_NAME,
    WEIGHTS_NAME,
    Artifact,
    load_artifact,
    serialize_safetensors,
)

ARTIFACT_SUBDIR = "oscar"
CONFIG_KEY = "oscar"
FOLDED_KEY = "v_folded"

#: Max relative logit / value difference, float32 folded vs float32 original (``max|a−b| / max|a|``).
CHECK_TOLERANCE = 1e-4
#: The same after reloading the saved checkpoint and running it in float32, by saved dtype. 16-bit
#: dtypes round every folded weight (bf16 keeps 8 significant bits). Measured on SmolLM2-135M
#: (2×64 tokens): folded bf16 5.8e-3, fp16 9.7e-4 -- no worse than casting the *unfolded* model
#: (8.7e-3, 9.8e-4). The bounds leave ~8× room; what they catch is a broken save (missing or
#: mis-tied weights, scrambled shards), which differs by O(1).
RELOAD_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
SAMPLE_SHAPE = (2, 64)
OUT_DTYPES = ("auto", "float32", "bfloat16", "float16")

ProgressFn = Callable[[str, int, int], None]   # (stage, done, total)


# ----------------------------------------------------------------------------- checks

def is_folded(metadata: dict[str, str]) -> bool:
    return str(metadata.get(FOLDED_KEY, "false")).lower() == "true"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_artifact_matches(model, artifact: Artifact) -> Geometry:
    """Raise :class:`ArtifactError` unless ``artifact`` was calibrated for ``model`` and still
    needs folding; returns the model's geometry."""
    where = artifact.path or "the artifact"
    if is_folded(artifact.metadata):
        raise ArtifactError(f"{where}: its value rotation is already folded into a checkpoint (v_folded=true); "
                            "fold the original artifact into the original model")
    folded_cfg = getattr(text_config(model.config), CONFIG_KEY, None) or getattr(model.config, CONFIG_KEY, None)
    if isinstance(folded_cfg, dict) and folded_cfg.get(FOLDED_KEY):
        sha = str(folded_cfg.get("artifact_fingerprint", "?"))[:12]
        raise ArtifactError("this model's config.json says an OSCAR value rotation is already folded into it "
                            f"(artifact {sha}…); fold into the original model")
    geo = geometry_of(model)
    md = artifact.metadata
    expected = {"num_layers": geo.num_layers, "num_attention_heads": geo.num_attention_heads,
                "num_kv_heads": geo.num_kv_heads, "head_dim": geo.head_dim}
    diff = [f"{k} {md.get(k)} vs {v}" for k, v in expected.items() if str(md.get(k)) != str(v)]
    if diff:
        raise ArtifactError(f"{where} was calibrated for {md.get('model_id')!r}, whose geometry differs from this "
                            f"model's ({'; '.join(diff)} in artifact vs model)")
    fp = model_fingerprint(model)
    if md.get("model_fingerprint") != fp:
        theirs = str(md.get("model_fingerprint"))[:12]
        raise ArtifactError(f"{where} was calibrated for {md.get('model_id')!r} (model fingerprint {theirs}…), "
                            f"not for this model (fingerprint {fp[:12]}…); calibrate this model with `oscar calibrate`")
    for i, layer in enumerate(artifact.layers):
        r = layer.v_rotation.to(torch.float64)
        if not torch.isfinite(r).all():
            raise ArtifactError(f"{where}: layers.{i}.v_rotation is not finite")
        err = float((r @ r.transpose(-1, -2) - torch.eye(r.shape[-1], dtype=torch.float64)).abs().max())
        if err > 1e-5:
            raise ArtifactError(f"{where}: layers.{i}.v_rotation is not orthogonal (‖RRᵀ−I‖∞ = {err:.2e})")
    return geo


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _plain_linear(module, what: str, rows: int | None = None) -> torch.nn.Linear:
    """``module`` as a plain ``nn.Linear`` holding ordinary float tensors, or a clear refusal."""
    if module is None:
        raise UnsupportedModelError(f"{what}: module not found")
    name = type(module).__name__
    if not isinstance(module, torch.nn.Linear) or type(module).forward is not torch.nn.Linear.forward:
        raise UnsupportedModelError(f"{what} is a {name}, not a plain torch.nn.Linear (quantised or custom layer); "
                                    "fold-weights needs a float checkpoint")
    held = [n for n, _ in module.named_parameters(recurse=False)] + [n for n, _ in module.named_buffers(recurse=False)]
    extra = sorted(n for n in held if n not in ("weight", "bias"))
    if extra:
        raise UnsupportedModelError(f"{what} carries {', '.join(extra)} beside its weight (block-quantised weights?); "
                                    "fold-weights needs a float checkpoint")
    for pname in ("weight", "bias"):
        t = getattr(module, pname)
        if t is None:
            continue
        if type(t.data) is not torch.Tensor or t.dtype not in _FLOAT_DTYPES:
            raise UnsupportedModelError(f"{what}.{pname} is {type(t.data).__name__} of dtype {t.dtype}, not a plain "
                                        "float tensor (FP8/INT weights cannot be folded exactly)")
        if t.device.type == "meta":
            raise UnsupportedModelError(f"{what}.{pname} is on the meta device (offloaded weights cannot be folded)")
    w = module.weight
    if w.dim() != 2:
        raise UnsupportedModelError(f"{what}.weight has shape {list(w.shape)}, expected a matrix")
    if rows is not None and w.shape[0] != rows:
        raise UnsupportedModelError(f"{what}.weight has {w.shape[0]} output rows, expected {rows}")
    return module


@dataclass(frozen=True)
class FoldTarget:
    """Where one layer's value rows and output columns live."""

    v: torch.nn.Linear       # v_proj, or the fused qkv projection
    v_offset: int            # first V row inside ``v``'s weight
    o: torch.nn.Linear


def fold_targets(model, geo: Geometry | None = None) -> list[FoldTarget]:
    """Every layer's fold target, validated before anything changes."""
    geo = geo or geometry_of(model)
    spec: ArchSpec = arch_for(geo.model_type)
    if not spec.o_proj or not (spec.v_proj or spec.fused_qkv):
        raise UnsupportedModelError(f"{geo.model_type}: the architecture registry names no value/output projection "
                                    "for it, so the value rotation cannot be folded")
    hq, hkv, d = geo.num_attention_heads, geo.num_kv_heads, geo.head_dim
    targets = []
    for i, attn in enumerate(attention_modules(model)):
        where = f"layer {i} ({type(attn).__name__})"
        if spec.fused_qkv:
            v = _plain_linear(getattr(attn, spec.fused_qkv, None), f"{where}.{spec.fused_qkv}",
                              rows=(hq + 2 * hkv) * d)
            offset = (hq + hkv) * d
        else:
            v = _plain_linear(getattr(attn, spec.v_proj, None), f"{where}.{spec.v_proj}", rows=hkv * d)
            offset = 0
        o = _plain_linear(getattr(attn, spec.o_proj, None), f"{where}.{spec.o_proj}")
        if o.weight.shape[1] != hq * d:
            raise UnsupportedModelError(f"{where}.{spec.o_proj}.weight has {o.weight.shape[1]} input columns, "
                                        f"expected {hq} heads × {d}")
        targets.append(FoldTarget(v, offset, o))
    return targets


# ----------------------------------------------------------------------------- the fold

def _math_device(t: torch.Tensor) -> torch.device:
    return torch.device("cpu") if t.device.type == "mps" else t.device   # no float64 on MPS


@torch.no_grad()
def fold_layer(target: FoldTarget, rotation: torch.Tensor, num_attention_heads: int) -> None:
    """Fold ``rotation`` [num_kv_heads, d, d] into one layer, in place (float64 math)."""
    hkv, d, _ = rotation.shape
    group = num_attention_heads // hkv
    w = target.v.weight
    dev = _math_device(w)
    r = rotation.to(dev, torch.float64)
    rows = slice(target.v_offset, target.v_offset + hkv * d)
    wv = w[rows].to(dev, torch.float64).reshape(hkv, d, -1)
    w[rows] = torch.einsum("hde,hdk->hek", r, wv).reshape(hkv * d, -1).to(w.device, w.dtype)   # Rᵀ W_h
    if target.v.bias is not None:
        b = target.v.bias
        bv = b[rows].to(dev, torch.float64).reshape(hkv, d)
        b[rows] = torch.einsum("hd,hde->he", bv, r).reshape(-1).to(b.device, b.dtype)           # b_h R
    wo = target.o.weight
    r_q = r.repeat_interleave(group, dim=0)                      # query head j reads KV head j // group
    wo64 = wo.to(dev, torch.float64).reshape(wo.shape[0], num_attention_heads, d)
    wo.copy_(torch.einsum("ojd,jde->oje", wo64, r_q).reshape(wo.shape).to(wo.device, wo.dtype))  # W_o[:, j] R


def fold_v_rotation(model, artifact: Artifact, *, progress: ProgressFn | None = None) -> None:
    """Fold the artifact's ``v_rotation`` into ``model`` in place. Checks the artifact against the
    model and validates every layer's layout before changing any weight."""
    geo = check_artifact_matches(model, artifact)
    targets = fold_targets(model, geo)
    n = len(targets)
    if progress:
        progress("fold", 0, n)
    for i, (t, layer) in enumerate(zip(targets, artifact.layers)):
        fold_layer(t, layer.v_rotation, geo.num_attention_heads)
        if progress:
            progress("fold", i + 1, n)


# ----------------------------------------------------------------------------- proof

def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a − b| / max|a|`` in float64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    scale = float(a.abs().max()) if a.numel() else 0.0
    err = float((a - b).abs().max()) if a.numel() else 0.0
    if not (err == err) or not torch.isfinite(b).all():
        return float("inf")
    return err / scale if scale > 0 else err


def sample_input_ids(tokenizer, vocab_size: int, shape: tuple[int, int] = SAMPLE_SHAPE,
                     seed: int = 0) -> tuple[torch.Tensor, str]:
    """``shape`` token ids from the embedded corpus, or seeded random ids without a tokenizer."""
    n = shape[0] * shape[1]
    if tokenizer is not None:
        from ..calibrate.corpus import embedded_texts, token_stream

        texts, ids = embedded_texts(), torch.empty(0, dtype=torch.long)
        for start in range(0, len(texts), 8):
            ids = torch.cat([ids, token_stream(texts[start:start + 8], tokenizer)])
            if len(ids) >= n:
                break
        if len(ids) >= n and int(ids[:n].max()) < vocab_size:
            return ids[:n].reshape(shape), "embedded"
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, shape, generator=g), "random"


@torch.no_grad()
def run_and_capture(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """float64 CPU logits and each layer's post-RoPE values [B, Hkv, T, d]."""
    values: dict[int, torch.Tensor] = {}

    def observe(layer, module, q, k, v, o, kwargs):
        values[layer] = v.detach().to("cpu", torch.float64)

    with Capture(model, [observe]):
        logits = model(input_ids=input_ids.to(model.device), use_cache=False).logits
    return logits.detach().to("cpu", torch.float64), values


@torch.no_grad()
def logits_of(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids.to(model.device), use_cache=False).logits.detach().to("cpu", torch.float64)


@dataclass
class FoldCheck:
    """Figures of the proof: folded vs original model on one sample batch (float32)."""

    logits_rel_diff: float
    value_rel_err: float
    value_rel_err_per_layer: list[float]
    tokens: list[int]
    input: str
    tolerance: float = CHECK_TOLERANCE

    @property
    def ok(self) -> bool:
        return self.logits_rel_diff <= self.tolerance and self.value_rel_err <= self.tolerance

    def to_dict(self) -> dict:
        return {"logits_rel_diff": self.logits_rel_diff, "value_rel_err": self.value_rel_err,
                "value_rel_err_per_layer": self.value_rel_err_per_layer, "tokens": self.tokens,
                "input": self.input, "tolerance": self.tolerance, "ok": self.ok}


def value_errors(before: dict[int, torch.Tensor], after: dict[int, torch.Tensor], artifact: Artifact) -> list[float]:
    """Per layer: ``max|v_fold − v R| / max|v R|`` with ``R`` per KV head."""
    errs = []
    for i, layer in enumerate(artifact.layers):
        if i not in before or i not in after:
            raise NumericalError(f"layer {i}: no values were captured; cannot check the fold")
        want = torch.einsum("bhtd,hde->bhte", before[i], layer.v_rotation.to(torch.float64))
        errs.append(rel_diff(want, after[i]))
    return errs


def fold_and_check(model, artifact: Artifact, input_ids: torch.Tensor, *, input_kind: str = "given",
                   progress: ProgressFn | None = None,
                   tolerance: float = CHECK_TOLERANCE) -> tuple[FoldCheck, torch.Tensor]:
    """Fold in place and prove it: returns the check and the original float64 logits.
    Raises :class:`NumericalError` when the figures exceed ``tolerance`` (the model is then left
    folded but unusable for writing; callers discard it). Run it on a float32 model."""
    check_artifact_matches(model, artifact)
    fold_targets(model)   # refuse unsupported layouts before the reference forward pass
    if progress:
        progress("reference", 0, 1)
    logits0, values0 = run_and_capture(model, input_ids)
    if progress:
        progress("reference", 1, 1)
    fold_v_rotation(model, artifact, progress=progress)
    if progress:
        progress("check", 0, 1)
    logits1, values1 = run_and_capture(model, input_ids)
    if progress:
        progress("check", 1, 1)
    per_layer = value_errors(values0, values1, artifact)
    check = FoldCheck(rel_diff(logits0, logits1), max(per_layer, default=0.0), per_layer,
                      list(input_ids.shape), input_kind, tolerance)
    if not check.ok:
        worst = max(range(len(per_layer)), key=per_layer.__getitem__) if per_layer else -1
        raise NumericalError(f"fold check failed: max relative logit difference {check.logits_rel_diff:.3g}, value "
                             f"rotation error {check.value_rel_err:.3g} (worst layer {worst}); tolerance "
                             f"{tolerance:g}; nothing written")
    return check, logits0


# ----------------------------------------------------------------------------- output directory

def check_fold_output(out: Path, overwrite: bool, protected: list[Path] = ()) -> None:
    """Refuse a file, a non-empty directory (unless ``overwrite``), an unwritable place, and any
    output that is, holds, or sits inside an input."""
    out = Path(out)
    res = out.resolve()
    for p in protected:
        p = Path(p).resolve()
        if res == p or res in p.parents or p in res.parents:
            raise InputError(f"--out {out} overlaps an input ({p}); choose another directory")
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputExistsError(f"{out} is not empty; pass --overwrite to replace it")
    parent = res.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise InputError(f"output directory {out} is not writable")


def _parse_shard_size(size: str | int) -> str | int:
    from transformers.utils.hub import convert_file_size_to_int

    try:
        n = convert_file_size_to_int(size if isinstance(size, int) else str(size).strip())
    except (ValueError, TypeError):
        raise InputError(f"shard size {size!r} is not a size like 2GB, 500MB or 1GiB") from None
    if n <= 0:
        raise InputError(f"shard size {size!r} must be positive")
    return size


def _publish_permissions(root: Path) -> None:
    """mkdtemp and some writers create owner-only entries; give the checkpoint the usual modes."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [root, *root.rglob("*")]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def _install(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``; an existing ``out`` is replaced only now."""
    if out.is_dir() and any(out.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.oscar-old-", dir=out.parent))
        os.replace(out, old / "x")
        try:
            os.replace(tmp, out)
        except OSError:
            os.replace(old / "x", out)
            raise
        shutil.rmtree(old, ignore_errors=True)
        return
    if out.is_dir():
        out.rmdir()
    os.replace(tmp, out)


def write_artifact_copy(directory: Path, artifact: Artifact, source_sha256: str) -> None:
    """The artifact, marked ``v_folded = "true"``, beside the checkpoint it was folded into."""
    directory.mkdir(parents=True, exist_ok=True)
    meta = dict(artifact.metadata, **{FOLDED_KEY: "true"})
    atomic_write_bytes(directory / WEIGHTS_NAME, serialize_safetensors(artifact.tensors(), meta))
    src = Path(artifact.path) if artifact.path else None
    if src is not None and (src / REPORT_NAME).exists():
        shutil.copyfile(src / REPORT_NAME, directory / REPORT_NAME)
    card = (src / CARD_NAME).read_text() if src is not None and (src / CARD_NAME).exists() else ""
    card = card.rstrip("\n") + ("\n\n" if card else "") + (
        "## Folded\n\n"
        "This copy's `v_rotation` is already folded into the checkpoint one directory up (`v_proj` rows and "
        "`o_proj` columns; metadata `v_folded = true`). Engines apply only `k_rotation` (online, to keys and "
        f"queries after RoPE) and must not rotate V again. Source artifact sha256: `{source_sha256}`.\n")
    (directory / CARD_NAME).write_text(card)


# ----------------------------------------------------------------------------- the whole command

@dataclass
class FoldResult:
    out: Path
    report: dict = field(default_factory=dict)


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


def fold_checkpoint(model_spec: str, artifact_path: Path, out: Path, *, dtype: str = "auto", device: str = "cpu",
                    trust_remote_code: bool = False, shard_size: str | int = "2GB", overwrite: bool = False,
                    progress: ProgressFn | None = None, loaded: tuple | None = None,
                    sample_shape: tuple[int, int] = SAMPLE_SHAPE) -> FoldResult:
    """Fold ``artifact_path``'s value rotation into ``model_spec`` and write a Hugging Face
    checkpoint into ``out``.

    ``loaded = (model, tokenizer_or_None[, source])`` uses a model already in memory; it is folded
    and cast **in place**. ``sample_shape`` is the (batch, tokens) of the proof's sample batch. The
    input model and artifact are never written to; ``out`` appears only when the checkpoint is
    complete and has passed both checks.
    """
    from ..model.load import _quiet, load_model, resolve_model

    t0 = time.perf_counter()
    out = Path(out)
    out_dtype = _resolve_dtype(dtype)
    shard_size = _parse_shard_size(shard_size)
    artifact_path = Path(artifact_path)
    artifact = load_artifact(artifact_path)
    if is_folded(artifact.metadata):
        raise ArtifactError(f"{artifact_path}: its value rotation is already folded into a checkpoint (v_folded=true); "
                            "fold the original artifact into the original model")
    protected = [Path(artifact.path)]
    source = None
    if loaded is None:
        source = resolve_model(model_spec)
        if source.kind != "hub":
            protected.append(Path(source.path) / source.gguf_file if source.gguf_file else Path(source.path))
    elif len(loaded) > 2:
        source = loaded[2]
    check_fold_output(out, overwrite, protected)
    artifact_sha = file_sha256(Path(artifact.path) / WEIGHTS_NAME)

    if loaded is None:
        lm = load_model(model_spec, dtype="auto", device=device, trust_remote_code=trust_remote_code)
        model, tok, source = lm.model, lm.tokenizer, lm.source
    else:
        model, tok = loaded[0], loaded[1]
    model_id = getattr(source, "model_id", None) or model_spec
    t_load = time.perf_counter() - t0

    geo = check_artifact_matches(model, artifact)
    fold_targets(model, geo)                  # refuse unsupported layouts before any work
    _drop_gguf_marker(model)
    input_dtype = model.dtype
    out_dtype = out_dtype or input_dtype
    if out_dtype not in RELOAD_TOLERANCE:
        raise InputError(f"cannot write dtype {out_dtype}; choose float32, bfloat16 or float16")
    fingerprint = model_fingerprint(model)
    if model.dtype != torch.float32:
        model.float()

    t1 = time.perf_counter()
    vocab = text_config(model.config).vocab_size
    input_ids, input_kind = sample_input_ids(tok, vocab, sample_shape)
    check, logits0 = fold_and_check(model, artifact, input_ids, input_kind=input_kind, progress=progress)
    t_fold = time.perf_counter() - t1

    model.config.oscar = {FOLDED_KEY: True, "artifact_fingerprint": artifact_sha, "model_fingerprint": fingerprint,
                          "format_version": FORMAT_VERSION, "artifact": f"{ARTIFACT_SUBDIR}/{WEIGHTS_NAME}",
                          "model_id": artifact.metadata.get("model_id")}
    out.resolve().parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.oscar-fold-", dir=out.resolve().parent))
    try:
        t2 = time.perf_counter()
        if progress:
            progress("save", 0, 1)
        if out_dtype != torch.float32:
            model.to(out_dtype)
        with _quiet():
            model.save_pretrained(tmp, max_shard_size=shard_size)
            if tok is not None and hasattr(tok, "save_pretrained"):
                tok.save_pretrained(tmp)
        write_artifact_copy(tmp / ARTIFACT_SUBDIR, artifact, artifact_sha)
        if progress:
            progress("save", 1, 1)
        t_save = time.perf_counter() - t2

        t3 = time.perf_counter()
        if progress:
            progress("reload", 0, 1)
        run_device = model.device
        if loaded is None:            # ours: free it before a second copy is loaded from disk
            del model
            gc.collect()
        reload = reload_check(tmp, input_ids, logits0, out_dtype, device=run_device)
        if progress:
            progress("reload", 1, 1)
        t_reload = time.perf_counter() - t3
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        _publish_permissions(tmp)
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report = {
        "out": str(out), "model": model_spec, "model_id": model_id, "artifact": str(artifact.path),
        "artifact_fingerprint": artifact_sha, "model_fingerprint": fingerprint,
        "input_dtype": str(input_dtype).replace("torch.", ""), "dtype": str(out_dtype).replace("torch.", ""),
        "num_layers": geo.num_layers, "num_kv_heads": geo.num_kv_heads, "head_dim": geo.head_dim,
        "num_attention_heads": geo.num_attention_heads,
        "check": check.to_dict(), "reload": reload, "files": files,
        "shards": sum(f.endswith(".safetensors") and "/" not in f for f in files),
        "timings": {"load_s": t_load, "fold_and_check_s": t_fold, "save_s": t_save, "reload_s": t_reload,
                    "total_s": time.perf_counter() - t0},
    }
    return FoldResult(out, report)


@torch.no_grad()
def reload_check(directory: Path, input_ids: torch.Tensor, logits0: torch.Tensor, dtype: torch.dtype,
                 device="cpu") -> dict:
    """Reload the written checkpoint with plain transformers, run it in float32, compare with the
    original logits; raise :class:`NumericalError` beyond :data:`RELOAD_TOLERANCE`."""
    from transformers import AutoModelForCausalLM

    from ..model.load import _quiet

    with _quiet():
        m = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    saved = json.loads((Path(directory) / "config.json").read_text()).get(CONFIG_KEY, {})
    if not saved.get(FOLDED_KEY):
        raise NumericalError(f"the saved config.json lacks the '{CONFIG_KEY}' record; nothing written")
    m.eval().float().to(device)
    d = rel_diff(logits0, logits_of(m, input_ids))
    tol = RELOAD_TOLERANCE[dtype]
    del m
    if not d <= tol:
        raise NumericalError(f"the saved checkpoint reloads with max relative logit difference {d:.3g} "
                             f"(> {tol:g} for {str(dtype).replace('torch.', '')}); nothing written")
    return {"logits_rel_diff": d, "tolerance": tol, "dtype": str(dtype).replace("torch.", ""), "ok": True}


__all__ = ["fold_checkpoint", "fold_v_rotation", "fold_and_check", "fold_layer", "fold_targets",
           "check_artifact_matches", "check_fold_output", "sample_input_ids", "run_and_capture", "rel_diff",
           "FoldCheck", "FoldResult", "FoldTarget", "is_folded", "CHECK_TOLERANCE", "RELOAD_TOLERANCE"]
