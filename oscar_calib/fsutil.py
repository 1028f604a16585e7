"""Files that are either complete or absent: atomic file writes and staged directories.

Every writer in the toolkit goes through these helpers, so an interrupted or failed command never
leaves a half-written file or directory where a user (or a tool) would take it for a finished one.

===================  ==============================================================================
helper               what it guarantees
===================  ==============================================================================
atomic_write_bytes   the file at ``path`` is the old one or the new one, never a mix (temporary
                     name in the same directory, ``fsync``, ``os.replace``)
atomic_write_files   several files into one directory: all are written under temporary names
                     first, then renamed into place in order (``last`` last), so a kill or a full
                     disk while writing leaves the old files (or none), never some new ones
staged_dir           a directory built under a temporary name beside ``out`` and moved into place
                     only when the ``with`` block succeeds; on any error it is deleted.
                     ``merge=False``: ``out`` is replaced as a whole (what it held is kept until the
                     new one is ready). ``merge=True``: the staged files are moved into ``out`` one
                     by one (``last`` moved last), other files in ``out`` are left alone.
                     ``if_absent=True`` (caches): installed only if no other writer got there first.
replace_dir          move a finished directory onto ``dest``, restoring ``dest`` if the move fails
check_can_replace    refuse a file where a directory goes, or an occupied directory unless overwrite
check_writable       refuse an output directory that cannot be created or written (a real probe)
remove_stale_temps   delete the temporaries a killed writer (SIGKILL, power loss) left behind
===================  ==============================================================================

A write that fails (disk full, quota, read-only file system) raises :class:`WriteError` with one
line naming the file; the temporary is removed and the old file is left as it was. ``staged_dir``
turns a full disk inside its block into the same error.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable, Iterator

from .errors import InputError, OutputExistsError, WriteError

# errors that mean "the storage refused the bytes", whatever the code was doing
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_error(e: OSError, path: Path, kept: str | None = None) -> WriteError:
    """The one-line :class:`WriteError` for an ``OSError`` while writing ``path``; ``kept`` says
    what is intact (default: ``path`` is unchanged)."""
    why = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        why += " (free some space and run again)"
    err = WriteError(f"cannot write {path}: {why}; {kept or f'{path} is unchanged'}")
    err.oserror = e
    return err


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_temp(path: Path, data: bytes) -> str:
    """``data`` in a fsync'ed temporary file beside ``path``; returns its name (removed on error)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())
        _write_all(fd, data)
        os.fsync(fd)
        os.close(fd)
        fd = -1
    except BaseException:
        if fd >= 0:
            os.close(fd)
        os.unlink(tmp)
        raise
    return tmp


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory."""
    atomic_write_files(Path(path).parent, {Path(path).name: data})


def atomic_write_files(directory: Path, files: dict[str, bytes], *, last: str | None = None) -> None:
    """Write ``files`` (name -> bytes) into ``directory``: every file goes to a temporary name first
    (written and fsync'ed), and only then are they renamed into place, in order, ``last`` last.
    On any error the temporaries are removed and the old files stay (:class:`WriteError`)."""
    directory = Path(directory)
    names = sorted(files, key=lambda n: n == last)          # stable: ``last`` moves to the end
    temps: dict[str, str] = {}
    try:
        for name in names:
            temps[name] = _write_temp(directory / name, files[name])
        for name in names:
            os.replace(temps.pop(name), directory / name)
    except OSError as e:
        if len(files) == 1:
            target = directory / name
            raise write_error(e, target, None if target.exists() else "nothing was written") from None
        raise write_error(e, directory, f"the files in {directory} are unchanged") from None
    finally:
        for tmp in temps.values():
            with suppress(OSError):
                os.unlink(tmp)


def remove_stale_temps(directory: Path, names) -> list[Path]:
    """Delete the temporaries of ``names`` (``.NAME.*.tmp``) in ``directory``: what a writer killed
    before its rename left. Only for files this process owns (nobody else writes them now)."""
    gone = []
    for name in names:
        for p in Path(directory).glob(f".{name}.*.tmp"):
            with suppress(OSError):
                p.unlink()
                gone.append(p)
    return gone


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
        try:
            yield tmp
        except (OSError, WriteError) as e:
            cause = getattr(e, "oserror", e)
            if isinstance(e, OSError) and e.errno not in STORAGE_ERRNOS:
                raise
            raise write_error(cause, out, "nothing was written" + (f"; {out} is unchanged" if out.exists() else "")) from None
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
