"""Checkpoints of the streaming accumulators: ``<out>/.oscar-checkpoint.pt`` (one per rank under
data parallelism), written atomically every ``checkpoint_every`` batches; ``--resume`` continues
from one when the settings, model fingerprint and token ids match (the key)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InputError
from ..fsutil import atomic_write_bytes

CHECKPOINT_NAME = ".oscar-checkpoint.pt"


def save_checkpoint(path: Path, run, key: str) -> None:
    import io

    buf = io.BytesIO()
    torch.save({"key": key, "batches_done": run.batches_done, "layer_info": run.layer_info,
                "stats": [s.state_dict() for s in run.stats]}, buf)
    atomic_write_bytes(path, buf.getvalue())


def load_checkpoint(path: Path, run, key: str) -> bool:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - a torn or foreign file is simply not resumable
        return False
    if state.get("key") != key:
        raise InputError(f"{path} was written by a run with other settings, model or data; "
                         "remove it or run without --resume")
    for s, st in zip(run.stats, state["stats"]):
        s.load_state_dict(st)
    run.batches_done = int(state["batches_done"])
    run.layer_info = {int(k): v for k, v in state["layer_info"].items()}
    return True


def other_world_checkpoints(out: Path, mine: str) -> list[str]:
    if not out.is_dir() or (out / mine).exists():
        return []
    stem = CHECKPOINT_NAME[:-3]
    return sorted(p.name for p in out.glob(f"{stem}*.pt"))
