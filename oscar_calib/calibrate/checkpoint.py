"""Checkpoints of the streaming accumulators: ``<out>/.oscar-checkpoint.pt`` (one per rank under
data parallelism), written atomically every ``checkpoint_every`` batches; ``--resume`` continues
from one when the settings, model fingerprint and token ids match (the key).

A directory holding a checkpoint is an interrupted run: without ``--resume`` (continue it) or
``--overwrite`` (start over, the checkpoints are removed) ``oscar calibrate`` refuses it rather
than silently discard the work. ``--resume`` where there is no checkpoint warns and starts over."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..errors import InputError, OscarWarning
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
