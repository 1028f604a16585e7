#!/usr/bin/env python
"""Check and time the INT2 KV-cache kernels in one run; write a JSON; print a table.

On the GPU (default), in this order:

1. device facts and the measured device-to-device copy bandwidth (bytes read + written);
2. correctness at one Qwen3-8B-shaped case: write kernel (code agreement with the reference)
   and every decode variant (relative error against the float32 reference), before any timing;
3. decode attention at 8K/32K/64K/128K context, batch 1 and 32, Qwen3-8B shapes (32 query heads,
   8 KV heads, head_dim 128, G=128, 64 sink + 256 recent BF16 tokens): INT2 kernel against BF16
   ``torch.nn.functional.scaled_dot_product_attention`` at the same context (GQA through
   ``enable_gqa``, and with the GQA group folded into 4 query rows per KV head; the faster
   counts) and FlashInfer's BF16 decode on a paged cache (``kernels_flashinfer.py``: checked
   against SDPA first; where it does not import or run, the result and the table say why in one
   line). A variant sweep runs first at the longest context per batch size (the library
   default, the first tuning with and without prefetch, register cap, PDL, tiles, stages,
   programs per SM); the best variant per batch size (the library default unless another is
   more than 3% faster) is then timed everywhere, plus the paged layout at two sizes (the median
   of 3 alternating rounds); at batch 1, what each part adds to a call (the call timed with the
   query rotation left out, the merge left out, both; the rotation kernel alone; a graph of one
   trivial kernel, the floor of every timed call); a profiler breakdown per kernel (rotation,
   decode, merge: their own durations, which overlap under PDL) follows; on an H100 the table
   also compares with the timings OSCAR's authors give for their own kernel;
4. write-kernel throughput (rotate + clip + quantise + pack) on 128K tokens x 8 heads, general
   and plane-wise kernels. The clip ratios are the bundled zoo's (the 8 heads take the octile
   midpoints of its K and V ratios: 0.88-0.95), since the clip selection's cost grows with the
   number of values above the clip; "rot+clip 0.96" times one ratio for every head.

Each kernel's bound (memory / instruction issue / latency) comes from Nsight Compute through
``scripts/dev/ncu_kernels.py``, which reads this script's JSON (``ncu_decode``, ``write_profile``);
``--ncu`` runs it at the end of the same run and adds a ``bound`` line per kernel to the table.

Timing (``harness.graph_ms``): medians of CUDA-graph replays (so host launch overhead stays out,
as in a serving engine's decode step) with L2 flushed before every call, inputs random (never
zeros), and when a working set is under 3x L2 the timed calls rotate through several copies of
it. Achieved bandwidth counts the cache bytes each kernel must read. The default flush
(``triton.testing.do_bench``) zeroes 256 MB, so the timed call starts with L2 full of dirty lines
and writes up to 50 MB back while it reads; that weighs more on a call that reads 76 MB (INT2,
128K x 1) than on one that reads 537 MB (BF16). ``--flush read`` sums the buffer instead, leaving
L2 clean, as after the weight GEMM that precedes attention in a decode step; the JSON records it.

Sweeps instead of the whole run: ``--variants JSON`` times decode configs at every context and
batch (``sweep.json``); ``--write-variants JSON`` checks write-kernel configs against the reference
(Qwen-like rows plus degenerate ones: equal after the clip, zero, a few ulps apart) and times
those that pass, with rotation and clip unless an entry says ``"rotation": false`` or ``"clip":
false`` (``"clip_ratio"``: a number, or one per head, instead of the zoo's), in alternating rounds
(``write_sweep.json``; with ``--ncu`` each one's instructions, issue rate and pipe use), e.g.
``--write-variants '[{}, {"check_thresholds": true}]'``.

``--quick`` runs tiny shapes under the Triton interpreter on the CPU (a smoke test of the script).
Usage: ``python scripts/bench/bench_kernels.py [--quick] [--ncu] [--out DIR] [--save]
[--variants JSON | --write-variants JSON]``. The parts: ``kernels_decode.py``,
``kernels_write.py``, ``kernels_sweep.py``, ``kernels_report.py``, ``kernels_flashinfer.py`` (beside this
file).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # imported rather than run (the tests)
    sys.path.append(str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    Clock,
    add_output_args,
    describe_device,
    new_result,
    out_dir,
    quick_interpreter,
    run_program,
    write_result,
)

NO_GPU = ("error: no CUDA device here; the benchmark needs a GPU (--quick runs a CPU smoke test under the Triton "
          "interpreter)")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run (tiny shapes, Triton interpreter)")
    add_output_args(ap)
    ap.add_argument("--contexts", default=None,
                    help="comma-separated context lengths (default 8192,32768,65536,131072; --quick: 88,152)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,32; --quick: 1)")
    ap.add_argument("--no-sweep", action="store_true", help="time the default decode variant only")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new timings after this")
    ap.add_argument("--variants", default=None, metavar="JSON",
                    help="sweep only: time these decode configs (a JSON list of config dicts, or a file holding "
                         "one) at every context x batch, no SDPA, no write kernel; writes sweep.json. Keys for the "
                         "benchmark only: \"bench_prerotated\": true times the call with the query given rotated, "
                         "\"bench_paged\": N on a paged cache of N-token pages (shuffled)")
    ap.add_argument("--write-variants", default=None, metavar="JSON",
                    help="write kernel only: check these write configs (a JSON list of config dicts, or a file "
                         "holding one) against the reference, then time each with rotation and clip on 128K "
                         "tokens x 8 heads in alternating rounds (an entry's \"rotation\": false / \"clip\": "
                         "false times it without them); writes write_sweep.json")
    ap.add_argument("--flush", choices=["write", "read"], default="write",
                    help="how L2 is emptied before each timed call: write (triton's do_bench: zeroing a "
                         "256 MB buffer, which leaves L2 full of dirty lines that the timed call writes "
                         "back) or read (summing one, which leaves it clean, as after a weight GEMM)")
    ap.add_argument("--ncu", action="store_true",
                    help="afterwards run each profiled kernel once under Nsight Compute (scripts/dev/ncu_kernels.py) "
                         "and add its metrics and bound (memory / instruction issue / latency) to the JSON and table")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from kernels_common import Ctx, int_list, parse_variants  # (imports torch)

    write_cfgs = variants = None
    if args.variants is not None:  # bad input is refused before any work
        variants = parse_variants(args.variants)
    if args.write_variants is not None:
        write_cfgs = parse_variants(args.write_variants, "--write-variants")
    contexts = int_list(args.contexts, "--contexts") or ([88, 152] if args.quick else [8192, 32768, 65536, 131072])
    batches = int_list(args.batches, "--batches") or ([1] if args.quick else [1, 32])
    if args.save and (args.quick or variants is not None or write_cfgs is not None):
        raise SystemExit("error: --save accepts a full GPU run only (not --quick, --variants or --write-variants)")
    import torch

    if args.quick:
        quick_interpreter()
    elif not torch.cuda.is_available():
        raise SystemExit(NO_GPU)
    from kernels_common import QUICK_SHAPE, QWEN
    from kernels_report import run_ncu, table

    from oscar_calib.kernels import bits_per_element

    ctx = Ctx(args, describe_device(cuda=not args.quick), Clock(None if args.quick else args.budget_s),
              quick=args.quick, variants=variants or [])
    shape = dict(QUICK_SHAPE if args.quick else QWEN)
    settings = {"shape": shape, "sink": ctx.sink, "recent": ctx.recent,
                "bits_per_element": bits_per_element(shape["group_size"]),
                "quick": args.quick, "flush": args.flush, "contexts": contexts, "batches": batches,
                "no_sweep": args.no_sweep}
    report = new_result("kernels", ctx.device, script=__file__, argv=argv, settings=settings)
    folder = out_dir(args)
    ctx.log(f"device: {ctx.device.facts()}")
    report["copy"] = copy_bandwidth(ctx)
    bw = report["copy"]["bytes_per_s"]
    ctx.log(f"copy bandwidth: {bw / 1e9:.0f} GB/s")
    if write_cfgs is not None:
        from kernels_sweep import print_write_sweep, sweep_write

        sweep_write(ctx, report, shape, write_cfgs)
        report["elapsed_s"] = ctx.clock.elapsed()
        path = write_result(report, save=False, out=folder, name="write_sweep.json")
        if args.ncu and ctx.cuda:
            report = run_ncu(ctx, path) or report
        print_write_sweep(ctx, report, bw)
        return 0
    if variants is not None:
        from kernels_sweep import print_sweep, sweep_variants

        sweep_variants(ctx, report, shape, contexts, batches, bw)
        report["elapsed_s"] = ctx.clock.elapsed()
        write_result(report, save=False, out=folder, name="sweep.json")
        print_sweep(report, contexts, batches)
        return 0
    full_run(ctx, report, shape, contexts, batches, bw)
    path = write_result(report, save=False, out=folder)
    if args.ncu and ctx.cuda:
        report = run_ncu(ctx, path) or report
    if args.save:
        print(f"current result: {write_result(report, save=True, out=folder)}")
    print(table(report))
    return 0


def copy_bandwidth(ctx) -> dict:
    """Device-to-device copy of 1 GiB (16 MiB on the CPU), bytes read + written per second."""
    import torch
    from harness import bench_ms

    n = (1 << 28) if ctx.cuda else (1 << 22)
    x = torch.randn(n, device=ctx.dev)
    y = torch.empty_like(x)
    ms = bench_ms([lambda: y.copy_(x)], cuda=ctx.cuda, flush=ctx.args.flush)
    return {"bytes_moved": 2 * n * 4, "ms": ms, "bytes_per_s": 2 * x.numel() * 4 / (ms * 1e-3)}


def setup_flashinfer(ctx, shape: dict) -> dict:
    """FlashInfer's BF16 decode, the second baseline: importable here? agrees with SDPA? Sets
    ``ctx.flashinfer`` (the module, or why not) and returns what the result file records."""
    from kernels_flashinfer import PAGE, check_flashinfer, flashinfer_status

    ctx.flashinfer = flashinfer_status(cuda=ctx.cuda)
    check = check_flashinfer(ctx, shape, ctx.flashinfer)
    if "skipped" in check:
        ctx.flashinfer = {"available": False, "skipped": check["skipped"]}
    else:
        ctx.flashinfer["forms"] = check["ok_forms"]
    rec = {"page": PAGE, "check": check} if ctx.flashinfer["available"] else {}
    rec.update({k: v for k, v in ctx.flashinfer.items() if k != "module"})
    for form, r in check.get("forms", {}).items():
        ctx.log(f"FlashInfer {check['version']} {form} (page {PAGE}): " + (
            f"{r['backend']}, max |diff| against SDPA {r['max_abs_diff']:.2e}, first call (build or load) "
            f"{r['first_call_s']:.1f} s" if r["ok"] else f"left out: {r['error']}"))
    if not ctx.flashinfer["available"]:
        ctx.log(f"FlashInfer baseline not timed: {rec['skipped']}")
    return rec


def full_run(ctx, report: dict, shape: dict, contexts: list[int], batches: list[int], bw: float) -> None:
    """Correctness, the sweep, every shape against SDPA, paged, the breakdown, the profile, the write."""
    from kernels_decode import (
        FIRST_TUNING,
        breakdown_decode,
        check_correctness,
        decode_variants,
        profile_decode,
        small_regime,
        sweep_best,
        time_paged,
        time_shapes,
    )
    from kernels_write import time_write, write_profile

    variants = decode_variants(ctx)
    report["correctness"] = check_correctness(ctx, shape, variants)
    report["flashinfer"] = setup_flashinfer(ctx, shape)
    ok_variants = [v for v, r in zip(variants, report["correctness"]["decode"]) if r["ok"]]
    if not ok_variants:
        ctx.log("no decode variant passed the correctness check; timing the default anyway")
        ok_variants = variants[:1]
    best = sweep_best(ctx, shape, batches, max(contexts), ok_variants, bw, report)
    report["best_config"] = {str(b): c for b, c in best.items()}
    report["ncu_decode"] = []
    for b in batches:
        for name, cfg in (("first tuning", FIRST_TUNING["small" if small_regime(b, shape["kv_heads"]) else "large"]),
                          ("default", {}), ("best", best[b])):
            if not any(e["batch"] == b and e["config"] == cfg for e in report["ncu_decode"]):
                report["ncu_decode"].append({"batch": b, "name": name, "config": cfg})
    report["rows"] = time_shapes(ctx, shape, contexts, batches, best)
    report["paged"] = time_paged(ctx, shape, contexts, batches, best)
    bd_contexts = list(dict.fromkeys([512] + contexts[:2] + contexts[-1:])) if ctx.cuda else contexts[:1]
    report["breakdown"] = breakdown_decode(ctx, shape, bd_contexts) if 1 in batches else []
    report["profile"] = profile_decode(ctx, shape, best) if ctx.cuda else {}
    report["write"] = time_write(ctx, shape)
    report["write_profile"] = write_profile(ctx, report["write"], shape["kv_heads"])
    report["elapsed_s"] = ctx.clock.elapsed()


if __name__ == "__main__":
    run_program(main)
