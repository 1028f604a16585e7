"""Triton kernel behind :func:`oscar_calib.kernels.write.quantize_kv` (imported lazily).

One program quantises ``BT`` rows (tokens) of one KV head: load ``[BT, d]``, rotate on the tensor
cores (fp32 accumulation), find each row's clip threshold, quantise per group, pack and store.

Clip threshold: ``t = sorted(|y|)[k]`` with ``k = min(floor(c*d), d-1)`` precomputed per head on
the host, i.e. the ``m``-th largest ``|y|`` with ``m = d - k`` (or minus the ``(k+1)``-th largest of
``-|y|`` when that is fewer rounds). Fast path: ``m`` rounds of "largest value below the previous
one" (one masked row maximum each), then one count: if exactly ``m`` values are ``>= v`` (no
ties among the top ``m``, the usual case), ``v`` is the answer. Otherwise the block falls back to
the exact tie-aware selection (max, count the occurrences, remove them). Exact either way;
``m + 1`` row reductions instead of ``2m``. Unrotated 16-bit input (e.g. values whose rotation
lives in v_proj) has many ties; there the kernel orders unique integer keys ``bits(|y|) |
column`` instead (``m`` reductions, exact, no fallback).

Quantisation: ``q = floor(y/s + z + 0.5)`` with IEEE division (``div_rn``), the reference's
arithmetic. (Multiplying by ``1/s`` and redoing only blocks near a rounding tie was tried: on
an H200 the block-wide tie check cost more than the division it saved.)
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _kth_largest(a, m, BT: tl.constexpr):
    """Per row of ``a`` [BT, D], the ``m``-th largest value counting multiplicity (1 <= m <= D)."""
    rem = tl.zeros([BT], dtype=tl.int32) + m
    t = tl.zeros([BT], dtype=tl.float32)
    for _ in range(m):
        v = tl.max(a, axis=1)
        eq = a == v[:, None]
        cnt = tl.sum(eq.to(tl.int32), axis=1)
        t = tl.where((rem > 0) & (cnt >= rem), v, t)
        rem = rem - cnt
        a = tl.where(eq, float("-inf"), a)
    return t


@triton.jit
def _kth_largest_fast(a, m, rmask):
    """``m``-th largest value per row assuming no ties among the top ``m``; ``ok`` says where the
    assumption holds (exactly ``m`` values ``>= v``; rows outside ``rmask`` count as ok)."""
    v = tl.max(a, axis=1)
    for _ in range(m - 1):
        v = tl.max(tl.where(a < v[:, None], a, float("-inf")), axis=1)
    cnt = tl.sum((a >= v[:, None]).to(tl.int32), axis=1)
    ok = (cnt == m) | (rmask == 0)
    return v, ok


@triton.jit
def _select(a, m, rmask, BT: tl.constexpr):
    t, ok = _kth_largest_fast(a, m, rmask)
    if tl.min(ok.to(tl.int32), axis=0) == 0:  # a tie among the top m somewhere in the block
        t = _kth_largest(a, m, BT)
    return t


@triton.jit
def _kth_keyed(a, m, LARGEST: tl.constexpr, D: tl.constexpr):
    """``m``-th largest (or smallest) value per row of ``a >= 0`` that came from 16-bit inputs:
    their float32 bit patterns have at least 13 zero low bits, so ``bits | column`` is a unique
    integer key with the same order; ``m`` rounds of "next key" are exact, ties included."""
    key = a.to(tl.int32, bitcast=True) | tl.arange(0, D)[None, :]
    if LARGEST:
        v = tl.max(key, axis=1)
        for _ in range(m - 1):
            v = tl.max(tl.where(key < v[:, None], key, -1), axis=1)
    else:
        v = tl.min(key, axis=1)
        for _ in range(m - 1):
            v = tl.min(tl.where(key > v[:, None], key, 2147483647), axis=1)
    return (v & -256).to(tl.float32, bitcast=True)


@triton.jit
def quantize_kv_kernel(
    x_ptr, s_xt, s_xh,
    r1_ptr, r2_ptr, kidx_ptr,
    codes_ptr, s_ct, s_ch,
    scale_ptr, off_ptr, s_st, s_sh,
    T,
    D: tl.constexpr, G: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, KB: tl.constexpr,
    ROT: tl.constexpr, CLIP: tl.constexpr, INTERP: tl.constexpr, FAST_DIV: tl.constexpr,
    KEYED: tl.constexpr = False,
):
    # ROT: 0 none, 1 16-bit hi+lo (two dots), 2 fp32 ("ieee"), 3 16-bit hi only.
    pid = tl.program_id(0)
    h = tl.program_id(1)
    rows = pid * BT + tl.arange(0, BT)
    rmask = rows < T
    cols = tl.arange(0, D)
    xrow = x_ptr + rows.to(tl.int64)[:, None] * s_xt + h * s_xh
    if ROT == 0:
        y = tl.load(xrow + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    else:
        y = tl.zeros([BT, D], dtype=tl.float32)
        kk = tl.arange(0, KB)
        rbase = h.to(tl.int64) * D * D
        for kb in tl.static_range(D // KB):
            xk = tl.load(xrow + kb * KB + kk[None, :], mask=rmask[:, None], other=0.0)
            roff = rbase + (kb * KB + kk)[:, None] * D + cols[None, :]
            r1 = tl.load(r1_ptr + roff)
            if ROT == 2:
                y = tl.dot(xk, r1, y, input_precision="ieee")
            else:
                if INTERP:  # the interpreter's bf16 dot is wrong; fp32 is exact for 16-bit operands
                    xk = xk.to(tl.float32)
                    r1 = r1.to(tl.float32)
                y = tl.dot(xk, r1, y)
                if ROT == 1:
                    r2 = tl.load(r2_ptr + roff)
                    if INTERP:
                        r2 = r2.to(tl.float32)
                    y = tl.dot(xk, r2, y)
    if CLIP:
        kq = tl.load(kidx_ptr + h)
        a = tl.abs(y)
        if KEYED:  # unrotated 16-bit input: ties are common, unique integer keys make them free
            if kq >= D // 2:
                t = _kth_keyed(a, D - kq, True, D)
            else:
                t = _kth_keyed(a, kq + 1, False, D)
        elif kq >= D // 2:
            t = _select(a, D - kq, rmask, BT)
        else:
            t = -_select(-a, kq + 1, rmask, BT)
        y = tl.maximum(tl.minimum(y, t[:, None]), -t[:, None])

    yg = tl.reshape(y, [BT, D // G, G])
    lo = tl.min(yg, axis=2)
    hi = tl.max(yg, axis=2)
    s = tl.maximum(tl.math.div_rn(hi - lo, tl.full([BT, D // G], 3.0, tl.float32)), 1e-8)
    z = tl.math.div_rn(-lo, s)
    if FAST_DIV:  # y * (1/s): differs from y / s by an ulp at most, so only at rounding ties
        r = tl.math.div_rn(tl.full([BT, D // G], 1.0, tl.float32), s)
        qf = tl.floor(yg * r[:, :, None] + z[:, :, None] + 0.5)
    else:  # IEEE division, the reference's arithmetic exactly
        s_b = tl.broadcast_to(s[:, :, None], [BT, D // G, G])
        qf = tl.floor(tl.math.div_rn(yg, s_b) + z[:, :, None] + 0.5)
    q = tl.minimum(tl.maximum(qf, 0.0), 3.0).to(tl.int32)

    q4 = tl.reshape(q, [BT, D // (4 * W), 4, W])
    shifts = 2 * tl.arange(0, 4)
    packed = tl.sum(q4 << shifts[None, None, :, None], axis=2)
    packed = tl.reshape(packed, [BT, D // 4]).to(tl.uint8)
    crow = codes_ptr + rows.to(tl.int64)[:, None] * s_ct + h * s_ch
    tl.store(crow + tl.arange(0, D // 4)[None, :], packed, mask=rmask[:, None])

    off = -(z * s)
    s16 = tl.minimum(s, 65504.0).to(tl.float16)
    o16 = tl.minimum(tl.maximum(off, -65504.0), 65504.0).to(tl.float16)
    prow = rows.to(tl.int64)[:, None] * s_st + h * s_sh + tl.arange(0, D // G)[None, :]
    tl.store(scale_ptr + prow, s16, mask=rmask[:, None])
    tl.store(off_ptr + prow, o16, mask=rmask[:, None])
