"""Where a calibration process stands in its job, and the hook points the pipeline calls.

:mod:`.pipeline` is the single-process algorithm. The few places where data parallelism changes
it are calls on a :class:`Ranks` object; the base class is one process (every hook a no-op or the
identity), and :class:`oscar_calib.calibrate.parallel.DataParallel` implements them over
torch.distributed. A plain run never starts a process group.

=====================  ======================================  =====================================
hook                   one process                             a data-parallel rank
=====================  ======================================  =====================================
``placement``          the placement as given                  this rank's slice of the GPUs
``checkpoint_name``    ``.oscar-checkpoint.pt``                ``...rank{r}-of-{world}.pt``
``agree``              raise this process's start-up error     all-gather settings and errors
``shard``              every batch                             batches ``rank, rank + world, ...``
``key_parts``          nothing                                 ``rank`` in the checkpoint key
``plan_pilot``         ``pilot_tokens`` (frozen locally)       frozen by ``after_batch`` instead
``after_batch``        nothing                                 the sst-approx pilot exchange, once
``reduce``             nothing                                 all-reduce the accumulators
``fit_share``          every layer                             layers ``rank, rank + world, ...``
``exchange``           ``[obj]``                               every rank's ``obj``, in rank order
``gather``             ``[obj]``                               the same, on rank 0 only (else None)
``timing``             nothing                                 world size, this rank's share
``barrier``            nothing                                 wait for every rank
=====================  ======================================  =====================================

After the reduction every rank holds the same accumulators, so the work that follows the capture
(held-out rows, eigendecompositions, clip grids, held-out errors) is split by layer: each rank
captures the held-out rows of its ``fit_share`` and fits those layers; the few decisions that need
every layer (a bit budget's allocation, the global clips) ``exchange`` small tables, and rank 0
``gather``s the fitted layers and writes the artifact.
"""

from __future__ import annotations

import os
from typing import Sequence

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


class Ranks:
    """The pipeline's hook points for a single process (the whole job is this process)."""

    rank = 0
    world_size = 1
    device: str | None = None       # this rank's compute device; None: as configured

    @property
    def enabled(self) -> bool:
        """Whether there are other ranks."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Whether this process reports, fits the clips and writes the artifact."""
        return self.rank == 0

    def placement(self, placement):
        return placement

    def checkpoint_name(self, base: str) -> str:
        return base

    def agree(self, info: dict, error: BaseException | None) -> None:
        """Raise this process's start-up ``error``, if any (ranks also compare ``info``)."""
        if error is not None:
            raise error

    def shard(self, batches: Sequence) -> list:
        return list(batches)

    def key_parts(self) -> dict:
        """What this process adds to its checkpoint's key."""
        return {}

    def plan_pilot(self, batches: Sequence, pilot_tokens: int, approx: bool) -> int:
        """The pilot size at which each layer freezes its sst-approx C̃_Q by itself."""
        return pilot_tokens

    def after_batch(self, stats: list, batches_done: int) -> None:
        """Called before the first batch and after every batch (``batches_done`` of this process's)."""

    def reduce(self, stats: list) -> None:
        """Sum the accumulators over ranks, in place."""

    def fit_share(self, layers: int) -> list[int]:
        """The layers (of ``layers``) whose held-out rows this process captures and whose rotations
        and clips it fits."""
        return list(range(layers))

    def exchange(self, obj, what: str) -> list:
        """Every rank's ``obj`` (picklable, small), in rank order, on every rank."""
        return [obj]

    def gather(self, obj, what: str) -> list | None:
        """Every rank's ``obj`` in rank order on rank 0; None on the other ranks."""
        return [obj]

    def timing(self, batches: Sequence) -> dict:
        """What the report's timings say about this process's share (``batches``: its batches)."""
        return {}

    def barrier(self, what: str) -> None:
        """Wait until every rank gets here."""
