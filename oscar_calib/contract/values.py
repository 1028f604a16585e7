"""The value checks of an artifact: its metadata values within the bounds the kernels and engines
take (:func:`check_metadata_values`), and its tensors finite, orthogonal rotations, clips in
(0, 1], descending eigenvalues, one rotation per layer for granularity ``layer``
(:func:`check_values`). They run in numpy (float64 where they compute) on numpy arrays or torch
tensors, and import no torch.

They live in the contract layer so that every reader refuses a bad artifact, not only ``oscar
validate``: :func:`oscar_calib.contract.checks.inspect_bytes` runs them for
:func:`~oscar_calib.contract.artifact.load_artifact` and for ``oscar validate``.
"""

from __future__ import annotations

import json
import re
import sys

import numpy as np

from ..errors import InputError
from .defaults import (
    BITS,
    COMPOSITIONS,
    GRANULARITIES,
    HEAD_DIM_MULTIPLE,
    K_OBJECTIVES,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_WINDOW_TOKENS,
    MIN_GROUP_SIZE,
    ORTHOGONALITY_TOL,
    V_OBJECTIVES,
    check_logit_correction,
)
from .layout import (
    IMPORTED,
    LAYER_GROUPS_METADATA,
    LAYER_V_GROUPS_METADATA,
    LOGIT_CORRECTION_METADATA,
    MODEL_SOURCE_FIELDS,
    MODEL_SOURCE_KINDS,
    MODEL_SOURCE_METADATA,
    SHARED_CLIP_METADATA,
    SHARED_KINDS,
    TENSOR_KINDS,
    TEXT_CONFIG_METADATA,
    tensor_name,
)

EIGENVALUE_TOL = 1e-6        # relative to the head's largest |eigenvalue|
INT_LIMIT = 2 ** 31          # every integer field: what an int32 holds (kernels index with int32)
# transformers' model types: a letter, then letters, digits, '_' or '-' ("llama", "gemma3_text", "gpt-sw3")
MODEL_TYPE = re.compile(r"[A-Za-z][A-Za-z0-9_\-]{0,63}")
_DIGITS = re.compile(r"[0-9]{1,30}")


def metadata_int(md: dict[str, str], key: str) -> int | None:
    """The integer value of ``key`` (ASCII digits only), None when absent or not such a number."""
    v = str(md.get(key, ""))
    return int(v) if _DIGITS.fullmatch(v) else None


def check_metadata_values(md: dict[str, str]) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` of the metadata values, beyond the presence and integer syntax that
    :func:`~oscar_calib.contract.checks.metadata_problems` checks: every count positive and within the
    bounds of :mod:`.defaults`, windows within :data:`~.defaults.MAX_WINDOW_TOKENS`, a group size that
    the kernels take (``layer_group_sizes``: :func:`layer_group_problems`), known method names, a sha256 fingerprint, ``calibration`` a JSON object, the
    optional keys well formed (``text_config`` a wrapper's model type and attribute), and ``model_type`` a transformers model type (a warning when
    transformers, already imported by this process, does not list it)."""
    problems, warnings = [], []
    ints = {k: metadata_int(md, k) for k in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim",
                                              "group_size", "bits", "sink_tokens", "recent_tokens")}
    for k, v in ints.items():
        if v is not None and v >= INT_LIMIT:
            problems.append(f"metadata {k!r} is {v}, beyond any model (limit {INT_LIMIT - 1})")
            ints[k] = None
    for k in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "group_size"):
        if ints.get(k) == 0:
            problems.append(f"metadata {k!r} must be positive")
    for k, cap in (("num_layers", MAX_LAYERS), ("num_attention_heads", MAX_HEADS), ("head_dim", MAX_HEAD_DIM)):
        if ints.get(k) is not None and ints[k] > cap:
            problems.append(f"metadata {k!r} is {ints[k]}, above the toolkit's limit of {cap}")
    if ints.get("bits") is not None and ints["bits"] != BITS:
        problems.append(f"metadata 'bits' is {ints['bits']}, format v1 stores 2-bit settings only")
    h, kv = ints.get("num_attention_heads"), ints.get("num_kv_heads")
    if h and kv and h % kv:
        problems.append(f"{h} query heads do not split evenly over {kv} KV heads")
    d, g = ints.get("head_dim"), ints.get("group_size")
    if d and d % HEAD_DIM_MULTIPLE:
        problems.append(f"head_dim {d} is not a multiple of {HEAD_DIM_MULTIPLE} (the INT2 cache packs four 2-bit "
                        "codes per byte)")
    if d and g and (g & (g - 1) or d % g):
        problems.append(f"group_size {g} must be a power of two dividing head_dim {d}")
    elif g and g < MIN_GROUP_SIZE:
        problems.append(f"group_size {g} is below {MIN_GROUP_SIZE} (it would store more bits per element than BF16)")
    sink, recent = ints.get("sink_tokens"), ints.get("recent_tokens")
    if sink is not None and recent is not None and sink + recent > MAX_WINDOW_TOKENS:
        problems.append(f"BF16 windows of {sink} sink + {recent} recent tokens exceed the limit of {MAX_WINDOW_TOKENS} "
                        "tokens (longer than any supported model's context)")
    if md.get("granularity", "head") not in GRANULARITIES:
        problems.append(f"unknown granularity {md.get('granularity')!r} (expected one of {', '.join(GRANULARITIES)})")
    if md.get("composition", IMPORTED) not in (*COMPOSITIONS, IMPORTED):
        problems.append(f"unknown composition {md.get('composition')!r}")
    if md.get("k_objective", IMPORTED) not in (*K_OBJECTIVES, IMPORTED):
        problems.append(f"unknown k_objective {md.get('k_objective')!r}")
    if md.get("v_objective", IMPORTED) not in (*V_OBJECTIVES, IMPORTED):
        problems.append(f"unknown v_objective {md.get('v_objective')!r}")
    fp = md.get("model_fingerprint")
    if fp is not None and not re.fullmatch(r"[0-9a-f]{64}", fp):
        problems.append("model_fingerprint is not a sha256 hex digest")
    if "calibration" in md:
        try:
            cal = json.loads(md["calibration"])
        except ValueError:
            cal = None
        if not isinstance(cal, dict):
            problems.append("metadata 'calibration' is not a JSON object")
    present = [k for k in SHARED_CLIP_METADATA if k in md]
    if present and len(present) != len(SHARED_CLIP_METADATA):
        problems.append(f"metadata has {present[0]!r} without {[k for k in SHARED_CLIP_METADATA if k not in md][0]!r}")
    for k in present:
        try:
            c = float(md[k])
        except ValueError:
            c = float("nan")
        if not 0 < c <= 1:
            problems.append(f"metadata {k!r} is {md[k]!r}, expected a clip ratio in (0, 1]")
    if LOGIT_CORRECTION_METADATA in md:
        try:
            check_logit_correction(md[LOGIT_CORRECTION_METADATA], f"metadata {LOGIT_CORRECTION_METADATA!r}")
        except InputError as e:
            problems.append(str(e))
    if md.get("v_folded", "false") not in ("true", "false"):
        problems.append(f"metadata 'v_folded' is {md.get('v_folded')!r}, expected 'true' or 'false'")
    if "model_type" in md:
        mt = str(md["model_type"])
        if not MODEL_TYPE.fullmatch(mt):
            problems.append(f"metadata 'model_type' is {mt[:40]!r}, not a transformers model type (a letter, then "
                            "letters, digits, '_' or '-')")
        else:
            known = _transformers_model_types()
            if known is not None and mt not in known:
                warnings.append(f"metadata 'model_type' {mt!r} is not a model type this transformers knows (a model "
                                "with remote code, or a newer transformers?)")
    if TEXT_CONFIG_METADATA in md:
        wrapper, _, attr = str(md[TEXT_CONFIG_METADATA]).partition(".")
        if not (MODEL_TYPE.fullmatch(wrapper) and re.fullmatch(r"[a-z][a-z0-9_]{0,63}", attr)):
            problems.append(f"metadata {TEXT_CONFIG_METADATA!r} is {str(md[TEXT_CONFIG_METADATA])[:60]!r}, expected "
                            "'<wrapper model_type>.<attribute>' (e.g. 'gemma3.text_config')")
    problems += model_source_problems(md)
    return problems, warnings


def _transformers_model_types() -> set[str] | None:
    """The model types of the transformers this process has already imported (None when it has not:
    checking must not import it, ``oscar validate`` stays light)."""
    auto = sys.modules.get("transformers.models.auto.configuration_auto")
    names = getattr(auto, "CONFIG_MAPPING_NAMES", None)
    return set(names) if names else None


def layer_group_problems(md: dict[str, str]) -> list[str]:
    """Why ``layer_group_sizes`` or ``layer_v_group_sizes`` is unusable (empty when absent or fine):
    one size per layer, each a power of two of at least :data:`~.defaults.MIN_GROUP_SIZE` dividing
    head_dim."""
    out = []
    n, d = metadata_int(md, "num_layers"), metadata_int(md, "head_dim")
    for key in (LAYER_GROUPS_METADATA, LAYER_V_GROUPS_METADATA):
        raw = md.get(key)
        if raw is None:
            continue
        parts = str(raw).split(",")
        if not all(_DIGITS.fullmatch(x.strip()) for x in parts):
            out.append(f"metadata {key!r} is not comma-separated integers: {raw[:60]!r}")
            continue
        sizes = [int(x) for x in parts]
        if n is not None and len(sizes) != n:
            out.append(f"metadata {key!r} has {len(sizes)} sizes for {n} layers")
            continue
        bad = [g for g in sizes if g <= 0 or g & (g - 1) or (d and d % g)]
        small = [g for g in sizes if g < MIN_GROUP_SIZE]
        if bad:
            out.append(f"metadata {key!r}: {bad[0]} is not a power of two dividing head_dim {d}")
        elif small:
            out.append(f"metadata {key!r}: {small[0]} is below the smallest group size {MIN_GROUP_SIZE}")
    return out


def check_values(tensors: dict, md: dict[str, str]) -> dict[str, list[str]]:
    """Finite values, orthogonality, clip range, eigenvalue order, per-layer granularity, per-layer
    group sizes (``layer_group_sizes`` and ``layer_v_group_sizes``, when stored).
    Assumes the structure checks passed; ``tensors`` are numpy arrays or torch tensors (an
    in-memory artifact's, on any device). Returns problems per check name."""
    out = {"finite": [], "orthogonal": [], "clips": [], "eigenvalues": [], "granularity": []}
    n = int(md["num_layers"])
    per_layer = md.get("granularity") == "layer"
    for i in range(n):
        t = {k: _numpy(tensors[tensor_name(i, k)]) for k in TENSOR_KINDS + SHARED_KINDS
             if tensor_name(i, k) in tensors}
        for k, x in t.items():
            bad = int(np.count_nonzero(~np.isfinite(x)))
            if bad:
                out["finite"].append(f"{tensor_name(i, k)} has {bad} non-finite value(s)")
        for k in ("k_rotation", "v_rotation", "k_layer_rotation", "v_layer_rotation"):
            r = t.get(k)
            if r is None or not np.isfinite(r).all():
                continue
            r64 = r.astype(np.float64)
            err = np.abs(r64 @ np.swapaxes(r64, -1, -2) - np.eye(r.shape[-1])).max(axis=(-1, -2)).reshape(-1)
            worst = int(err.argmax())
            if float(err[worst]) >= ORTHOGONALITY_TOL:
                where = f" on KV head {worst}" if r.ndim == 3 else ""
                out["orthogonal"].append(f"{tensor_name(i, k)} is not orthogonal: ‖RRᵀ − I‖∞ = "
                                         f"{float(err[worst]):.2e}{where} (limit {ORTHOGONALITY_TOL:g})")
            if per_layer and r.ndim == 3 and r.shape[0] > 1 and not np.allclose(r, r[:1], atol=1e-6, rtol=0):
                out["granularity"].append(f"{tensor_name(i, k)} differs between KV heads but granularity is 'layer'")
        for k in ("k_clip", "v_clip"):
            c = t[k]
            bad = ~((c > 0) & (c <= 1)) & np.isfinite(c)
            if bad.any():
                out["clips"].append(f"{tensor_name(i, k)} has ratio(s) outside (0, 1]: "
                                    f"{', '.join(f'{float(v):g}' for v in c[bad][:4])}")
        for k in ("k_eigenvalues", "v_eigenvalues", "k_layer_eigenvalues", "v_layer_eigenvalues"):
            if k not in t:
                continue
            e = t[k].astype(np.float64)
            if not np.isfinite(e).all() or e.shape[-1] < 2:
                continue
            scale = np.maximum(np.abs(e).max(axis=-1, keepdims=True), 1e-30)
            rise = ((e[..., 1:] - e[..., :-1]) / scale).max()
            if float(rise) > EIGENVALUE_TOL:
                out["eigenvalues"].append(f"{tensor_name(i, k)} is not in descending order")
    out["group_sizes"] = layer_group_problems(md)
    return out


def _numpy(x) -> np.ndarray:
    """A numpy view of an array or of a torch tensor (detached, on the CPU), without importing torch."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        try:
            x = x.numpy()
        except TypeError:                       # bfloat16 / FP8: numpy has no such dtype
            x = x.float().numpy()
    return np.asarray(x)


def value_problems(tensors: dict, md: dict[str, str]) -> list[str]:
    """Every problem :func:`check_values` finds, in its order (finite first)."""
    return [p for found in check_values(tensors, md).values() for p in found]


def model_source_problems(md: dict[str, str]) -> list[str]:
    """Why ``model_source`` is unusable (empty when absent or fine): not a JSON object of strings,
    an unknown field or kind, or no ``alias`` / ``path`` where its kind needs one."""
    raw = md.get(MODEL_SOURCE_METADATA)
    if raw is None:
        return []
    try:
        rec = json.loads(raw)
    except ValueError:
        rec = None
    key = MODEL_SOURCE_METADATA
    if not isinstance(rec, dict) or not all(isinstance(v, str) and v for v in rec.values()):
        return [f"metadata {key!r} is not a JSON object of non-empty strings: {str(raw)[:60]!r}"]
    unknown = sorted(set(rec) - set(MODEL_SOURCE_FIELDS))
    if unknown:
        return [f"metadata {key!r} has unknown field(s) {', '.join(unknown)}"]
    kind = rec.get("kind")
    if kind not in MODEL_SOURCE_KINDS:
        return [f"metadata {key!r} has kind {kind!r}, expected one of {', '.join(MODEL_SOURCE_KINDS)}"]
    needs = {"alias": "alias", "local": "path", "gguf": "path", "hub": "hub_id"}[kind]
    if needs not in rec:
        return [f"metadata {key!r} of kind {kind!r} has no {needs!r}"]
    return []
