#!/usr/bin/env python
"""Calibration cost: capture+accumulate overhead vs a plain forward pass, and peak memory at two
token budgets.

    python scripts/bench_calibrate.py                      # SmolLM2-135M on the CPU, 8K vs 64K tokens
    python scripts/bench_calibrate.py --budgets 4096,16384 --repeats 3

What is measured (one process per budget, so peak RSS is that budget's own):
* ``plain``: forward passes over the calibration batches (``use_cache=False``), no capture.
* ``capture``: the same passes through ``collect_statistics`` (capture, float64 accumulators,
  per-batch finiteness checks), checkpointing off.
Both are timed alternately ``--repeats`` times; the medians give the overhead ratio.
Peak memory: ``ru_maxrss`` of the process (CPU) or ``torch.cuda.max_memory_allocated`` minus the
weights (GPU). Writes JSON to ``$OUT/bench_calibrate.json`` (default ./bench_out) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one_budget(model: str, tokens: int, seq_len: int, batch_size: int, repeats: int, device: str) -> dict:
    import torch

    from oscar_calib.config import CalibrationConfig
    from oscar_calib.corpus import plan_tokens
    from oscar_calib.pipeline import collect_statistics, prepare_model

    cfg = CalibrationConfig(model=model, tokens=tokens, seq_len=seq_len, batch_size=batch_size, device=device,
                            dtype="float32" if device == "cpu" else "bfloat16")
    lm = prepare_model(cfg)
    data = "embedded"
    plan = plan_tokens(lm.tokenizer, data=data, tokens=tokens, seq_len=seq_len, heldout_tokens=cfg.heldout_tokens,
                       heldout_seqs=1, seed=0)
    if plan.tokens < tokens:
        raise SystemExit(f"only {plan.tokens} tokens available")
    batches = plan.batches(batch_size)
    dev = next(lm.model.parameters()).device
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    weights = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def plain():
        with torch.no_grad():
            for b in batches:
                lm.model(input_ids=b.to(dev), use_cache=False)
        sync()

    def capture():
        collect_statistics(lm, plan, cfg)
        sync()

    plain()   # warm-up
    times = {"plain": [], "capture": []}
    for _ in range(repeats):
        for name, fn in (("plain", plain), ("capture", capture)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    # capture() includes one held-out forward of heldout_tokens; subtract its share from the ratio
    med = {k: statistics.median(v) for k, v in times.items()}
    peak = (torch.cuda.max_memory_allocated() - weights) if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"tokens": plan.tokens, "seq_len": seq_len, "batch_size": batch_size, "device": str(dev),
            "median_plain_s": med["plain"], "median_capture_s": med["capture"],
            "overhead": med["capture"] / med["plain"] - 1, "tokens_per_s_capture": plan.tokens / med["capture"],
            "peak_bytes": peak, "peak_kind": "cuda allocated beyond weights" if cuda else "process max RSS",
            "times": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budgets", default="8192,65536", help="comma-separated token budgets")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)   # child mode: one budget, JSON on stdout
    args = ap.parse_args()
    if args.one:
        res = one_budget(args.model, args.one, args.seq_len, args.batch_size, args.repeats, args.device)
        print("RESULT " + json.dumps(res))
        return
    results = []
    for b in [int(x) for x in args.budgets.split(",")]:
        cmd = [sys.executable, __file__, "--one", str(b), "--model", args.model, "--seq-len", str(args.seq_len),
               "--batch-size", str(args.batch_size), "--repeats", str(args.repeats), "--device", args.device]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.exit(f"budget {b} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(line[0][7:]))
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    lo, hi = results[0]["peak_bytes"], results[-1]["peak_bytes"]
    doc = {"model": args.model, "results": results, "memory_growth": hi / lo - 1}
    (out / "bench_calibrate.json").write_text(json.dumps(doc, indent=2))
    print(f"\n{'tokens':>8} {'plain s':>9} {'capture s':>10} {'overhead':>9} {'tok/s':>8} {'peak MiB':>9}")
    for r in results:
        print(f"{r['tokens']:>8} {r['median_plain_s']:>9.2f} {r['median_capture_s']:>10.2f} {r['overhead']:>8.1%} "
              f"{r['tokens_per_s_capture']:>8.0f} {r['peak_bytes'] / 2**20:>9.0f}")
    print(f"peak memory growth {results[0]['tokens']} -> {results[-1]['tokens']} tokens: {doc['memory_growth']:+.1%} "
          f"({results[0]['peak_kind']})")


if __name__ == "__main__":
    main()
