"""SGLang's OSCAR rotation files (the OSCAR fork's and upstream SGLang's): writing them, checking
them as each loader does, and reading them back (for ``oscar import``).

Three loaders, read for this module (nothing copied):

* the fork's main (FutureMLS-Lab/OSCAR at 473ff3f9d, ``load_oscar_rotations`` in
  ``sglang-research/python/sglang/srt/mem_cache/memory_pool.py``): ``torch.load`` with torch 2.9's
  default ``weights_only=True``, a mapping with a ``"layers"`` key, every layer id of the model looked
  up as an ``int`` or a decimal ``str`` key (extra keys ignored), each ``"rotation"`` of shape
  ``(head_dim, head_dim)`` (an ``[h, d, d]`` tensor is refused), cast to bf16; ``format_version``,
  ``objective``, ``eigenvalues`` and ``layer_id`` are never read. Its writer
  (``rotation/compute_kv_rotation.py``) stores ``{"format_version": 1, "objective",
  "source_grouping": "layer", "layers": {i: {"layer_id", "rotation" fp32 [d, d], "eigenvalues" fp32
  [d]}}}``, eigenvalues ascending as ``torch.linalg.eigh`` returns them;
* the fork's newer code (FutureMLS-Lab/OSCAR at 8dbf789065, ``load_oscar_rotations`` and
  ``load_oscar_rotation_field`` in ``python/sglang/srt/mem_cache/memory_pool.py``; its pull request
  #20 brought per-KV-head rotations, and the PR head itself was not readable here): the same lookup,
  by GLOBAL layer id (a hybrid model's pool passes the ids of its attention layers, which may be
  sparse), each rotation ``[d, d]`` (V1) or ``[num_kv_heads, d, d]`` (V2, dispatched on
  ``rotation.dim()``; sliced per tensor-parallel rank, so the head count must be the model's), and
  the optional per-layer fields ``q_rotation`` / ``o_rotation`` (``[d, d]`` or ``[h, d, d]``) and
  ``k_mean`` (``[d]`` or ``[h, d]``; ``load_oscar_rotation_field(path, "k_mean", ..., vector=True)``),
  each on every layer or on none (a field on some layers only is a ``ValueError``), cast to the
  pool's dtype. ``k_mean`` is subtracted from every key before the key rotation, for every stored
  key and the keys of an extend alike (its test ``rotation/tests/test_oscar2_transforms.py`` at
  2911dd3f9a: the pool centers in bf16, ``k − k_mean``, then rotates), so a query's logits all move
  by ``q·k_mean``. The per-head writer stores ``{"format_version": 2, "objective", "source_grouping":
  "per_kv_head", "layers": {i: {"layer_id", "rotation" [h, d, d]}}}`` and no eigenvalues;
* upstream SGLang's pull request #32129 (sgl-project/sglang at 166afca4bc,
  ``UnifiedInt2HPKVPool.__init__`` in ``python/sglang/srt/mem_cache/unified_kv_pool.py``): it calls
  the fork's loader (``load_oscar_rotations`` of its ``memory_pool.py``, which was not readable at
  that revision) for the contiguous layer range ``[start_layer, start_layer + layer_num)`` with one
  ``head_dim``, holds the rotations in the HP dtype, and its group size defaults to head_dim when
  ``--kv-cache-quant-group-size`` is not given; its windows must be multiples of
  ``N_Q = 4 × itemsize(hp)`` (8 for bf16). Checked as the fork's main.

=====================  =====================================================================
target                 what :func:`~oscar_calib.tools.export.ptfile.payload` writes per layer
=====================  =====================================================================
``sglang-fork``        format_version 1: the layer's shared rotation fp32 ``[d, d]`` and its
                       eigenvalues fp32 ``[d]`` ascending (what the fork's main loads)
``sglang-fork-v2``     format_version 2, ``source_grouping: "per_kv_head"``: every KV head's
                       rotation fp32 ``[h, d, d]``, heads in the model's ``k_proj``/``v_proj``
                       order, no eigenvalues (its writer's form); with key centering the K
                       file's layers also hold ``k_mean`` fp32 ``[h, d]`` (the artifact's)
``sglang``             as ``sglang-fork`` (upstream's pull request loads the fork's V1 files)
=====================  =====================================================================

Rotations follow oscar's convention, which is SGLang's: a rotated row is ``x @ R``; the query uses
the K file; the attention output is mapped back with ``o @ R_vᵀ``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ....contract.defaults import ORTHOGONALITY_TOL
from ....contract.features import layer_span
from ....errors import ArtifactError, InputError
from ....numerics.rotation import orthogonality_error
from ..ptfile import load_plain

TARGETS = {
    "sglang-fork": "the OSCAR SGLang fork's main branch: one rotation per layer (format_version 1)",
    "sglang-fork-v2": "the OSCAR SGLang fork's newer code (its PR #20): one rotation per KV head (format_version 2)",
    "sglang": "upstream SGLang with its pull request #32129 (--kv-cache-dtype int2): the fork's V1 files",
}
PER_HEAD_TARGETS = ("sglang-fork-v2",)
# optional per-layer fields of the fork's newer loader: name -> trailing shape in units of head_dim
OPTIONAL_FIELDS = {"q_rotation": 2, "o_rotation": 2, "k_mean": 1}
# a 16-bit file's rotation is up to ~8e-3 from orthogonal; within this it is re-orthogonalised on import
REORTHOGONALIZE_TOL = 2e-2


def check_target(target: str) -> str:
    if target not in TARGETS:
        raise InputError(f"unknown --target {target!r}; choose from {', '.join(TARGETS)}")
    return target


def file_name(which: str, objective: str) -> str:
    """``k_rotation_<objective>.pt`` / ``v_rotation_<objective>.pt`` (the fork's naming)."""
    return f"{which}_rotation_{objective}.pt"


def _layer_entries(obj, num_layers: int, layer_ids=None) -> tuple[dict[int, object], list[int]]:
    """The entries of the model's layers (``layer_ids``, default ``0..num_layers-1``: global ids)
    keyed by int (the fork's lookup: int key first, then its decimal string), and the ids present
    beyond them (ignored, like the fork does)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("layers"), dict):
        kind = type(obj).__name__ if not isinstance(obj, dict) else "a dict without a 'layers' mapping"
        raise ArtifactError(f"holds {kind}; SGLang needs a dict with a 'layers' mapping")
    wanted = list(layer_ids) if layer_ids is not None else list(range(num_layers))
    layers = obj["layers"]
    found, extra = {}, []
    for key in layers:
        if isinstance(key, bool) or not (isinstance(key, int) or (isinstance(key, str) and key.isdigit())):
            raise ArtifactError(f"layer id {key!r} is not an integer")
        lid = int(key)
        if lid not in wanted:
            extra.append(lid)
        elif lid not in found or isinstance(key, int):
            found[lid] = layers[key]
    missing = [i for i in wanted if i not in found]
    if missing:
        raise ArtifactError(f"has no rotation for layer(s) {layer_span(missing)} (the model's layers: "
                            f"{layer_span(wanted)})")
    return found, sorted(set(extra))


def fork_load_problems(path: Path, *, num_layers: int, head_dim: int, target: str = "sglang-fork",
                       num_kv_heads: int | None = None, layer_ids=None, layer_heads=None) -> list[str]:
    """Would SGLang (``target``) load this file? Its loader's acceptance rules (module docstring),
    encoded as oscar's own checks, plus what the loader does not check but serving needs (finite,
    orthogonal in float64 to 1e-5, a per-head tensor with the model's KV head count). ``layer_heads``:
    ``(num_kv_heads, head_dim)`` of every layer where they differ (the newer loader's per-layer
    ``head_dim``), in the order of ``layer_ids``."""
    check_target(target)
    try:
        obj, _ = load_plain(path)
        entries, _ = _layer_entries(obj, num_layers, layer_ids)
    except (ArtifactError, InputError) as e:
        return [str(e)]
    per_head = target in PER_HEAD_TARGETS
    ids = list(layer_ids) if layer_ids is not None else list(range(num_layers))
    heads = dict(zip(ids, layer_heads or [(num_kv_heads, head_dim)] * num_layers))
    problems = []
    for i, entry in sorted(entries.items()):
        h, d = heads[i]
        shapes = [(d, d)] + ([(h, d, d)] if per_head else [])
        r = entry.get("rotation") if isinstance(entry, dict) else None
        if not isinstance(r, torch.Tensor):
            problems.append(f"layer {i} has no 'rotation' tensor")
            continue
        if tuple(r.shape) not in shapes:
            why = (" (per-KV-head rotations load only in the fork's newer code: export --target sglang-fork-v2, or "
                   "--target " + target + " for the shared per-layer ones)") if r.dim() == 3 and not per_head else ""
            problems.append(f"layer {i} rotation has shape {list(r.shape)}; {target} needs "
                            f"{' or '.join(str(list(s)) for s in shapes)}{why}")
            continue
        if not r.is_floating_point() or not torch.isfinite(r).all():
            problems.append(f"layer {i} rotation is not a finite floating-point tensor")
            continue
        err = orthogonality_error(r)
        if err >= ORTHOGONALITY_TOL:
            problems.append(f"layer {i} rotation is not orthogonal (‖RRᵀ − I‖∞ = {err:.2e})")
    if per_head:
        problems += optional_field_problems(entries, head_dim, num_kv_heads, heads)
    return problems


def optional_field_problems(entries: dict[int, object], d: int, h: int | None,
                            heads: dict | None = None) -> list[str]:
    """The fork's newer loader's rules for ``q_rotation`` / ``o_rotation`` / ``k_mean``: on every
    layer or on none, each ``[d, d]`` (``[d]`` for the mean) or with a leading KV-head axis;
    ``heads[i]``: layer ``i``'s ``(h, d)`` where layers differ (default ``(h, d)`` everywhere)."""
    problems = []
    for name, rank in OPTIONAL_FIELDS.items():
        present = [i for i, e in entries.items() if isinstance(e, dict) and e.get(name) is not None]
        if present and len(present) != len(entries):
            problems.append(f"'{name}' is on {len(present)} of {len(entries)} layers; the loader needs it on all or "
                            "none")
        for i in present:
            hi, di = (heads or {}).get(i, (h, d))
            tail = (di,) * rank
            t = entries[i][name]
            ok = isinstance(t, torch.Tensor) and tuple(t.shape[-rank:]) == tail and t.dim() in (rank, rank + 1) \
                and (t.dim() == rank or hi is None or t.shape[0] == hi)
            if not ok:
                shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                problems.append(f"layer {i} '{name}' has shape {shape}, expected {list(tail)} or [{hi}, *{list(tail)}]")
                break
            if not t.is_floating_point() or not torch.isfinite(t).all():
                problems.append(f"layer {i} '{name}' is not a finite floating-point tensor")
                break
    return problems


def nearest_orthogonal(r: torch.Tensor) -> torch.Tensor:
    """The orthogonal matrix closest to ``r`` in Frobenius norm (the polar factor ``U Vᵀ`` of its SVD),
    in float64."""
    u, _, vh = torch.linalg.svd(r.to(torch.float64))
    return u @ vh


def read_rotation_file(path: Path, *, num_layers: int, num_kv_heads: int, head_dim: int, layer_ids=None):
    """Read a file SGLang loads (V1, or a V2 per-head one) for a model of this geometry, as a
    :class:`~oscar_calib.tools.export.base.ReadRotations` (one entry per model layer, in
    ``layer_ids`` order). Accepts what the loaders accept (any or no ``format_version``, e.g. ``"identity-v1"``; int or str layer
    ids; extra layers, which are ignored and recorded; any floating dtype) and dispatches on
    ``rotation.dim()`` (2: shared by the layer's KV heads, 3: per KV head). 16-bit rotations within
    2e-2 of orthogonal are projected to the nearest orthogonal matrix (recorded); anything else that
    is wrong is one clear :class:`ArtifactError` naming the file."""
    from ..base import ReadRotations

    path = Path(path)
    obj, raw = load_plain(path)
    ids = list(layer_ids) if layer_ids is not None else list(range(num_layers))
    try:
        entries, extra = _layer_entries(obj, num_layers, ids)
        version = obj.get("format_version", "missing")
        rots, eigs, fixed, dtypes = [], [], 0.0, set()
        for i in ids:
            r, e, err = _read_layer(entries[i], i, num_kv_heads, head_dim)
            rots.append(r)
            eigs.append(e)
            fixed = max(fixed, err)
            dtypes.add(str(entries[i]["rotation"].dtype).replace("torch.", ""))
        means = _key_means({i: entries[i] for i in ids}, num_kv_heads, head_dim)
    except ArtifactError as e:
        raise ArtifactError(f"{path}: {e}") from None
    notes = [f"layer(s) {layer_span(extra)} ignored (not among the model's layers)"] if extra else []
    if fixed:
        notes.append(f"16-bit rotations re-orthogonalised (‖RRᵀ − I‖∞ was {fixed:.1e})")
    if means is not None:
        notes.append("k_mean on every layer: the keys are stored centered on it (key centering)")
    return ReadRotations(path.name, str(version), rots, hashlib.sha256(raw).hexdigest(), eigs, notes,
                         "+".join(sorted(dtypes)), k_means=means)


def _key_means(entries: dict[int, object], h: int, d: int) -> list[torch.Tensor] | None:
    """Every layer's ``k_mean`` as float32 ``[h, d]`` (a ``[d]`` one repeated per KV head), or None
    when no layer has one; the fork's newer loader's rules (:func:`optional_field_problems`), and
    the non-orthogonal OSCAR-2 companions (``q_rotation``, ``o_rotation``), which oscar's artifact
    cannot hold, refused in one line rather than dropped."""
    for name in ("q_rotation", "o_rotation"):
        if any(isinstance(e, dict) and e.get(name) is not None for e in entries.values()):
            raise ArtifactError(f"holds '{name}' (a non-orthogonal OSCAR-2 transform): oscar's artifact stores "
                                "orthogonal rotations only, so it is not imported")
    problems = optional_field_problems(entries, d, h)
    if problems:
        raise ArtifactError(problems[0])
    if not any(isinstance(e, dict) and e.get("k_mean") is not None for e in entries.values()):
        return None
    return [entries[i]["k_mean"].to(torch.float32).expand(h, d).contiguous().clone() for i in sorted(entries)]


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
    err, fixed = orthogonality_error(r), 0.0
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
