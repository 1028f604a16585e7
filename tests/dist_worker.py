"""One rank of a data-parallel test job (tests/calibration/test_distributed.py starts it through
``oscar_calib.jobs.launch.launch``, which sets RANK / WORLD_SIZE / MASTER_ADDR like torchrun).

Argument: a JSON job file ``{"cfg": {...}, "out": str, "work": str, "resume": bool,
"model": {tiny_model kwargs}, "model_rank": {rank: kwargs}, "die": {rank: batch}}``. Every rank
builds the same seeded tiny model (``model_rank`` changes one rank's), calls ``calibrate`` and
writes into ``work``: ``batches.rank{r}`` (the local batch counts it saw), ``fitting.rank{r}`` (the
layers it fitted), ``error.rank{r}`` (a typed error, then its exit code), and on rank 0 ``stats.pt``
(the all-reduced accumulators).
"""

import json
import os
import signal
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]    # factories, this checkout's package

import torch  # noqa: E402

torch.set_num_threads(1)     # the single-process reference in the test runs with one thread too

from factories import loaded_tiny  # noqa: E402

from oscar_calib.calibration.pipeline import calibrate  # noqa: E402
from oscar_calib.contract.config import CalibrationConfig  # noqa: E402
from oscar_calib.errors import OscarError  # noqa: E402


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ["RANK"])
    work = Path(job["work"])
    kw = dict(job.get("model", {}))
    kw.update(job.get("model_rank", {}).get(str(rank), {}))
    die_at = job.get("die", {}).get(str(rank))
    seen = []

    def on_batch(n):
        seen.append(n)
        (work / f"batches.rank{rank}").write_text(json.dumps(seen))
        if die_at is not None and n == die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    try:
        res = calibrate(CalibrationConfig(**job["cfg"]), job["out"], loaded=loaded_tiny(**kw),
                        resume=job.get("resume", False), on_batch=on_batch)
    except OscarError as e:
        (work / f"error.rank{rank}").write_text(f"{type(e).__name__}: {e}")
        sys.exit(e.exit_code)
    (work / f"fitting.rank{rank}").write_text(json.dumps(res.stats.fitting))
    if rank == 0:
        torch.save({"stats": [s.state_dict() for s in res.stats.stats], "timings": res.report["timings"]},
                   work / "stats.pt")


if __name__ == "__main__":
    main()
