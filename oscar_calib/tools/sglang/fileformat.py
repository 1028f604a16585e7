"""The OSCAR SGLang fork's rotation files: writing them, checking them as the fork loads them, and
reading them back (for ``oscar import``).

Facts from the fork (public repo FutureMLS-Lab/OSCAR at 473ff3f9d, read for this module; nothing
copied): its loader (``load_oscar_rotations`` in ``sglang-research/python/sglang/srt/mem_cache/
memory_pool.py``) ``torch.load``\\ s the file with torch 2.9's default ``weights_only=True``, needs a
mapping with a ``"layers"`` key, looks every layer id of the model up as an ``int`` or a decimal
``str`` key (extra keys are ignored), requires each ``"rotation"`` to have shape ``(head_dim,
head_dim)`` (a per-KV-head ``[h, d, d]`` tensor is refused on main), casts it to bf16 for serving,
and never reads ``format_version``, ``objective``, ``eigenvalues`` or ``layer_id``. Its open pull
request #20 adds per-KV-head files (``format_version: 2``, ``[h, d, d]`` per layer, dispatched on
``rotation.dim()``). Its writer (``rotation/compute_kv_rotation.py``) stores
``{"format_version": 1, "objective", "source_grouping": "layer", "layers": {i: {"layer_id",
"rotation" fp32 [d, d], "eigenvalues" fp32 [d]}}}`` with eigenvalues in ascending order, as
``torch.linalg.eigh`` returns them (aligned with the eigenvectors, not with the columns of R).

=================  ============================================================================
target             what :func:`payload` writes per layer
=================  ============================================================================
``fork-main``      ``format_version`` 1: the layer's shared rotation fp32 ``[d, d]`` and its
                   eigenvalues fp32 ``[d]`` ascending (what the fork's main loads)
``pr20``           ``format_version`` 2: every KV head's rotation fp32 ``[h, d, d]`` and eigenvalues
                   ``[h, d]`` ascending, heads in the model's ``k_proj``/``v_proj`` order (needs a
                   fork build with PR #20)
=================  ============================================================================

Rotations follow oscar's convention, which is the fork's: a rotated row is ``x @ R``; the query uses
the K file; the attention output is mapped back with ``o @ R_vᵀ``.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...errors import ArtifactError, InputError
from ...spec.defaults import ORTHOGONALITY_TOL

TARGETS = {
    "fork-main": "the OSCAR SGLang fork's main branch: one rotation per layer (format_version 1)",
    "pr20": "a fork build with its pull request #20: one rotation per KV head (format_version 2)",
}
# a 16-bit file's rotation is up to ~8e-3 from orthogonal; within this it is re-orthogonalised on import
REORTHOGONALIZE_TOL = 2e-2


def check_target(target: str) -> str:
    if target not in TARGETS:
        raise InputError(f"unknown --target {target!r}; choose from {', '.join(TARGETS)}")
    return target


def file_name(which: str, objective: str) -> str:
    """``k_rotation_<objective>.pt`` / ``v_rotation_<objective>.pt`` (the fork's naming)."""
    return f"{which}_rotation_{objective}.pt"


def payload(rotations: list[torch.Tensor], eigenvalues: list[torch.Tensor | None], *, objective: str) -> dict:
    """The fork's dict for one cache: ``rotations[i]`` ``[d, d]`` (format_version 1) or ``[h, d, d]``
    (format_version 2), ``eigenvalues[i]`` descending (oscar's order; written ascending, the
    fork's) or None. Tensors are cloned, fp32 and contiguous (a saved view would carry its whole
    storage)."""
    dims = {r.dim() for r in rotations}
    if len(dims) != 1 or dims.pop() not in (2, 3):
        raise ArtifactError("every layer needs a [d, d] rotation (format_version 1) or an [h, d, d] one (2)")
    version = 1 if rotations[0].dim() == 2 else 2
    layers = {}
    for i, (r, e) in enumerate(zip(rotations, eigenvalues)):
        entry = {"layer_id": i, "rotation": r.detach().to("cpu", torch.float32).contiguous().clone()}
        if e is not None:
            entry["eigenvalues"] = e.detach().to("cpu", torch.float32).flip(-1).contiguous().clone()
        layers[i] = entry
    return {"format_version": version, "objective": objective,
            "source_grouping": "layer" if version == 1 else "head", "layers": layers}


def identity_payload(num_layers: int, head_dim: int) -> dict:
    """Identity rotations for every layer (the V file of a checkpoint whose V rotation is already
    folded into its weights: the fork then quantises V as the weights produce it and maps the output
    back with ``o @ I``)."""
    eye = torch.eye(head_dim, dtype=torch.float32)
    return {"format_version": 1, "objective": "identity", "source_grouping": "layer",
            "layers": {i: {"layer_id": i, "rotation": eye.clone()} for i in range(num_layers)}}


def save_bytes(obj: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ----------------------------------------------------------------------------- loading

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


def _layer_entries(obj, num_layers: int) -> tuple[dict[int, object], list[int]]:
    """The entries of layers ``0..num_layers-1`` keyed by int (the fork's lookup: int key first,
    then its decimal string), and the ids present beyond them (ignored, like the fork does)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("layers"), dict):
        kind = type(obj).__name__ if not isinstance(obj, dict) else "a dict without a 'layers' mapping"
        raise ArtifactError(f"holds {kind}; the fork needs a dict with a 'layers' mapping")
    layers = obj["layers"]
    found, extra = {}, []
    for key in layers:
        if isinstance(key, bool) or not (isinstance(key, int) or (isinstance(key, str) and key.isdigit())):
            raise ArtifactError(f"layer id {key!r} is not an integer")
        lid = int(key)
        if lid >= num_layers:
            extra.append(lid)
        elif lid not in found or isinstance(key, int):
            found[lid] = layers[key]
    missing = [i for i in range(num_layers) if i not in found]
    if missing:
        raise ArtifactError(f"has no rotation for layer(s) {_span(missing)} (the model has layers 0..{num_layers - 1})")
    return found, sorted(set(extra))


def _span(ids: list[int]) -> str:
    if ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 2:
        return f"{ids[0]}..{ids[-1]}"
    return ", ".join(map(str, ids[:8])) + (" …" if len(ids) > 8 else "")


def fork_load_problems(path: Path, *, num_layers: int, head_dim: int, target: str = "fork-main",
                       num_kv_heads: int | None = None) -> list[str]:
    """Would the fork load this file? Its loader's acceptance rules (see the module docstring),
    encoded as oscar's own checks, plus what the fork does not check but serving needs (finite,
    orthogonal in float64 to 1e-5). ``target="pr20"`` also accepts ``[num_kv_heads, d, d]``."""
    check_target(target)
    try:
        obj, _ = load_plain(path)
        entries, _ = _layer_entries(obj, num_layers)
    except (ArtifactError, InputError) as e:
        return [str(e)]
    problems = []
    shapes = [(head_dim, head_dim)] + ([(num_kv_heads, head_dim, head_dim)] if target == "pr20" else [])
    for i in range(num_layers):
        entry = entries[i]
        r = entry.get("rotation") if isinstance(entry, dict) else None
        if not isinstance(r, torch.Tensor):
            problems.append(f"layer {i} has no 'rotation' tensor")
            continue
        if tuple(r.shape) not in shapes:
            why = " (per-KV-head rotations load only in a fork build with PR #20: export --target fork-main)" \
                if r.dim() == 3 and target == "fork-main" else ""
            problems.append(f"layer {i} rotation has shape {list(r.shape)}; the fork ({target}) needs "
                            f"{' or '.join(str(list(s)) for s in shapes)}{why}")
            continue
        if not r.is_floating_point() or not torch.isfinite(r).all():
            problems.append(f"layer {i} rotation is not a finite floating-point tensor")
            continue
        err = orthogonality(r)
        if err >= ORTHOGONALITY_TOL:
            problems.append(f"layer {i} rotation is not orthogonal (‖RRᵀ − I‖∞ = {err:.2e})")
    return problems


def orthogonality(r: torch.Tensor) -> float:
    r64 = r.to(torch.float64)
    eye = torch.eye(r.shape[-1], dtype=torch.float64)
    return float((r64 @ r64.transpose(-1, -2) - eye).abs().max())


def nearest_orthogonal(r: torch.Tensor) -> torch.Tensor:
    """The orthogonal matrix closest to ``r`` in Frobenius norm (the polar factor ``U Vᵀ`` of its SVD),
    in float64."""
    u, _, vh = torch.linalg.svd(r.to(torch.float64))
    return u @ vh


@dataclass
class RotationFile:
    """One parsed fork file: ``rotations[i]`` is ``[1, d, d]`` (shared) or ``[h, d, d]`` (per head), fp32."""

    path: Path
    format_version: str                 # as written in the file ("1", "2", "identity-v1", "missing")
    rotations: list[torch.Tensor]
    eigenvalues: list[torch.Tensor | None]
    sha256: str
    ignored_layers: list[int] = field(default_factory=list)
    reorthogonalized: float = 0.0       # largest ‖RRᵀ − I‖∞ fixed by projection (16-bit files), 0 if none
    source_dtype: str = "float32"

    @property
    def per_head(self) -> bool:
        return any(r.shape[0] > 1 for r in self.rotations)


def read_rotation_file(path: Path, *, num_layers: int, num_kv_heads: int, head_dim: int) -> RotationFile:
    """Read a file the fork loads (or a PR #20 per-head one) for a model of this geometry. Accepts
    what the fork accepts (any or no ``format_version``, e.g. ``"identity-v1"``; int or str layer
    ids; extra layers, which are ignored and recorded; any floating dtype) and dispatches on
    ``rotation.dim()`` (2: shared by the layer's KV heads, 3: per KV head). 16-bit rotations within
    2e-2 of orthogonal are projected to the nearest orthogonal matrix (recorded); anything else that
    is wrong is one clear :class:`ArtifactError` naming the file."""
    path = Path(path)
    obj, raw = load_plain(path)
    try:
        entries, extra = _layer_entries(obj, num_layers)
        version = obj.get("format_version", "missing")
        rots, eigs, fixed, dtypes = [], [], 0.0, set()
        for i in range(num_layers):
            r, e, err = _read_layer(entries[i], i, num_kv_heads, head_dim)
            rots.append(r)
            eigs.append(e)
            fixed = max(fixed, err)
            dtypes.add(str(entries[i]["rotation"].dtype).replace("torch.", ""))
    except ArtifactError as e:
        raise ArtifactError(f"{path}: {e}") from None
    return RotationFile(path, str(version), rots, eigs, hashlib.sha256(raw).hexdigest(), extra, fixed,
                        "+".join(sorted(dtypes)))


def _read_layer(entry, i: int, h: int, d: int) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    if not isinstance(entry, dict) or not isinstance(entry.get("rotation"), torch.Tensor):
        raise ArtifactError(f"layer {i} has no 'rotation' tensor")
    r = entry["rotation"]
    if r.dim() == 2 and tuple(r.shape) == (d, d):
        r = r.unsqueeze(0)
    elif not (r.dim() == 3 and tuple(r.shape) == (h, d, d)):
        raise ArtifactError(f"layer {i} rotation has shape {list(r.shape)}; the model needs [{d}, {d}] (one per "
                            f"layer) or [{h}, {d}, {d}] (one per KV head)")
    if not r.is_floating_point() or not torch.isfinite(r).all():
        raise ArtifactError(f"layer {i} rotation is not a finite floating-point tensor")
    err, fixed = orthogonality(r), 0.0
    if err >= ORTHOGONALITY_TOL:
        if r.element_size() > 2 or err >= REORTHOGONALIZE_TOL:
            raise ArtifactError(f"layer {i} rotation is not orthogonal (‖RRᵀ − I‖∞ = {err:.2e})")
        r, fixed = nearest_orthogonal(r), err
    e = entry.get("eigenvalues")
    if e is not None:
        if not isinstance(e, torch.Tensor) or not e.is_floating_point():
            raise ArtifactError(f"layer {i} 'eigenvalues' is not a floating-point tensor")
        if tuple(e.shape) not in ((d,), (r.shape[0], d)):
            raise ArtifactError(f"layer {i} eigenvalues have shape {list(e.shape)}, expected [{d}] or "
                                f"[{r.shape[0]}, {d}]")
        e = e.to(torch.float32).reshape(-1, d)
    return r.to(torch.float32), e, fixed
