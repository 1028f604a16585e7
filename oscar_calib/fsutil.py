"""Files that are either complete or absent: atomic file writes and staged directories.

Every writer in the toolkit goes through these helpers, so an interrupted or failed command never
leaves a half-written file or directory where a user (or a tool) would take it for a finished one.

===================  ==============================================================================
helper               what it guarantees
===================  ==============================================================================
atomic_write_bytes   the file at ``path`` is the old one or the new one, never a mix (temporary
                     name in the same directory, ``fsync``, ``os.replace``)
staged_dir           a directory built under a temporary name beside ``out`` and moved into place
                     only when the ``with`` block succeeds; on any error it is deleted.
                     ``merge=False``: ``out`` is replaced as a whole (what it held is kept until the
                     new one is ready). ``merge=True``: the staged files are moved into ``out`` one
                     by one (``last`` moved last), other files in ``out`` are left alone.
                     ``if_absent=True`` (caches): installed only if no other writer got there first.
replace_dir          move a finished directory onto ``dest``, restoring ``dest`` if the move fails
check_can_replace    refuse a file where a directory goes, or an occupied directory unless overwrite
check_writable       refuse an output directory that cannot be created or written (a real probe)
===================  ==============================================================================
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable, Iterator

from .errors import InputError, OutputExistsError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def apply_umask_mode(root: Path, *, recursive: bool = False) -> None:
    """``mkdtemp`` makes owner-only directories; give ``root`` (and with ``recursive`` everything
    under it) the modes a plain ``mkdir``/``open`` would have given."""
    mask = _umask()
    root = Path(root)
    for p in [root, *(root.rglob("*") if recursive else ())]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def replace_dir(src: Path, dest: Path) -> None:
    """Move directory ``src`` to ``dest``; what ``dest`` held is removed only once the move is done
    (and put back if the move fails)."""
    src, dest = Path(src), Path(dest)
    if not dest.exists() and not dest.is_symlink():
        os.replace(src, dest)
        return
    if dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir()):
        dest.rmdir()
        os.replace(src, dest)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    os.replace(dest, aside / "x")
    try:
        os.replace(src, dest)
    except BaseException:
        os.replace(aside / "x", dest)
        shutil.rmtree(aside, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def check_can_replace(out: Path, *, overwrite: bool, occupied: Callable[[Path], bool] | None = None,
                      what: str = "is not empty") -> None:
    """Refuse a file at ``out``, or a directory that is ``occupied`` (default: non-empty) unless
    ``overwrite``; the message says ``f"{out} {what}"``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a directory")
    full = occupied or (lambda d: any(d.iterdir()))
    if out.is_dir() and full(out) and not overwrite:
        raise OutputExistsError(f"{out} {what}; pass --overwrite to replace it")


def check_writable(out: Path) -> None:
    """Refuse an output directory that cannot be created or written: its nearest existing ancestor
    must be a directory where a file can be made (a real probe: ``os.access`` says yes to root
    even on read-only file systems)."""
    out = Path(out)
    parent = out if out.is_dir() else out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"cannot create output directory {out}: {parent} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".oscar-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError:
        raise InputError(f"output directory {out} is not writable") from None


@contextmanager
def staged_dir(out: Path, *, overwrite: bool = False, merge: bool = False, last: str | None = None,
               check: bool = True, if_absent: bool = False, tag: str = "tmp") -> Iterator[Path]:
    """Yield a temporary directory beside ``out``; install it when the block succeeds (see the
    module docstring), delete it on any error. With ``check``, refuse a file at ``out`` or a
    non-empty ``out`` unless ``overwrite``. With ``if_absent`` (a cache), the staged directory is
    installed only where nothing is: if another writer installed ``out`` first, ours is dropped."""
    out = Path(out)
    if check:
        check_can_replace(out, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=f".{tag}", dir=out.parent))
    try:
        apply_umask_mode(tmp)
        yield tmp
        if if_absent:
            with suppress(OSError):        # a non-empty ``out`` appeared meanwhile: keep it
                os.replace(tmp, out)
            return
        if not merge or not out.exists():
            replace_dir(tmp, out)
            return
        names = sorted(p.name for p in tmp.iterdir())
        if last in names:
            names.remove(last)
            names.append(last)
        for name in names:
            target = out / name
            if target.is_dir() and not target.is_symlink():
                replace_dir(tmp / name, target)
            else:
                os.replace(tmp / name, target)
        tmp.rmdir()
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
