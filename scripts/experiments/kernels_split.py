#!/usr/bin/env python
"""Decode kernel with keys and values in groups of different sizes, against the uniform cache, in one run.

The decode kernel's value loop takes its own group size, plane width and parameter strides when a
cache stores K and V in groups of different sizes (``Int2KVCache.v_group_size``); where they are
equal it compiles to the code it always did (the same SASS instruction for instruction:
``scripts/dev/kernel_sass.py`` on this tree and on a copy of the previous kernel). This benchmark
measures both claims on the GPU:

1. correctness: every timed cache form against ``decode_attention_reference`` at a small shape;
2. uniform ``G = 128`` at Qwen3-8B shapes (32 query / 8 KV heads, head_dim 128, 64 + 256 BF16
   window), 32K and 128K context, batch 1 and 32: this tree's kernel against the previous one
   (``--baseline DIR``: a directory holding that version's ``decode.py`` and ``_decode_triton.py``,
   e.g. ``git show REV:oscar_calib/kernels/decode.py``), alternating in ``--rounds`` rounds (the
   median ratio counts; the target is within 3%);
3. the split forms at the same shapes: K 32 / V 128 (2.625 bits per element), with uniform 64
   (2.5) and 32 (3.0) beside it; and Gemma-3-270M-like heads (4 query / 1 KV head, head_dim 256)
   at 32K: uniform 256 and 64, K 32 / V 256 (2.5625 bits), batch 1 and 32.

Timing: CUDA-graph replays timed by ``triton.testing.do_bench`` (median; it flushes L2 before every
call), random caches (``kernels.testing.random_int2_cache``), several copies of a working set under
3x L2. Writes ``kernels_split-{device}.json`` under ``--out`` (device, commit, date, command,
library versions) and prints a table. ``--quick``: tiny shapes under the Triton interpreter on the
CPU (a smoke test of the script).

Usage: ``python scripts/experiments/kernels_split.py [--baseline DIR] [--out DIR] [--quick]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, default=None,
                    help="directory with the previous kernel's decode.py and _decode_triton.py (uniform G=128 "
                         "timed against it)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="output folder (default $OUT)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the uniform comparison")
    ap.add_argument("--budget-s", type=float, default=200.0, help="start no new timing after this many seconds")
    ap.add_argument("--correction", action="store_true",
                    help="only time the logit-noise correction: Qwen3-8B shapes, G 128 and K 32 / V 128, with and "
                         "without it, alternating (--rounds)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run (tiny shapes, Triton interpreter)")
    return ap.parse_args(argv)


ARGS = parse_args()
if ARGS.quick:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
from harness import capture_graph, describe_device, git_commit, versions  # noqa: E402

from oscar_calib.kernels import (  # noqa: E402
    bits_per_element,
    decode_attention,
    decode_attention_reference,
)
from oscar_calib.kernels.testing import (  # noqa: E402
    random_int2_cache,
    random_rotation,
    relative_error,
)

GPU = torch.cuda.is_available() and not ARGS.quick
DEV = "cuda" if GPU else "cpu"
T0 = time.time()
SINK, RECENT = (64, 256) if GPU else (4, 8)
QWEN = {"name": "qwen3-8b", "q_heads": 32, "kv_heads": 8, "head_dim": 128}
GEMMA = {"name": "gemma3-270m", "q_heads": 4, "kv_heads": 1, "head_dim": 256}
if ARGS.quick:
    QWEN = {"name": "tiny-d128", "q_heads": 4, "kv_heads": 2, "head_dim": 128}
    GEMMA = {"name": "tiny-d256", "q_heads": 4, "kv_heads": 1, "head_dim": 256}
LOG: list[str] = []


def log(msg: str) -> None:
    line = f"[{time.time() - T0:6.1f}s] {msg}"
    LOG.append(line)
    print(line, flush=True)


def load_baseline(path: Path):
    """The previous ``decode`` module, its Triton kernels loaded from the same directory."""
    for name in ("decode.py", "_decode_triton.py"):
        if not (path / name).is_file():
            sys.exit(f"error: --baseline {path}: no {name} there")
    spec = importlib.util.spec_from_file_location("oscar_calib.kernels._baseline_decode_triton",
                                                  path / "_decode_triton.py")
    tri = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tri)
    spec = importlib.util.spec_from_file_location("oscar_calib.kernels._baseline_decode", path / "decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.load_triton_module = lambda name: tri
    return mod


def graph_ms(fns: list) -> float:
    """Median time of one call, CUDA-graph replays rotating through ``fns`` (one per input copy)."""
    for f in fns:
        f()
    if not GPU:
        t = time.perf_counter()
        fns[0]()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    torch.cuda.synchronize()
    graphs = [capture_graph(f) for f in fns]
    i = [0]

    def step():
        graphs[i[0] % len(graphs)].replay()
        i[0] += 1

    return float(triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median"))


def l2_bytes() -> int:
    if not GPU:
        return 4 << 20
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))


def cache_bytes(batch, shape, gk, gv, hist, window) -> int:
    h, d = shape["kv_heads"], shape["head_dim"]
    per_tok = 2 * (d // 4) + 4 * (d // gk + d // gv)
    return batch * h * (hist * per_tok + window * 2 * d * 2)


def time_form(shape, ctx, batch, gk, gv, decode=decode_attention, corr: float = 0.0) -> dict:
    h, qh, d = shape["kv_heads"], shape["q_heads"], shape["head_dim"]
    window = min(ctx, SINK + RECENT)
    hist = ctx - window
    nbytes = cache_bytes(batch, shape, gk, gv, hist, window)
    copies = 1 if not GPU or nbytes >= 3 * l2_bytes() else min(16, math.ceil(3 * l2_bytes() / nbytes))
    q = torch.randn(batch, qh, d, device=DEV).to(torch.bfloat16)
    rk = random_rotation(h, d, device=DEV)
    caches = [random_int2_cache(batch, h, d, gk, hist, window, device=DEV, v_group_size=gv) for _ in range(copies)]
    out = torch.empty(batch, qh, d, device=DEV, dtype=torch.bfloat16)
    extra = {"logit_correction": corr} if corr else {}
    fns = [lambda c=c: decode(q, c, k_rotation=rk, backend="triton", out=out, check_lengths=False, **extra)
           for c in caches]
    ms = graph_ms(fns)
    del caches
    if GPU:
        torch.cuda.empty_cache()
    return {"shape": shape["name"], "context": ctx, "batch": batch, "k_group": gk, "v_group": gv,
            "bits_per_element": (bits_per_element(gk) + bits_per_element(gv)) / 2, "us": ms * 1e3,
            "bytes": nbytes, "bytes_per_s": nbytes / (ms * 1e-3), "copies": copies,
            **({"logit_correction": corr} if corr else {})}


def check(shape, gk, gv, decode=decode_attention, corr: float = 0.0) -> float:
    """Relative error of the kernel against the reference on a small cache of this form."""
    h, qh, d = shape["kv_heads"], shape["q_heads"], shape["head_dim"]
    gen = torch.Generator().manual_seed(gk * 7 + gv)
    cache = random_int2_cache(2, h, d, gk, 200 if GPU else 40, SINK + RECENT, device=DEV, generator=None,
                              v_group_size=gv)
    q = torch.randn(2, qh, d, generator=gen).to(DEV)
    rk = random_rotation(h, d, generator=gen, device=DEV)
    extra = {"logit_correction": corr} if corr else {}
    got = decode(q, cache, k_rotation=rk, backend="triton", out_dtype=torch.float32, **extra)
    want = decode_attention_reference(q, cache, k_rotation=rk, out_dtype=torch.float32, **extra)
    return relative_error(got, want)


def alternating(time_a, time_b, names: tuple[str, str]) -> tuple[list[dict], float]:
    """``--rounds`` rounds of ``time_a()`` then ``time_b()`` (µs each): every round's pair under
    ``names`` with its ratio b / a, and the median ratio."""
    rounds = []
    for _ in range(ARGS.rounds if GPU else 1):
        a, b = time_a(), time_b()
        rounds.append({names[0]: a, names[1]: b, "ratio": b / a})
    return rounds, statistics.median(r["ratio"] for r in rounds)


def over_budget() -> bool:
    return time.time() - T0 > ARGS.budget_s


def main() -> None:
    base = load_baseline(ARGS.baseline) if ARGS.baseline else None
    contexts = [32768, 131072] if GPU else [400]
    batches = [1, 32] if GPU else [1, 2]
    report = {"benchmark": "kernels_split", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": "python scripts/experiments/kernels_split.py " + " ".join(sys.argv[1:]),
              "commit": git_commit(), "device": dataclasses.asdict(describe_device(cuda=GPU)), "versions": versions(),
              "sink": SINK, "recent": RECENT,
              "baseline": str(ARGS.baseline) if ARGS.baseline else None, "checks": [], "uniform_vs_baseline": [],
              "forms": []}
    if ARGS.correction:
        return correction_run(report, contexts, batches)
    qwen_forms = [(128, 128), (32, 128), (64, 64), (32, 32)]
    gemma_forms = [(256, 256), (32, 256), (64, 64)]
    for shape, forms in ((QWEN, qwen_forms), (GEMMA, gemma_forms)):
        for gk, gv in forms:
            err = check(shape, gk, gv)
            report["checks"].append({"shape": shape["name"], "k_group": gk, "v_group": gv, "rel_err": err,
                                     "ok": err < 3e-3})
            log(f"check {shape['name']} K {gk} / V {gv}: rel err {err:.2e}")
        if base is not None and shape is QWEN:
            err = check(shape, 128, 128, base.decode_attention)
            report["checks"].append({"shape": shape["name"], "k_group": 128, "v_group": 128, "rel_err": err,
                                     "ok": err < 3e-3, "kernel": "baseline"})
            log(f"check baseline {shape['name']} G 128: rel err {err:.2e}")
    # uniform G = 128: this tree against the previous kernel, alternating
    if base is not None:
        for batch in batches:
            for ctx in contexts:
                if over_budget():
                    break
                rounds, med = alternating(lambda: time_form(QWEN, ctx, batch, 128, 128, base.decode_attention)["us"],
                                          lambda: time_form(QWEN, ctx, batch, 128, 128)["us"],
                                          ("baseline_us", "this_us"))
                report["uniform_vs_baseline"].append({"context": ctx, "batch": batch, "rounds": rounds,
                                                      "median_ratio": med})
                log(f"uniform G=128 ctx={ctx} B={batch}: this/baseline {med:.4f} ("
                    + ", ".join(f"{r['this_us']:.1f}/{r['baseline_us']:.1f} us" for r in rounds) + ")")
    for shape, forms, ctxs in ((QWEN, qwen_forms, contexts), (GEMMA, gemma_forms, contexts[:1])):
        for batch in batches:
            for ctx in ctxs:
                for gk, gv in forms:
                    if over_budget():
                        report["forms"].append({"shape": shape["name"], "context": ctx, "batch": batch,
                                                "k_group": gk, "v_group": gv, "skipped": "time budget"})
                        continue
                    row = time_form(shape, ctx, batch, gk, gv)
                    report["forms"].append(row)
                    log(f"{shape['name']} ctx={ctx} B={batch} K {gk} / V {gv} ({row['bits_per_element']:.4g} bits): "
                        f"{row['us']:.1f} us, {row['bytes_per_s'] / 1e9:.0f} GB/s")
    write(report, "kernels_split")


def correction_run(report: dict, contexts: list[int], batches: list[int]) -> None:
    """The decode kernel with the logit-noise correction (gain 1) against without, alternating."""
    report.update(benchmark="kernels_correction", correction=[])
    for gk, gv in ((128, 128), (32, 128)):
        err = check(QWEN, gk, gv, corr=1.0)
        report["checks"].append({"shape": QWEN["name"], "k_group": gk, "v_group": gv, "logit_correction": 1.0,
                                 "rel_err": err, "ok": err < 3e-3})
        log(f"check {QWEN['name']} K {gk} / V {gv} corrected: rel err {err:.2e}")
        for batch in batches:
            for ctx in contexts:
                if over_budget():
                    break
                rounds, med = alternating(lambda: time_form(QWEN, ctx, batch, gk, gv)["us"],
                                          lambda: time_form(QWEN, ctx, batch, gk, gv, corr=1.0)["us"],
                                          ("plain_us", "corrected_us"))
                report["correction"].append({"k_group": gk, "v_group": gv, "context": ctx, "batch": batch,
                                             "rounds": rounds, "median_ratio": med})
                log(f"K {gk} / V {gv} ctx={ctx} B={batch}: corrected/plain {med:.4f} ("
                    + ", ".join(f"{r['corrected_us']:.1f}/{r['plain_us']:.1f} us" for r in rounds) + ")")
    write(report, "kernels_correction")


def write(report: dict, name: str) -> None:
    report["elapsed_s"] = time.time() - T0
    report["log"] = LOG
    out = Path(ARGS.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{report['device']['slug']}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"written: {path}")


def table(report: dict) -> str:
    lines = ["| shape | context | batch | K / V group | bits/elem | us | GB/s |", "|---|---|---|---|---|---|---|"]
    for r in report["forms"]:
        if "us" in r:
            lines.append(f"| {r['shape']} | {r['context']} | {r['batch']} | {r['k_group']} / {r['v_group']} | "
                         f"{r['bits_per_element']:.4g} | {r['us']:.1f} | {r['bytes_per_s'] / 1e9:.0f} |")
    for r in report["uniform_vs_baseline"]:
        lines.append(f"uniform G=128 {r['context']} x {r['batch']}: this kernel / previous = {r['median_ratio']:.4f}")
    for r in report.get("correction", []):
        lines.append(f"K {r['k_group']} / V {r['v_group']} {r['context']} x {r['batch']}: with the logit-noise "
                     f"correction / without = {r['median_ratio']:.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
