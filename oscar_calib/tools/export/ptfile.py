"""The ``.pt`` rotation files that the OSCAR SGLang fork and vLLM's pull request both load: a
``torch.save`` of plain tensors, ``{"format_version", "objective", "source_grouping", "layers":
{i: {"layer_id", "rotation", "eigenvalues"}}}`` (the fork's writer's form, read for
:mod:`.sglang.fileformat`), written by :func:`payload` and :func:`save_bytes` and opened only
through :func:`load_plain` (``torch.load(weights_only=True)``: oscar never unpickles anything
else). Which loader takes which form, and what each checks, is in the targets' modules."""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

import torch

from ...errors import ArtifactError, InputError


def payload(rotations: list[torch.Tensor], eigenvalues: list[torch.Tensor | None], *, objective: str,
            layer_ids=None, k_means: list[torch.Tensor] | None = None) -> dict:
    """The fork's dict for one cache: ``rotations[i]`` ``[d, d]`` (format_version 1) or ``[h, d, d]``
    (format_version 2), ``eigenvalues[i]`` descending (oscar's order; written ascending, the
    fork's, and only in format_version 1, as its writers do) or None, keyed by the model's layer
    ids (``layer_ids``, default ``0..n-1``: a hybrid model's attention layers by their global id,
    as the fork's Qwen3.5 recipe keys them); ``k_means[i]`` ``[h, d]`` (the K file of a centered
    artifact: every layer's ``k_mean``) or None. Tensors are cloned, fp32 and contiguous (a saved view
    would carry its whole storage)."""
    dims = {r.dim() for r in rotations}
    if len(dims) != 1 or dims.pop() not in (2, 3):
        raise ArtifactError("every layer needs a [d, d] rotation (format_version 1) or an [h, d, d] one (2)")
    version = 1 if rotations[0].dim() == 2 else 2
    layers = {}
    ids = list(layer_ids) if layer_ids is not None else range(len(rotations))
    for j, (i, r, e) in enumerate(zip(ids, rotations, eigenvalues)):
        entry = {"layer_id": i, "rotation": r.detach().to("cpu", torch.float32).contiguous().clone()}
        if e is not None and version == 1:
            entry["eigenvalues"] = e.detach().to("cpu", torch.float32).flip(-1).contiguous().clone()
        if k_means is not None:
            entry["k_mean"] = k_means[j].detach().to("cpu", torch.float32).contiguous().clone()
        layers[i] = entry
    return {"format_version": version, "objective": objective,
            "source_grouping": "layer" if version == 1 else "per_kv_head", "layers": layers}


def identity_payload(num_layers: int, head_dim, layer_ids=None) -> dict:
    """Identity rotations for every layer (the V file of a checkpoint whose V rotation is already
    folded into its weights: the fork then quantises V as the weights produce it and maps the output
    back with ``o @ I``), keyed like :func:`payload`; ``head_dim`` one for all layers or one per layer."""
    dims = [head_dim] * num_layers if isinstance(head_dim, int) else list(head_dim)
    ids = list(layer_ids) if layer_ids is not None else range(num_layers)
    return {"format_version": 1, "objective": "identity", "source_grouping": "layer",
            "layers": {i: {"layer_id": i, "rotation": torch.eye(d, dtype=torch.float32)} for i, d in zip(ids, dims)}}


def save_bytes(obj: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load_reason(e: Exception) -> str:
    """One short line from torch.load's (long, multi-line, ANSI-coloured) refusal."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    m = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if m:
        return f"it pickles the Python object {m.group(1)}"
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")[:120]
    if isinstance(e, pickle.UnpicklingError):
        return f"unpickling refused: {first}"
    return f"not a readable torch.save file: {type(e).__name__}: {first}"


def load_plain(path: Path) -> tuple[object, bytes]:
    """``torch.load(weights_only=True)`` of ``path`` (what the fork does, and the only way oscar
    opens a pickle), with one clear error."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    raw = path.read_bytes()
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True), raw
    except Exception as e:  # noqa: BLE001 - unpickling raises many types; all mean "refused"
        raise ArtifactError(f"{path}: not a plain tensor dict that torch.load(weights_only=True) accepts "
                            f"({_load_reason(e)}); oscar never unpickles anything else") from None


__all__ = ["identity_payload", "load_plain", "payload", "save_bytes"]
