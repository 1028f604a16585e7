#!/usr/bin/env python
"""Check and time the INT2 KV-cache kernels in one run; write a JSON under $OUT; print a table.

On the GPU (default), in this order:

1. device facts and the measured device-to-device copy bandwidth (bytes read + written);
2. correctness at one Qwen3-8B-shaped case: write kernel (code agreement with the reference)
   and every decode variant (relative error against the float32 reference), before any timing;
3. decode attention at 8K/32K/64K/128K context, batch 1 and 32, Qwen3-8B shapes (32 query heads,
   8 KV heads, head_dim 128, G=128, 64 sink + 256 recent BF16 tokens): INT2 kernel against BF16
   ``torch.nn.functional.scaled_dot_product_attention`` (GQA through ``enable_gqa``, and with
   the GQA group folded into 4 query rows per KV head; the faster counts). A variant sweep runs
   first at 128K per batch size (the library default, the round-1 tuning, register cap, PDL,
   tiles, stages, programs per SM, KV heads per program); the best variant per batch size (the
   library default unless another is more than 3% faster) is then timed everywhere, plus the
   paged layout at two sizes (the median of 3 alternating rounds); at batch 1, what each part
   adds to a call (the call timed with the query rotation left out, the merge left out, both;
   the rotation kernel alone; a graph of one trivial kernel, the floor of every timed call);
   a profiler breakdown per kernel (rotation, decode, merge: their own durations, which overlap
   under PDL) follows; on an H100 the table also compares with the timings of OSCAR's own kernel
   given in issue 15;
4. write-kernel throughput (rotate + clip + quantise + pack) on 128K tokens x 8 heads, general
   and plane-wise kernels. The clip ratios are the bundled zoo's (the 8 heads take the octile
   midpoints of its K and V ratios: 0.88-0.95), since the clip selection's cost grows with the
   number of values above the clip; "rot+clip 0.96" is the ratio of earlier rounds' tables.

Each kernel's bound (memory / instruction issue / latency) comes from Nsight Compute through
``scripts/dev/ncu_kernels.py``, which reads this script's JSON (``ncu_decode``, ``write_profile``);
``--ncu`` runs it at the end of the same run and adds a ``bound`` line per kernel to the table.

Timing: ``triton.testing.do_bench`` medians (it flushes L2 before every call) of CUDA-graph
replays (so host launch overhead stays out, as in a serving engine's decode step), inputs are
random (never zeros), and when a working set is under 3x L2 the timed calls rotate through
several copies of it. Achieved bandwidth counts the cache bytes each kernel must read.
do_bench flushes by zeroing 256 MB, so the timed call starts with L2 full of dirty lines and
writes up to 50 MB back while it reads; that weighs more on a call that reads 76 MB (INT2, 128K
x 1) than on one that reads 537 MB (BF16). ``--flush read`` sums the buffer instead, leaving L2
clean, as after the weight GEMM that precedes attention in a decode step; the JSON records it.

Sweeps instead of the whole run: ``--variants JSON`` times decode configs at every context and
batch (``sweep.json``); ``--write-variants JSON`` checks write-kernel configs against the reference
(Qwen-like rows plus degenerate ones: equal after the clip, zero, a few ulps apart) and times
those that pass, with rotation and clip unless an entry says ``"rotation": false`` or ``"clip":
false`` (``"clip_ratio"``: a number, or one per head, instead of the zoo's), in alternating rounds
(``write_sweep.json``; with ``--ncu`` each one's instructions, issue rate and pipe use), e.g.
``--write-variants '[{}, {"check_thresholds": true}]'``.

``--quick`` runs tiny shapes under the Triton interpreter on the CPU (a smoke test of the script).
Usage: ``PYTHONPATH=. python scripts/bench/bench_kernels.py [--quick] [--ncu] [--out DIR]
[--variants JSON | --write-variants JSON]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from functools import lru_cache
from pathlib import Path

QWEN = {"q_heads": 32, "kv_heads": 8, "head_dim": 128, "group_size": 128}
SINK, RECENT = 64, 256


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run (tiny shapes, Triton interpreter)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="output folder (default $OUT or ./bench_out)")
    ap.add_argument("--contexts", default=None,
                    help="comma-separated context lengths (default 8192,32768,65536,131072; --quick: 360,704)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,32; --quick: 1,2)")
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
    return ap.parse_args()


ARGS = parse_args()
if ARGS.quick:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from oscar_calib.kernels import (
    Int2KVCache,
    QuantizedKV,
    bits_per_element,
    build_cache,
    decode_attention,
    decode_attention_reference,
    quantize_kv,
    quantize_kv_reference,
)
from oscar_calib.kernels import decode as decode_mod  # noqa: E402
from oscar_calib.kernels import write as write_mod  # noqa: E402
from oscar_calib.kernels._common import load_triton_module  # noqa: E402
from oscar_calib.kernels.testing import (
    code_agreement,
    kv_rows,
    random_int2_cache,
    random_rotation,
    relative_error,
)

T0 = time.time()
GPU = torch.cuda.is_available() and not ARGS.quick
DEV = "cuda" if GPU else "cpu"
if ARGS.quick:
    from oscar_calib.kernels._common import interpreter_problem

    if interpreter_problem():
        sys.exit(f"error: --quick: {interpreter_problem()}")
if not GPU and not ARGS.quick:
    sys.exit("error: no CUDA device here; the benchmark needs a GPU (--quick runs a CPU smoke test under the "
             "Triton interpreter)")
LOG: list[str] = []


def log(msg: str) -> None:
    line = f"[{time.time() - T0:7.1f}s] {msg}"
    LOG.append(line)
    print(line, flush=True)


def over_budget() -> bool:
    return time.time() - T0 > ARGS.budget_s


# ----------------------------------------------------------------------------------------- timing
def sync():
    if GPU:
        torch.cuda.synchronize()


def graph_of(fn):
    """Capture ``fn`` (already warmed up) in a CUDA graph; returns the graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_ms(fns: list) -> float:
    """Median time of one call, rotating through ``fns`` (one per input copy)."""
    i = [0]

    def step():
        fns[i[0] % len(fns)]()
        i[0] += 1

    if GPU and ARGS.flush == "read":
        return read_flushed_ms(step)
    if GPU:
        import triton.testing

        return float(triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median"))
    ts = []
    for _ in range(2):
        t = time.perf_counter()
        step()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


FLUSH_BUF: list = []


def read_flushed_ms(step, warmup: int = 25, reps: int = 100) -> float:
    """Median time of ``step`` after reading a 256 MB buffer (L2 left full of clean lines)."""
    if not FLUSH_BUF:
        FLUSH_BUF.append(torch.ones(64 << 20, dtype=torch.float32, device=DEV))
    buf = FLUSH_BUF[0]
    sink = torch.empty((), dtype=torch.float32, device=DEV)
    for _ in range(warmup):
        step()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        torch.sum(buf, dim=0, out=sink)
        a.record()
        step()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)


def timed_graphs(make_fns: list):
    """Warm up, capture (GPU) and time a list of zero-argument callables."""
    for f in make_fns:
        f()
    sync()
    if GPU:
        graphs = [graph_of(f) for f in make_fns]
        return time_ms([g.replay for g in graphs])
    return time_ms(make_fns)


def copies_for(ws_bytes: int, l2_bytes: int) -> int:
    if not GPU:
        return 1
    return 1 if ws_bytes >= 3 * l2_bytes else min(16, math.ceil(3 * l2_bytes / max(1, ws_bytes)))


def free_bytes() -> int:
    if GPU:
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    return 8 << 30


# ----------------------------------------------------------------------------------------- steps
def device_facts() -> dict:
    facts = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        facts["triton"] = triton.__version__
    except Exception as e:  # pragma: no cover
        facts["triton"] = f"unavailable: {e}"
    if GPU:
        p = torch.cuda.get_device_properties(0)
        facts.update(name=p.name, sms=p.multi_processor_count, memory_gb=round(p.total_memory / 2**30, 1),
                     l2_bytes=int(getattr(p, "L2_cache_size", 50 << 20)), capability=f"{p.major}.{p.minor}")
    else:
        facts.update(name=f"CPU ({platform.processor() or platform.machine()}), Triton interpreter",
                     l2_bytes=4 << 20)
    return facts


def copy_bandwidth() -> dict:
    n = (1 << 28) if GPU else (1 << 22)  # 1 GiB / 16 MiB of fp32
    x = torch.randn(n, device=DEV)
    y = torch.empty_like(x)
    ms = time_ms([lambda: y.copy_(x)])
    bw = 2 * x.numel() * 4 / (ms * 1e-3)
    return {"bytes_moved": 2 * n * 4, "ms": ms, "bytes_per_s": bw}


def int2_bytes(batch, kvh, d, g, hist, window, dtype_bytes=2) -> int:
    """Bytes the INT2 decode must read: K+V codes and params of the history, K+V window."""
    per_tok = 2 * (d // 4 + 2 * 2 * (d // g))
    return batch * kvh * (hist * per_tok + window * 2 * d * dtype_bytes)


# the round-1 kernel's tuning (before issue 15), per regime, for comparison in the same run
ROUND1 = {"small": {"BLOCK_N": 64, "BLOCK16": 32, "heads_per_program": 1, "programs_per_sm": 8,
                    "prefetch": False, "maxnreg": 0, "pdl": False},
          "large": {"BLOCK_N": 64, "BLOCK16": 32, "heads_per_program": "fill", "programs_per_sm": 16,
                    "prefetch": False, "maxnreg": 0, "pdl": False}}
# the defaults after the first round-2 sweep (prefetch), for comparison in the same run
ROUND2 = {"small": {"BLOCK_N": 64, "BLOCK16": 32, "heads_per_program": 1, "programs_per_sm": 8,
                    "prefetch": True, "maxnreg": 0, "pdl": False},
          "large": {"BLOCK_N": 64, "BLOCK16": 32, "heads_per_program": "fill", "programs_per_sm": 16,
                    "prefetch": True, "maxnreg": 0, "pdl": False}}
# OSCAR's own INT2 decode kernel on an H100, tuned, from issue 15 (us): (batch, context) -> time
# rounds of the paged-against-contiguous comparison (alternating, fresh caches; the median counts)
PAGED_ROUNDS = 3
OSCAR_REF_H100 = {(1, 32768): 60.7, (1, 131072): 181.2, (32, 32768): 956.0, (32, 131072): 3752.0}


def decode_variants(batch: int | None = None) -> list[dict]:
    """Variants swept at the longest context for ``batch`` (None: every batch's, for the
    correctness check). ``{}`` is the library default."""
    if ARGS.quick:
        return [{"mode": 0, "BLOCK_N": 32, "BLOCK16": 32, "programs_per_sm": 1},
                {"mode": 0, "BLOCK_N": 16, "BLOCK16": 16, "programs_per_sm": 1, "heads_per_program": 1,
                 "prefetch": True, "maxnreg": 128}]
    if ARGS.no_sweep:
        return [{}]
    if batch is None:
        out = []
        for b in (1, 32):
            out += [v for v in decode_variants(b) if v not in out]
        return out
    small = batch * QWEN["kv_heads"] < 64
    out = [{}, ROUND1["small" if small else "large"], ROUND2["small" if small else "large"], {"pdl": False}]
    if small:
        out += [{"maxnreg": 0}, {"split_tokens16": 128}, {"merge_two_pass": True}]
    else:
        out += [{"programs_per_sm": 64}, {"programs_per_sm": 128}, {"merge_two_pass": True}]
    return out


def check_correctness(shape: dict, variants: list[dict]) -> dict:
    """Write kernel and every decode variant against the references at one shape."""
    gen = torch.Generator().manual_seed(0)
    h, qh, d, g = shape["kv_heads"], shape["q_heads"], shape["head_dim"], shape["group_size"]
    b, t = 2, (3000 if GPU else 120)
    sink, recent = (SINK, RECENT) if GPU else (8, 16)
    k = kv_rows((b, t, h, d), torch.bfloat16, generator=gen).to(DEV)
    v = kv_rows((b, t, h, d), torch.bfloat16, generator=gen, outliers=False).to(DEV)
    rk = random_rotation(h, d, generator=gen, device=DEV)
    rv = random_rotation(h, d, generator=gen, device=DEV)
    kclip = torch.full((h,), 0.96, device=DEV)
    res = {}
    x = k.reshape(-1, h, d)
    got = quantize_kv(x, rk, kclip, g, backend="triton")
    # the reference on the CPU: on CUDA tensors torch divides by a Python scalar as a multiply by
    # its reciprocal ((max - min) / 3), which moves ~1e-6 of the codes at rounding ties
    xc, rkc, kclipc = x.cpu(), rk.cpu(), kclip.cpu()
    ref = quantize_kv_reference(xc, rkc, kclipc, g)
    worst, frac = code_agreement(got, ref)
    res["write"] = {"max_level_diff": worst, "codes_differing": frac,
                    "dequant_max_abs_diff": float((got.dequantize().cpu() - ref.dequantize()).abs().max())}
    log(f"check write: codes differing {frac:.2e} (max {worst} level), dequant max |diff| "
        f"{res['write']['dequant_max_abs_diff']:.3g}")
    for name, cfg, rot in (("planes", {"planes": True}, rk), ("planes rounds", {"planes": True, "select": "rounds"}, rk),
                           ("planes divide", {"planes": True, "quantize": "divide"}, rk),
                           ("planes per block", {"planes": True, "programs_per_sm": 0}, rk),
                           ("general", {"planes": False}, rk), ("planes, no rotation", {"planes": True}, None)):
        got = quantize_kv(x, rot, kclip, g, backend="triton", config=cfg)
        worst, frac = code_agreement(got, quantize_kv_reference(xc, None if rot is None else rkc, kclipc, g))
        res[f"write {name}"] = {"max_level_diff": worst, "codes_differing": frac}
        log(f"check write {name}: codes differing {frac:.2e} (max {worst} level)")
    cache = build_cache(k, v, lengths=[t, t // 2 + 7], k_rotation=rk, v_rotation=rv, k_clip=kclip,
                        v_clip=0.92, group_size=g, sink=sink, recent=recent, backend="triton")
    q = kv_rows((b, qh, d), torch.bfloat16, generator=gen).to(DEV)
    want = decode_attention_reference(q, cache, k_rotation=rk, out_dtype=torch.float32)
    res["decode"] = []
    for cfg in variants:
        try:
            o = decode_attention(q, cache, k_rotation=rk, backend="triton", out_dtype=torch.float32, config=cfg)
            err = relative_error(o, want)
            info = kernel_info(decode_mod.LAST_LAUNCH.get("split"))
        except Exception as e:  # noqa: BLE001 - report and go on with the other variants
            res["decode"].append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:400], "ok": False,
                                  "rel_err": float("nan")})
            log(f"check decode {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}")
            continue
        res["decode"].append({"config": cfg, "rel_err": err, "ok": bool(err < 3e-3), "kernel": info})
        log(f"check decode {cfg}: rel err {err:.2e}; kernel {info}")
    o = decode_attention(q, cache, k_rotation=rk, v_rotation=rv, unrotate=True, backend="triton",
                         out_dtype=torch.float32, config=variants[0])
    err = relative_error(o, decode_attention_reference(q, cache, k_rotation=rk, v_rotation=rv, unrotate=True,
                                                       out_dtype=torch.float32))
    res["decode_unrotate_rel_err"] = err
    log(f"check decode unrotate: rel err {err:.2e}")
    return res


def kernel_info(k) -> dict:
    """Registers, spills and shared memory of a compiled Triton kernel (what the version exposes)."""
    if k is None:
        return {}
    out = {}
    for name in ("n_regs", "n_spills", "shared"):
        v = getattr(k, name, None)
        if isinstance(v, (int, float)):
            out[name] = v
    meta = getattr(k, "metadata", None)
    shared = getattr(meta, "shared", None)
    if "shared" not in out and isinstance(shared, int):
        out["shared"] = shared
    return out


def random_paged(cache: Int2KVCache, page: int) -> Int2KVCache:
    """The same random history laid out in shuffled pages (built directly, no copy loop; a last
    partial page is padded)."""
    b, h, lcap, _ = cache.k_codes.shape
    per = -(-lcap // page)
    perm = torch.randperm(b * per, device=cache.k_codes.device)
    table = perm.view(b, per).to(torch.int32)

    def pool(t):  # [B, H, L, w] -> pages [B*per, H, page, w] placed at perm
        t = F.pad(t, (0, 0, 0, per * page - lcap))
        src = t.view(b, h, per, page, t.shape[-1]).permute(0, 2, 1, 3, 4).reshape(b * per, h, page, t.shape[-1])
        out = torch.empty_like(src)
        out[perm] = src
        return out

    return Int2KVCache(pool(cache.k_codes), pool(cache.k_scale), pool(cache.k_offset),
                       pool(cache.v_codes), pool(cache.v_scale), pool(cache.v_offset),
                       cache.hist_lens, cache.k_bf16, cache.v_bf16, cache.bf16_lens, cache.group_size, table)


def time_decode(ctx: int, batch: int, shape: dict, cfg: dict, l2: int, *, sdpa: bool, paged: int | None = None,
                copies: int | None = None) -> dict:
    h, qh, d, g = shape["kv_heads"], shape["q_heads"], shape["head_dim"], shape["group_size"]
    window = min(ctx, SINK + RECENT)
    hist = ctx - window
    ib = int2_bytes(batch, h, d, g, hist, window)
    n2 = copies or copies_for(ib, l2)
    bf_bytes = batch * h * ctx * d * 2 * 2
    nb = copies_for(bf_bytes, l2)
    need = ib * n2 + (bf_bytes * nb * 1.3 if sdpa else 0) + (512 << 20)
    row = {"context": ctx, "batch": batch, "history": hist, "window": window, "config": cfg,
           "int2_bytes": ib, "bf16_bytes": bf_bytes, "paged": paged}
    if need > 0.9 * free_bytes():
        row["skipped"] = f"needs ~{need / 2**30:.1f} GiB, {free_bytes() / 2**30:.1f} GiB free"
        return row
    q = torch.randn(batch, qh, d, device=DEV).to(torch.bfloat16)
    rk = random_rotation(h, d, device=DEV)
    caches = [random_int2_cache(batch, h, d, g, hist, window, device=DEV) for _ in range(n2)]
    if paged:
        caches = [random_paged(c, paged) for c in caches]
    out = torch.empty(batch, qh, d, device=DEV, dtype=torch.bfloat16)
    # bench-only key: the query given already rotated (no rotation kernel), to time what it adds
    kr = None if cfg.get("bench_prerotated") else rk
    kcfg = {k: v for k, v in cfg.items() if not k.startswith("bench_")}
    fns = [lambda c=c: decode_attention(q, c, k_rotation=kr, backend="triton", out=out, check_lengths=False,
                                        config=kcfg) for c in caches]
    ms = timed_graphs(fns)
    row.update(int2_ms=ms, int2_copies=n2, int2_bytes_per_s=ib / (ms * 1e-3),
               kernel=kernel_info(decode_mod.LAST_LAUNCH.get("split")))
    del caches, fns
    if sdpa:
        qs = q.view(batch, qh, 1, d)
        kv = [(torch.randn(batch, h, ctx, d, device=DEV, dtype=torch.bfloat16),
               torch.randn(batch, h, ctx, d, device=DEV, dtype=torch.bfloat16)) for _ in range(nb)]
        res = {}
        try:
            res["sdpa_gqa_ms"] = timed_graphs(
                [lambda k=k, v=v: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True) for k, v in kv])
        except Exception as e:  # noqa: BLE001
            res["sdpa_gqa_error"] = f"{type(e).__name__}: {e}"[:200]
        qf = q.view(batch, h, qh // h, d)  # GQA group as query rows: the same attention
        res["sdpa_fold_ms"] = timed_graphs(
            [lambda k=k, v=v: F.scaled_dot_product_attention(qf, k, v) for k, v in kv])
        best = min(v for k, v in res.items() if k.endswith("_ms"))
        row.update(res, sdpa_ms=best, sdpa_copies=nb, sdpa_bytes_per_s=bf_bytes / (best * 1e-3),
                   speedup=best / ms)
        del kv
    if GPU:
        torch.cuda.empty_cache()
    return row


def safe_time_decode(ctx, batch, *a, **k) -> dict:
    try:
        return time_decode(ctx, batch, *a, **k)
    except Exception as e:  # noqa: BLE001 - one failed shape must not lose the rest of the run
        if GPU:
            torch.cuda.empty_cache()
        log(f"decode ctx={ctx} B={batch} failed: {type(e).__name__}: {str(e)[:300]}")
        return {"context": ctx, "batch": batch, "skipped": f"error {type(e).__name__}: {str(e)[:200]}"}


def profile_decode(shape: dict, best: dict) -> dict:
    """Device time per kernel of one decode call (torch.profiler, 20 calls) at 128K context."""
    from torch.profiler import ProfilerActivity, profile

    h, qh, d, g = shape["kv_heads"], shape["q_heads"], shape["head_dim"], shape["group_size"]
    out = {}
    for batch in sorted(best):
        if over_budget():
            break
        try:
            cache = random_int2_cache(batch, h, d, g, 131072 - SINK - RECENT, SINK + RECENT, device=DEV)
            q = torch.randn(batch, qh, d, device=DEV).to(torch.bfloat16)
            rk = random_rotation(h, d, device=DEV)
            fn = lambda: decode_attention(q, cache, k_rotation=rk, backend="triton", check_lengths=False,  # noqa: E731
                                          config=best[batch])
            fn()
            sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                sync()
            rows = {}
            for e in prof.key_averages():
                t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                if t:
                    rows[e.key[:60]] = t / 20
            out[str(batch)] = dict(sorted(rows.items(), key=lambda kv: -kv[1]))
            log(f"profile 128K B={batch} (us per call): "
                + ", ".join(f"{k[:40]}={v:.1f}" for k, v in list(out[str(batch)].items())[:6]))
        except Exception as e:  # noqa: BLE001
            log(f"profile B={batch} failed: {type(e).__name__}: {str(e)[:200]}")
    return out


@contextlib.contextmanager
def merge_left_out():
    """Bench only: the decode call without its merge kernel (the launch becomes a no-op), to
    time what the merge adds to the call."""
    mod = load_triton_module("_decode_triton")
    real = mod.decode_merge_kernel

    class _Skip:
        def __getitem__(self, grid):
            return lambda *a, **k: None

    mod.decode_merge_kernel = _Skip()
    try:
        yield
    finally:
        mod.decode_merge_kernel = real


BREAKDOWN_PARTS = ("call", "prerotated", "no_merge", "decode_only", "rotation_only", "floor")


def breakdown_decode(shape: dict, contexts: list[int], l2: int) -> list[dict]:
    """Batch 1, where a call is short: the library default's call time with parts left out
    (``prerotated``: the query given rotated, no rotation kernel; ``no_merge``; ``decode_only``:
    both), the rotation kernel alone, and ``floor``: a graph of one trivial kernel (what every
    timed call, SDPA's too, includes: graph launch and event timing). Differences give what each
    part adds to the critical path; PDL overlaps part of each kernel with its neighbours."""
    h, qh, d, g = shape["kv_heads"], shape["q_heads"], shape["head_dim"], shape["group_size"]
    rows = []
    for ctx in contexts:
        if over_budget():
            break
        window = min(ctx, SINK + RECENT)
        n2 = copies_for(int2_bytes(1, h, d, g, ctx - window, window), l2)
        q = torch.randn(1, qh, d, device=DEV).to(torch.bfloat16)
        rk = random_rotation(h, d, device=DEV)
        caches = [random_int2_cache(1, h, d, g, ctx - window, window, device=DEV) for _ in range(n2)]
        out = torch.empty(1, qh, d, device=DEV, dtype=torch.bfloat16)
        row = {"context": ctx, "batch": 1}
        for part in BREAKDOWN_PARTS:
            kr = None if part in ("prerotated", "decode_only") else rk
            if part == "rotation_only":
                cfg = decode_mod.tuning(1, h)
                mod = load_triton_module("_decode_triton")
                fns = [lambda: decode_mod._rotate_query_triton(mod, q, rk, h, cfg, False)]
            elif part == "floor":
                fns = [lambda: out.fill_(1.0)]
            else:
                fns = [lambda c=c, kr=kr: decode_attention(q, c, k_rotation=kr, backend="triton", out=out,
                                                           check_lengths=False) for c in caches]
            with merge_left_out() if part in ("no_merge", "decode_only") else contextlib.nullcontext():
                row[part + "_ms"] = timed_graphs(fns)
        rows.append(row)
        log(f"breakdown ctx={ctx} B=1 (us): " + ", ".join(f"{p} {row[p + '_ms'] * 1e3:.1f}" for p in BREAKDOWN_PARTS))
        del caches
        if GPU:
            torch.cuda.empty_cache()
    return rows


def write_variants() -> list[tuple[str, dict, dict]]:
    if ARGS.quick:
        return [("rot+clip", {}, {"clip": True})]
    gen = {"planes": False}
    clip, noclip = {"clip": True}, {"clip": False}
    norot, fp32 = {"clip": True, "rot": False}, {"clip": True, "rot": False, "fp32": True}
    # "{}" is the library default: plane-wise, codes by thresholds; with a 16-bit rotation one
    # product split into planes on a persistent grid (2 programs per SM; 128-row blocks, 8 warps,
    # 3 stages) whose programs load the rotation once, and the tournament clip selection
    # (unrotated 16-bit input: rounds over integer keys).
    blocks = {"programs_per_sm": 0, "num_stages": 3}  # one program per 64-row block (round 2c)
    tile2d = {"BT": 64, "num_warps": 4, "num_stages": 2}  # round 2d's tile of the persistent grid
    cfgs = [("rot+clip", {}, clip),
            ("rot+clip 0.96", {}, {"clip": True, "ratio": 0.96}),
            ("rot+clip 0.96 top3", {"select_top3": True}, {"clip": True, "ratio": 0.96}),
            ("rot+clip top3", {"select_top3": True}, clip),
            ("rot+clip divide", {"quantize": "divide"}, clip),
            ("rot+clip per block", blocks, clip),
            ("rot+clip per block divide", {**blocks, "quantize": "divide"}, clip),
            ("rot+clip 64-row tile", tile2d, clip),
            ("rot+clip 1/SM", {"programs_per_sm": 1}, clip),
            ("rot+clip 2 stages", {"num_stages": 2}, clip),
            ("rot+clip rounds", {"select": "rounds"}, clip),
            ("rot+clip general", gen, clip),
            ("rot+clip per-plane dots", {"split": False}, clip),
            ("rot+clip fast-rot", {}, {"clip": True, "fast": True}),
            ("rot, no clip", {}, noclip),
            ("rot, no clip 64-row tile", tile2d, noclip),
            ("rot, no clip per block", blocks, noclip),
            ("rot, no clip general", gen, noclip),
            ("no rot, clip", {}, norot),
            ("no rot, clip general", gen, norot),
            ("no rot, fp32 clip", {}, fp32),
            ("no rot, fp32 clip rounds", {"select": "rounds"}, fp32),
            ("no rot, clip divide", {"quantize": "divide"}, norot),
            ("no rot/clip", {}, {"clip": False, "rot": False}),
            ("no rot/clip divide", {"quantize": "divide"}, {"clip": False, "rot": False}),
            ("no rot/clip general", gen, {"clip": False, "rot": False})]
    return cfgs


def write_profile(rows: list[dict], h: int) -> list[dict]:
    """Write configurations for ``scripts/dev/ncu_kernels.py``: the library defaults with clip (with
    and without rotation), the fastest rotated one with clip, the fastest without either."""
    opts = {n: o for n, _, o in write_variants()}
    ratios = zoo_clip_ratios(h)
    timed = [r for r in rows if "ms" in r]
    picks = [r for r in timed if r["name"] in ("rot+clip", "no rot, clip")]
    clip_rows = [r for r in timed if opts[r["name"]]["clip"] and opts[r["name"]].get("rot", True)
                 and not opts[r["name"]].get("fast")]
    plain = [r for r in timed if not opts[r["name"]]["clip"] and not opts[r["name"]].get("rot", True)]
    for group in (clip_rows, plain):
        if group:
            picks.append(min(group, key=lambda r: r["ms"]))
    seen, out = set(), []
    for r in picks:
        if r["name"] not in seen:
            seen.add(r["name"])
            o = opts[r["name"]]
            out.append({"name": r["name"], "config": r["config"], "rot": o.get("rot", True), "clip": o["clip"],
                        "clip_ratio": o.get("ratio", ratios)})
    return out


@lru_cache(maxsize=None)
def zoo_clip_ratios(h: int) -> tuple[float, ...]:
    """``h`` clip ratios spread like the bundled zoo's K and V ratios: their quantiles at the
    midpoints of ``h`` equal slices (0.92 each if the zoo cannot be read)."""
    from safetensors import safe_open

    vals = []
    for f in sorted((Path(__file__).resolve().parents[2] / "zoo").glob("*/*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            vals += [fh.get_tensor(k).flatten() for k in fh.keys() if k.endswith(("k_clip", "v_clip"))]
    if not vals:
        return (0.92,) * h
    v = torch.cat(vals).double()
    q = torch.quantile(v, torch.tensor([(i + 0.5) / h for i in range(h)], dtype=torch.float64))
    return tuple(round(float(c), 4) for c in q)


def ratio_tensor(ratio, like: torch.Tensor) -> torch.Tensor:
    """Clip ratios shaped like ``like``: one number for every head, or a list, one per head."""
    vals = list(ratio) if isinstance(ratio, (list, tuple)) else [ratio] * like.numel()
    return torch.tensor(vals, dtype=like.dtype, device=like.device)


def write_inputs(h: int, d: int, g: int):
    """The timed write's inputs: 128K tokens (256 under --quick) x ``h`` heads of bf16 rows with
    an outlier channel, a random rotation, the zoo's clip ratios (:func:`zoo_clip_ratios`), and
    the output buffers."""
    t = 131072 if GPU else 256
    x = torch.randn(t, h, d, device=DEV).to(torch.bfloat16)
    x[..., 7] = x[..., 7] * 20 + 5
    rk = random_rotation(h, d, device=DEV)
    clip = torch.tensor(zoo_clip_ratios(h), device=DEV)
    out = QuantizedKV(torch.empty(t, h, d // 4, dtype=torch.uint8, device=DEV),
                      torch.empty(t, h, d // g, dtype=torch.float16, device=DEV),
                      torch.empty(t, h, d // g, dtype=torch.float16, device=DEV), g)
    return x, rk, clip, out


def time_write(shape: dict, l2: int) -> list[dict]:
    h, d, g = shape["kv_heads"], shape["head_dim"], shape["group_size"]
    x, rk, clip, out = write_inputs(h, d, g)
    t = x.shape[0]
    x32 = None
    rows = []
    for name, cfg, opt in write_variants():
        if over_budget():
            rows.append({"name": name, "skipped": "time budget"})
            continue
        rot = rk if opt.get("rot", True) else None
        cl = clip if opt["clip"] else None
        if cl is not None and "ratio" in opt:
            cl = ratio_tensor(opt["ratio"], clip)
        if opt.get("fp32"):  # float32 rows: the float clip selection without a rotation
            x32 = x.float() if x32 is None else x32
        xin = x32 if opt.get("fp32") else x
        nbytes = xin.numel() * xin.element_size() + out.codes.numel() + 2 * out.scale.numel() * 2
        fn = lambda: quantize_kv(xin, rot, cl, g, backend="triton", out=out,  # noqa: E731
                                 fast_rotation=opt.get("fast", False), config=cfg)
        try:
            ms = timed_graphs([fn])
        except Exception as e:  # noqa: BLE001
            rows.append({"name": name, "skipped": f"error {type(e).__name__}: {str(e)[:200]}"})
            log(f"write {name} failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        rows.append({"name": name, "config": cfg, "tokens": t, "bytes": nbytes, "ms": ms,
                     "bytes_per_s": nbytes / (ms * 1e-3), "kernel": kernel_info(write_mod.LAST_LAUNCH.get("write"))})
        log(f"write {name}: {ms * 1e3:.1f} us, {nbytes / (ms * 1e-3) / 1e9:.0f} GB/s")
    return rows


VARIANTS: list[dict] = []


def int_list(text: str | None, flag: str) -> list[int]:
    """``"1,32"`` -> ``[1, 32]``; None -> ``[]``; anything else is one line and exit 1."""
    if text is None:
        return []
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        sys.exit(f"error: {flag} {text!r}: expected comma-separated positive integers")
    if not vals or min(vals) < 1:
        sys.exit(f"error: {flag} {text!r}: expected comma-separated positive integers")
    return vals


def parse_variants(text: str, flag: str = "--variants") -> list[dict]:
    """``--variants`` / ``--write-variants``: a JSON list of config dicts, inline or in a file."""
    p = Path(text)
    if text.lstrip().startswith("["):
        raw = text
    elif p.is_file():
        raw = p.read_text()
    else:
        sys.exit(f"error: {flag} {text!r} is neither a JSON list nor a file")
    try:
        val = json.loads(raw)
    except json.JSONDecodeError as e:
        sys.exit(f"error: {flag} is not JSON: {e}")
    if not isinstance(val, list) or not all(isinstance(v, dict) for v in val):
        sys.exit(f"error: {flag} must be a JSON list of config objects")
    return val


def pick_best(cands: list[tuple[float, dict]], margin: float = 0.03) -> dict:
    """The sweep's winner: the fastest config, but the library default (``{}``) unless the fastest
    beats it by more than ``margin``. Wins of 0.1% and 1.1% at 128K x 1 (``split_tokens16: 128``,
    rounds 2c and 2d) were noise: the default's own time there moves by 1-2% between runs, and
    the variant, timed at every other context, was slower at 8K and 32K."""
    fastest = min(cands, key=lambda c: c[0])
    default = [c for c in cands if c[1] == {}]
    if default and fastest[0] >= default[0][0] * (1 - margin):
        return {}
    return fastest[1]


def sweep_variants(report: dict, shape: dict, contexts: list[int], batches: list[int], l2: int, bw: float,
                   out_dir: Path) -> None:
    """``--variants``: check each config against the reference, then time it at every shape."""
    variants = VARIANTS
    report["correctness"] = check_correctness(shape, variants)
    report["variants"] = []
    for cfg, ok in zip(variants, report["correctness"]["decode"]):
        if not ok["ok"]:
            log(f"variant {cfg}: failed the correctness check, not timed")
            continue
        for batch in batches:
            for ctx in contexts:
                if over_budget():
                    break
                row = safe_time_decode(ctx, batch, shape, cfg, l2, sdpa=False, paged=cfg.get("bench_paged"))
                report["variants"].append(row)
                if "int2_ms" in row:
                    log(f"variant ctx={ctx} B={batch} {cfg}: {row['int2_ms'] * 1e3:.1f} us "
                        f"({row['int2_bytes_per_s'] / bw * 100:.0f}% of copy BW)")
    report["elapsed_s"] = time.time() - T0
    (out_dir / "sweep.json").write_text(json.dumps(report, indent=2, default=str))
    for batch in batches:
        for ctx in contexts:
            rows = sorted((r for r in report["variants"] if r["batch"] == batch and r["context"] == ctx
                           and "int2_ms" in r), key=lambda r: r["int2_ms"])
            for r in rows:
                print(f"{ctx:>7} x {batch:<3} {r['int2_ms'] * 1e3:8.1f} us  {r['config']}")


WRITE_ROUNDS = 3  # alternating rounds of a write sweep (each config timed once per round)


def write_check_rows(h: int, d: int, gen) -> torch.Tensor:
    """Rows for the write sweep's check: Qwen-like K rows, plus rows whose values are all equal
    after the clip (some beyond it), all zero, or a few ulps apart around a large offset
    (degenerate groups that exact kernels must handle like the reference), 1200 tokens x ``h``
    heads."""
    x = kv_rows((1200, h, d), torch.float32, generator=gen)
    x[:60] = 3.0  # all equal after the clip, with values beyond it on one side or the other
    x[:20, :, :5] = 50.0
    x[20:40, :, 3:6] = -50.0
    x[60:80] = 1000.0 + torch.randint(-3, 4, (20, h, d), generator=gen) * 6.1e-5
    x[80:100] = 0.0
    return x.to(torch.bfloat16)


BENCH_KEYS = ("rotation", "clip", "clip_ratio")


def kernel_config(cfg: dict, rot, clip):
    """A write-sweep entry's kernel config and its inputs: ``"rotation": false`` / ``"clip": false``
    in the entry time it without them, ``"clip_ratio"`` (a number, or one per KV head) with other
    clip ratios than ``clip``'s (all other keys go to the kernel)."""
    kcfg = {k: v for k, v in cfg.items() if k not in BENCH_KEYS}
    if not cfg.get("clip", True):
        return kcfg, (rot if cfg.get("rotation", True) else None), None
    if "clip_ratio" in cfg and clip is not None:
        clip = ratio_tensor(cfg["clip_ratio"], clip)
    return kcfg, (rot if cfg.get("rotation", True) else None), clip


def sweep_write(report: dict, shape: dict, configs: list[dict], bw: float, out_dir: Path) -> None:
    """``--write-variants``: each config's code agreement with the reference (rotation and clip),
    then each timed on 128K tokens x 8 heads in ``WRITE_ROUNDS`` alternating rounds (median)."""
    h, d, g = shape["kv_heads"], shape["head_dim"], shape["group_size"]
    gen = torch.Generator().manual_seed(5)
    xc = write_check_rows(h, d, gen)
    rk = random_rotation(h, d, generator=gen)
    clip = torch.tensor(zoo_clip_ratios(h))
    refs = {(c, "rot"): quantize_kv_reference(xc, rk, cl, g) for c, cl in ((True, clip), (False, None))}
    refs.update({(c, "no rot"): quantize_kv_reference(xc, None, cl, g) for c, cl in ((True, clip), (False, None))})
    ok_cfgs, report["write_check"] = [], []
    for cfg in configs:
        row = {"config": cfg}
        try:
            kcfg, _, clip_i = kernel_config(cfg, None, clip)
            if clip_i is not None and clip_i.numel() != h:
                raise ValueError(f"clip_ratio needs one number or {h}, got {clip_i.numel()}")
            for name, rot in (("rot", rk), ("no rot", None)):
                got = quantize_kv(xc.to(DEV), None if rot is None else rot.to(DEV),
                                  None if clip_i is None else clip_i.to(DEV), g, backend="triton", config=kcfg)
                ref = refs[(clip_i is not None, name)] if "clip_ratio" not in cfg else \
                    quantize_kv_reference(xc, rot, clip_i, g)
                worst, frac = code_agreement(got, ref)
                same = bool(torch.equal(got.scale.cpu(), ref.scale) and torch.equal(got.offset.cpu(), ref.offset))
                row[name] = {"max_level_diff": worst, "codes_differing": frac, "params_identical": same}
        except Exception as e:  # noqa: BLE001 - a config the kernel refuses is a failed check, not a crash
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            report["write_check"].append(row)
            log(f"check write {cfg}: {row['error']} -- FAILED, not timed")
            continue
        # unrotated input must match exactly; rotated, by at most a rounding tie (one level, rare)
        row["ok"] = (row["no rot"]["codes_differing"] == 0 and row["no rot"]["params_identical"]
                     and row["rot"]["max_level_diff"] <= 1 and row["rot"]["codes_differing"] <= 1e-4)
        report["write_check"].append(row)
        log(f"check write {cfg}: rotated {row['rot']['codes_differing']:.2e} codes differ, unrotated "
            f"{row['no rot']['codes_differing']:.2e} (params identical: {row['no rot']['params_identical']})"
            f"{'' if row['ok'] else ' -- FAILED, not timed'}")
        if row["ok"]:
            ok_cfgs.append(cfg)
    x, rot, clip_d, out = write_inputs(h, d, g)
    t = x.shape[0]
    nbytes = x.numel() * x.element_size() + out.codes.numel() + 2 * out.scale.numel() * 2
    times: dict[int, list[float]] = {i: [] for i in range(len(ok_cfgs))}
    regs: dict[int, object] = {}
    for _ in range(WRITE_ROUNDS if GPU else 1):
        for i, cfg in enumerate(ok_cfgs):
            if over_budget():
                break
            kcfg, r_i, c_i = kernel_config(cfg, rot, clip_d)
            fn = lambda kcfg=kcfg, r_i=r_i, c_i=c_i: quantize_kv(x, r_i, c_i, g, backend="triton", out=out,  # noqa: E731
                                                                  config=kcfg)
            times[i].append(timed_graphs([fn]))
            regs[i] = kernel_info(write_mod.LAST_LAUNCH.get("write"))
    report["write_sweep"] = []
    for i, cfg in enumerate(ok_cfgs):
        if not times[i]:
            continue
        ms = statistics.median(times[i])
        report["write_sweep"].append({"config": cfg, "ms": ms, "runs_ms": times[i], "tokens": t, "bytes": nbytes,
                                      "bytes_per_s": nbytes / (ms * 1e-3), "kernel": regs.get(i)})
    report["ncu_decode"] = []
    report["write_profile"] = [{"name": json.dumps(cfg), "config": kernel_config(cfg, None, None)[0],
                                "rot": cfg.get("rotation", True), "clip": cfg.get("clip", True),
                                "clip_ratio": cfg.get("clip_ratio", clip.tolist())}
                               for cfg in ok_cfgs]
    report["elapsed_s"] = time.time() - T0
    path = out_dir / "write_sweep.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    if ARGS.ncu and GPU:
        report = run_ncu(path) or report
    for n in report.get("ncu", []):
        m = n["metrics"]
        log(f"ncu {n['what']}: {(m.get('time') or 0) / 1e3:.1f} us, {m.get('warp_instructions') or 0:.3g} warp "
            f"instructions, issue {m.get('issue_pct') or 0:.0f}%, DRAM {m.get('dram_pct') or 0:.0f}%, ALU pipe "
            f"{m.get('alu_pipe_pct') or 0:.0f}%, {m.get('registers')} registers -> {m['bound']}")
    print(f"write, {t} tokens x {h} heads, with rotation and clip unless the config says otherwise "
          f"(median of {WRITE_ROUNDS if GPU else 1} rounds):")
    for r in sorted(report["write_sweep"], key=lambda r: r["ms"]):
        runs = ", ".join(f"{m * 1e3:.1f}" for m in r["runs_ms"])
        print(f"{r['ms'] * 1e3:8.1f} us  {r['bytes_per_s'] / bw * 100:4.0f}% of copy  ({runs})  {r['config']}")


def main():
    global VARIANTS
    write_cfgs = None
    if ARGS.variants is not None:  # bad input is refused before any work
        VARIANTS = parse_variants(ARGS.variants)
    if ARGS.write_variants is not None:
        write_cfgs = parse_variants(ARGS.write_variants, "--write-variants")
    contexts = int_list(ARGS.contexts, "--contexts") or ([360, 704] if ARGS.quick else [8192, 32768, 65536, 131072])
    batches = int_list(ARGS.batches, "--batches") or ([1, 2] if ARGS.quick else [1, 32])
    out_dir = Path(ARGS.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = dict(QWEN) if not ARGS.quick else {"q_heads": 4, "kv_heads": 2, "head_dim": 64, "group_size": 64}
    report: dict = {"device": device_facts(), "shape": shape, "sink": SINK, "recent": RECENT,
                    "bits_per_element": bits_per_element(shape["group_size"]), "quick": ARGS.quick, "flush": ARGS.flush}
    l2 = report["device"]["l2_bytes"]
    log(f"device: {report['device']}")
    report["copy"] = copy_bandwidth()
    bw = report["copy"]["bytes_per_s"]
    log(f"copy bandwidth: {bw / 1e9:.0f} GB/s")
    if write_cfgs is not None:
        sweep_write(report, shape, write_cfgs, bw, out_dir)
        return
    if ARGS.variants is not None:
        sweep_variants(report, shape, contexts, batches, l2, bw, out_dir)
        return

    variants = decode_variants()
    report["correctness"] = check_correctness(shape, variants)
    ok_variants = [v for v, r in zip(variants, report["correctness"]["decode"]) if r["ok"]]
    if not ok_variants:
        log("no decode variant passed the correctness check; timing the default anyway")
        ok_variants = variants[:1]

    # variant sweep at the longest context, per batch size
    best = {}
    report["sweep"] = []
    ctx_max = max(contexts)
    for batch in batches:
        cands = []
        for cfg in [v for v in decode_variants(batch) if v in ok_variants] if not (ARGS.quick or ARGS.no_sweep) else []:
            if over_budget():
                break
            row = safe_time_decode(ctx_max, batch, shape, cfg, l2, sdpa=False)
            report["sweep"].append(row)
            if "int2_ms" in row:
                cands.append((row["int2_ms"], cfg))
                log(f"sweep ctx={ctx_max} B={batch} {cfg}: {row['int2_ms'] * 1e3:.1f} us "
                    f"({row['int2_bytes_per_s'] / bw * 100:.0f}% of copy BW)")
            else:
                log(f"sweep ctx={ctx_max} B={batch}: skipped ({row['skipped']})")
        best[batch] = pick_best(cands) if cands else ok_variants[0]
    report["best_config"] = {str(b): c for b, c in best.items()}
    report["ncu_decode"] = []
    for b in batches:
        for name, cfg in (("round-1 tuning", ROUND1["small" if b * shape["kv_heads"] < 64 else "large"]),
                          ("default", {}), ("best", best[b])):
            if not any(e["batch"] == b and e["config"] == cfg for e in report["ncu_decode"]):
                report["ncu_decode"].append({"batch": b, "name": name, "config": cfg})

    report["decode"] = []
    for batch in batches:
        for ctx in contexts:
            if over_budget():
                report["decode"].append({"context": ctx, "batch": batch, "skipped": "time budget"})
                continue
            row = safe_time_decode(ctx, batch, shape, best[batch], l2, sdpa=True)
            report["decode"].append(row)
            if "skipped" in row:
                log(f"decode ctx={ctx} B={batch}: skipped ({row['skipped']})")
            else:
                log(f"decode ctx={ctx} B={batch}: INT2 {row['int2_ms'] * 1e3:.1f} us, "
                    f"SDPA {row['sdpa_ms'] * 1e3:.1f} us, x{row['speedup']:.2f}")
    # paged layout (page 64, shuffled pages) against contiguous
    report["paged"] = []
    cases = [(32768, max(batches)), (131072, min(batches))] if GPU else [(contexts[-1], batches[-1])]
    page = 64 if GPU else 16
    for pctx, pb in cases:
        if over_budget() or pctx not in contexts:
            continue
        hist = pctx - min(pctx, SINK + RECENT)
        if hist % page:
            continue
        # contiguous with the sweep's best, paged with the library's choice for paged caches;
        # alternating rounds on fresh caches (one run's ratio moved by +-3% between runs)
        rounds = []
        for _ in range(PAGED_ROUNDS if GPU else 1):
            cont = safe_time_decode(pctx, pb, shape, best[pb], l2, sdpa=False)
            pag = safe_time_decode(pctx, pb, shape, {}, l2, sdpa=False, paged=page)
            if "int2_ms" in cont and "int2_ms" in pag:
                rounds.append({"contiguous_ms": cont["int2_ms"], "paged_ms": pag["int2_ms"],
                               "ratio": pag["int2_ms"] / cont["int2_ms"]})
        entry = {"context": pctx, "batch": pb, "page": page, "config": best[pb], "contiguous": cont, "paged": pag,
                 "rounds": rounds}
        if rounds:
            entry["median_ratio"] = statistics.median(r["ratio"] for r in rounds)
            log(f"paged page={page} ctx={pctx} B={pb}: median of {len(rounds)} rounds {(entry['median_ratio'] - 1) * 100:+.1f}% "
                f"against contiguous ({best[pb]}); rounds "
                + ", ".join(f"{r['paged_ms'] * 1e3:.1f}/{r['contiguous_ms'] * 1e3:.1f} us" for r in rounds))
        report["paged"].append(entry)

    bd_contexts = list(dict.fromkeys(([512] if GPU else []) + contexts[:2] + contexts[-1:]))
    report["breakdown"] = breakdown_decode(shape, bd_contexts, l2) if 1 in batches else []
    report["profile"] = profile_decode(shape, best) if GPU else {}
    report["write"] = time_write(shape, l2)
    report["write_profile"] = write_profile(report["write"], shape["kv_heads"])
    report["elapsed_s"] = time.time() - T0
    path = out_dir / "bench_kernels.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    if ARGS.ncu and GPU:
        report = run_ncu(path) or report
    print_table(report, bw)


NCU_SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "SchedulerStats", "InstructionStats")


def run_ncu(path: Path) -> dict | None:
    """Profile the report's ``ncu_decode``/``write_profile`` configurations under Nsight Compute
    (one call each, ``--clock-control none``) and merge the metrics and bounds into ``path``."""
    import shutil
    import subprocess

    ncu = shutil.which("ncu") or next((str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/ncu"))), None)
    if ncu is None:
        log("--ncu: Nsight Compute (ncu) not found; bounds not measured")
        return None
    script = str(Path(__file__).resolve().parents[1] / "dev" / "ncu_kernels.py")
    labels, csv_path = path.with_name("ncu_labels.json"), path.with_name("ncu.csv")
    cmd = [ncu, "--csv", "--page", "raw", "--clock-control", "none", "-k", "regex:decode|quantize|rotate_query"]
    for sec in NCU_SECTIONS:
        cmd += ["--section", sec]
    cmd += [sys.executable, script, "target", "--report", str(path), "--labels", str(labels)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with open(csv_path, "w") as f:
        res = subprocess.run(cmd, stdout=f, stderr=subprocess.PIPE, text=True, env=env)
    if res.returncode != 0:
        log(f"--ncu: ncu exited {res.returncode}: {res.stderr.strip()[-300:]}")
        return None
    subprocess.run([sys.executable, script, "merge", "--report", str(path), "--labels", str(labels),
                    "--csv", str(csv_path)], check=False, env=env)
    return json.loads(path.read_text())


def print_table(report: dict, bw: float) -> None:
    dev = report["device"]["name"]
    h100 = "H100" in dev
    lines = [f"device: {dev}; copy bandwidth {bw / 1e9:.0f} GB/s (read+write); "
             f"Qwen3-8B shapes {report['shape']}; {report['bits_per_element']} bits/element; "
             f"L2 flushed by a {report.get('flush', 'write')} before each call"]
    lines.append(f"{'ctx':>7} {'B':>3} {'INT2 us':>9} {'SDPA us':>9} {'speedup':>7} {'INT2 GB/s':>9} "
                 f"{'%copy':>6} {'SDPA %copy':>10}" + ("  vs OSCAR ref (issue 15, H100)" if h100 else ""))
    for r in report["decode"]:
        if "skipped" in r or "int2_ms" not in r:
            lines.append(f"{r['context']:>7} {r['batch']:>3}  skipped: {r.get('skipped')}")
            continue
        ref = OSCAR_REF_H100.get((r["batch"], r["context"])) if h100 else None
        lines.append(
            f"{r['context']:>7} {r['batch']:>3} {r['int2_ms'] * 1e3:>9.1f} {r['sdpa_ms'] * 1e3:>9.1f} "
            f"{r['speedup']:>7.2f} {r['int2_bytes_per_s'] / 1e9:>9.0f} {r['int2_bytes_per_s'] / bw * 100:>5.0f}% "
            f"{r['sdpa_bytes_per_s'] / bw * 100:>9.0f}%" + (f"  {ref / (r['int2_ms'] * 1e3):.2f}x faster" if ref else ""))
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
            lines.append(f"sweep 128K B={r['batch']:<3} {r['int2_ms'] * 1e3:8.1f} us {r['config']}")
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
    print("\n".join(lines))


if __name__ == "__main__":
    main()
