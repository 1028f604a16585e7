"""What every fold writes beside its checkpoint, and the checks on where it goes: the output
directory refused when it overlaps an input or cannot be written, the artifact copy marked
``v_folded = "true"`` under :data:`ARTIFACT_SUBDIR`, and file hashes. Shared by the dense fold
(:mod:`.checkpoint`) and the FP8 fold (:mod:`.fp8`)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from ...contract.artifact import (
    CARD_NAME,
    REPORT_NAME,
    WEIGHTS_NAME,
    Artifact,
    serialize_artifact,
)
from ...errors import InputError
from ...fsutil import atomic_write_bytes, check_can_replace

ARTIFACT_SUBDIR = "oscar"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_fold_output(out: Path, overwrite: bool, protected: list[Path] = ()) -> None:
    """Refuse a file, a non-empty directory (unless ``overwrite``), an unwritable place, and any
    output that is, holds, or sits inside an input."""
    out = Path(out)
    res = out.resolve()
    for p in protected:
        p = Path(p).resolve()
        if res == p or res in p.parents or p in res.parents:
            raise InputError(f"--out {out} overlaps an input ({p}); choose another directory")
    check_can_replace(out, overwrite=overwrite)
    parent = res.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise InputError(f"output directory {out} is not writable")


def write_artifact_copy(directory: Path, artifact: Artifact, source_sha256: str) -> None:
    """The artifact, marked ``v_folded = "true"``, beside the checkpoint it was folded into."""
    directory.mkdir(parents=True, exist_ok=True)
    meta = {**artifact.metadata, **artifact.settings.replace(v_folded=True).metadata()}
    atomic_write_bytes(directory / WEIGHTS_NAME, serialize_artifact(artifact.tensors(), meta))
    src = Path(artifact.path) if artifact.path else None
    if src is not None and (src / REPORT_NAME).exists():
        shutil.copyfile(src / REPORT_NAME, directory / REPORT_NAME)
    card = (src / CARD_NAME).read_text() if src is not None and (src / CARD_NAME).exists() else ""
    centered = (" With key centering every key is stored as `(k − k_mean) @ k_rotation`: `k_mean` is a mean of "
                "post-RoPE keys, which no projection weight can subtract, so it stays in this copy and is applied "
                "online too." if artifact.settings.key_centering else "")
    card = card.rstrip("\n") + ("\n\n" if card else "") + (
        "## Folded\n\n"
        "This copy's `v_rotation` is already folded into the checkpoint one directory up (`v_proj` rows and "
        "`o_proj` columns; metadata `v_folded = true`). Engines apply only `k_rotation` (online, to keys and "
        f"queries after RoPE) and must not rotate V again.{centered} Source artifact sha256: `{source_sha256}`.\n")
    (directory / CARD_NAME).write_text(card)
