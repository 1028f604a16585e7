"""Checkpoints of the streaming accumulators: ``<out>/.oscar-checkpoint.pt`` (one per rank under
data parallelism), written atomically every ``checkpoint_every`` batches; ``--resume`` continues
from one when the settings, model fingerprint and token ids match (the key).

A directory holding a checkpoint is an interrupted run: without ``--resume`` (continue it) or
``--overwrite`` (start over, the checkpoints are removed) ``oscar calibrate`` refuses it rather
than silently discard the work. ``--resume`` where there is no checkpoint warns and starts over.
Ctrl-C, a failure of another rank and a full disk keep the checkpoint and say so in one line
(:func:`interruptible`, :func:`cleanup_failed_run`); any other failure removes it."""

from __future__ import annotations

import contextlib
import shutil
import warnings
from pathlib import Path

import torch

from ..errors import DistributedError, InputError, Interrupted, OscarWarning, WriteError
from ..fsutil import atomic_write_bytes, remove_stale_temps

CHECKPOINT_NAME = ".oscar-checkpoint.pt"
_STEM = CHECKPOINT_NAME[:-3]


def save_checkpoint(path: Path, run, key: str) -> None:
    import io

    buf = io.BytesIO()
    torch.save({"key": key, "batches_done": run.batches_done, "layer_info": run.layer_info,
                "stats": [s.state_dict() for s in run.stats]}, buf)
    atomic_write_bytes(path, buf.getvalue())


def load_checkpoint(path: Path, run, key: str) -> bool:
    """Load ``path`` into ``run`` when it exists and its key matches (True); warn and return False
    when there is nothing usable to resume from."""
    remove_stale_temps(path.parent, [path.name])      # a write killed before its rename
    who = _rank_prefix(path.name)
    if not path.exists():
        warnings.warn(f"{who}--resume: no checkpoint {path.name} in {path.parent}; starting from the first batch",
                      OscarWarning, stacklevel=2)
        return False
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - a torn or foreign file is simply not resumable
        warnings.warn(f"{who}--resume: {path} cannot be read (not a checkpoint of this toolkit); starting from the "
                      "first batch", OscarWarning, stacklevel=2)
        return False
    if state.get("key") != key:
        raise InputError(f"{path} was written by a run with other settings, model or data; "
                         "remove it or run without --resume")
    for s, st in zip(run.stats, state["stats"]):
        s.load_state_dict(st)
    run.batches_done = int(state["batches_done"])
    run.layer_info = {int(k): v for k, v in state["layer_info"].items()}
    return True


def _rank_prefix(name: str) -> str:
    """``"rank R: "`` for a per-rank checkpoint name, else nothing."""
    if ".rank" not in name:
        return ""
    return f"rank {name.split('.rank', 1)[1].split('-of-', 1)[0]}: "


def checkpoints_in(out: Path) -> list[str]:
    """Names of the checkpoints (any number of ranks) in ``out``."""
    return sorted(p.name for p in Path(out).glob(f"{_STEM}*.pt")) if Path(out).is_dir() else []


def _world_of(name: str) -> int:
    return int(name[:-3].rsplit("-of-", 1)[1]) if "-of-" in name else 1


def other_world_checkpoints(out: Path, mine: str) -> list[str]:
    """Checkpoints in ``out`` written by a job with another number of ranks than ``mine``'s."""
    return [n for n in checkpoints_in(out) if _world_of(n) != _world_of(mine)]


def remove_checkpoints(out: Path) -> None:
    """Start over (``--overwrite``): remove every checkpoint and its stale temporaries in ``out``."""
    names = checkpoints_in(out)
    for n in names:
        (Path(out) / n).unlink(missing_ok=True)
    remove_stale_temps(out, names)


@contextlib.contextmanager
def interruptible(run, total: int, checkpoint: Path | None):
    """Ctrl-C during the capture becomes :class:`Interrupted`, saying what was kept."""
    try:
        yield
    except KeyboardInterrupt:
        if checkpoint is not None and run.checkpointed:
            raise Interrupted(f"interrupted after batch {run.batches_done} of {total}; the checkpoint at batch "
                              f"{run.checkpointed} is kept in {checkpoint.parent}: rerun the same command with "
                              "--resume to continue") from None
        raise Interrupted(f"interrupted after batch {run.batches_done} of {total}, before the first checkpoint; "
                          "nothing to resume") from None


# what leaves the checkpoint in place for --resume: an interruption, a failure of another rank, a full disk
_RESUMABLE = (KeyboardInterrupt, SystemExit, Interrupted, DistributedError, WriteError)


def cleanup_failed_run(out: Path, ckpt: Path, created: bool, error: BaseException) -> None:
    """After a failed run: drop the checkpoint unless the run can be resumed, and an output
    directory this run created if nothing is left in it."""
    if not isinstance(error, _RESUMABLE):
        ckpt.unlink(missing_ok=True)
    if created and out.is_dir() and not any(out.iterdir()):
        shutil.rmtree(out, ignore_errors=True)


def raise_with_resume_hint(error: BaseException, ckpt: Path) -> None:
    """A full disk with a checkpoint kept: the same line, plus how to go on."""
    if isinstance(error, WriteError) and ckpt.exists():
        raise WriteError(f"{error}; the checkpoint {ckpt} is kept: rerun with --resume once the disk has room") from None


@contextlib.contextmanager
def failing_cleanly(out: Path, ckpt: Path, created: bool):
    """Around a stage of a run: Ctrl-C becomes :func:`interrupted`'s line; any other failure
    cleans up (:func:`cleanup_failed_run`) and, on a full disk, says how to resume."""
    try:
        yield
    except KeyboardInterrupt:
        raise interrupted(ckpt) from None
    except BaseException as e:
        cleanup_failed_run(out, ckpt, created, e)
        raise_with_resume_hint(e, ckpt)
        raise


def interrupted(ckpt: Path) -> Interrupted:
    """Ctrl-C outside the capture (loading, rotations, writing)."""
    if ckpt.exists():
        return Interrupted(f"interrupted; the checkpoint in {ckpt.parent} is kept: rerun the same command with --resume "
                           "to continue")
    return Interrupted("interrupted; nothing was written")
