"""``oscar push`` and ``oscar pull``: artifacts to and from the Hugging Face hub and ModelScope.

=================  ==========================================================================
target             form
=================  ==========================================================================
Hugging Face       ``hf:ORG/NAME``          (``https://huggingface.co/ORG/NAME``)
ModelScope         ``modelscope:ORG/NAME``  (``https://modelscope.cn/models/ORG/NAME``)
=================  ==========================================================================

Push validates first (:mod:`oscar_calib.tools.validate`) and never uploads an invalid artifact, nor
one without a content digest (``oscar validate --fix-digest`` adds it). It also wants the artifact
*verified* on the content it holds now: its directory holds ``verify.json`` with ``"passed": true``
(written by ``oscar verify``) recording the artifact's current content digest
(:mod:`oscar_calib.contract.verification`); a verification of other content is *stale*.
``force=True`` waives only that requirement, and the plan says what it skipped. The files uploaded
are the artifact directory's regular top-level files except hidden ones and temporaries
(``oscar.safetensors``, ``README.md`` — the model card, required — ``calibration.json``,
``verify.json``, ...); a dry run lists exactly these.

Credentials: Hugging Face uses ``HF_TOKEN`` or the token stored by ``hf auth login``
(``huggingface_hub.get_token()``); ModelScope uses ``MODELSCOPE_API_TOKEN`` or the session stored
by ``modelscope login`` (its cookie jar). A push without either fails with one line that says how
to log in. Pull needs no token for public repositories.

Pull downloads into ``$OSCAR_CACHE/zoo/<hf|modelscope>/<ORG>/<NAME>`` (``OSCAR_CACHE`` defaults to
``~/.cache/oscar``) or ``out``: into a temporary sibling first, then validates (a stored digest
must match), stores the content digest when the artifact came without one, then renames, so the
destination only ever holds a complete, valid artifact that carries its digest. A repeated pull into the cache
replaces the cached copy; an explicit ``out`` that already holds files needs ``overwrite``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import HfApi
from huggingface_hub import get_token as hf_get_token
from huggingface_hub import snapshot_download as _hf_snapshot_download

from ..contract.layout import (  # PULL_RECORD is hidden: never pushed
    CARD_NAME,
    PULL_RECORD,
    WEIGHTS_NAME,
)
from ..contract.verification import Verification
from ..errors import (
    ArtifactError,
    InputError,
    OscarError,
    PublishError,
)
from ..fsutil import staged_dir
from .hub import require_online
from .validate import (
    ModelReference,
    ValidationReport,
    fix_digest,
    require_valid,
    validate_artifact,
)

HUBS = {"hf": "Hugging Face", "modelscope": "ModelScope"}
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,99}")


@dataclass(frozen=True)
class Target:
    """A repository on a hub: ``hub`` is ``hf`` or ``modelscope``."""

    hub: str
    repo_id: str

    @property
    def org(self) -> str:
        return self.repo_id.split("/")[0]

    @property
    def name(self) -> str:
        return self.repo_id.split("/")[1]

    @property
    def url(self) -> str:
        if self.hub == "hf":
            endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
            return f"{endpoint}/{self.repo_id}"
        return f"https://modelscope.cn/models/{self.repo_id}"

    def __str__(self) -> str:
        return f"{self.hub}:{self.repo_id}"


def parse_target(text: str) -> Target:
    """``hf:ORG/NAME`` or ``modelscope:ORG/NAME`` (``ms:`` is accepted for ModelScope)."""
    hub, sep, repo = str(text).strip().partition(":")
    hub = {"ms": "modelscope", "huggingface": "hf"}.get(hub.lower(), hub.lower())
    parts = repo.split("/")
    if (not sep or hub not in HUBS or len(parts) != 2 or not all(_NAME.fullmatch(p) for p in parts)
            or any(".." in p for p in parts)):
        raise InputError(f"malformed target {text!r}: expected hf:ORG/NAME or modelscope:ORG/NAME "
                         "(letters, digits, '.', '_', '-')")
    return Target(hub, repo)


def parse_source(text: str) -> tuple[Target, str | None]:
    """``hf:ORG/NAME[@REV]`` or ``modelscope:ORG/NAME[@REV]``: the target and the revision (a
    branch, tag or commit; ``None`` for the default branch)."""
    base, at, revision = str(text).strip().partition("@")
    if at and not _REVISION.fullmatch(revision):
        raise InputError(f"malformed revision {revision!r} in {text!r}")
    return parse_target(base), revision or None


# ----------------------------------------------------------------------------- push

@dataclass
class PushPlan:
    """Everything a push will do; a dry run prints it and stops."""

    target: Target
    folder: Path
    files: list[tuple[str, int]]            # (name inside the repo, bytes)
    commit_message: str
    private: bool = False
    revision: str | None = None
    verification: Verification = field(default_factory=lambda: Verification("none", "not checked"))
    content_sha256: str = ""
    validation: ValidationReport | None = field(default=None, repr=False)

    @property
    def verified(self) -> bool:
        return self.verification.verified

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)

    def to_dict(self) -> dict:
        return {"target": str(self.target), "url": self.target.url, "hub": self.target.hub,
                "repo_id": self.target.repo_id, "folder": str(self.folder), "revision": self.revision,
                "private": self.private, "commit_message": self.commit_message, "verified": self.verified,
                "verification": self.verification.state, "verification_why": self.verification.why,
                "content_sha256": self.content_sha256, "files": [{"name": n, "bytes": s} for n, s in self.files], "total_bytes": self.total_bytes}


def publish_files(folder: Path) -> list[tuple[str, int]]:
    """The files a push uploads: regular top-level files, hidden files and temporaries excluded."""
    out = []
    for p in sorted(Path(folder).iterdir()):
        if p.is_file() and not p.is_symlink() and not p.name.startswith(".") and not p.name.endswith((".tmp", "~")):
            out.append((p.name, p.stat().st_size))
    return out


def plan_push(artifact: Path, target: Target | str, *, revision: str | None = None, private: bool = False,
              commit_message: str | None = None, force: bool = False,
              model: ModelReference | None = None) -> PushPlan:
    """Validate the artifact and list what would be uploaded. Raises for an invalid artifact, one
    without a content digest, a missing model card, or an artifact not verified on its current
    content (no ``verify.json``, a failed or a stale one) without ``force``."""
    folder = Path(artifact)
    if folder.is_file() and folder.name == WEIGHTS_NAME:
        folder = folder.parent
    if not folder.is_dir():
        raise InputError(f"{artifact}: not an artifact directory")
    target = parse_target(target) if isinstance(target, str) else target
    if revision is not None and not _REVISION.fullmatch(revision):
        raise InputError(f"malformed revision {revision!r}")
    report = require_valid(folder, model=model)
    if not (folder / CARD_NAME).is_file():
        raise ArtifactError(f"{folder}: no model card ({CARD_NAME}); every pushed artifact carries one")
    if not report.has_digest:
        raise ArtifactError(f"{folder}: carries no content digest, so its readers could not tell a changed copy; run "
                            f"`oscar validate --fix-digest {folder}` (a verify.json stays valid)")
    ver = report.verification or Verification("none", "not checked")
    if not ver.verified and not force:
        what = "is stale" if ver.state == "stale" else "is not verified"
        raise ArtifactError(f"{folder} {what}: {ver.why}; or pass --force to push it unverified")
    md = report.metadata
    message = commit_message or (f"OSCAR rotations for {md.get('model_id', '?')} "
                                 f"({md.get('granularity', '?')} granularity, oscar {md.get('toolkit_version', '?')})")
    return PushPlan(target, folder, publish_files(folder), message, private, revision, ver, report.content_sha256,
                    report)


def hf_token() -> str:
    token = os.environ.get("HF_TOKEN") or hf_get_token()
    if not token:
        raise InputError("no Hugging Face token: set HF_TOKEN or run `hf auth login`")
    return token


def modelscope_token() -> str | None:
    """``MODELSCOPE_API_TOKEN``, else ``None`` when a stored login session exists (the client
    uses it); raises when neither is there."""
    token = os.environ.get("MODELSCOPE_API_TOKEN")
    if token:
        return token
    if modelscope_logged_in():
        return None
    raise InputError("no ModelScope token: set MODELSCOPE_API_TOKEN or run `modelscope login --token TOKEN`")


def modelscope_logged_in() -> bool:
    from modelscope.hub.api import ModelScopeConfig

    return bool(ModelScopeConfig.get_cookies())


def modelscope_api_class():
    """The ModelScope client class (imported lazily: importing modelscope takes seconds)."""
    from modelscope.hub.api import HubApi

    return HubApi


def push(plan: PushPlan) -> str:
    """Create the repository if needed (and the branch for a revision), upload the files.
    Returns the repository URL."""
    try:
        if plan.target.hub == "hf":
            _push_hf(plan)
        else:
            _push_modelscope(plan)
    except OscarError:
        raise
    except Exception as e:  # noqa: BLE001 - the clients raise many types; one line for the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PublishError(f"{HUBS[plan.target.hub]} push to {plan.target} failed: {first}") from None
    if plan.revision and plan.target.hub == "hf":
        return f"{plan.target.url}/tree/{plan.revision}"
    return plan.target.url


def _push_hf(plan: PushPlan) -> None:
    api = HfApi(token=hf_token())
    repo_id = plan.target.repo_id
    api.create_repo(repo_id, repo_type="model", private=plan.private, exist_ok=True)
    if plan.revision:
        api.create_branch(repo_id, branch=plan.revision, repo_type="model", exist_ok=True)
    api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=str(plan.folder),
                      allow_patterns=[name for name, _ in plan.files], commit_message=plan.commit_message,
                      revision=plan.revision)


def _push_modelscope(plan: PushPlan) -> None:
    token = modelscope_token()
    api = modelscope_api_class()(token=token) if token else modelscope_api_class()()
    repo_id = plan.target.repo_id
    api.create_repo(repo_id, token=token, repo_type="model", visibility="private" if plan.private else "public",
                    exist_ok=True)
    kwargs = dict(repo_type="model", token=token, commit_message=plan.commit_message,
                  allow_patterns=[name for name, _ in plan.files])
    if plan.revision:
        kwargs["revision"] = plan.revision       # ModelScope commits on this branch
    api.upload_folder(repo_id, str(plan.folder), **kwargs)


# ----------------------------------------------------------------------------- pull

def cache_dir_for(target: Target) -> Path:
    from ..model.load import cache_root

    return cache_root() / "zoo" / target.hub / target.org / target.name


@dataclass
class PullResult:
    target: Target
    path: Path
    revision: str | None
    report: ValidationReport

    def to_dict(self) -> dict:
        return {"target": str(self.target), "path": str(self.path), "revision": self.revision,
                "ok": self.report.ok, "problems": self.report.problems,
                "model_id": self.report.metadata.get("model_id")}


def pull(source: Target | str, *, revision: str | None = None, out: Path | None = None,
         overwrite: bool = False) -> PullResult:
    """Download an artifact repository, validate it and move it into place (see module doc)."""
    target = parse_target(source) if isinstance(source, str) else source
    dest = Path(out) if out is not None else cache_dir_for(target)
    with staged_dir(dest, overwrite=overwrite or out is None, tag="pull") as tmp:
        download_snapshot(target, revision, tmp)
        shutil.rmtree(tmp / ".cache", ignore_errors=True)     # huggingface_hub's local-dir bookkeeping
        if not (tmp / WEIGHTS_NAME).is_file():
            raise ArtifactError(f"{target} holds no {WEIGHTS_NAME}: not an OSCAR artifact repository")
        report = validate_artifact(tmp)
        if not report.ok:
            more = f" (+{len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
            raise ArtifactError(f"{target}: downloaded artifact is invalid: {report.problems[0]}{more}")
        if not report.has_digest:            # an older artifact: the local copy carries its digest
            fix_digest(tmp, record=False)
            report = validate_artifact(tmp)
        record = {"source": str(target), "url": target.url, "revision": revision, "pulled_at": int(time.time())}
        (tmp / PULL_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    report.path = dest
    return PullResult(target, dest, revision, report)


def download_snapshot(target: Target, revision: str | None, local_dir: Path, *,
                      allow_patterns: list[str] | None = None) -> None:
    """Download the repository's files (those matching ``allow_patterns``, default all) into
    ``local_dir``; raises :class:`PublishError` with one line when the hub cannot be reached or
    has no such repository or revision."""
    kwargs = dict(repo_id=target.repo_id, repo_type="model", revision=revision, local_dir=str(local_dir))
    if allow_patterns is not None:
        kwargs["allow_patterns"] = allow_patterns
    try:
        if target.hub == "hf":
            hf_snapshot_download(**kwargs)
        else:
            modelscope_snapshot_download()(**kwargs)
    except OscarError:
        raise
    except Exception as e:  # noqa: BLE001
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PublishError(f"cannot download {target} from {HUBS[target.hub]} (no network, no such repository "
                           f"or revision?): {first}") from None


def hf_snapshot_download(**kwargs):
    """huggingface_hub's ``snapshot_download``, once the hub answers (:func:`.hub.require_online`:
    without a network, one line in seconds instead of its retries)."""
    require_online("hf")
    return _hf_snapshot_download(**kwargs)


def modelscope_snapshot_download():
    """ModelScope's ``snapshot_download``, once ModelScope answers (see :func:`hf_snapshot_download`)."""
    require_online("modelscope")
    from modelscope.hub.snapshot_download import snapshot_download

    return snapshot_download


