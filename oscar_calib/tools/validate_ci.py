"""Validation where CI runs it: hub repositories checked in place, the files a change touches
(what pre-commit passes a hook), and GitHub workflow annotations.

=========================  ================================================================
source                     what is validated
=========================  ================================================================
``hf:ORG/NAME[@REV]``      the repository's ``oscar.safetensors`` files (at its root or in
``modelscope:ORG/NAME``    sub-folders), downloaded into a temporary folder that is removed
(``ms:`` too)              afterwards: nothing is kept, the pull cache is not touched
a local path               as :func:`~oscar_calib.tools.validate.find_artifacts` expands it;
                           a directory holding a zoo ``index.json`` (``oscar validate zoo``)
                           is also checked as a zoo, as below: what ``make test`` and the
                           pre-commit hook call stale, ``oscar validate zoo`` calls stale
=========================  ================================================================

A run whose every PATH is missing (none exists, no hub repository among them) has nothing to
validate: one :class:`~oscar_calib.errors.InputError`, as a mistyped path is anywhere else. A
missing PATH beside others is a problem in its own report, so one run reports everything.

With ``changed_files`` the local paths are the files a change touches (pre-commit passes the
staged files its ``files`` pattern matches): a ``.safetensors`` file is validated; a zoo's
``index.json`` stands for its whole zoo, so every artifact below its directory is validated, the
index must be current (what ``oscar zoo index`` would write), and every zoo artifact must carry
its content digest and, when it has a ``verify.json``, one that verified its current content (not
stale); any other file, such as an unrelated ``index.json``, is skipped.

GitHub annotations follow the workflow-command syntax ``::error file=F,title=T::MESSAGE``; data
escapes ``%``, CR and LF, properties also ``:`` and ``,`` (the runner's own escaping rules).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from ..contract.artifact import WEIGHTS_NAME
from ..contract.layout import ZOO_INDEX_NAME, is_zoo_index
from ..errors import InputError, PublishError
from .validate import ModelReference, ValidationReport, validate_paths
from .zoo import index_is_current, scan

_HUB_PREFIX = re.compile(r"(hf|huggingface|modelscope|ms):", re.IGNORECASE)


def is_hub_source(text: str) -> bool:
    """``hf:…``/``modelscope:…``/``ms:…`` that is not also an existing local path."""
    return bool(_HUB_PREFIX.match(str(text))) and not Path(text).exists()


def _failed(path: str | Path, check: str, problem: str) -> ValidationReport:
    report = ValidationReport(path=Path(path))
    report.add(check, [problem])
    return report


def validate_hub(source: str, *, model: ModelReference | None = None) -> list[ValidationReport]:
    """Download ``source``'s artifacts into a temporary folder, validate them, remove the folder.
    Report paths read ``hf:ORG/NAME[@REV]`` (``/SUB`` for an artifact in a sub-folder). A failed
    download is a problem in the report, not an exception; a malformed source raises
    :class:`~oscar_calib.errors.InputError`."""
    # the hub clients load only for hub sources: validating local files stays light
    from .publish import download_snapshot, parse_source

    target, revision = parse_source(source)
    label = f"{target}@{revision}" if revision else str(target)
    with tempfile.TemporaryDirectory(prefix="oscar-validate-") as tmp:
        root = Path(tmp)
        try:
            download_snapshot(target, revision, root, allow_patterns=[f"*{WEIGHTS_NAME}"])
        except PublishError as e:
            return [_failed(label, "download", str(e))]
        reports = validate_paths([root], model=model, allow_empty=True)
        for r in reports:
            rel = r.path.relative_to(root)
            r.path = Path(label) / rel if rel.parts else Path(label)
    return reports or [_failed(label, "file", f"holds no {WEIGHTS_NAME}: not an OSCAR artifact repository")]


def expand_changed_files(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """``(paths to validate, zoo indexes to check)`` for the files a change touches (module doc)."""
    targets: list[Path] = []
    indexes: list[Path] = []
    for p in map(Path, paths):
        if p.suffix == ".safetensors":
            targets.append(p)
        elif p.name == ZOO_INDEX_NAME and is_zoo_index(p):
            targets.append(p.parent)
            indexes.append(p)
    return targets, indexes


def check_index(index: Path, invalid: set[Path] = frozenset()) -> ValidationReport:
    """The zoo index must equal what ``oscar zoo index`` writes for the artifacts beside it, and
    every artifact of the zoo carry its content digest and no stale ``verify.json``
    (:func:`zoo_problems`; ``invalid``: artifact directories whose validation failed already)."""
    root = Path(index).parent
    report = ValidationReport(path=Path(index))
    problem = [] if index_is_current(root) else [
        f"stale: it does not describe the artifacts beside it; run `oscar zoo index --zoo {root}`"]
    report.add("index", problem)
    report.add("zoo", zoo_problems(root, invalid))
    return report


def zoo_problems(root: Path, invalid: set[Path] = frozenset()) -> list[str]:
    """What a committed zoo may not hold: an artifact without its content digest, or one whose
    ``verify.json`` verified other content. Damaged artifacts (``invalid``, or unreadable) are the
    validation's to report."""
    out = []
    skip = {Path(p).resolve() for p in invalid}
    for e in scan(root, source="zoo"):
        if e.error or Path(e.path).resolve() in skip:
            continue
        if e.content_sha256 is None:
            out.append(f"{e.name}: carries no content digest; run `oscar validate --fix-digest {e.path}`")
        if e.verification == "stale":
            out.append(f"{e.name}: its verify.json verified other content; run `oscar verify {e.path}` again")
    return out


def validate_sources(sources: list[str], *, model: ModelReference | None = None, allow_empty: bool = False,
                     changed_files: bool = False) -> list[ValidationReport]:
    """Validate local paths and hub repositories, in the order given. Every hub source is parsed
    before anything is downloaded, so a malformed one fails at once."""
    for s in sources:
        if is_hub_source(s):
            from .publish import parse_source

            parse_source(s)
    missing = [s for s in sources if not is_hub_source(s) and not Path(s).exists()]
    if sources and len(missing) == len(sources):          # nothing to validate: a mistyped path
        raise InputError(f"{missing[0]}: no such file or directory")
    reports: list[ValidationReport] = []
    local: list[Path] = []

    def flush() -> None:
        if changed_files:
            targets, indexes = expand_changed_files(local)
            found = validate_paths(targets, model=model, allow_empty=True)
            invalid = {r.path if r.path.is_dir() else r.path.parent for r in found if not r.ok}
            reports.extend(found)
            reports.extend(check_index(i, invalid) for i in indexes)
        elif local:
            found = validate_paths(local, model=model, allow_empty=allow_empty)
            reports.extend(found)
            # a zoo given as a directory: its index is checked as the pre-commit hook checks it
            # (`oscar validate zoo` and `make test` agree on what is stale)
            invalid = {r.path if r.path.is_dir() else r.path.parent for r in found if not r.ok}
            reports.extend(check_index(p / ZOO_INDEX_NAME, invalid) for p in local
                           if p.is_dir() and is_zoo_index(p / ZOO_INDEX_NAME))
        local.clear()

    for s in sources:
        if is_hub_source(s):
            flush()
            reports.extend(validate_hub(s, model=model))
        else:
            local.append(Path(s))
    flush()
    return reports


# ----------------------------------------------------------------------------- GitHub annotations

def escape_data(text: str) -> str:
    """A workflow command's message: ``%``, CR and LF escaped (``%`` first)."""
    return str(text).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """A workflow command's property value: as :func:`escape_data`, plus ``:`` and ``,``."""
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def workflow_command(command: str, message: str, **properties: str | None) -> str:
    """``::command k=v,k=v::message`` with every part escaped; ``None`` properties are left out."""
    props = ",".join(f"{k}={escape_property(v)}" for k, v in properties.items() if v is not None)
    return f"::{command}{' ' + props if props else ''}::{escape_data(message)}"


def annotation_file(report: ValidationReport, cwd: Path | None = None) -> str | None:
    """The file an annotation points at: the artifact's ``oscar.safetensors`` (relative to the
    working directory, which is the repository root in CI), or ``None`` for a hub repository."""
    if is_hub_source(str(report.path)):
        return None
    path = report.path / WEIGHTS_NAME if (report.path / WEIGHTS_NAME).is_file() else report.path
    cwd = Path(cwd or os.getcwd()).resolve()
    try:
        return path.resolve().relative_to(cwd).as_posix() if path.is_absolute() else path.as_posix()
    except ValueError:
        return path.as_posix()


def github_lines(reports: list[ValidationReport], cwd: Path | None = None) -> list[str]:
    """One ``::error`` annotation per problem; for a valid artifact one ``::warning`` per warning (no
    content digest, a stale verification) and a plain ``ok`` line; and a closing count."""
    lines = []
    for r in reports:
        file = annotation_file(r, cwd)
        notes = [("digest" if "digest" in w else "metadata", w) for w in r.warnings]
        if getattr(r.verification, "state", None) == "stale":
            notes.append(("verified", f"verified: stale: {r.verification.why}"))
        for check, note in notes if r.ok else ():          # an invalid artifact: its errors say what matters
            lines.append(workflow_command("warning", note if file else f"{r.path}: {note}", file=file,
                                          title=f"oscar validate: {check}"))
        if r.ok:
            md = r.metadata
            about = f" ({md['model_id']}, {md.get('num_layers', '?')} layers)" if "model_id" in md else ""
            lines.append(f"ok {r.path}{about}")
            continue
        for check, problem in r.findings or [("", p) for p in r.problems]:
            message = problem if file else f"{r.path}: {problem}"
            lines.append(workflow_command("error", message, file=file,
                                          title=f"oscar validate: {check}" if check else "oscar validate"))
    bad = sum(not r.ok for r in reports)
    lines.append(f"oscar validate: {len(reports)} checked, {bad} with problems")
    return lines
