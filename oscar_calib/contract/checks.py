"""Every check of an artifact file, in one order: the one function every reader goes through.

:func:`inspect_bytes` runs them on a file's bytes and returns a :class:`ValidationReport`;
:func:`~oscar_calib.contract.artifact.load_artifact` (and so verify, eval, fold-weights, export, the
runtime caches and schemes) refuses an artifact with its first problem, ``oscar validate``
(:mod:`oscar_calib.tools.validate`) prints all of them, and push and pull refuse on any.

=====================  ======================================================================
check                  what must hold
=====================  ======================================================================
file                   a complete safetensors file laid out as every safetensors reader
                       wants it (:mod:`.stfile`: a truncated download is caught here)
metadata               ``format``/``format_version`` and every required key, integer fields
                       in bounds (:class:`.settings.ArtifactSettings`); metadata that
                       contradicts what every tensor says is named once, as the root cause
shapes                 every tensor of every layer present, float32, with its contract shape
finite … group_sizes   the tensor values (:func:`.values.check_values`)
digest                 the stored ``content_sha256`` equals the content's digest
                       (:mod:`.digest`); a file without one is read with a warning
=====================  ======================================================================

Problems are collected per check, never raised here, so one run reports everything wrong. Reading
and checking import neither torch nor transformers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import FORMAT_VERSION
from ..errors import ArtifactError, OscarError
from . import stfile
from .digest import content_digest, digest_problem, missing_digest_warning
from .layout import (
    CENTER_KINDS,
    DIGEST_KEY,
    FORMAT_NAME,
    INT_METADATA,
    KEY_CENTERING_METADATA,
    LAYER_HEAD_DIMS_METADATA,
    LAYER_KV_HEADS_METADATA,
    REQUIRED_METADATA,
    SHARED_KINDS,
    TENSOR_KINDS,
    dtype_name,
    tensor_name,
    tensor_shape,
)
from .settings import ArtifactSettings, metadata_int
from .values import check_values, provenance_problems
from .verification import Verification

_ROTATION = re.compile(r"layers\.(\d{1,6})\.([kv])_rotation")


@dataclass
class ValidationReport:
    """The result for one artifact: ``problems`` is empty when it is valid. ``content_sha256`` is
    the digest of the content as read (None when the file is unreadable); ``verification`` (set by
    ``oscar validate`` and push) is what :func:`~oscar_calib.contract.verification.verification_of`
    says of its ``verify.json``."""

    path: Path
    problems: list[str] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)   # check name -> passed (absent: not run)
    findings: list[tuple[str, str]] = field(default_factory=list)   # (check name, problem), as added
    warnings: list[str] = field(default_factory=list)
    content_sha256: str | None = None
    verification: Verification | None = None
    settings: ArtifactSettings | None = None     # the typed settings, when the metadata is sound

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def has_digest(self) -> bool:
        return DIGEST_KEY in self.metadata

    def add(self, check: str, problems: list[str]) -> None:
        self.checks[check] = self.checks.get(check, True) and not problems
        self.problems.extend(problems)
        self.findings.extend((check, p) for p in problems)

    def error(self, where=None) -> ArtifactError:
        """The one-line refusal: the first problem, and how many more ``oscar validate`` shows."""
        where = where or self.path
        more = f" (+{len(self.problems) - 1} more; run `oscar validate {where}`)" if len(self.problems) > 1 else ""
        return ArtifactError(f"{where}: {self.problems[0]}{more}")

    def to_dict(self) -> dict:
        md = self.metadata
        ver = self.verification
        return {"path": str(self.path), "ok": self.ok, "problems": list(self.problems), "checks": dict(self.checks),
                "warnings": list(self.warnings), "model_id": md.get("model_id"),
                "format_version": md.get("format_version"), "num_layers": md.get("num_layers"),
                "num_kv_heads": md.get("num_kv_heads"), "head_dim": md.get("head_dim"),
                "granularity": md.get("granularity"), "composition": md.get("composition"),
                "content_sha256": self.content_sha256, "stored_content_sha256": md.get(DIGEST_KEY),
                "verified": ver.state if ver else None, "verified_why": ver.why if ver else None}


# ----------------------------------------------------------------------------- the checks

def metadata_problems(md: dict[str, str]) -> list[str]:
    """What keeps the expected tensors from being known: ``format``, ``format_version``, a missing
    required key, an integer field that is not ASCII digits."""
    problems = []
    if md.get("format") != FORMAT_NAME:
        problems.append(f"metadata 'format' is {md.get('format')!r}, expected {FORMAT_NAME!r}")
    if md.get("format_version") != str(FORMAT_VERSION):
        problems.append(f"unsupported format_version {md.get('format_version')!r} (this toolkit reads {FORMAT_VERSION})")
    missing = [k for k in REQUIRED_METADATA if k not in md]
    if missing:
        problems.append(f"metadata missing {', '.join(missing)}")
    for k in INT_METADATA:
        if k in md and metadata_int(md, k) is None:
            problems.append(f"metadata {k!r} is not a non-negative integer: {str(md[k])[:40]!r}")
    return problems


def contradictions(tensors: dict, md: dict[str, str]) -> list[str]:
    """Metadata that every rotation in the file contradicts, named once (the root cause, instead of
    one line per tensor): ``head_dim`` or ``num_kv_heads`` when all rotations agree with each other
    on another size, ``num_layers`` when K and V rotations cover exactly layers 0..L-1 for another L."""
    rots = {name: tuple(t.shape) for name, t in tensors.items() if _ROTATION.fullmatch(name)}
    if not rots:
        return []
    n, h, d = (metadata_int(md, k) for k in ("num_layers", "num_kv_heads", "head_dim"))
    out = []
    shapes = set(rots.values())
    if len(shapes) == 1:
        shape = shapes.pop()
        if len(shape) == 3 and shape[1] == shape[2]:
            if shape[1] != d:
                out.append(f"metadata head_dim={d} but every rotation is {shape[1]}x{shape[2]} ({len(rots)} of them)")
            if shape[0] != h:
                out.append(f"metadata num_kv_heads={h} but every rotation holds {shape[0]} KV head(s) "
                           f"({len(rots)} of them)")
    found = [_ROTATION.fullmatch(name).groups() for name in rots]
    layers = sorted({int(i) for i, _ in found})
    complete = all(f"layers.{i}.{w}_rotation" in rots for i in layers for w in "kv")
    if complete and layers == list(range(len(layers))) and len(layers) != n:
        out.append(f"metadata num_layers={n} but the file holds rotations for {len(layers)} layers "
                   f"(0-{len(layers) - 1})")
    return out


def layer_heads(md: dict[str, str]) -> list[tuple[int, int]]:
    """``(num_kv_heads, head_dim)`` of every layer, from ``layer_kv_heads`` / ``layer_head_dims`` when
    the metadata has them (well formed: a malformed one is the settings' problem, and the uniform
    geometry is assumed here), else ``num_kv_heads`` / ``head_dim`` everywhere."""
    n, h, d = (int(md[k]) for k in ("num_layers", "num_kv_heads", "head_dim"))
    per = []
    for key, default in ((LAYER_KV_HEADS_METADATA, h), (LAYER_HEAD_DIMS_METADATA, d)):
        parts = str(md.get(key, "")).split(",")
        ok = key in md and len(parts) == n and all(re.fullmatch(r"[0-9]{1,6}", x.strip()) for x in parts)
        per.append([int(x) for x in parts] if ok else [default] * n)
    return list(zip(*per))


def shape_problems(tensors: dict, md: dict[str, str]) -> list[str]:
    """Every tensor of the contract present, with its layer's shape (:func:`layer_heads`) and dtype
    float32; no others. The shared rotations are optional (all of them or none); the key means are
    there exactly when the metadata says the keys are centered (``k_centered``)."""
    problems = []
    kinds = TENSOR_KINDS
    if any(name.endswith(SHARED_KINDS) for name in tensors):      # optional: all of them or none
        kinds = TENSOR_KINDS + SHARED_KINDS
    centered = md.get(KEY_CENTERING_METADATA) == "true"
    if centered:
        kinds = kinds + CENTER_KINDS
    elif any(name.endswith(CENTER_KINDS) for name in tensors):
        first = next(name for name in sorted(tensors) if name.endswith(CENTER_KINDS))
        problems.append(f"{first} is stored but metadata {KEY_CENTERING_METADATA!r} is not 'true': a reader would "
                        "serve the keys uncentered")
        tensors = {k: v for k, v in tensors.items() if not k.endswith(CENTER_KINDS)}
    expected = {tensor_name(i, k): tensor_shape(k, h, d) for i, (h, d) in enumerate(layer_heads(md)) for k in kinds}
    for name, shape in expected.items():
        if name not in tensors:
            problems.append(f"missing tensor {name}")
        elif tuple(tensors[name].shape) != shape:
            problems.append(f"{name} has shape {list(tensors[name].shape)}, expected {list(shape)}")
        elif dtype_name(tensors[name]) != "float32":
            problems.append(f"{name} has dtype {dtype_name(tensors[name])}, expected float32")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        problems.append(f"unexpected tensors: {', '.join(extra[:5])}")
    return problems


def check_structure(tensors: dict, md: dict[str, str]) -> list[str]:
    """Format-v1 structure: :func:`metadata_problems`, else :func:`contradictions`, else
    :func:`shape_problems`. ``tensors`` may hold torch tensors or numpy arrays (anything with
    ``shape`` and ``dtype``). Returns one message per problem (empty when fine)."""
    return metadata_problems(md) or contradictions(tensors, md) or shape_problems(tensors, md)


def check_content(tensors: dict, md: dict[str, str], report: ValidationReport) -> None:
    """Add the metadata, shape and value checks of ``tensors`` and ``md`` to ``report``, in order;
    the values are checked only once metadata and shapes are sound."""
    base = metadata_problems(md)
    if base:            # without them the expected shapes are unknown
        report.add("metadata", base)
        return
    report.settings, values = ArtifactSettings.read(md)        # the one parse of the settings
    more, warnings = provenance_problems(md)
    values += more
    root = contradictions(tensors, md)
    report.warnings.extend(warnings)
    report.add("metadata", root + values)
    if root:
        return
    if any(p.startswith(("metadata 'num_layers'", "metadata 'num_kv_heads'", "metadata 'head_dim'",
                         f"metadata {LAYER_HEAD_DIMS_METADATA!r}", f"metadata {LAYER_KV_HEADS_METADATA!r}"))
           for p in values):
        return          # a count beyond its bound: the expected tensors are not worth listing
    report.add("shapes", shape_problems(tensors, md))
    if not (report.checks["metadata"] and report.checks["shapes"]):
        return
    for name, problems in check_values(tensors, md).items():
        report.add(name, problems)


def inspect_bytes(raw: bytes, path: Path) -> tuple[ValidationReport, dict]:
    """Every check (module docstring) of the artifact file whose bytes are ``raw``. Returns the
    report and the tensors as numpy arrays over ``raw`` (empty when the file is unreadable)."""
    report = ValidationReport(path=Path(path))
    try:
        header, data_start = stfile.parse(raw)
    except OscarError as e:
        report.add("file", [str(e)])
        return report, {}
    report.add("file", [])
    md = report.metadata = {str(k): str(v) for k, v in (header.get("__metadata__") or {}).items()}
    tensors = stfile.read_arrays(raw, header, data_start)
    check_content(tensors, md, report)
    report.content_sha256 = content_digest(md, stfile.tensor_entries(raw, header, data_start))
    problem = digest_problem(md.get(DIGEST_KEY), report.content_sha256)
    report.add("digest", [problem] if problem else [])
    if DIGEST_KEY not in md:
        report.warnings.append(missing_digest_warning(report.path))
    return report, tensors


def read_file(path: Path) -> bytes:
    """The bytes of an artifact file, or :class:`ArtifactError` with one line."""
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read ({e.strerror or e})") from None
