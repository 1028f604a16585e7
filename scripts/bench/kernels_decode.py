"""Decode attention in ``bench_kernels.py``: the correctness check, the variant sweep, the timed
shapes against BF16 SDPA, the paged layout, the batch-1 breakdown and the per-kernel profile."""

from __future__ import annotations

import contextlib
import statistics

import torch
import torch.nn.functional as F
from kernels_common import Ctx, int2_bytes, kernel_info
from kernels_flashinfer import flashinfer_fields

from oscar_calib.kernels import (
    Int2KVCache,
    build_cache,
    decode_attention,
    decode_attention_reference,
    quantize_kv,
    quantize_kv_reference,
)
from oscar_calib.kernels import decode as decode_mod
from oscar_calib.kernels.testing import (
    code_agreement,
    kv_rows,
    merge_left_out,
    random_int2_cache,
    random_rotation,
    relative_error,
    rotate_query_triton,
)

# the first tuning of the decode kernel, per regime, timed in the same run for comparison
FIRST_TUNING = {"small": {"BLOCK_N": 64, "BLOCK16": 32, "heads_per_program": 1, "programs_per_sm": 8,
                    "prefetch": False, "maxnreg": 0, "pdl": False},
          "large": {"BLOCK_N": 64, "BLOCK16": 32, "heads_per_program": "fill", "programs_per_sm": 16,
                    "prefetch": False, "maxnreg": 0, "pdl": False}}
# the same with the prefetch of offsets and parameters, for comparison in the same run
FIRST_TUNING_PREFETCH = {"small": {"BLOCK_N": 64, "BLOCK16": 32, "heads_per_program": 1, "programs_per_sm": 8,
                    "prefetch": True, "maxnreg": 0, "pdl": False},
          "large": {"BLOCK_N": 64, "BLOCK16": 32, "heads_per_program": "fill", "programs_per_sm": 16,
                    "prefetch": True, "maxnreg": 0, "pdl": False}}
# rounds of the paged-against-contiguous comparison (alternating, fresh caches; the median counts)
PAGED_ROUNDS = 3
# OSCAR's own INT2 decode kernel on an H100, tuned, as its authors timed it (us): (batch, context) -> time
OSCAR_REF_H100 = {(1, 32768): 60.7, (1, 131072): 181.2, (32, 32768): 956.0, (32, 131072): 3752.0}
BREAKDOWN_PARTS = ("call", "prerotated", "no_merge", "decode_only", "rotation_only", "floor")


def small_regime(batch: int, kv_heads: int) -> bool:
    return batch * kv_heads < 64


def decode_variants(ctx: Ctx, batch: int | None = None) -> list[dict]:
    """Variants swept at the longest context for ``batch`` (None: every batch's, for the
    correctness check). ``{}`` is the library default."""
    if ctx.quick:
        return [{"mode": 0, "BLOCK_N": 32, "BLOCK16": 32, "programs_per_sm": 1},
                {"mode": 0, "BLOCK_N": 16, "BLOCK16": 16, "programs_per_sm": 1, "heads_per_program": 1,
                 "prefetch": True, "maxnreg": 128}]
    if ctx.args.no_sweep:
        return [{}]
    if batch is None:
        out = []
        for b in (1, 32):
            out += [v for v in decode_variants(ctx, b) if v not in out]
        return out
    small = small_regime(batch, 8)
    regime = "small" if small else "large"
    out = [{}, FIRST_TUNING[regime], FIRST_TUNING_PREFETCH[regime], {"pdl": False}]
    if small:
        out += [{"maxnreg": 0}, {"split_tokens16": 128}, {"merge_two_pass": True}]
    else:
        out += [{"programs_per_sm": 64}, {"programs_per_sm": 128}, {"merge_two_pass": True}]
    return out


def check_correctness(ctx: Ctx, shape: dict, variants: list[dict], *, write: bool = True) -> dict:
    """Every decode variant (and, with ``write``, the write kernel's configurations) against the
    references at one shape: 2 sequences of 3000 tokens (64 on the CPU) and 2500 / 1507."""
    dev = ctx.dev
    gen = torch.Generator().manual_seed(0)
    h, qh, d, g = shape["kv_heads"], shape["q_heads"], shape["head_dim"], shape["group_size"]
    b, t = 2, (3000 if ctx.cuda else 64)
    k = kv_rows((b, t, h, d), torch.bfloat16, generator=gen).to(dev)
    v = kv_rows((b, t, h, d), torch.bfloat16, generator=gen, outliers=False).to(dev)
    rk = random_rotation(h, d, generator=gen, device=dev)
    rv = random_rotation(h, d, generator=gen, device=dev)
    kclip = torch.full((h,), 0.96, device=dev)
    res = check_write(ctx, k.reshape(-1, h, d), rk, kclip, g) if write else {}
    cache = build_cache(k, v, lengths=[t, t // 2 + 7], k_rotation=rk, v_rotation=rv, k_clip=kclip,
                        v_clip=0.92, group_size=g, sink=ctx.sink, recent=ctx.recent, backend="triton")
    q = kv_rows((b, qh, d), torch.bfloat16, generator=gen).to(dev)
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
            ctx.log(f"check decode {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}")
            continue
        res["decode"].append({"config": cfg, "rel_err": err, "ok": bool(err < 3e-3), "kernel": info})
        ctx.log(f"check decode {cfg}: rel err {err:.2e}; kernel {info}")
    o = decode_attention(q, cache, k_rotation=rk, v_rotation=rv, unrotate=True, backend="triton",
                         out_dtype=torch.float32, config=variants[0])
    err = relative_error(o, decode_attention_reference(q, cache, k_rotation=rk, v_rotation=rv, unrotate=True,
                                                       out_dtype=torch.float32))
    res["decode_unrotate_rel_err"] = err
    ctx.log(f"check decode unrotate: rel err {err:.2e}")
    return res


WRITE_CHECKS = (("planes", {"planes": True}, True), ("planes rounds", {"planes": True, "select": "rounds"}, True),
                ("planes divide", {"planes": True, "quantize": "divide"}, True),
                ("planes per block", {"planes": True, "programs_per_sm": 0}, True),
                ("general", {"planes": False}, True), ("planes, no rotation", {"planes": True}, False))


def check_write(ctx: Ctx, x, rk, kclip, g: int) -> dict:
    """The write kernel's default and :data:`WRITE_CHECKS` configurations against the reference."""
    res = {}
    got = quantize_kv(x, rk, kclip, g, backend="triton")
    # the reference on the CPU: on CUDA tensors torch divides by a Python scalar as a multiply by
    # its reciprocal ((max - min) / 3), which moves ~1e-6 of the codes at rounding ties
    xc, rkc, kclipc = x.cpu(), rk.cpu(), kclip.cpu()
    ref = quantize_kv_reference(xc, rkc, kclipc, g)
    worst, frac = code_agreement(got, ref)
    res["write"] = {"max_level_diff": worst, "codes_differing": frac,
                    "dequant_max_abs_diff": float((got.dequantize().cpu() - ref.dequantize()).abs().max())}
    ctx.log(f"check write: codes differing {frac:.2e} (max {worst} level), dequant max |diff| "
            f"{res['write']['dequant_max_abs_diff']:.3g}")
    for name, cfg, rotated in WRITE_CHECKS:
        got = quantize_kv(x, rk if rotated else None, kclip, g, backend="triton", config=cfg)
        worst, frac = code_agreement(got, quantize_kv_reference(xc, rkc if rotated else None, kclipc, g))
        res[f"write {name}"] = {"max_level_diff": worst, "codes_differing": frac}
        ctx.log(f"check write {name}: codes differing {frac:.2e} (max {worst} level)")
    return res


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


def time_decode(ctx: Ctx, c: int, batch: int, shape: dict, cfg: dict, *, sdpa: bool, paged: int | None = None,
                copies: int | None = None) -> dict:
    """One decode shape: the INT2 call (rotating input copies) and, with ``sdpa``, BF16 SDPA and
    FlashInfer's BF16 paged decode (``kernels_flashinfer``; or the line saying why not)."""
    dev = ctx.dev
    h, qh, d, g = shape["kv_heads"], shape["q_heads"], shape["head_dim"], shape["group_size"]
    window = min(c, ctx.sink + ctx.recent)
    hist = c - window
    ib = int2_bytes(batch, h, d, g, hist, window)
    n2 = copies or ctx.copies(ib)
    bf_bytes = batch * h * c * d * 2 * 2
    nb = ctx.copies(bf_bytes)
    need = ib * n2 + (bf_bytes * nb * 1.3 if sdpa else 0) + (512 << 20)
    row = {"context": c, "batch": batch, "history": hist, "window": window, "config": cfg,
           "int2_bytes": ib, "bf16_bytes": bf_bytes, "paged": paged}
    if need > 0.9 * ctx.free_bytes():
        row["skipped"] = f"needs ~{need / 2**30:.1f} GiB, {ctx.free_bytes() / 2**30:.1f} GiB free"
        return row
    q = torch.randn(batch, qh, d, device=dev).to(torch.bfloat16)
    rk = random_rotation(h, d, device=dev)
    caches = [random_int2_cache(batch, h, d, g, hist, window, device=dev) for _ in range(n2)]
    if paged:
        caches = [random_paged(cc, paged) for cc in caches]
    out = torch.empty(batch, qh, d, device=dev, dtype=torch.bfloat16)
    # bench-only key: the query given already rotated (no rotation kernel), to time what it adds
    kr = None if cfg.get("bench_prerotated") else rk
    kcfg = {k: v for k, v in cfg.items() if not k.startswith("bench_")}
    fns = [lambda cc=cc: decode_attention(q, cc, k_rotation=kr, backend="triton", out=out, check_lengths=False,
                                          config=kcfg) for cc in caches]
    ms = ctx.time(fns)
    sms = ctx.stream(fns)
    row.update(int2_ms=ms, int2_copies=n2, int2_bytes_per_s=ib / (ms * 1e-3), int2_stream_ms=sms,
               int2_stream_bytes_per_s=ib / (sms * 1e-3), kernel=kernel_info(decode_mod.LAST_LAUNCH.get("split")))
    del caches, fns
    if sdpa:
        qs = q.view(batch, qh, 1, d)
        kv = [(torch.randn(batch, h, c, d, device=dev, dtype=torch.bfloat16),
               torch.randn(batch, h, c, d, device=dev, dtype=torch.bfloat16)) for _ in range(nb)]
        res = {}
        try:
            res["sdpa_gqa_ms"] = ctx.time(
                [lambda k=k, v=v: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True) for k, v in kv])
        except Exception as e:  # noqa: BLE001
            res["sdpa_gqa_error"] = f"{type(e).__name__}: {e}"[:200]
        qf = q.view(batch, h, qh // h, d)  # GQA group as query rows: the same attention
        res["sdpa_fold_ms"] = ctx.time([lambda k=k, v=v: F.scaled_dot_product_attention(qf, k, v) for k, v in kv])
        best = min(v for k, v in res.items() if k.endswith("_ms"))
        form = min((k for k in res if k.endswith("_ms")), key=res.get)
        fold = form == "sdpa_fold_ms"
        qx = qf if fold else qs
        res["sdpa_stream_ms"] = ctx.stream([lambda k=k, v=v: F.scaled_dot_product_attention(qx, k, v, enable_gqa=not fold)
                                            for k, v in kv])
        row.update(res, sdpa_ms=best, sdpa_copies=nb, sdpa_bytes_per_s=bf_bytes / (best * 1e-3), speedup=best / ms,
                   stream_speedup=res["sdpa_stream_ms"] / sms)
        del kv
        ctx.empty_cache()
        row.update(flashinfer_fields(ctx, c, batch, shape, q, bf_bytes, nb, best))
        if "flashinfer_ms" in row:
            row.update(flashinfer_speedup=row["flashinfer_ms"] / ms,
                       flashinfer_stream_speedup=row["flashinfer_stream_ms"] / sms)
    ctx.empty_cache()
    return row


def safe_time_decode(ctx: Ctx, c: int, batch: int, *a, **k) -> dict:
    try:
        return time_decode(ctx, c, batch, *a, **k)
    except Exception as e:  # noqa: BLE001 - one failed shape must not lose the rest of the run
        ctx.empty_cache()
        ctx.log(f"decode ctx={c} B={batch} failed: {type(e).__name__}: {str(e)[:300]}")
        return {"context": c, "batch": batch, "skipped": f"error {type(e).__name__}: {str(e)[:200]}"}


def pick_best(cands: list[tuple[float, dict]], margin: float = 0.03) -> dict:
    """The sweep's winner: the fastest config, but the library default (``{}``) unless the fastest
    beats it by more than ``margin``. Wins of 0.1-1.1% at 128K x 1 (``split_tokens16: 128``) were
    noise: the default's own time there moves by 1-2% between runs, and the variant, timed at
    every other context, was slower at 8K and 32K."""
    fastest = min(cands, key=lambda c: c[0])
    default = [c for c in cands if c[1] == {}]
    if default and fastest[0] >= default[0][0] * (1 - margin):
        return {}
    return fastest[1]


def sweep_best(ctx: Ctx, shape: dict, batches: list[int], c_max: int, ok_variants: list[dict], bw: float,
               report: dict) -> dict:
    """Each batch size's variants at the longest context; the best per batch (:func:`pick_best`)."""
    best = {}
    report["sweep"] = []
    for batch in batches:
        cands = []
        todo = [] if (ctx.quick or ctx.args.no_sweep) else [v for v in decode_variants(ctx, batch) if v in ok_variants]
        for cfg in todo:
            if ctx.over_budget():
                break
            row = safe_time_decode(ctx, c_max, batch, shape, cfg, sdpa=False)
            report["sweep"].append(row)
            if "int2_ms" in row:
                cands.append((row["int2_ms"], cfg))
                ctx.log(f"sweep ctx={c_max} B={batch} {cfg}: {row['int2_ms'] * 1e3:.1f} us "
                        f"({row['int2_bytes_per_s'] / bw * 100:.0f}% of copy BW)")
            else:
                ctx.log(f"sweep ctx={c_max} B={batch}: skipped ({row['skipped']})")
        best[batch] = pick_best(cands) if cands else ok_variants[0]
    return best


def time_shapes(ctx: Ctx, shape: dict, contexts: list[int], batches: list[int], best: dict) -> list[dict]:
    """Every context x batch with the batch's best variant, against SDPA."""
    rows = []
    for batch in batches:
        for c in contexts:
            if ctx.over_budget():
                rows.append({"context": c, "batch": batch, "skipped": "time budget"})
                continue
            row = safe_time_decode(ctx, c, batch, shape, best[batch], sdpa=True)
            rows.append(row)
            if "skipped" in row:
                ctx.log(f"decode ctx={c} B={batch}: skipped ({row['skipped']})")
            else:
                fi = (f", FlashInfer {row['flashinfer_ms'] * 1e3:.1f} us, x{row['flashinfer_speedup']:.2f}"
                      if "flashinfer_ms" in row else f"; FlashInfer: {row.get('flashinfer_skipped')}")
                ctx.log(f"decode ctx={c} B={batch}: INT2 {row['int2_ms'] * 1e3:.1f} us, "
                        f"SDPA {row['sdpa_ms'] * 1e3:.1f} us, x{row['speedup']:.2f}" + fi)
    return rows


def time_paged(ctx: Ctx, shape: dict, contexts: list[int], batches: list[int], best: dict) -> list[dict]:
    """The paged layout (page 64, shuffled pages) against contiguous: contiguous with the sweep's
    best, paged with the library's choice for paged caches; alternating rounds on fresh caches
    (one run's ratio moved by +-3% between runs)."""
    out = []
    cases = [(32768, max(batches)), (131072, min(batches))] if ctx.cuda else [(contexts[-1], batches[-1])]
    page = 64 if ctx.cuda else 16
    for pctx, pb in cases:
        if ctx.over_budget() or pctx not in contexts:
            continue
        hist = pctx - min(pctx, ctx.sink + ctx.recent)
        if hist % page:
            continue
        rounds = []
        for _ in range(PAGED_ROUNDS if ctx.cuda else 1):
            cont = safe_time_decode(ctx, pctx, pb, shape, best[pb], sdpa=False)
            pag = safe_time_decode(ctx, pctx, pb, shape, {}, sdpa=False, paged=page)
            if "int2_ms" in cont and "int2_ms" in pag:
                rounds.append({"contiguous_ms": cont["int2_ms"], "paged_ms": pag["int2_ms"],
                               "ratio": pag["int2_ms"] / cont["int2_ms"]})
        entry = {"context": pctx, "batch": pb, "page": page, "config": best[pb], "contiguous": cont, "paged": pag,
                 "rounds": rounds}
        if rounds:
            entry["median_ratio"] = statistics.median(r["ratio"] for r in rounds)
            ctx.log(f"paged page={page} ctx={pctx} B={pb}: median of {len(rounds)} rounds "
                    f"{(entry['median_ratio'] - 1) * 100:+.1f}% against contiguous ({best[pb]}); rounds "
                    + ", ".join(f"{r['paged_ms'] * 1e3:.1f}/{r['contiguous_ms'] * 1e3:.1f} us" for r in rounds))
        out.append(entry)
    return out


def profile_decode(ctx: Ctx, shape: dict, best: dict) -> dict:
    """Device time per kernel of one decode call (torch.profiler, 20 calls) at 128K context."""
    from torch.profiler import ProfilerActivity, profile

    h, qh, d, g = shape["kv_heads"], shape["q_heads"], shape["head_dim"], shape["group_size"]
    out = {}
    for batch in sorted(best):
        if ctx.over_budget():
            break
        try:
            window = ctx.sink + ctx.recent
            cache = random_int2_cache(batch, h, d, g, 131072 - window, window, device=ctx.dev)
            q = torch.randn(batch, qh, d, device=ctx.dev).to(torch.bfloat16)
            rk = random_rotation(h, d, device=ctx.dev)

            def fn():
                decode_attention(q, cache, k_rotation=rk, backend="triton", check_lengths=False, config=best[batch])

            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            rows = {}
            for e in prof.key_averages():
                t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                if t:
                    rows[e.key[:60]] = t / 20
            out[str(batch)] = dict(sorted(rows.items(), key=lambda kv: -kv[1]))
            ctx.log(f"profile 128K B={batch} (us per call): "
                    + ", ".join(f"{k[:40]}={v:.1f}" for k, v in list(out[str(batch)].items())[:6]))
        except Exception as e:  # noqa: BLE001
            ctx.log(f"profile B={batch} failed: {type(e).__name__}: {str(e)[:200]}")
    return out


def breakdown_decode(ctx: Ctx, shape: dict, contexts: list[int]) -> list[dict]:
    """Batch 1, where a call is short: the library default's call time with parts left out
    (``prerotated``: the query given rotated, no rotation kernel; ``no_merge``; ``decode_only``:
    both), the rotation kernel alone, and ``floor``: a graph of one trivial kernel (what every
    timed call, SDPA's too, includes: graph launch and event timing). Differences give what each
    part adds to the critical path; PDL overlaps part of each kernel with its neighbours."""
    h, qh, d, g = shape["kv_heads"], shape["q_heads"], shape["head_dim"], shape["group_size"]
    rows = []
    for c in contexts:
        if ctx.over_budget():
            break
        window = min(c, ctx.sink + ctx.recent)
        n2 = ctx.copies(int2_bytes(1, h, d, g, c - window, window))
        q = torch.randn(1, qh, d, device=ctx.dev).to(torch.bfloat16)
        rk = random_rotation(h, d, device=ctx.dev)
        caches = [random_int2_cache(1, h, d, g, c - window, window, device=ctx.dev) for _ in range(n2)]
        out = torch.empty(1, qh, d, device=ctx.dev, dtype=torch.bfloat16)
        row = {"context": c, "batch": 1}
        for part in BREAKDOWN_PARTS:
            kr = None if part in ("prerotated", "decode_only") else rk
            if part == "rotation_only":
                fns = [lambda: rotate_query_triton(q, rk, h)]
            elif part == "floor":
                fns = [lambda: out.fill_(1.0)]
            else:
                fns = [lambda cc=cc, kr=kr: decode_attention(q, cc, k_rotation=kr, backend="triton", out=out,
                                                             check_lengths=False) for cc in caches]
            with merge_left_out() if part in ("no_merge", "decode_only") else contextlib.nullcontext():
                row[part + "_ms"] = ctx.time(fns)
        rows.append(row)
        ctx.log(f"breakdown ctx={c} B=1 (us): " + ", ".join(f"{p} {row[p + '_ms'] * 1e3:.1f}" for p in BREAKDOWN_PARTS))
        del caches
        ctx.empty_cache()
    return rows
