"""The sweeps of ``bench_kernels.py``: ``--variants`` (decode configs at every shape) and
``--write-variants`` (write configs checked against the reference, then timed in alternating
rounds). Their results are research, written to ``--out`` only (``sweep.json``, ``write_sweep.json``)."""

from __future__ import annotations

import json
import statistics

import torch
from kernels_common import Ctx, kernel_info
from kernels_decode import check_correctness, safe_time_decode
from kernels_write import ratio_tensor, write_inputs, zoo_clip_ratios

from oscar_calib.kernels import quantize_kv, quantize_kv_reference
from oscar_calib.kernels import write as write_mod
from oscar_calib.kernels.testing import code_agreement, kv_rows, random_rotation

WRITE_ROUNDS = 3  # alternating rounds of a write sweep (each config timed once per round)
BENCH_KEYS = ("rotation", "clip", "clip_ratio")


def sweep_variants(ctx: Ctx, report: dict, shape: dict, contexts: list[int], batches: list[int], bw: float) -> None:
    """``--variants``: check each config against the reference, then time it at every shape."""
    variants = ctx.variants
    report["correctness"] = check_correctness(ctx, shape, variants, write=False)
    rows = report["rows"]
    for cfg, ok in zip(variants, report["correctness"]["decode"]):
        if not ok["ok"]:
            ctx.log(f"variant {cfg}: failed the correctness check, not timed")
            continue
        for batch in batches:
            for c in contexts:
                if ctx.over_budget():
                    break
                row = safe_time_decode(ctx, c, batch, shape, cfg, sdpa=False, paged=cfg.get("bench_paged"))
                rows.append(row)
                if "int2_ms" in row:
                    ctx.log(f"variant ctx={c} B={batch} {cfg}: {row['int2_ms'] * 1e3:.1f} us "
                            f"({row['int2_bytes_per_s'] / bw * 100:.0f}% of copy BW), in stream "
                            f"{row['int2_stream_ms'] * 1e3:.1f} us ({row['int2_stream_bytes_per_s'] / bw * 100:.0f}%)")


def print_sweep(report: dict, contexts: list[int], batches: list[int]) -> None:
    for batch in batches:
        for c in contexts:
            rows = sorted((r for r in report["rows"] if r["batch"] == batch and r["context"] == c
                           and "int2_ms" in r), key=lambda r: r["int2_ms"])
            for r in rows:
                stream = f"{r['int2_stream_ms'] * 1e3:8.1f} us in stream" if "int2_stream_ms" in r else ""
                print(f"{c:>7} x {batch:<3} {r['int2_ms'] * 1e3:8.1f} us {stream}  {r['config']}")


def write_check_rows(h: int, d: int, gen, tokens: int = 1200) -> torch.Tensor:
    """Rows for the write sweep's check: Qwen-like K rows, plus rows whose values are all equal
    after the clip (some beyond it), all zero, or a few ulps apart around a large offset
    (degenerate groups that exact kernels must handle like the reference), ``tokens`` (at least
    100) x ``h`` heads."""
    x = kv_rows((tokens, h, d), torch.float32, generator=gen)
    x[:60] = 3.0  # all equal after the clip, with values beyond it on one side or the other
    x[:20, :, :5] = 50.0
    x[20:40, :, 3:6] = -50.0
    x[60:80] = 1000.0 + torch.randint(-3, 4, (20, h, d), generator=gen) * 6.1e-5
    x[80:100] = 0.0
    return x.to(torch.bfloat16)


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


def check_write_configs(ctx: Ctx, report: dict, shape: dict, configs: list[dict]) -> list[dict]:
    """Each config's code agreement with the reference, rotated and not; the configs that pass."""
    h, d, g = shape["kv_heads"], shape["head_dim"], shape["group_size"]
    gen = torch.Generator().manual_seed(5)
    xc = write_check_rows(h, d, gen, tokens=1200 if ctx.cuda else 120)
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
                got = quantize_kv(xc.to(ctx.dev), None if rot is None else rot.to(ctx.dev),
                                  None if clip_i is None else clip_i.to(ctx.dev), g, backend="triton", config=kcfg)
                ref = refs[(clip_i is not None, name)] if "clip_ratio" not in cfg else \
                    quantize_kv_reference(xc, rot, clip_i, g)
                worst, frac = code_agreement(got, ref)
                same = bool(torch.equal(got.scale.cpu(), ref.scale) and torch.equal(got.offset.cpu(), ref.offset))
                row[name] = {"max_level_diff": worst, "codes_differing": frac, "params_identical": same}
        except Exception as e:  # noqa: BLE001 - a config the kernel refuses is a failed check, not a crash
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            report["write_check"].append(row)
            ctx.log(f"check write {cfg}: {row['error']} -- FAILED, not timed")
            continue
        # unrotated input must match exactly; rotated, by at most a rounding tie (one level, rare)
        row["ok"] = (row["no rot"]["codes_differing"] == 0 and row["no rot"]["params_identical"]
                     and row["rot"]["max_level_diff"] <= 1 and row["rot"]["codes_differing"] <= 1e-4)
        report["write_check"].append(row)
        ctx.log(f"check write {cfg}: rotated {row['rot']['codes_differing']:.2e} codes differ, unrotated "
                f"{row['no rot']['codes_differing']:.2e} (params identical: {row['no rot']['params_identical']})"
                f"{'' if row['ok'] else ' -- FAILED, not timed'}")
        if row["ok"]:
            ok_cfgs.append(cfg)
    return ok_cfgs


def sweep_write(ctx: Ctx, report: dict, shape: dict, configs: list[dict]) -> None:
    """``--write-variants``: each config checked (:func:`check_write_configs`), then those that
    pass timed on 128K tokens x 8 heads in ``WRITE_ROUNDS`` alternating rounds (median)."""
    h, d, g = shape["kv_heads"], shape["head_dim"], shape["group_size"]
    ok_cfgs = check_write_configs(ctx, report, shape, configs)
    x, rot, clip_d, out = write_inputs(ctx, h, d, g)
    t = x.shape[0]
    nbytes = x.numel() * x.element_size() + out.codes.numel() + 2 * out.scale.numel() * 2
    times: dict[int, list[float]] = {i: [] for i in range(len(ok_cfgs))}
    regs: dict[int, object] = {}
    for _ in range(WRITE_ROUNDS if ctx.cuda else 1):
        for i, cfg in enumerate(ok_cfgs):
            if ctx.over_budget():
                break
            kcfg, r_i, c_i = kernel_config(cfg, rot, clip_d)

            def fn(kcfg=kcfg, r_i=r_i, c_i=c_i):
                quantize_kv(x, r_i, c_i, g, backend="triton", out=out, config=kcfg)

            times[i].append(ctx.time([fn]))
            regs[i] = kernel_info(write_mod.LAST_LAUNCH.get("write"))
    for i, cfg in enumerate(ok_cfgs):
        if not times[i]:
            continue
        ms = statistics.median(times[i])
        report["rows"].append({"config": cfg, "ms": ms, "runs_ms": times[i], "tokens": t, "bytes": nbytes,
                               "bytes_per_s": nbytes / (ms * 1e-3), "kernel": regs.get(i)})
    report["ncu_decode"] = []
    report["write_profile"] = [{"name": json.dumps(cfg), "config": kernel_config(cfg, None, None)[0],
                                "rot": cfg.get("rotation", True), "clip": cfg.get("clip", True),
                                "clip_ratio": cfg.get("clip_ratio", list(zoo_clip_ratios(h)))}
                               for cfg in ok_cfgs]


def print_write_sweep(ctx: Ctx, report: dict, bw: float) -> None:
    for n in report.get("ncu", []):
        m = n["metrics"]
        ctx.log(f"ncu {n['what']}: {(m.get('time') or 0) / 1e3:.1f} us, {m.get('warp_instructions') or 0:.3g} warp "
                f"instructions, issue {m.get('issue_pct') or 0:.0f}%, DRAM {m.get('dram_pct') or 0:.0f}%, ALU pipe "
                f"{m.get('alu_pipe_pct') or 0:.0f}%, {m.get('registers')} registers -> {m['bound']}")
    rows = report["rows"]
    tokens = rows[0]["tokens"] if rows else 0
    print(f"write, {tokens} tokens x {report['settings']['shape']['kv_heads']} heads, with rotation and clip unless "
          f"the config says otherwise (median of {WRITE_ROUNDS if ctx.cuda else 1} rounds):")
    for r in sorted(rows, key=lambda r: r["ms"]):
        runs = ", ".join(f"{m * 1e3:.1f}" for m in r["runs_ms"])
        print(f"{r['ms'] * 1e3:8.1f} us  {r['bytes_per_s'] / bw * 100:4.0f}% of copy  ({runs})  {r['config']}")
