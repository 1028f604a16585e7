"""Starting local ranks: a command line run as N local ranks through torch's elastic launcher (what
``torchrun --standalone`` runs), naming the rank that failed. ``oscar calibrate --nproc N``
re-executes its own command line so (:func:`oscar_calib.calibration.parallel.calibrate_parallel`);
what each rank does is :mod:`oscar_calib.calibration.parallel`.

Several machines use torchrun itself (``torchrun --nnodes N --nproc-per-node K --rdzv-backend c10d
--rdzv-endpoint HOST:PORT -m oscar_calib calibrate ...`` on every machine, or under SLURM;
docs/guides/scaling.md): inside such a job ``--nproc`` may be left out, or must equal the ranks of this machine."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import uuid

from ..errors import DistributedError, InputError
from .env import STOPPED_EXIT, env_world_size, launched


def wants_launch(nproc: int | None) -> bool:
    """Whether ``--nproc`` asks this process to start ranks (False inside a rank, whose machine must
    then run ``nproc`` ranks of the job, and for ``--nproc 1`` or none)."""
    if nproc is None:
        return False
    _check_positive(nproc)
    if launched():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", env_world_size()))
        if nproc != local:
            raise InputError(f"--nproc {nproc} but this machine runs {local} rank(s) of the job (LOCAL_WORLD_SIZE="
                             f"{local}, WORLD_SIZE={env_world_size()}); leave --nproc out under torchrun")
        return False
    return nproc > 1


def _check_positive(nproc: int) -> None:
    if nproc < 1:
        raise InputError(f"--nproc must be at least 1, got {nproc}")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def available_devices(device: str) -> tuple[int, str]:
    """(how many ranks this machine can take, what they are) for a configured device."""
    from ..model.load import resolve_device

    if resolve_device(device).startswith("cuda"):
        import torch

        return torch.cuda.device_count(), "CUDA device(s) visible (one rank per GPU)"
    return _cores(), "CPU core(s) available to this process (on the CPU each rank needs a core of its own)"


def check_nproc(nproc: int, device: str) -> None:
    """Refuse ``--nproc`` below 1 or above the devices of this machine (GPUs on CUDA, cores on the CPU)."""
    _check_positive(nproc)
    n, what = available_devices(device)
    if nproc > n:
        raise InputError(f"--nproc {nproc}: only {n} {what}")


def launch(nproc: int, cmd: list[str], *, hint: str = "", env: dict[str, str] | None = None) -> int:
    """Run ``cmd`` (an executable and its arguments) as ``nproc`` local ranks through torch's
    elastic launcher (what ``torchrun --standalone`` runs), and wait.

    Returns 0 when every rank exits 0 and 1 when only rank 0 exits with 1 (the CLI's "verification
    failed"); raises :class:`DistributedError` naming the rank that failed first otherwise (a
    rank that dies stops the others)."""
    from torch.distributed.elastic.multiprocessing import (
        DefaultLogsSpecs,
        SignalException,
    )
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _check_positive(nproc)
    extra = {"shutdown_timeout": 15} if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)} else {}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"oscar-{uuid.uuid4().hex[:12]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          logs_specs=DefaultLogsSpecs(), **extra)
    added = dict(env or {})
    added.setdefault("NCCL_NVLS_ENABLE", os.environ.get("NCCL_NVLS_ENABLE", "0"))
    if "OMP_NUM_THREADS" not in os.environ:
        added["OMP_NUM_THREADS"] = str(max(_cores() // nproc, 1))
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.distributed.launcher")]
    levels = [lg.level for lg in loggers]
    saved = {k: os.environ.get(k) for k in list(added) + ["TORCHELASTIC_SIGNALS_TO_HANDLE"]}
    try:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
        os.environ.update(added)
        elastic_launch(config, cmd[0])(*cmd[1:])
        return 0
    except SignalException:
        raise KeyboardInterrupt from None
    except ChildFailedError as e:
        return _report_failure(e.failures, hint)
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _report_failure(failures: dict, hint: str) -> int:
    if set(failures) == {0} and failures[0].exitcode == 1:
        return 1
    # the root cause: the earliest failure that is not a survivor stopping (the launcher's SIGTERM, or
    # a rank that exits with STOPPED_EXIT because another rank failed); a rank killed by a signal first
    items = sorted(failures.items(), key=lambda kv: (kv[1].exitcode in (-signal.SIGTERM, STOPPED_EXIT),
                                                     kv[1].exitcode >= 0, kv[1].timestamp, kv[0]))
    rank, f = items[0]
    if f.exitcode < 0:
        try:
            name = signal.Signals(-f.exitcode).name
        except ValueError:
            name = f"signal {-f.exitcode}"
        what = f"rank {rank} died ({name})"
    else:
        what = f"rank {rank} failed with exit code {f.exitcode} (its message is above)"
    others = sorted(r for r in failures if r != rank)
    stopped = f"; rank(s) {', '.join(map(str, others))} were stopped" if others else ""
    raise DistributedError(f"{what}{stopped}{'; ' + hint if hint else ''}")


def cli_argv(command: str) -> list[str]:
    """This process's command line from ``command`` on (what each rank re-executes)."""
    argv = list(sys.argv[1:])
    if command not in argv:
        raise InputError(f"cannot find the {command!r} command in this process's arguments to re-execute it; "
                         f"start the ranks with: torchrun --nproc-per-node N -m oscar_calib {command} ...")
    return argv[argv.index(command):]


__all__ = ["wants_launch", "launch", "check_nproc", "available_devices", "cli_argv"]
