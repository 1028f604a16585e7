"""``verify.json`` tied to the content it verified.

``oscar verify`` writes ``verify.json`` beside the artifact: its measurements, and what they are
about (:func:`provenance`): the content digest of the artifact it checked (``content_sha256``,
:mod:`.digest`), the fingerprint of the model it ran and the toolkit version. The verification
holds for that content only: :func:`verification_of` compares the recorded digest with the
artifact's current one, and ``oscar push`` calls an artifact verified only when they are equal.

=========  ======================================================================
state      meaning
=========  ======================================================================
``yes``    ``"passed": true`` on exactly this content
``stale``  it passed, but on other content (the artifact was edited, re-calibrated
           or damaged since), or it does not record which content it verified
``no``     ``verify.json`` is unreadable, or the artifact failed verification
``none``   no ``verify.json``
=========  ======================================================================
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from .layout import VERIFY_NAME

STATES = ("yes", "stale", "no", "none")


@dataclass(frozen=True)
class Verification:
    state: str          # one of STATES
    why: str            # one sentence, with the next step when it is not "yes"

    @property
    def verified(self) -> bool:
        return self.state == "yes"


def provenance(content_sha256: str, model_fingerprint: str | None) -> dict:
    """What ``verify.json`` records about what it measured."""
    return {"content_sha256": content_sha256, "model_fingerprint": model_fingerprint, "toolkit_version": __version__}


def verification_of(directory: Path, content_sha256: str | None) -> Verification:
    """What the ``verify.json`` in ``directory`` says of the artifact whose content digest is
    ``content_sha256`` (None: unknown, the artifact is unreadable)."""
    path = Path(directory) / VERIFY_NAME
    again = f"run `oscar verify {directory}`"
    if not path.exists():
        return Verification("none", f"no {VERIFY_NAME} ({again})")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return Verification("no", f"{VERIFY_NAME} is not readable JSON ({again})")
    if not isinstance(doc, dict) or doc.get("passed") is not True:
        return Verification("no", f"{VERIFY_NAME} does not say \"passed\": true")
    recorded = doc.get("content_sha256")
    if not isinstance(recorded, str):
        return Verification("stale", f"{VERIFY_NAME} does not record which content it verified (written before "
                                     f"oscar recorded it); {again} again")
    if recorded != content_sha256:
        now = f"{content_sha256[:16]}…" if content_sha256 else "unreadable content"
        return Verification("stale", f"{VERIFY_NAME} passed on content {recorded[:16]}…, the artifact now holds "
                                     f"{now} (changed after it was verified); {again} again")
    return Verification("yes", f"{VERIFY_NAME} passed on this content ({recorded[:16]}…)")
