"""The proof of a fold: the original and the folded model on one sample batch, in float32.

The sample batch is 2×64 tokens of the embedded corpus (seeded random ids without a tokenizer).
The logits must agree to ``max|a−b| / max|a| ≤`` :data:`CHECK_TOLERANCE` and every layer's
post-RoPE values must equal the original values times ``R`` per KV head to the same bound;
otherwise :func:`fold_and_check` raises and the caller writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...contract.artifact import Artifact
from ...errors import NumericalError
from ...model.capture import Capture
from ...progress import ProgressFn, step
from .weights import check_artifact_matches, fold_targets, fold_v_rotation

#: Max relative logit / value difference, float32 folded vs float32 original (``max|a−b| / max|a|``).
CHECK_TOLERANCE = 1e-4
SAMPLE_SHAPE = (2, 64)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a − b| / max|a|`` in float64 (0 when both are zero; inf when ``b`` is not finite)."""
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
        from ...data.corpus import embedded_texts, token_stream

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
    """float64 CPU logits of ``input_ids``, without a cache."""
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
                   progress: ProgressFn | None = None, tolerance: float = CHECK_TOLERANCE,
                   fingerprint: str | None = None) -> tuple[FoldCheck, torch.Tensor]:
    """Fold in place and prove it: returns the check and the original float64 logits.
    Raises :class:`NumericalError` when the figures exceed ``tolerance`` (the model is then left
    folded but unusable for writing; callers discard it). Run it on a float32 model."""
    geo = check_artifact_matches(model, artifact, fingerprint=fingerprint)
    fold_targets(model, geo)   # refuse unsupported layouts before the reference forward pass
    with step(progress, "fold: reference pass"):
        logits0, values0 = run_and_capture(model, input_ids)
    fold_v_rotation(model, artifact, progress=progress, checked=geo)
    with step(progress, "fold: check pass"):
        logits1, values1 = run_and_capture(model, input_ids)
    per_layer = value_errors(values0, values1, artifact)
    check = FoldCheck(rel_diff(logits0, logits1), max(per_layer, default=0.0), per_layer,
                      list(input_ids.shape), input_kind, tolerance)
    if not check.ok:
        worst = max(range(len(per_layer)), key=per_layer.__getitem__) if per_layer else -1
        raise NumericalError(f"fold check failed: max relative logit difference {check.logits_rel_diff:.3g}, value "
                             f"rotation error {check.value_rel_err:.3g} (worst layer {worst}); tolerance "
                             f"{tolerance:g}; nothing written")
    return check, logits0
