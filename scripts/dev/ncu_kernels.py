#!/usr/bin/env python
"""What bounds each INT2 kernel: run them under Nsight Compute and classify the result.

Two steps, on the GPU machine, after ``scripts/bench/bench_kernels.py`` has written its report:

1. ``ncu --csv --page raw --clock-control none -k regex:'decode|quantize|rotate_query' \\
   --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
   --section SchedulerStats --section InstructionStats \\
   python scripts/dev/ncu_kernels.py target --report R.json --labels L.json > ncu.csv``
   runs one decode call per configuration the report lists under ``ncu_decode`` (128K context;
   the first tuning, the library default and the sweep's best per batch) and one write call
   per configuration under ``write_profile``; ``L.json`` lists the kernels launched, in launch order;
2. ``python scripts/dev/ncu_kernels.py merge --report R.json --labels L.json --csv ncu.csv`` adds
   per-kernel metrics and a bound to the report and prints them.

Bound: *memory* when DRAM throughput is at least 70% of its peak; *instruction issue* when the
schedulers issue on at least 70% of active cycles; otherwise *latency*, named by the stall
reason that costs most cycles per issued instruction (``long_scoreboard``: waits for global
memory; ``short_scoreboard``: shared memory and special functions; ``barrier``; ``wait``: fixed
latency dependencies; ``math_pipe_throttle``: a busy unit, e.g. the tensor cores).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

if str(Path(__file__).resolve().parents[1] / "bench") not in sys.path:  # bench_kernels' parts, the harness
    sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))

from kernels_common import int2_bytes  # noqa: E402

DRAM = "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"
ISSUE = ("smsp__issue_active.avg.pct_of_peak_sustained_active", "sm__inst_issued.avg.pct_of_peak_sustained_active")
KEEP = {
    "gpu__time_duration.sum": "time",
    DRAM: "dram_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_pct",
    "launch__registers_per_thread": "registers",
    "launch__occupancy_limit_registers": "blocks_per_sm_by_registers",
    "smsp__inst_executed.sum": "warp_instructions",
    "launch__grid_size": "grid",
    # busy fraction of the execution pipes: ALU (compares, min/max, selects, integer logic; 64 lanes
    # per SM per cycle), FMA (fp32 add/multiply, IMAD; 128), tensor (the rotation products)
    "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_elapsed": "alu_pipe_pct",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_elapsed": "fma_pipe_pct",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed": "tensor_pipe_pct",
}


def target(args) -> None:
    import torch

    from oscar_calib.kernels import QuantizedKV, decode_attention, quantize_kv
    from oscar_calib.kernels import write as write_mod
    from oscar_calib.kernels.testing import random_int2_cache, random_rotation

    rep = json.loads(Path(args.report).read_text())
    settings = rep["settings"]
    shp = settings["shape"]
    h, qh, d, g = shp["kv_heads"], shp["q_heads"], shp["head_dim"], shp["group_size"]
    sink, recent = settings["sink"], settings["recent"]
    labels = []
    by_batch: dict[int, list] = {}
    for e in rep.get("ncu_decode", []):
        by_batch.setdefault(int(e["batch"]), []).append(e)
    for batch, entries in by_batch.items():
        cache = random_int2_cache(batch, h, d, g, 131072 - sink - recent, sink + recent, device="cuda")
        q = torch.randn(batch, qh, d, device="cuda").to(torch.bfloat16)
        rk = random_rotation(h, d, device="cuda")
        for e in entries:
            decode_attention(q, cache, k_rotation=rk, backend="triton", check_lengths=False, config=e["config"])
            torch.cuda.synchronize()
            names = ["rotate_query_kernel", "decode_kernel", "decode_merge_kernel"]
            labels += [{"kernel": k, "what": f"decode 128K B={batch} {e['name']}", "config": e["config"],
                        "bytes": int2_bytes(batch, h, d, g, 131072 - sink - recent, sink + recent)
                        if k == "decode_kernel" else None} for k in names]
        del cache
        torch.cuda.empty_cache()
    t = 131072
    x = torch.randn(t, h, d, device="cuda").to(torch.bfloat16)
    rk = random_rotation(h, d, device="cuda")
    clip = torch.full((h,), 0.92, device="cuda")  # (entries carry their own "clip_ratio")
    out = QuantizedKV(torch.empty(t, h, d // 4, dtype=torch.uint8, device="cuda"),
                      torch.empty(t, h, d // g, dtype=torch.float16, device="cuda"),
                      torch.empty(t, h, d // g, dtype=torch.float16, device="cuda"), g)
    nbytes = x.numel() * 2 + out.codes.numel() + 2 * out.scale.numel() * 2
    for w in rep.get("write_profile", []):
        cl = clip
        if "clip_ratio" in w:  # a number, or one per KV head
            r = w["clip_ratio"]
            cl = torch.tensor(r if isinstance(r, list) else [r] * h, dtype=clip.dtype, device="cuda")
        quantize_kv(x, rk if w["rot"] else None, cl if w["clip"] else None, g, backend="triton", out=out,
                    config=w["config"])
        torch.cuda.synchronize()
        kern = getattr(write_mod.LAST_LAUNCH.get("write"), "name", None) or "quantize_kv"
        labels.append({"kernel": kern, "what": f"write {w['name']}", "config": w["config"], "bytes": nbytes})
    Path(args.labels).write_text(json.dumps(labels, indent=1))


def _rows(csv_path: str) -> tuple[list[dict], dict]:
    """Data rows and the units row of ncu's raw CSV page."""
    lines = [ln for ln in Path(csv_path).read_text(errors="replace").splitlines() if ln.startswith('"')]
    if not lines:
        return [], {}
    rows = list(csv.DictReader(lines))
    units = next((r for r in rows if not r.get("ID", "").strip().isdigit()), {})
    return [r for r in rows if r.get("ID", "").strip().isdigit()], units


TIME_SCALE = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9}


def _num(v):
    try:
        return float(str(v).replace(",", ""))
    except (TypeError, ValueError):
        return None


def classify(m: dict) -> str:
    dram = m.get("dram_pct")
    issue = m.get("issue_pct")
    if dram is not None and dram >= 70:
        return "memory"
    if issue is not None and issue >= 70:
        return "instruction issue"
    stalls = m.get("stalls") or {}
    if stalls:
        top = max(stalls, key=stalls.get)
        return f"latency ({top})"
    return "latency"


def merge(args) -> None:
    rep_path = Path(args.report)
    rep = json.loads(rep_path.read_text())
    labels = json.loads(Path(args.labels).read_text())
    rows, units = _rows(args.csv)
    tscale = TIME_SCALE.get(str(units.get("gpu__time_duration.sum", "nsecond")).strip(), 1.0)
    out = []
    li = 0
    for r in rows:
        name = r.get("Kernel Name", "")
        while li < len(labels) and labels[li]["kernel"] not in name:
            li += 1  # a launch ncu did not profile
        if li >= len(labels):
            break
        lab = labels[li]
        li += 1
        m = {v: _num(r.get(k)) for k, v in KEEP.items() if k in r}
        if m.get("time") is not None:
            m["time"] *= tscale  # ns
        if m.get("issue_pct") is None:
            for k in ISSUE:
                if k in r:
                    m["issue_pct"] = _num(r[k])
        m["stalls"] = {k.split("issue_stalled_")[1].split("_per_issue_active")[0]: _num(v)
                       for k, v in r.items() if "issue_stalled_" in k and "per_issue_active.ratio" in k
                       and _num(v)}
        if m.get("time") and lab.get("bytes"):
            m["achieved_GBps_at_ncu_clock"] = lab["bytes"] / (m["time"] * 1e-9) / 1e9
        m["bound"] = classify(m)
        out.append({**lab, "metrics": m})
    rep["ncu"] = out
    from oscar_calib.fsutil import atomic_write_text

    atomic_write_text(rep_path, json.dumps(rep, indent=1, default=str) + "\n")
    print("kernel bounds (Nsight Compute, one call each):")
    for o in out:
        m = o["metrics"]
        top = sorted(m["stalls"].items(), key=lambda kv: -kv[1])[:3]
        print(f"  {o['what']:<34} {o['kernel']:<26} {m.get('time') or 0:>9.0f} ns  DRAM {m.get('dram_pct') or 0:4.0f}%  "
              f"issue {m.get('issue_pct') or 0:4.0f}%  occ {m.get('occupancy_pct') or 0:4.0f}%  "
              f"regs {m.get('registers') or 0:.0f}  -> {m['bound']}; top stalls "
              + ", ".join(f"{k} {v:.1f}" for k, v in top) + _pipes(m))


def _pipes(m: dict) -> str:
    """``; pipes ALU a% FMA f% tensor t%`` where Nsight Compute reported them."""
    have = [(n, m.get(k)) for n, k in (("ALU", "alu_pipe_pct"), ("FMA", "fma_pipe_pct"), ("tensor", "tensor_pipe_pct"))
            if m.get(k) is not None]
    return ("; pipes " + " ".join(f"{n} {v:.0f}%" for n, v in have)) if have else ""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("target")
    t.add_argument("--report", required=True)
    t.add_argument("--labels", required=True)
    mg = sub.add_parser("merge")
    mg.add_argument("--report", required=True)
    mg.add_argument("--labels", required=True)
    mg.add_argument("--csv", required=True)
    args = ap.parse_args(argv)
    target(args) if args.cmd == "target" else merge(args)


if __name__ == "__main__":
    main()
