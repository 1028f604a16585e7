"""``oscar validate``: check artifacts against the format-v1 contract, one line per problem.

=====================  ======================================================================
check                  what must hold
=====================  ======================================================================
file                   a complete safetensors file: 8-byte header length, JSON header, every
                       tensor's data inside the file (a truncated download is caught here)
metadata               ``format``/``format_version`` and every required key
                       (:func:`oscar_calib.spec.artifact.check_structure`), integer fields, ``bits``
                       = 2, a known ``granularity``/``composition``/objectives, ``group_size`` a
                       power of two dividing ``head_dim``, query heads a multiple of KV heads,
                       ``calibration`` a JSON object, ``model_fingerprint`` 64 hex digits
shapes                 every tensor of every layer present, float32, with its contract shape
finite                 no NaN/Inf anywhere
orthogonal             ‖R Rᵀ − I‖∞ < 1e-5 for every stored (float32) rotation, computed in float64
                       (the optional shared per-layer rotations included)
shared                 the optional ``layers.{i}.{k,v}_layer_rotation`` [d, d] and
                       ``{k,v}_layer_eigenvalues`` [d]: all of them or none; metadata
                       ``fork_k_clip``/``fork_v_clip``: both or neither, each in (0, 1]
clips                  every clip ratio in (0, 1]
eigenvalues            descending along head_dim, up to 1e-6 of the head's largest |λ|
granularity            ``layer``: one rotation repeated for every KV head
group_sizes            the optional ``layer_group_sizes`` (a bit budget): one power of two
                       dividing ``head_dim`` per layer
model_source           the optional record of where the model came from: a JSON object with a
                       known ``kind`` and the ``alias`` / ``path`` / ``hub_id`` it needs
model (``--model``)    fingerprint, layers, query/KV heads and head_dim equal the model's
=====================  ======================================================================

A PATH may be an artifact directory, an ``oscar.safetensors`` (or any ``.safetensors``) file, or a
directory holding artifact directories at any depth (``oscar validate zoo``). The zoo's own
``index.json`` is skipped, so ``oscar validate zoo/*`` works; any other file is a problem. Problems are
collected, never raised, so one run reports everything wrong with every artifact.

Tensors are read with numpy straight from the byte ranges the checked header names, and every
check runs in numpy (float64 where it computes): validating imports neither torch nor
transformers, so ``oscar validate`` without ``--model`` starts in well under a second.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import FORMAT_VERSION
from ..errors import OscarError
from ..spec.artifact import (
    FORMAT_NAME,
    INT_METADATA,
    REQUIRED_METADATA,
    SHARED_CLIP_METADATA,
    WEIGHTS_NAME,
    check_structure,
    compatibility_problems,
    model_source_problems,
)
from ..spec.defaults import COMPOSITIONS, GRANULARITIES, K_OBJECTIVES, V_OBJECTIVES
from ..spec.stfile import read_header
from ..spec.values import EIGENVALUE_TOL, check_values  # noqa: F401 (re-exported: the value checks' home is spec)

IMPORTED = "imported"        # objective/composition of an artifact made by ``oscar import``

# safetensors dtype tags numpy reads; the others (BF16, FP8) are described by name and shape only
_NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
                 "U8": "u1", "BOOL": "?", "U16": "<u2", "U32": "<u4", "U64": "<u8"}
_DTYPE_NAMES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


@dataclass
class ModelReference:
    """What ``--model`` contributes: the model's fingerprint and attention geometry."""

    spec: str
    model_id: str
    fingerprint: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_model(cls, model, spec: str = "", model_id: str = "") -> "ModelReference":
        from ..model.geometry import geometry_of, model_fingerprint

        g = geometry_of(model)
        return cls(spec, model_id or spec, model_fingerprint(model), g.num_layers, g.num_attention_heads,
                   g.num_kv_heads, g.head_dim)


def model_reference(spec: str, *, trust_remote_code: bool = False) -> ModelReference:
    """Load ``spec`` (alias, directory, .gguf, hub id) and keep only what validation needs."""
    from ..model.load import load_model

    lm = load_model(spec, device="cpu", trust_remote_code=trust_remote_code)
    return ModelReference.from_model(lm.model, spec, lm.source.model_id)


@dataclass
class ValidationReport:
    """The result for one artifact: ``problems`` is empty when it is valid."""

    path: Path
    problems: list[str] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)   # check name -> passed (absent: not run)
    findings: list[tuple[str, str]] = field(default_factory=list)   # (check name, problem), as added

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, check: str, problems: list[str]) -> None:
        self.checks[check] = self.checks.get(check, True) and not problems
        self.problems.extend(problems)
        self.findings.extend((check, p) for p in problems)

    def to_dict(self) -> dict:
        md = self.metadata
        return {"path": str(self.path), "ok": self.ok, "problems": list(self.problems), "checks": dict(self.checks),
                "model_id": md.get("model_id"), "format_version": md.get("format_version"),
                "num_layers": md.get("num_layers"), "num_kv_heads": md.get("num_kv_heads"),
                "head_dim": md.get("head_dim"), "granularity": md.get("granularity"),
                "composition": md.get("composition")}


# ----------------------------------------------------------------------------- finding artifacts

def find_artifacts(paths: list[Path], *, allow_empty: bool = False) -> list[tuple[Path, str | None]]:
    """Expand PATH arguments, in order, into ``(safetensors file, None)`` or, for an argument
    naming no artifact, ``(argument, message)``. Duplicates are dropped."""
    out: list[tuple[Path, str | None]] = []
    seen: set[Path] = set()

    def keep(f: Path) -> None:
        if f.resolve() not in seen:
            seen.add(f.resolve())
            out.append((f, None))

    for p in map(Path, paths):
        if p.is_file():
            if p.suffix == ".safetensors":
                keep(p)
            elif is_zoo_index(p):
                continue          # the zoo's own index.json: `oscar validate zoo/*` skips it
            else:
                out.append((p, "not an artifact (give an artifact directory or its oscar.safetensors)"))
        elif p.is_dir():
            if (p / WEIGHTS_NAME).is_file():
                keep(p / WEIGHTS_NAME)
                continue
            found = sorted(f for f in p.rglob(WEIGHTS_NAME)
                           if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts))
            for f in found:
                keep(f)
            if not found and not allow_empty:
                out.append((p, f"no artifact ({WEIGHTS_NAME}) in this directory or below it"))
        else:
            out.append((p, "no such file or directory"))
    return out


def is_zoo_index(path: Path) -> bool:
    if path.name != "index.json":
        return False
    try:
        return json.loads(path.read_text()).get("format") == "oscar-zoo-index"
    except (OSError, ValueError, AttributeError):
        return False


# ----------------------------------------------------------------------------- reading

@dataclass
class _Unread:
    """A tensor numpy cannot hold (bfloat16, FP8): its shape and dtype, for the structure check."""

    shape: tuple[int, ...]
    dtype: str


def read_tensors(path: Path, header: dict, data_start: int) -> dict[str, np.ndarray | _Unread]:
    """Every tensor of a safetensors file whose ``header`` :func:`read_header` checked, as numpy
    arrays (little-endian, as stored)."""
    raw = path.read_bytes()
    out: dict[str, np.ndarray | _Unread] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = tuple(int(x) for x in info["shape"])
        if info["dtype"] not in _NUMPY_DTYPES:
            out[name] = _Unread(shape, _DTYPE_NAMES.get(info["dtype"], info["dtype"]))
            continue
        start = data_start + int(info["data_offsets"][0])
        out[name] = np.frombuffer(raw, dtype=_NUMPY_DTYPES[info["dtype"]], count=math.prod(shape),
                                  offset=start).reshape(shape)
    return out


# ----------------------------------------------------------------------------- checks

def _header_metadata_ok(md: dict[str, str]) -> bool:
    """The conditions under which :func:`check_structure` goes on to check tensors."""
    return (md.get("format") == FORMAT_NAME and md.get("format_version") == str(FORMAT_VERSION)
            and all(k in md for k in REQUIRED_METADATA) and all(str(md[k]).isdigit() for k in INT_METADATA))


def check_metadata_values(md: dict[str, str]) -> list[str]:
    """Value checks beyond :func:`check_structure` (which checks presence and integer syntax)."""
    problems = []
    ints = {}
    for k in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "group_size", "bits"):
        v = str(md.get(k, ""))
        if v.isdigit():
            ints[k] = int(v)
    for k in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "group_size"):
        if ints.get(k) == 0:
            problems.append(f"metadata {k!r} must be positive")
    if "bits" in ints and ints["bits"] != 2:
        problems.append(f"metadata 'bits' is {ints['bits']}, format v1 stores 2-bit settings only")
    h, kv = ints.get("num_attention_heads"), ints.get("num_kv_heads")
    if h and kv and h % kv:
        problems.append(f"{h} query heads do not split evenly over {kv} KV heads")
    d, g = ints.get("head_dim"), ints.get("group_size")
    if d and g and (g & (g - 1) or d % g):
        problems.append(f"group_size {g} must be a power of two dividing head_dim {d}")
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
    if md.get("v_folded", "false") not in ("true", "false"):
        problems.append(f"metadata 'v_folded' is {md.get('v_folded')!r}, expected 'true' or 'false'")
    problems += model_source_problems(md)
    return problems


def check_against_model(md: dict[str, str], ref: ModelReference) -> list[str]:
    return compatibility_problems(md, ref, ref.fingerprint, model_name=ref.spec or ref.model_id)


def validate_artifact(path: Path, *, model: ModelReference | None = None) -> ValidationReport:
    """Run every check on one artifact (directory or safetensors file); never raises for a bad
    artifact: problems are returned in the report."""
    path = Path(path)
    wpath = path / WEIGHTS_NAME if path.is_dir() else path
    report = ValidationReport(path=path)
    if not wpath.is_file():
        report.add("file", [f"no {WEIGHTS_NAME} here"])
        return report
    try:
        header, data_start = read_header(wpath)
        report.metadata = {str(k): str(v) for k, v in (header.get("__metadata__") or {}).items()}
        tensors = read_tensors(wpath, header, data_start)
    except OscarError as e:
        report.add("file", [str(e)])
        return report
    except OSError as e:
        report.add("file", [f"cannot read ({e.strerror or e})"])
        return report
    report.add("file", [])
    md = report.metadata
    structure = check_structure(tensors, md)
    if not _header_metadata_ok(md):
        # check_structure stops at metadata problems: without them the expected shapes are unknown
        report.add("metadata", structure)
        return report
    report.add("metadata", check_metadata_values(md))
    report.add("shapes", structure)
    if not (report.checks["metadata"] and report.checks["shapes"]):
        return report
    for name, problems in check_values(tensors, md).items():
        report.add(name, problems)
    if model is not None:
        report.add("model", check_against_model(md, model))
    return report


def validate_paths(paths: list[Path], *, model: ModelReference | None = None,
                   allow_empty: bool = False) -> list[ValidationReport]:
    reports = []
    for f, error in find_artifacts(paths, allow_empty=allow_empty):
        if error is not None:
            reports.append(ValidationReport(path=f))
            reports[-1].add("file", [error])
        else:
            reports.append(validate_artifact(f.parent if f.name == WEIGHTS_NAME else f, model=model))
    return reports


def require_valid(path: Path, *, model: ModelReference | None = None) -> ValidationReport:
    """Validate or raise :class:`~oscar_calib.errors.ArtifactError` naming the first problem."""
    from ..errors import ArtifactError

    report = validate_artifact(path, model=model)
    if not report.ok:
        more = f" (+{len(report.problems) - 1} more; run `oscar validate {path}`)" if len(report.problems) > 1 else ""
        raise ArtifactError(f"{path}: {report.problems[0]}{more}")
    return report
