"""The ``oscar`` CLI with faults injected, for tests that start it as a process (under torchrun, or
alone): ``python tests/fault_worker.py calibrate ...``. Before each forward pass after the first
``OSCAR_TEST_SLOW_FROM`` (default 0) it sleeps ``OSCAR_TEST_SLOW`` seconds; the rank
``OSCAR_TEST_DIE_RANK`` (``RANK``, 0 when unset) writes the time to ``OSCAR_TEST_MARK`` and kills
itself with SIGKILL right after its ``OSCAR_TEST_DIE_AT``-th forward pass. ``OSCAR_TEST_SLOW_RANKS``
(comma-separated) limits the sleeps to those ranks. With ``OSCAR_TEST_ENDS`` (a folder) every rank
that exits on its own (not killed) writes there the time it exited, ``end.rank{RANK}`` (what
scripts/bench/bench_scale.py times), and how many forward passes it had finished,
``forwards.rank{RANK}`` (what the tests check: a rank stopped in its own batches, not at the
collective they lead to)."""

import atexit
import os
import signal
import sys
import time
from pathlib import Path

from oscar_calib.calibration import collect

_real_forward = collect.capture_forward
_calls = {"n": 0}


def _env(name: str, default: str = "") -> str:
    return os.environ.get(f"OSCAR_TEST_{name}", default)


def _forward(model, ids):
    rank = os.environ.get("RANK", "0")
    _real_forward(model, ids)
    _calls["n"] += 1
    if _env("DIE_RANK") == rank and _calls["n"] == int(_env("DIE_AT", "0")):
        if _env("MARK"):
            Path(_env("MARK")).write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    slow_ranks = _env("SLOW_RANKS")
    if _env("SLOW") and _calls["n"] >= int(_env("SLOW_FROM", "0")) and (not slow_ranks or rank in slow_ranks.split(",")):
        time.sleep(float(_env("SLOW")))


def _record_end() -> None:
    rank = os.environ.get("RANK", "0")
    Path(_env("ENDS"), f"forwards.rank{rank}").write_text(str(_calls["n"]))
    Path(_env("ENDS"), f"end.rank{rank}").write_text(repr(time.time()))


collect.capture_forward = _forward
if _env("ENDS"):
    atexit.register(_record_end)

if __name__ == "__main__":
    from oscar_calib.cli import main

    sys.argv = ["oscar", *sys.argv[1:]]
    main()
