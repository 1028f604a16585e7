"""What the environment says about this process's job: whether it is one rank of several
(:func:`launched`, ``WORLD_SIZE`` as torchrun, accelerate launch and ``oscar calibrate --nproc`` set
it), the seconds a supervision setting asks for (:func:`env_seconds`), and the exit code of a rank
stopped because of another rank (:data:`STOPPED_EXIT`)."""

from __future__ import annotations

import os

from ..errors import DistributedError, InputError

STOPPED_EXIT = 143          # 128 + SIGTERM: this rank stopped because of another rank (not a root cause)


def stopped(message: str) -> DistributedError:
    """The error of a rank stopped because of another rank (its exit code tells a launcher so)."""
    err = DistributedError(message)
    err.exit_code = STOPPED_EXIT
    return err


def env_world_size() -> int:
    """``WORLD_SIZE`` as set by torchrun / accelerate launch / ``--nproc`` (1 when unset)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise DistributedError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


def env_seconds(name: str, default: float, *, zero_means: str | None = None) -> float:
    """A number of seconds from environment variable ``name`` (``default`` when unset): positive, or
    also 0 when ``zero_means`` says what 0 does (e.g. ``"off"``). Anything else is one clear line."""
    raw = os.environ.get(name, str(default))
    try:
        v = float(raw)
    except ValueError:
        raise InputError(f"{name}={raw!r} is not a number of seconds") from None
    if v < 0 or (v == 0 and zero_means is None):
        allowed = f"0 ({zero_means}) or a positive number" if zero_means else "positive"
        raise InputError(f"{name} must be {allowed}" + (" of seconds" if zero_means else ""))
    return v


def launched() -> bool:
    """True inside a rank of a multi-process job (torchrun, accelerate launch, ``--nproc``, or a
    script that initialised a process group of several ranks)."""
    if env_world_size() > 1:
        return True
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
