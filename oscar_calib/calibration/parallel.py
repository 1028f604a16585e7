"""Data-parallel calibration over torch.distributed: the :class:`DataParallel` hooks of the pipeline.

:mod:`.pipeline` is the single-process algorithm; it calls the hook points of
:class:`~oscar_calib.calibration.ranks.Ranks` (a table there), and only a process started as one rank
of a job enters :func:`session` and gets :class:`DataParallel`. Every rank loads the same model,
plans the same token ids, and streams its share of the calibration batches through its own copy;
the float64 accumulators are then summed over ranks and rank 0 writes the artifact. The same code
runs however the ranks were started:

=============================================  ===============================================
started by                                     what sets RANK / WORLD_SIZE / MASTER_ADDR / ...
=============================================  ===============================================
``oscar calibrate --nproc N``                  torch's elastic launcher (the engine behind
                                               ``torchrun``), called in-process; it re-executes
                                               the same command line once per rank
                                               (:mod:`oscar_calib.jobs.launch`)
``torchrun --nproc-per-node N -m oscar_calib   torchrun
calibrate ...``
``accelerate launch -m oscar_calib calibrate`` accelerate (through torchrun)
a script calling ``pipeline.calibrate``         whatever started it (env://); a process group
                                               the script already initialised is reused
=============================================  ===============================================

Decisions:

* **Backend and device**: ``nccl`` with device ``cuda:LOCAL_RANK`` when the run's device is CUDA,
  ``gloo`` on the CPU. Control messages (start-up check, barriers) always go through a ``gloo``
  group, so a dead peer shows up as a closed connection rather than an NCCL hang.
  ``NCCL_NVLS_ENABLE`` defaults to ``0`` (NVLink multicast off: one all-reduce per run gains
  nothing from it, and some shared hosts require it off).
* **Sharding**: batch ``i`` (of the single-process batch list) goes to rank ``i % world``; the
  union over ranks is exactly the single-process token stream.
* **Reduction**: one ``all_reduce(SUM)`` of every layer's float64 sums, weight sums and token
  counts (counts are exact in float64 below 2**53). Only the order of float additions differs from
  a single process, so accumulators agree to ~1e-15 relative (tested at 1e-12).
* **sst-approx pilot**: the pilot is the same as in a single process: the first ``P`` batches of
  the global stream, ``P`` the fewest whose tokens reach ``pilot_tokens``. Each rank buffers the K/V
  rows of its own pilot batches; after them, every rank joins one all-reduce of its pilot query sums,
  so C̃_Q is the single-process pilot C̃_Q up to summation order, and every rank weights with it.
* **Held-out rows, rotations, clips**: split by layer. After the all-reduce every rank holds the
  same accumulators; rank ``r`` captures the held-out rows of layers ``r, r + world, ...`` (its own
  forward over the held-out sequences, the same on every rank) and computes their
  eigendecompositions, clip grids and held-out errors. What needs every layer (a bit budget's
  allocation, the one global K/V clip pair) is decided on every rank from small per-layer tables
  that the ranks exchange, in layer order, so each rank decides what one process decides. Rank 0
  gathers the fitted layers (float32 tensors and report rows, pickled: no bit changes) and alone
  writes the artifact. A layer is fitted by the same code on the same inputs wherever it runs, so
  the artifact is byte-for-byte the one rank 0 would have fitted alone.
* **Checkpoints**: per rank, ``<out>/.oscar-checkpoint.rank{r}-of-{world}.pt`` (this rank's partial
  sums over its own shard). ``--resume`` resumes each rank from its own file, with the same world
  size (another size is refused with the size to use). Files are kept when a rank dies, and removed
  once rank 0 has written the artifact.
* **Failures**: ``init_process_group`` gets a timeout (``OSCAR_DIST_TIMEOUT`` seconds, default
  1800) for every collective. At start-up every rank's model fingerprint, token-plan sha256,
  settings and start-up error (if any) are all-gathered; any mismatch or error stops every rank with
  the same :class:`DistributedError` before anything is written. While the ranks compute, a
  heartbeat in the job's store (:mod:`.heartbeat`, ``OSCAR_DIST_HEARTBEAT`` seconds, default 60)
  names a rank that died on any machine and stops the others within that time; a rank that fails
  on its own tells the others why at once. A collective that fails (a dead peer closes its
  sockets), a SIGTERM from the launcher and a stop from the heartbeat all become one line
  (:class:`DistributedError`) naming the rank when it is known; checkpoints stay. With ``--nproc``
  the parent names the rank that died as well.
* **Several machines**: nothing changes but the launcher (``torchrun --nnodes N --rdzv-backend c10d
  --rdzv-endpoint HOST:PORT``, or SLURM through torchrun: docs/guides/scaling.md). Devices are chosen
  from ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (the ranks of this machine), never the global rank.
* **Big models** (:mod:`oscar_calib.model.placement`): with a device map as well, each rank gets an
  equal, contiguous slice of the node's GPUs (:func:`placement_for_rank`).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..contract.config import CalibrationConfig
from ..errors import DistributedError, Interrupted
from ..jobs.launch import check_nproc, launch
from ..jobs.session import DistContext, placement_for_rank, session
from ..model.placement import Placement
from .ranks import Ranks
from .report import check_output_dir
from .stats import ACCUMULATORS

# ----------------------------------------------------------------------------- start-up

def check_agreement(ctx: DistContext, info: dict, error: BaseException | None) -> None:
    """All ranks exchange ``info`` (fingerprint, tokens sha, settings) and their start-up error.
    Raises ``error`` on the rank that had it, and :class:`DistributedError` on every other rank
    when any rank failed or the ranks disagree. Single process: just raises ``error``."""
    if not ctx.enabled:
        if error is not None:
            raise error
        return
    mine = dict(info, error=None if error is None else f"{type(error).__name__}: {error}")
    ranks = ctx.gather_objects(mine, "the start-up check")
    if error is not None:
        raise error
    failed = [(r, v["error"]) for r, v in enumerate(ranks) if v["error"]]
    if failed:
        r, msg = failed[0]
        raise DistributedError(f"rank {r} failed at start-up ({msg}); nothing was written")
    for key, what in (("fingerprint", "the model fingerprint (different models or revisions?)"),
                      ("tokens", "the calibration token ids (different data or tokenizers?)"),
                      ("settings", "the calibration settings")):
        vals = [v.get(key) for v in ranks]
        if len(set(vals)) > 1:
            shown = ", ".join(f"rank {r}: {str(v)[:12]}" for r, v in enumerate(vals))
            raise DistributedError(f"ranks disagree on {what}: {shown}; every rank must load the same model, data "
                                   "and settings; nothing was written")


# ----------------------------------------------------------------------------- accumulators

def pilot_batches(batches: Sequence[torch.Tensor], pilot_tokens: int) -> int:
    """How many leading batches form the sst-approx pilot in a single process (the fewest whose
    tokens reach ``pilot_tokens``; all of them if the budget is smaller)."""
    seen = 0
    for i, b in enumerate(batches):
        seen += b.numel()
        if seen >= pilot_tokens:
            return i + 1
    return len(batches)


def freeze_pilot_across_ranks(stats: list, ctx: DistContext, pilot_tokens: int) -> None:
    """Freeze every layer's sst-approx pilot C̃_Q from the pilot batches of all ranks. Each rank
    calls this exactly once, after its own pilot batches (``pilot_tokens``: tokens in the global
    pilot). A rank resumed from a checkpoint taken after the freeze already holds C̃_Q; it is then
    broadcast to the others instead (it is the same on every rank)."""
    frozen = stats[0].pilot_cq is not None
    flags = torch.zeros(ctx.world_size, dtype=torch.float64)
    flags[ctx.rank] = float(frozen)
    ctx.all_reduce_(flags, "the sst-approx pilot")
    shapes = [s.sums["q"].shape for s in stats]         # layers may differ in heads and head_dim (Gemma 4)
    dev = ctx.comm_device
    if bool(flags.any()):
        src = int(flags.nonzero()[0, 0])
        if ctx.rank == src:
            buf = torch.cat([s.pilot_cq.to(dev).reshape(-1) for s in stats])
        else:
            buf = torch.zeros(sum(shape.numel() for shape in shapes), dtype=torch.float64, device=dev)
        flat, scale = ctx.broadcast_(buf, src, "the sst-approx pilot"), [1] * len(stats)
    else:
        flat = ctx.all_reduce_(torch.cat([s.sums["q"].to(dev).reshape(-1) for s in stats]), "the sst-approx pilot")
        scale = [max(pilot_tokens * s.group, 1) for s in stats]
    parts = flat.split([shape.numel() for shape in shapes])
    for s, part, shape, n in zip(stats, parts, shapes, scale):
        s.freeze_pilot(part.reshape(shape) / n)


def all_reduce_stats(stats: list, ctx: DistContext) -> None:
    """Sum every layer's accumulators, weight sums and token counts over ranks, in place."""
    if not ctx.enabled:
        return
    parts = []
    for s in stats:
        if s.approx and s.pilot_cq is None:
            raise RuntimeError("all_reduce_stats before the sst-approx pilot was frozen")
        parts += [s.sums[n].reshape(-1) for n in ACCUMULATORS]
        parts += [s.w_sum.reshape(-1), torch.tensor([float(s.tokens)], dtype=torch.float64, device=s.w_sum.device)]
    flat = torch.cat([p.to(ctx.comm_device) for p in parts])
    ctx.all_reduce_(flat, "the reduction of the accumulators")
    off = 0
    for s in stats:
        for n in ACCUMULATORS:
            t = s.sums[n]
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()
        s.w_sum.copy_(flat[off:off + s.w_sum.numel()])
        off += s.w_sum.numel()
        s.tokens = int(round(float(flat[off])))
        off += 1


# ----------------------------------------------------------------------------- the pipeline's hooks

class DataParallel(Ranks):
    """The pipeline's hook points for one rank of a data-parallel job (the table in
    :mod:`oscar_calib.calibration.ranks`); its collectives go through ``ctx``."""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.rank, self.world_size, self.device = ctx.rank, ctx.world_size, ctx.device
        self._pilot: tuple[int, int] | None = None   # (this rank's pilot batches, global pilot tokens)

    def placement(self, placement):
        return placement_for_rank(placement, self.ctx)

    def checkpoint_name(self, base: str) -> str:
        stem = base[:-3] if base.endswith(".pt") else base
        return f"{stem}.rank{self.rank}-of-{self.world_size}.pt"

    def agree(self, info: dict, error: BaseException | None) -> None:
        check_agreement(self.ctx, info, error)

    def shard(self, batches: Sequence) -> list:
        """Batch ``i`` goes to rank ``i % world_size``."""
        return list(batches[self.rank::self.world_size])

    def key_parts(self) -> dict:
        return {"rank": [self.rank, self.world_size]}

    def plan_pilot(self, batches: Sequence, pilot_tokens: int, approx: bool) -> int:
        n = pilot_batches(batches, pilot_tokens)
        mine = len(range(self.rank, n, self.world_size))
        self._pilot = (mine, sum(b.numel() for b in batches[:n])) if approx else None
        return 2**62                       # frozen by after_batch, from every rank's pilot batches

    def after_batch(self, stats: list, batches_done: int) -> None:
        if self._pilot is not None and batches_done >= self._pilot[0]:
            freeze_pilot_across_ranks(stats, self.ctx, self._pilot[1])
            self._pilot = None

    def reduce(self, stats: list) -> None:
        all_reduce_stats(stats, self.ctx)

    def fit_share(self, layers: int) -> list[int]:
        """Layer ``i`` goes to rank ``i % world_size``."""
        return list(range(self.rank, layers, self.world_size))

    def exchange(self, obj, what: str) -> list:
        return self.ctx.gather_objects(obj, what)

    def gather(self, obj, what: str) -> list | None:
        return self.ctx.gather_to_main(obj, what)

    def timing(self, batches: Sequence) -> dict:
        return {"world_size": self.world_size, "rank_batches": len(batches),
                "rank_tokens": sum(b.numel() for b in batches)}

    def barrier(self, what: str) -> None:
        self.ctx.barrier(what)


# ----------------------------------------------------------------------------- starting the ranks

def calibrate_parallel(cfg: CalibrationConfig, out: Path, nproc: int, argv: list[str], *, overwrite: bool = False,
                       resume: bool = False) -> int:
    """Start ``nproc`` local ranks that each run the command line ``argv`` (``calibrate ...``,
    which must describe ``cfg`` and ``out``) through torch's elastic launcher, after checking
    what can be checked here. Returns rank 0's exit code (0, or 1 when verification failed);
    raises :class:`DistributedError` naming the rank that failed otherwise."""
    cfg.validate()
    check_nproc(nproc, cfg.device)
    check_output_dir(Path(out), overwrite, resume)
    hint = f"any per-rank checkpoints in {out} are kept: rerun the same command with --resume to continue"
    try:
        return launch(nproc, [sys.executable, "-m", "oscar_calib", *argv], hint=hint)
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted; {hint}") from None


@contextlib.contextmanager
def data_parallel(device: str = "auto", placement: Placement | None = None) -> Iterator[DataParallel]:
    """This rank's hooks, inside :func:`session` (for a process started as one rank of a job)."""
    with session(device, placement) as ctx:
        yield DataParallel(ctx)


__all__ = ["DataParallel", "calibrate_parallel", "data_parallel", "check_agreement", "all_reduce_stats",
           "freeze_pilot_across_ranks", "pilot_batches"]
