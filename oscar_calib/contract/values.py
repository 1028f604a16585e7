"""The value checks of an artifact: its metadata values (the settings, :mod:`.settings`, and the
provenance: :func:`check_metadata_values`), and its tensors finite, orthogonal rotations, clips in
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

from .defaults import ORTHOGONALITY_TOL
from .layout import (
    MODEL_SOURCE_FIELDS,
    MODEL_SOURCE_KINDS,
    MODEL_SOURCE_METADATA,
    SHARED_KINDS,
    TENSOR_KINDS,
    TEXT_CONFIG_METADATA,
    tensor_name,
)
from .settings import MODEL_TYPE, ArtifactSettings

EIGENVALUE_TOL = 1e-6        # relative to the head's largest |eigenvalue|


def check_metadata_values(md: dict[str, str]) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` of the metadata values, beyond the presence and integer syntax that
    :func:`~oscar_calib.contract.checks.metadata_problems` checks: the settings
    (:meth:`.settings.ArtifactSettings.read`: counts, bounds, group sizes, windows, method names,
    optional keys) and the provenance (:func:`provenance_problems`)."""
    _, found = ArtifactSettings.read(md)
    problems = [p for p in found if not p.startswith("metadata missing ")]
    more, warnings = provenance_problems(md)
    return problems + more, warnings


def provenance_problems(md: dict[str, str]) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` of what says where an artifact came from: a sha256 fingerprint,
    ``calibration`` a JSON object, ``model_source`` well formed, ``text_config`` a wrapper's model type
    and attribute, and a warning when transformers, already imported by this process, does not
    know ``model_type``."""
    problems, warnings = [], []
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
    mt = md.get("model_type")
    if mt is not None and MODEL_TYPE.fullmatch(str(mt)):
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


def check_values(tensors: dict, md: dict[str, str]) -> dict[str, list[str]]:
    """Finite values, orthogonality, clip range, eigenvalue order, per-layer granularity.
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
