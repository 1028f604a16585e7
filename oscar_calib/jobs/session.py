"""This process's place in a torch.distributed job: joining it, its devices, its collectives.

:func:`session` joins the job described by the environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: what torchrun, accelerate launch and ``oscar calibrate
--nproc`` set, on one machine or many) and yields a :class:`DistContext` whose collectives turn
every failure into one :class:`~oscar_calib.errors.DistributedError` line. The decisions are in
:mod:`oscar_calib.calibration.parallel`; the liveness watch in :mod:`oscar_calib.jobs.heartbeat`.

Devices come from ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (the ranks of this machine), never from
the global rank: rank 9 of a 2 × 8 job is local rank 1 of its machine and takes ``cuda:1`` (or, with
a device map, its machine's GPUs ``k … 2k−1``, ``k = gpus // 8``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from ..errors import DistributedError, first_line
from ..model.placement import Placement, cpu_bytes
from .env import env_seconds, env_world_size, stopped
from .heartbeat import Heartbeat, heartbeat_timeout, job_store

DEFAULT_TIMEOUT_S = 1800


@dataclass
class DistContext:
    """This process's place in a torch.distributed job, and the collectives calibration uses:
    every failure of one becomes a one-line :class:`DistributedError`. A plain single process is
    ``DistContext()``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: str | None = None       # this rank's compute device ("cuda:1", "cpu"); None: as configured
    backend: str | None = None
    ctrl: object = None             # gloo group for control messages (None: the default group)
    timeout_s: float = DEFAULT_TIMEOUT_S
    heartbeat: Heartbeat | None = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def comm_device(self) -> torch.device:
        return torch.device(self.device if self.backend == "nccl" else "cpu")

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise several types
            reason = self.heartbeat.await_reason() if self.heartbeat is not None else None
            if reason:
                self.heartbeat.tell(reason)
                raise stopped(f"rank {self.rank}: stopped during {what}: {reason}; checkpoints are kept, "
                                       "rerun with --resume") from None
            first = re.sub(r"^\[[^\]]*\]\s*", "", first_line(e))[:200]
            raise stopped(f"rank {self.rank}: lost contact with another rank during {what} ({first}); "
                                   "another rank probably failed, see its message; checkpoints are kept, rerun "
                                   "with --resume") from None

    def gather_objects(self, obj, what: str) -> list:
        out = [None] * self.world_size
        self._call(what, dist.all_gather_object, out, obj, group=self.ctrl)
        return out

    def gather_to_main(self, obj, what: str) -> list | None:
        """Every rank's ``obj`` in rank order on rank 0 (None elsewhere), through the control group."""
        out = [None] * self.world_size if self.is_main else None
        self._call(what, dist.gather_object, obj, out, dst=0, group=self.ctrl)
        return out

    def barrier(self, what: str) -> None:
        self._call(what, dist.monitored_barrier, group=self.ctrl,
                   timeout=datetime.timedelta(seconds=self.timeout_s), wait_all_ranks=True)

    def all_reduce_(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Sum ``t`` over ranks in place (on the communication device) and return it."""
        return self._collective(t, what, dist.all_reduce, op=dist.ReduceOp.SUM)

    def broadcast_(self, t: torch.Tensor, src: int, what: str) -> torch.Tensor:
        return self._collective(t, what, dist.broadcast, src=src)

    def _collective(self, t: torch.Tensor, what: str, fn, **kwargs) -> torch.Tensor:
        self.barrier(what)          # a dead peer fails here, on gloo, instead of hanging in NCCL
        buf = t.to(self.comm_device)
        self._call(what, fn, buf, **kwargs)
        if buf is not t:
            t.copy_(buf)
        return t


def _timeout_s() -> float:
    return env_seconds("OSCAR_DIST_TIMEOUT", DEFAULT_TIMEOUT_S)


def gpus_per_rank(gpus: int, local_world: int | None = None) -> int:
    """GPUs of one rank when a device map spreads each rank's model: ``gpus // ranks of this
    machine`` (``local_world``, default ``LOCAL_WORLD_SIZE``)."""
    if local_world is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env_world_size()))
    return max(gpus // max(local_world, 1), 1)


def rank_device(device: str, local_rank: int, placement: "Placement | None",
                local_world: int | None = None) -> tuple[str, str]:
    """(backend, this rank's device) for a configured ``device`` ("auto", "cpu", "cuda", ...): local
    rank ``r`` of this machine takes ``cuda:r``, or with a device map the first of its GPUs."""
    from ..model.load import resolve_device

    dev = resolve_device(device)
    if not dev.startswith("cuda"):
        return "gloo", "cpu"
    n = torch.cuda.device_count()
    per = gpus_per_rank(n, local_world) if placement is not None and placement.device_map is not None else 1
    first = local_rank * per
    if first >= n:
        raise DistributedError(f"rank with LOCAL_RANK={local_rank} has no GPU: only {n} CUDA device(s) visible "
                               "(one rank per GPU; start fewer ranks)")
    return "nccl", f"cuda:{first}"


@contextlib.contextmanager
def session(device: str = "auto", placement: "Placement | None" = None) -> Iterator[DistContext]:
    """The job this process belongs to. Initialises ``torch.distributed`` from the environment
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) when WORLD_SIZE > 1 and no process
    group exists yet, and destroys only a group it created. Single process: ``DistContext()``."""
    existing = dist.is_available() and dist.is_initialized()
    if not existing and env_world_size() <= 1:
        yield DistContext()
        return
    if not dist.is_available():
        raise DistributedError("this torch build has no torch.distributed")
    timeout = _timeout_s()
    if existing:
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise DistributedError(f"WORLD_SIZE={env_world_size()} but {', '.join(missing)} not set; start the ranks "
                                   "with torchrun, accelerate launch or oscar calibrate --nproc")
        rank, world = int(os.environ["RANK"]), env_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend, dev = rank_device(device, local_rank, placement, local_world)
    if existing:
        backend = dist.get_backend()
        if backend != "nccl" and dev.startswith("cuda"):
            raise DistributedError(f"the process group uses {backend}; CUDA calibration needs nccl")
    created, ctrl = False, None
    old_term = hb = None
    try:
        if not existing:
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            kwargs = {}
            if backend == "nccl":
                torch.cuda.set_device(torch.device(dev))
                kwargs["device_id"] = torch.device(dev)
            try:
                dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout), **kwargs)
            except Exception as e:  # noqa: BLE001
                raise DistributedError(f"rank {rank}: cannot join the process group ({os.environ.get('MASTER_ADDR')}:"
                                       f"{os.environ.get('MASTER_PORT')}): {first_line(e)}") from None
            created = True
        if backend != "gloo":
            ctrl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        hb = _start_heartbeat(rank, world, timeout)
        ctx = DistContext(rank, world, local_rank, local_world, dev, backend, ctrl, timeout, hb)

        def _terminated(signum, frame):   # the launcher stops survivors with SIGTERM; so does the heartbeat
            known = hb.why() if hb is not None else None
            if known:
                hb.tell(known)       # the ranks of other machines stop now, with the root cause, not this rank's silence
            why = f"stopped: {known}" if known else "stopped by the launcher (another rank failed, see its message)"
            raise stopped(f"rank {rank}: {why}; checkpoints are kept, rerun with --resume")

        try:
            old_term = signal.signal(signal.SIGTERM, _terminated)
        except ValueError:      # not the main thread
            old_term = None
        try:
            yield ctx
        except BaseException as e:
            if hb is not None and not isinstance(e, DistributedError):
                hb.fail(f"{type(e).__name__}: {first_line(e)}")     # the others stop now, knowing why
            raise
        if hb is not None:
            hb.finish()
    finally:
        if hb is not None:
            hb.close()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        if created:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _start_heartbeat(rank: int, world: int, timeout: float) -> Heartbeat | None:
    """This rank's heartbeat (:mod:`.heartbeat`), or None when it is off or the job has no store."""
    beat = heartbeat_timeout()
    if beat <= 0 or world < 2:
        return None
    try:
        store = job_store(min(timeout, 300.0))
    except Exception as e:  # noqa: BLE001
        raise DistributedError(f"rank {rank}: cannot reach the job's store at {os.environ.get('MASTER_ADDR')}:"
                               f"{os.environ.get('MASTER_PORT')} for the heartbeat: {first_line(e)}") from None
    return Heartbeat(store, rank, world, beat).start() if store is not None else None


def placement_for_rank(placement: Placement | None, ctx: DistContext) -> Placement | None:
    """This rank's share of a big-model placement: under data parallelism with a device map, an
    equal, contiguous slice of the node's GPUs (rank ``r`` of ``n`` per node: GPUs ``r·k … r·k+k−1``,
    ``k = gpus // n``), each at 90% of its free memory unless ``--max-memory`` says otherwise."""
    if placement is None or not ctx.enabled or placement.device_map is None or not torch.cuda.is_available():
        return placement
    n = torch.cuda.device_count()
    per = gpus_per_rank(n, ctx.local_world_size)
    gpus = range(ctx.local_rank * per, ctx.local_rank * per + per)
    user = dict(placement.max_memory or {})
    mm = {g: user.get(g, int(torch.cuda.mem_get_info(g)[0] * 0.9)) for g in gpus if g < n}
    mm.update({k: v for k, v in user.items() if not isinstance(k, int)})
    mm.setdefault("cpu", cpu_bytes())
    return Placement(placement.device_map, mm, placement.offload_dir)


__all__ = ["DistContext", "session", "gpus_per_rank", "placement_for_rank", "DEFAULT_TIMEOUT_S"]
