#!/usr/bin/env python
"""Where a first run's time and memory go: ``oscar calibrate`` and ``oscar verify`` on the demo
model (SmolLM2-135M, CPU), each profiled with cProfile in a process of its own.

    python scripts/dev/profile_demo.py               # the settings of `make demo`
    python scripts/dev/profile_demo.py --quick       # the settings of `oscar calibrate --quick`
    python scripts/dev/profile_demo.py --top 30 --out prof/

For each part it records, from the library's own progress reports (``oscar_calib.progress``), the
wall time of every stage and the peak resident memory reached during it (Linux ``VmHWM``, reset at
every stage boundary through ``/proc/self/clear_refs``), the process's overall peak RSS, and the
functions with the most time of their own. Parts:

* ``calibrate``: model loading + ``calibrate()`` without its verify (the default data and seed);
* ``verify``: model loading + ``verify_artifact()`` on that artifact with verify's defaults (or,
  with ``--quick``, the lighter settings ``oscar calibrate --quick`` verifies with).

Writes ``OUT/profile_demo.json`` and ``OUT/{calibrate,verify}.prof`` (open with ``python -m pstats``
or snakeviz) and prints the stage tables and the top functions. The machine is shared: compare
runs taken back to back, and read the load average printed with them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _status(key: str) -> int:
    """``VmRSS``/``VmHWM`` of this process in bytes (0 where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")     # resets VmHWM to the current RSS
    except OSError:
        pass


class StageRecorder:
    """A progress callback that times every stage and the peak RSS reached during it."""

    def __init__(self):
        self.stages: list[dict] = []
        self.current: str | None = None
        self.t0 = time.perf_counter()

    def __call__(self, stage: str, done: int, total: int | None = None, unit: str = "") -> None:
        if stage != self.current:
            self.close()
            self.current = stage
            _reset_peak()
            self.stages.append({"stage": stage, "start_s": time.perf_counter() - self.t0, "unit": unit,
                                "total": total})
        if total is not None and done >= total:
            self.close()

    def close(self) -> None:
        if self.current is not None:
            s = self.stages[-1]
            s["seconds"] = time.perf_counter() - self.t0 - s["start_s"]
            s["peak_rss_mb"] = _status("VmHWM") / 2**20
            self.current = None


def top_functions(prof: cProfile.Profile, n: int) -> str:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(n)
    return buf.getvalue()


def run_part(part: str, artifact: Path, quick: bool, out: Path, top: int) -> dict:
    """One part in this process: returns its stage table, totals and top functions."""
    sys.path.insert(0, str(ROOT))
    from oscar_calib.calibration.pipeline import calibrate
    from oscar_calib.contract.config import config_from_options
    from oscar_calib.eval.verify import QUICK_VERIFY, verify_artifact
    from oscar_calib.model.load import load_model

    rec = StageRecorder()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    if part == "calibrate":
        cfg = config_from_options(None, {"device": "cpu"}, quick=quick)
        lm = load_model(cfg.model, device="cpu", progress=rec)
        calibrate(cfg, artifact, overwrite=True, loaded=lm, progress=rec)
    else:
        lm = load_model("smollm2-135m", device="cpu", progress=rec)
        verify_artifact(artifact, loaded=lm, progress=rec, **(QUICK_VERIFY if quick else {}))
    prof.disable()
    rec.close()
    prof.dump_stats(str(out / f"{part}.prof"))
    return {"part": part, "quick": quick, "wall_s": time.perf_counter() - t0, "stages": rec.stages,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "top": top_functions(prof, top)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="profile `oscar calibrate --quick`'s settings")
    ap.add_argument("--top", type=int, default=20, help="functions to list per part, by own time")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    ap.add_argument("--part", choices=("calibrate", "verify"), help=argparse.SUPPRESS)   # child process
    ap.add_argument("--artifact", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part:
        doc = run_part(args.part, args.artifact, args.quick, args.out, args.top)
        (args.out / f"{args.part}.json").write_text(json.dumps(doc, indent=2))
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    results = {"load_average_before": os.getloadavg(), "quick": args.quick, "parts": []}
    with tempfile.TemporaryDirectory(prefix="oscar-profile-") as tmp:
        for part in ("calibrate", "verify"):
            cmd = [sys.executable, __file__, "--part", part, "--artifact", str(Path(tmp) / "demo"), "--out",
                   str(args.out), "--top", str(args.top)] + (["--quick"] if args.quick else [])
            subprocess.run(cmd, check=True, env=env)
            results["parts"].append(json.loads((args.out / f"{part}.json").read_text()))
    results["load_average_after"] = os.getloadavg()
    (args.out / "profile_demo.json").write_text(json.dumps(results, indent=2))
    for p in results["parts"]:
        print(p["top"])
    for p in results["parts"]:
        print(f"\n{p['part']}{' --quick' if args.quick else ''}: {p['wall_s']:.1f} s, peak RSS {p['peak_rss_mb']:.0f} MB")
        print(f"  {'stage':<40} {'seconds':>8} {'peak RSS MB':>12}")
        for s in p["stages"]:
            print(f"  {s['stage']:<40} {s.get('seconds', float('nan')):8.1f} {s.get('peak_rss_mb', float('nan')):12.0f}")
    la = results["load_average_before"]
    print(f"\nload average before: {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}; JSON: {args.out / 'profile_demo.json'}")


if __name__ == "__main__":
    main()
