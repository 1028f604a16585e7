"""``oscar validate``: check artifacts against the format-v1 contract, one line per problem.

The checks are the contract's own (:mod:`oscar_calib.contract.checks`, the one function every reader
goes through), run on the file's bytes:

=====================  ======================================================================
check                  what must hold
=====================  ======================================================================
file                   a complete safetensors file: 8-byte header length, JSON header, tensors
                       back to back covering the file exactly (a truncated download or an
                       edited offset is caught here)
metadata               ``format``/``format_version`` and every required key, integer fields
                       within bounds (layers, heads, head_dim a multiple of 4, windows),
                       ``bits`` = 2, a known ``granularity``/``composition``/objectives,
                       ``group_size`` (and the optional per-layer ``layer_group_sizes`` /
                       ``layer_v_group_sizes``) a power of two of at least 4 dividing
                       ``head_dim``, query heads a multiple of KV heads, the optional
                       ``logit_correction`` in [0, 4], ``calibration`` a JSON object,
                       ``model_fingerprint`` 64 hex digits, ``model_type`` well formed
                       (:class:`~oscar_calib.contract.settings.ArtifactSettings`); metadata
                       that every tensor contradicts is named once as the root cause
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
model_source           the optional record of where the model came from: a JSON object with a
                       known ``kind`` and the ``alias`` / ``path`` / ``hub_id`` it needs
digest                 the stored ``content_sha256`` matches the content (none stored: a
                       warning; ``--fix-digest`` adds it)
model (``--model``)    fingerprint, layers, query/KV heads and head_dim equal the model's
=====================  ======================================================================

Beside the checks, each local artifact's ``verify.json`` is compared with its content
(:mod:`oscar_calib.contract.verification`): ``verified`` is ``yes``, ``stale`` (it verified other
content), ``no`` or ``none``. That is not a problem of the artifact; ``oscar push`` acts on it.

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
from dataclasses import dataclass
from pathlib import Path

from ..contract import stfile
from ..contract.artifact import compatibility_problems
from ..contract.checks import ValidationReport, inspect_bytes, read_file
from ..contract.layout import (
    CARD_NAME,
    DIGEST_KEY,
    REPORT_NAME,
    WEIGHTS_NAME,
    is_zoo_index,
)
from ..contract.verification import verification_of
from ..errors import ArtifactError
from ..fsutil import atomic_write_bytes, atomic_write_files


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
    ids: tuple[int, ...] | None = None           # the attention layers' decoder-layer ids (a hybrid's)
    head_dims: tuple[int, ...] | None = None     # every attention layer's head_dim and KV heads
    kv_heads: tuple[int, ...] | None = None

    @classmethod
    def from_model(cls, model, spec: str = "", model_id: str = "") -> "ModelReference":
        from ..model.geometry import geometry_of, model_fingerprint

        g = geometry_of(model)
        return cls(spec, model_id or spec, model_fingerprint(model), g.num_layers, g.num_attention_heads,
                   g.num_kv_heads, g.head_dim, g.ids, g.head_dims, g.kv_heads)


def model_reference(spec: str, *, trust_remote_code: bool = False) -> ModelReference:
    """Load ``spec`` (alias, directory, .gguf, hub id) and keep only what validation needs."""
    from ..model.load import load_model

    lm = load_model(spec, device="cpu", trust_remote_code=trust_remote_code)
    return ModelReference.from_model(lm.model, spec, lm.source.model_id)


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


# ----------------------------------------------------------------------------- checks

def check_against_model(md: dict[str, str], ref: ModelReference) -> list[str]:
    return compatibility_problems(md, ref, ref.fingerprint, model_name=ref.spec or ref.model_id)


def validate_artifact(path: Path, *, model: ModelReference | None = None) -> ValidationReport:
    """Run every check on one artifact (directory or safetensors file) and read its verification;
    never raises for a bad artifact: problems are returned in the report."""
    path = Path(path)
    wpath = path / WEIGHTS_NAME if path.is_dir() else path
    if not wpath.is_file():
        report = ValidationReport(path=path)
        report.add("file", [f"no {WEIGHTS_NAME} here"])
        return report
    try:
        raw = read_file(wpath)
    except ArtifactError as e:
        report = ValidationReport(path=path)
        report.add("file", [str(e).removeprefix(f"{wpath}: ")])
        return report
    report, _ = inspect_bytes(raw, path)
    if report.content_sha256 is not None:
        report.verification = verification_of(wpath.parent, report.content_sha256)
    if model is not None and report.checks.get("metadata") and report.checks.get("shapes"):
        report.add("model", check_against_model(report.metadata, model))
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
    report = validate_artifact(path, model=model)
    if not report.ok:
        raise report.error(path)
    return report


# ----------------------------------------------------------------------------- --fix-digest

def fix_digest(path: Path, *, record: bool = True) -> str:
    """Store the content digest in an artifact that has none (``oscar validate --fix-digest``):
    the file is rewritten canonically under a temporary name and renamed into place, its tensors
    byte for byte as they were. Refused (:class:`ArtifactError`, one line) unless the artifact is
    otherwise valid; a stored digest that does not match is never replaced (the content changed
    after it was written: that is what the digest exists to catch). When ``calibration.json``
    is there it records the digest too, and a model card generated from it (unedited) is
    generated again, showing it (``record=False``: only the safetensors file). The digest leaves itself out, so a ``verify.json`` written
    before still matches. Returns one line saying what was done."""
    path = Path(path)
    wpath = path / WEIGHTS_NAME if path.is_dir() else path
    raw = read_file(wpath)
    report, _ = inspect_bytes(raw, wpath)
    if not report.ok:
        raise report.error(path)
    digest = report.content_sha256
    if report.has_digest:
        return f"{path}: content digest already stored ({digest[:16]}…)"
    header, start = stfile.parse(raw)
    data = stfile.serialize(stfile.tensor_entries(raw, header, start), report.metadata | {DIGEST_KEY: digest})
    check, _ = inspect_bytes(data, wpath)
    if not check.ok or check.content_sha256 != digest or check.warnings:      # never write what would not load
        raise ArtifactError(f"{path}: rewriting it would change its content; left as it was")
    atomic_write_bytes(wpath, data)
    recorded = _record_digest(wpath.parent, digest) if record else ""
    return f"{path}: stored content digest {digest[:16]}…" + (f"; {recorded}" if recorded else "")


def _record_digest(directory: Path, digest: str) -> str:
    """``calibration.json`` records ``content_sha256``; the model card is generated again when it is
    exactly the one generated from the report (so nothing a user wrote is lost)."""
    from ..contract.card import model_card

    rpath, cpath = directory / REPORT_NAME, directory / CARD_NAME
    try:
        report = json.loads(rpath.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(report, dict):
        return ""
    try:
        generated = cpath.is_file() and cpath.read_text() == model_card(report)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError):   # not a calibration report's card
        generated = False
    report[DIGEST_KEY] = digest
    files = {REPORT_NAME: (json.dumps(report, indent=2, sort_keys=True) + "\n").encode()}
    if generated:
        files[CARD_NAME] = model_card(report).encode()
    atomic_write_files(directory, files)
    return f"recorded in {REPORT_NAME}" + (f" and {CARD_NAME}" if generated else "")
