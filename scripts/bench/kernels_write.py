"""The write kernel in ``bench_kernels.py`` (rotate + clip + quantise + pack): its timed variants,
the configurations profiled under Nsight Compute, and the clip ratios it is timed at."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from kernels_common import Ctx, kernel_info

from oscar_calib.kernels import QuantizedKV, quantize_kv
from oscar_calib.kernels import write as write_mod
from oscar_calib.kernels.testing import random_rotation

ZOO = Path(__file__).resolve().parents[2] / "zoo"


def write_variants(ctx: Ctx) -> list[tuple[str, dict, dict]]:
    """(name, kernel config, options) of every timed write; options: ``clip``, ``rot`` (default
    True), ``ratio`` (instead of the zoo's), ``fp32`` (float32 rows), ``fast`` (fast rotation),
    ``center`` (a key-centering shift, the one more operand of a centered key cache)."""
    if ctx.quick:
        return [("rot+clip", {}, {"clip": True})]
    gen = {"planes": False}
    clip, noclip = {"clip": True}, {"clip": False}
    norot, fp32 = {"clip": True, "rot": False}, {"clip": True, "rot": False, "fp32": True}
    # "{}" is the library default: plane-wise, codes by thresholds; with a 16-bit rotation one
    # product split into planes on a persistent grid (2 programs per SM; 128-row blocks, 8 warps,
    # 3 stages) whose programs load the rotation once, and the tournament clip selection
    # (unrotated 16-bit input: rounds over integer keys).
    blocks = {"programs_per_sm": 0, "num_stages": 3}  # one program per 64-row block
    tile2d = {"BT": 64, "num_warps": 4, "num_stages": 2}  # a 64-row tile of the persistent grid
    return [("rot+clip", {}, clip),
            ("rot+clip centered", {}, {"clip": True, "center": True}),
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
            ("no rot, clip centered", {}, {**norot, "center": True}),
            ("no rot, clip general", gen, norot),
            ("no rot, fp32 clip", {}, fp32),
            ("no rot, fp32 clip rounds", {"select": "rounds"}, fp32),
            ("no rot, clip divide", {"quantize": "divide"}, norot),
            ("no rot/clip", {}, {"clip": False, "rot": False}),
            ("no rot/clip divide", {"quantize": "divide"}, {"clip": False, "rot": False}),
            ("no rot/clip general", gen, {"clip": False, "rot": False})]


def write_profile(ctx: Ctx, rows: list[dict], h: int) -> list[dict]:
    """Write configurations for ``scripts/dev/ncu_kernels.py``: the library defaults with clip (with
    and without rotation), the fastest rotated one with clip, the fastest without either."""
    opts = {n: o for n, _, o in write_variants(ctx)}
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
    for f in sorted(ZOO.glob("*/*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            vals += [fh.get_tensor(k).flatten() for k in fh.keys() if k.endswith(("k_clip", "v_clip"))]
    if not vals:
        return (0.92,) * h
    v = torch.cat(vals).double()
    q = torch.quantile(v, torch.tensor([(i + 0.5) / h for i in range(h)], dtype=torch.float64))
    return tuple(round(float(c), 4) for c in q)


def centering_shift(h: int, d: int, device) -> torch.Tensor:
    """A key-centering shift ``[h, d]`` float32 (the mean key in the rotated basis; random here: the
    kernel's cost does not depend on its values)."""
    return (torch.randn(h, d, generator=torch.Generator().manual_seed(11)) * 2).to(device)


def ratio_tensor(ratio, like: torch.Tensor) -> torch.Tensor:
    """Clip ratios shaped like ``like``: one number for every head, or a list, one per head."""
    vals = list(ratio) if isinstance(ratio, (list, tuple)) else [ratio] * like.numel()
    return torch.tensor(vals, dtype=like.dtype, device=like.device)


def write_inputs(ctx: Ctx, h: int, d: int, g: int):
    """The timed write's inputs: 128K tokens (256 under --quick) x ``h`` heads of bf16 rows with
    an outlier channel, a random rotation, the zoo's clip ratios (:func:`zoo_clip_ratios`), and
    the output buffers."""
    dev = ctx.dev
    t = 131072 if ctx.cuda else 256
    x = torch.randn(t, h, d, device=dev).to(torch.bfloat16)
    x[..., 7] = x[..., 7] * 20 + 5
    rk = random_rotation(h, d, device=dev)
    clip = torch.tensor(zoo_clip_ratios(h), device=dev)
    out = QuantizedKV(torch.empty(t, h, d // 4, dtype=torch.uint8, device=dev),
                      torch.empty(t, h, d // g, dtype=torch.float16, device=dev),
                      torch.empty(t, h, d // g, dtype=torch.float16, device=dev), g)
    return x, rk, clip, out


def time_write(ctx: Ctx, shape: dict) -> list[dict]:
    """Every :func:`write_variants` entry on :func:`write_inputs`."""
    h, d, g = shape["kv_heads"], shape["head_dim"], shape["group_size"]
    x, rk, clip, out = write_inputs(ctx, h, d, g)
    t = x.shape[0]
    x32 = None
    rows = []
    for name, cfg, opt in write_variants(ctx):
        if ctx.over_budget():
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

        shift = centering_shift(h, d, ctx.dev) if opt.get("center") else None

        def fn(xin=xin, rot=rot, cl=cl, opt=opt, cfg=cfg, shift=shift):
            quantize_kv(xin, rot, cl, g, backend="triton", out=out, fast_rotation=opt.get("fast", False), config=cfg,
                        center=shift)

        try:
            ms = ctx.time([fn])
        except Exception as e:  # noqa: BLE001
            rows.append({"name": name, "skipped": f"error {type(e).__name__}: {str(e)[:200]}"})
            ctx.log(f"write {name} failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        rows.append({"name": name, "config": cfg, "tokens": t, "bytes": nbytes, "ms": ms,
                     "bytes_per_s": nbytes / (ms * 1e-3), "kernel": kernel_info(write_mod.LAST_LAUNCH.get("write"))})
        ctx.log(f"write {name}: {ms * 1e3:.1f} us, {nbytes / (ms * 1e-3) / 1e9:.0f} GB/s")
    return rows
