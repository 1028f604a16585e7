"""The hook points the calibration pipeline calls where data parallelism changes it.

:mod:`.pipeline` is the single-process algorithm. The few places where data parallelism changes
it are calls on a :class:`Ranks` object; the base class is one process (every hook a no-op or the
identity), and :class:`oscar_calib.calibration.parallel.DataParallel` implements them over
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

from typing import Sequence


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
