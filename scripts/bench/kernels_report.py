"""The table ``bench_kernels.py`` prints last, and its ``--ncu`` step (Nsight Compute through
``scripts/dev/ncu_kernels.py``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from harness import ROOT
from kernels_common import Ctx
from kernels_decode import OSCAR_REF_H100

NCU_SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "SchedulerStats", "InstructionStats")
NCU_SCRIPT = ROOT / "scripts" / "dev" / "ncu_kernels.py"


def run_ncu(ctx: Ctx, path: Path) -> dict | None:
    """Profile the report's ``ncu_decode``/``write_profile`` configurations under Nsight Compute
    (one call each, ``--clock-control none``) and merge the metrics and bounds into ``path``."""
    ncu = shutil.which("ncu") or next((str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/ncu"))), None)
    if ncu is None:
        ctx.log("--ncu: Nsight Compute (ncu) not found; bounds not measured")
        return None
    labels, csv_path = path.with_name("ncu_labels.json"), path.with_name("ncu.csv")
    cmd = [ncu, "--csv", "--page", "raw", "--clock-control", "none", "-k", "regex:decode|quantize|rotate_query"]
    for sec in NCU_SECTIONS:
        cmd += ["--section", sec]
    cmd += [sys.executable, str(NCU_SCRIPT), "target", "--report", str(path), "--labels", str(labels)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(csv_path, "w") as f:
        res = subprocess.run(cmd, stdout=f, stderr=subprocess.PIPE, text=True, env=env)
    if res.returncode != 0:
        ctx.log(f"--ncu: ncu exited {res.returncode}: {res.stderr.strip()[-300:]}")
        return None
    subprocess.run([sys.executable, str(NCU_SCRIPT), "merge", "--report", str(path), "--labels", str(labels),
                    "--csv", str(csv_path)], check=False, env=env)
    return json.loads(path.read_text())


def _stream_cols(r: dict, bw: float) -> str:
    """A row's in-stream figures (calls back to back in one graph; older results have none)."""
    if "int2_stream_ms" not in r:
        return ""
    sdpa = f" {r['sdpa_stream_ms'] * 1e3:>8.1f} {r['stream_speedup']:>7.2f}" if "sdpa_stream_ms" in r else ""
    return f" |            {r['int2_stream_ms'] * 1e3:>8.1f} {r['int2_stream_bytes_per_s'] / bw * 100:>5.0f}%" + sdpa


def flashinfer_lines(report: dict, bw: float) -> list[str]:
    """FlashInfer's BF16 decode beside the rows: its time, % of copy and the INT2 speed-up over
    it per shape, or the one line saying why it was not timed (results before it had neither)."""
    fi = report.get("flashinfer")
    if fi is None:
        return []
    if not fi.get("available"):
        return [f"FlashInfer BF16 decode (second baseline): not timed: {fi.get('skipped')}"]
    forms = fi["check"]["forms"]
    out = [f"FlashInfer {fi['version']} BF16 decode, paged (page {fi['page']}), second baseline, the faster form; "
           + "; ".join(f"{f} ({r['backend']}) max |diff| against SDPA {r['max_abs_diff']:.1e}" if r["ok"]
                       else f"{f} left out: {r['error']}" for f, r in forms.items()) + ":",
           f"{'ctx':>7} {'B':>3} {'FI us':>9} {'%copy':>6} {'INT2 x':>7} {'SDPA/FI':>8} | in stream: {'FI us':>8} "
           f"{'INT2 x':>7} | " + " ".join(f"{f + ' us':>17}" for f in fi["forms"])]
    for r in report["rows"]:
        if "flashinfer_ms" in r:
            out.append(f"{r['context']:>7} {r['batch']:>3} {r['flashinfer_ms'] * 1e3:>9.1f} "
                       f"{r['flashinfer_bytes_per_s'] / bw * 100:>5.0f}% {r['flashinfer_speedup']:>7.2f} "
                       f"{r['flashinfer_vs_sdpa']:>8.2f} |            {r['flashinfer_stream_ms'] * 1e3:>8.1f} "
                       f"{r['flashinfer_stream_speedup']:>7.2f} | "
                       + " ".join(f"{r[f'flashinfer_{f}_ms'] * 1e3:>17.1f}" for f in fi["forms"]))
        elif "int2_ms" in r:
            out.append(f"{r['context']:>7} {r['batch']:>3}  FlashInfer not timed: {r.get('flashinfer_skipped')}")
    return out


def table(report: dict) -> str:
    """The full run's table: decode against SDPA, paged, the batch-1 breakdown, write, sweep, bounds."""
    bw = report["copy"]["bytes_per_s"]
    s = report["settings"]
    dev = report["device_name"]
    h100 = "H100" in dev
    lines = [f"device: {dev}; copy bandwidth {bw / 1e9:.0f} GB/s (read+write); "
             f"Qwen3-8B shapes {s['shape']}; {s['bits_per_element']} bits/element; "
             f"L2 flushed by a {s.get('flush', 'write')} before each call"]
    lines.append(f"{'ctx':>7} {'B':>3} {'INT2 us':>9} {'SDPA us':>9} {'speedup':>7} {'INT2 GB/s':>9} "
                 f"{'%copy':>6} {'SDPA %copy':>10} | in stream: {'INT2 us':>8} {'%copy':>6} {'SDPA us':>8} "
                 f"{'speedup':>7}" + ("  vs OSCAR's own kernel (H100)" if h100 else ""))
    for r in report["rows"]:
        if "skipped" in r or "int2_ms" not in r:
            lines.append(f"{r['context']:>7} {r['batch']:>3}  skipped: {r.get('skipped')}")
            continue
        ref = OSCAR_REF_H100.get((r["batch"], r["context"])) if h100 else None
        lines.append(
            f"{r['context']:>7} {r['batch']:>3} {r['int2_ms'] * 1e3:>9.1f} {r['sdpa_ms'] * 1e3:>9.1f} "
            f"{r['speedup']:>7.2f} {r['int2_bytes_per_s'] / 1e9:>9.0f} {r['int2_bytes_per_s'] / bw * 100:>5.0f}% "
            f"{r['sdpa_bytes_per_s'] / bw * 100:>9.0f}%" + _stream_cols(r, bw)
            + (f"  {ref / (r['int2_ms'] * 1e3):.2f}x faster" if ref else ""))
    lines += flashinfer_lines(report, bw)
    for p in report["paged"]:
        if p.get("rounds"):
            rs = p["rounds"]
            lines.append(f"paged (page {p['page']}) ctx {p['context']} B {p['batch']}: median of {len(rs)} rounds "
                         f"{(p['median_ratio'] - 1) * 100:+.1f}% against contiguous (rounds "
                         + ", ".join(f"{(r['ratio'] - 1) * 100:+.1f}%" for r in rs)
                         + f"; last {rs[-1]['paged_ms'] * 1e3:.1f} vs {rs[-1]['contiguous_ms'] * 1e3:.1f} us)")
    if report.get("breakdown"):
        lines.append("batch 1, what each part adds (us; a graph of one trivial kernel is the floor every timed call "
                     "includes):")
        lines.append(f"{'ctx':>7} {'call':>7} {'rotation':>9} {'merge':>7} {'decode only':>12} {'rotation alone':>15} "
                     f"{'floor':>7}")
        for r in report["breakdown"]:
            us = {k[:-3]: v * 1e3 for k, v in r.items() if k.endswith("_ms")}
            lines.append(f"{r['context']:>7} {us['call']:>7.1f} {us['call'] - us['prerotated']:>+9.1f} "
                         f"{us['call'] - us['no_merge']:>+7.1f} {us['decode_only']:>12.1f} {us['rotation_only']:>15.1f} "
                         f"{us['floor']:>7.1f}")
    for w in report["write"]:
        if "ms" in w:
            lines.append(f"write {w['name']:<26} {w['tokens']} tok: {w['ms'] * 1e3:8.1f} us "
                         f"{w['bytes_per_s'] / 1e9:6.0f} GB/s {w['bytes_per_s'] / bw * 100:4.0f}% of copy")
    for r in report.get("sweep", []):
        if "int2_ms" in r:
            lines.append(f"sweep {r['context']} B={r['batch']:<3} {r['int2_ms'] * 1e3:8.1f} us {r['config']}")
    for n in report.get("ncu", []):
        m = n["metrics"]
        lines.append(f"bound {n['what']:<34} {n['kernel']:<26} {(m.get('time') or 0) / 1e3:8.1f} us  "
                     f"DRAM {m.get('dram_pct') or 0:3.0f}%  issue {m.get('issue_pct') or 0:3.0f}%  -> {m['bound']}"
                     + (f"; ALU pipe {m['alu_pipe_pct']:.0f}%, FMA {m.get('fma_pipe_pct') or 0:.0f}%, tensor "
                        f"{m.get('tensor_pipe_pct') or 0:.0f}%" if m.get("alu_pipe_pct") is not None else ""))
    lines.append(f"best decode config per batch: {report['best_config']}")
    c = report["correctness"]
    lines.append(f"correctness: write codes differing {c['write']['codes_differing']:.1e}; decode rel err "
                 + ", ".join(f"{r['rel_err']:.1e}" for r in c["decode"]))
    return "\n".join(lines)
