"""Triton kernels behind :func:`oscar_calib.kernels.write.quantize_kv` (imported lazily).

One program quantises ``BT`` rows (tokens) of one KV head: load ``[BT, d]``, rotate on the tensor
cores (fp32 accumulation), subtract the head's centering shift (``CENTER``: one ``[d]`` float32 load
per program), find each row's clip threshold, quantise per group, pack and store.
``quantize_kv_kernel`` holds the row as one ``[BT, d]`` tensor (general); for rows of a single
byte block, ``quantize_kv_planes_kernel`` holds it as four ``[BT, d/4]`` bit-plane tensors (below).

Clip threshold: ``t = sorted(|y|)[k]`` with ``k = min(floor(c*d), d-1)`` precomputed per head on
the host, i.e. the ``m``-th largest ``|y|`` with ``m = d - k`` (or minus the ``(k+1)``-th largest of
``-|y|`` when that is fewer rounds). Fast path: ``m`` rounds of "largest value below the previous
one" (one masked row maximum each), then one count: if exactly ``m`` values are ``>= v`` (no
ties among the top ``m``, the usual case), ``v`` is the answer. Otherwise the block falls back to
the exact tie-aware selection (max, count the occurrences, remove them). Exact either way;
``m + 1`` row reductions instead of ``2m``. Unrotated 16-bit input (e.g. values whose rotation
lives in v_proj) has many ties; there the kernel orders unique integer keys ``bits(|y|) |
column`` instead (``m`` reductions, exact, no fallback). The plane-wise kernel's default
(``SORTED``) runs the fast path as a tournament: each column's four plane values sorted once,
then per round one row reduction over the column heads and a pop (:func:`_mth_sorted4`).

Quantisation: ``q = floor(y/s + z + 0.5)`` with IEEE division (``div_rn``) is the reference's
arithmetic. The plane-wise kernel (``THRESH``) gets the same codes from three thresholds per
group, derived exactly from that arithmetic (see ``_thresholds``; ``CHECKT`` re-checks them with
it), and divides only in a block where a group fails (non-finite, or ``|z| >= 2^50``). With
``LATE`` the codes are thresholds of the unclipped values: the clip only moves each group's
extremes, and a per-group check (:func:`_clip_free`) sends a block whose clipped group is
degenerate to the clipped division. (Multiplying by ``1/s`` and redoing only blocks near a
rounding tie was tried: on an H200 the block-wide tie check cost more than the division it saved.)
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
    r1_ptr, r2_ptr, kidx_ptr, c_ptr,
    codes_ptr, s_ct, s_ch,
    scale_ptr, off_ptr, s_st, s_sh,
    T,
    D: tl.constexpr, G: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, KB: tl.constexpr,
    ROT: tl.constexpr, CLIP: tl.constexpr, INTERP: tl.constexpr, FAST_DIV: tl.constexpr,
    KEYED: tl.constexpr = False, CENTER: tl.constexpr = False,
):
    # ROT: 0 none, 1 16-bit hi+lo (two dots), 2 fp32 ("ieee"), 3 16-bit hi only.
    # CENTER: subtract c[h] (float32 [H, D], the key mean in the rotated basis) from every rotated row.
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
    if CENTER:
        y = y - tl.load(c_ptr + h * D + cols)[None, :]
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


# --------------------------------------------------------------------------------------------
# Plane-wise kernel (one byte block per row, ``D == 4W``): the row is held as four ``[BT, W]``
# tensors, plane ``p`` = channels ``[pW, (p+1)W)`` = bit pair ``p`` of bytes ``0..W-1``. Every
# step (rotation dots, clip selection, group statistics, quantisation, packing) works on
# tensors of one layout, so packing is four shifts and ors per byte and no reshape moves data
# between threads.
# --------------------------------------------------------------------------------------------


@triton.jit
def _rdot(xk, r1_ptr, r2_ptr, roff, y, ROT: tl.constexpr, INTERP: tl.constexpr):
    """``y += xk @ R[roff]`` for one plane's columns (ROT as in :func:`quantize_kv_kernel`)."""
    r1 = tl.load(r1_ptr + roff)
    if ROT == 2:
        y = tl.dot(xk, r1, y, input_precision="ieee")
    else:
        if INTERP:  # the interpreter's 16-bit dot is not exact; fp32 is, for 16-bit operands
            xk = xk.to(tl.float32)
            r1 = r1.to(tl.float32)
        y = tl.dot(xk, r1, y)
        if ROT == 1:
            r2 = tl.load(r2_ptr + roff)
            if INTERP:
                r2 = r2.to(tl.float32)
            y = tl.dot(xk, r2, y)
    return y


@triton.jit
def _max4(a0, a1, a2, a3):
    return tl.maximum(tl.maximum(tl.max(a0, axis=1), tl.max(a1, axis=1)),
                      tl.maximum(tl.max(a2, axis=1), tl.max(a3, axis=1)))


@triton.jit
def _max4_below(a0, a1, a2, a3, v):
    """Per row, the largest value strictly below ``v``."""
    vb = v[:, None]
    return _max4(tl.where(a0 < vb, a0, float("-inf")), tl.where(a1 < vb, a1, float("-inf")),
                 tl.where(a2 < vb, a2, float("-inf")), tl.where(a3 < vb, a3, float("-inf")))


@triton.jit
def _count4(a0, a1, a2, a3, v, SIGNS: tl.constexpr = False):
    """Per row, how many values are ``>= v`` (one row reduction over the four planes' counts);
    ``SIGNS``: as ``> pred(v)`` by the signs of differences (:func:`_below`)."""
    if SIGNS:
        pb = _f32_pred(v)[:, None]
        return -tl.sum(_below(pb, a0) + _below(pb, a1) + _below(pb, a2) + _below(pb, a3), axis=1)
    vb = v[:, None]
    ge = (a0 >= vb).to(tl.int32) + (a1 >= vb).to(tl.int32) + (a2 >= vb).to(tl.int32) + (a3 >= vb).to(tl.int32)
    return tl.sum(ge, axis=1)


@triton.jit
def _kth_largest4(a0, a1, a2, a3, m, BT: tl.constexpr):
    """Tie-aware ``m``-th largest per row over the four planes (see :func:`_kth_largest`)."""
    rem = tl.zeros([BT], dtype=tl.int32) + m
    t = tl.zeros([BT], dtype=tl.float32)
    for _ in range(m):
        v = _max4(a0, a1, a2, a3)
        vb = v[:, None]
        cnt = (tl.sum((a0 == vb).to(tl.int32), axis=1) + tl.sum((a1 == vb).to(tl.int32), axis=1)
               + tl.sum((a2 == vb).to(tl.int32), axis=1) + tl.sum((a3 == vb).to(tl.int32), axis=1))
        t = tl.where((rem > 0) & (cnt >= rem), v, t)
        rem = rem - cnt
        a0 = tl.where(a0 == vb, float("-inf"), a0)
        a1 = tl.where(a1 == vb, float("-inf"), a1)
        a2 = tl.where(a2 == vb, float("-inf"), a2)
        a3 = tl.where(a3 == vb, float("-inf"), a3)
    return t


@triton.jit
def _select4(a0, a1, a2, a3, m, rmask, BT: tl.constexpr):
    """``m``-th largest per row: ``m`` rounds of "largest below the previous", one count, and the
    tie-aware selection only for blocks with a tie among the top ``m`` (exact either way)."""
    v = _max4(a0, a1, a2, a3)
    for _ in range(m - 1):
        v = _max4_below(a0, a1, a2, a3, v)
    return _unless_tied(a0, a1, a2, a3, v, m, rmask, BT)


@triton.jit
def _unless_tied(a0, a1, a2, a3, v, m, rmask, BT: tl.constexpr, SIGNS: tl.constexpr = False):
    """``v`` where every row of the block has exactly ``m`` values ``>= v`` (no tie among its top
    ``m``: the fast paths' answer is exact), else the tie-aware selection for the block."""
    ok = (_count4(a0, a1, a2, a3, v, SIGNS) == m) | (rmask == 0)
    if tl.min(ok.to(tl.int32), axis=0) == 0:
        v = _kth_largest4(a0, a1, a2, a3, m, BT)
    return v


@triton.jit
def _ce(x, y):
    """Compare-exchange: (larger, smaller)."""
    return tl.maximum(x, y), tl.minimum(x, y)


@triton.jit
def _mth_sorted4(a0, a1, a2, a3, m, LOWEST: tl.constexpr, TOP3: tl.constexpr = False):
    """``m`` rounds of a tournament over the ``W`` columns of each row: the four plane values of
    a column (held by one thread) are sorted once (five compare-exchanges); a round takes the
    row maximum of the column heads and pops the column(s) whose head it was. Without ties
    among the top ``m`` this is the ``m``-th largest value (the caller checks).
    Per round: one compare, four selects and one row reduction per column, against a
    compare, a select and a maximum per value (and four reductions) for
    :func:`_max4_below`. ``TOP3``: each column keeps its three largest values only (a column
    holding four of the row's top ``m`` then yields a smaller value, which the caller's count
    check refuses like a tie)."""
    s0, s1 = _ce(a0, a1)
    s2, s3 = _ce(a2, a3)
    s0, s2 = _ce(s0, s2)
    if TOP3:
        s1 = tl.maximum(s1, s3)
    else:
        s1, s3 = _ce(s1, s3)
    s1, s2 = _ce(s1, s2)
    v = tl.max(s0, axis=1)
    for _ in range(m - 1):
        pop = s0 == v[:, None]
        s0 = tl.where(pop, s1, s0)
        s1 = tl.where(pop, s2, s1)
        if TOP3:
            s2 = tl.where(pop, LOWEST, s2)
        else:
            s2 = tl.where(pop, s3, s2)
            s3 = tl.where(pop, LOWEST, s3)
        v = tl.max(s0, axis=1)
    return v


@triton.jit
def _mag(y, NEG: tl.constexpr):
    """``|y|``, or ``-|y|`` where ``NEG``."""
    a = tl.abs(y)
    if NEG:
        a = -a
    return a


@triton.jit
def _select4_sorted_y(y0, y1, y2, y3, m, rmask, BT: tl.constexpr, NEG: tl.constexpr, TOP3: tl.constexpr,
                      SIGNS: tl.constexpr = False):
    """:func:`_select4` with the tournament of :func:`_mth_sorted4` for the rounds, over the
    magnitudes of ``y`` (negated where ``NEG``); the same count check (exactly ``m`` values
    ``>= v``) and tie-aware fallback, so exact either way."""
    a0 = _mag(y0, NEG)
    a1 = _mag(y1, NEG)
    a2 = _mag(y2, NEG)
    a3 = _mag(y3, NEG)
    return _unless_tied(a0, a1, a2, a3, _mth_sorted4(a0, a1, a2, a3, m, float("-inf"), TOP3), m, rmask, BT, SIGNS)


@triton.jit
def _key(a, P: tl.constexpr, W: tl.constexpr):
    return a.to(tl.int32, bitcast=True) | (P * W + tl.arange(0, W))[None, :]


@triton.jit
def _kth_keyed4(a0, a1, a2, a3, m, LARGEST: tl.constexpr, W: tl.constexpr):
    """:func:`_kth_keyed` over the four planes (unique keys ``bits | channel``; exact)."""
    k0 = _key(a0, 0, W)
    k1 = _key(a1, 1, W)
    k2 = _key(a2, 2, W)
    k3 = _key(a3, 3, W)
    if LARGEST:
        v = _max4(k0, k1, k2, k3)
        for _ in range(m - 1):
            vb = v[:, None]
            v = _max4(tl.where(k0 < vb, k0, -1), tl.where(k1 < vb, k1, -1),
                      tl.where(k2 < vb, k2, -1), tl.where(k3 < vb, k3, -1))
    else:
        v = -_max4(-k0, -k1, -k2, -k3)
        for _ in range(m - 1):
            vb = v[:, None]
            big = 2147483647
            v = -_max4(-tl.where(k0 > vb, k0, big), -tl.where(k1 > vb, k1, big),
                       -tl.where(k2 > vb, k2, big), -tl.where(k3 > vb, k3, big))
    return (v & -256).to(tl.float32, bitcast=True)


@triton.jit
def _qplane(y, s, z):
    """Codes of one plane: ``clamp(floor(y/s + z + 0.5), 0, 3)`` with IEEE division."""
    sb = tl.broadcast_to(s[:, None], y.shape)
    qf = tl.floor(tl.math.div_rn(y, sb) + z[:, None] + 0.5)
    return tl.minimum(tl.maximum(qf, 0.0), 3.0).to(tl.int32)


# Quantisation by thresholds. ``f(y) = floor(fl(fl(fl(y / s) + z) + 0.5))`` (the reference's
# arithmetic) is monotone in ``y``: every step is a correctly rounded operation, and those are
# monotone. So ``clamp(f(y), 0, 3) = [y >= T1] + [y >= T2] + [y >= T3]`` with ``T_k`` the smallest
# float32 with ``f(T_k) >= k``: three compares per value instead of a division. ``T_k`` comes
# backwards through the chain: ``U_k``, the smallest float with ``fl(U_k + 0.5) >= k`` (0.5 - 2^-25,
# 1.5, 2.5; ``tests`` recomputes them); ``Q_k``, the smallest float with ``fl(Q_k + z) >= U_k``;
# ``T_k``, the smallest float with ``fl(T_k / s) >= Q_k``. A correctly rounded result is ``>= X``
# exactly when the exact value lies above the midpoint of ``pred(X)`` and ``X`` (or on it, when the
# tie goes to ``X``: an even mantissa), and the midpoints, ``m - z`` and ``m * s`` are computed in
# float64. Each ``T_k`` is then checked with the reference arithmetic (``f(T_k) >= k`` and
# ``f(pred(T_k)) < k``, which by monotonicity pins it down); a block with any failed check divides
# instead, so the codes are exact either way.
U1 = tl.constexpr(0.49999997)  # float32 0.5 - 2^-25 (bits 0x3EFFFFFF)


@triton.jit
def _f32_succ(f):
    """The next float32 above finite ``f`` (-0 counts as +0)."""
    b = f.to(tl.int32, bitcast=True)
    b = tl.where(b == -2147483648, 0, b)
    return tl.where(b >= 0, b + 1, b - 1).to(tl.float32, bitcast=True)


@triton.jit
def _f32_pred(f):
    """The next float32 below finite ``f`` (-0 counts as +0)."""
    b = f.to(tl.int32, bitcast=True)
    b = tl.where(b == -2147483648, 0, b)
    return tl.where(b > 0, b - 1, tl.where(b == 0, -2147483647, b + 1)).to(tl.float32, bitcast=True)


@triton.jit
def _f32_at_least(e, strict):
    """The smallest float32 ``>= e`` (``> e`` where ``strict``) for float64 ``e``."""
    f = e.to(tl.float32)
    fd = f.to(tl.float64)
    return tl.where((fd < e) | (strict & (fd == e)), _f32_succ(f), f)


@triton.jit
def _above_mid(x):
    """(midpoint of ``pred(x)`` and ``x`` in float64, whether the tie rounds down: odd mantissa)."""
    m = (_f32_pred(x).to(tl.float64) + x.to(tl.float64)) * 0.5
    return m, (x.to(tl.int32, bitcast=True) & 1) == 1


@triton.jit
def _level_value(y, s, z):
    """``floor(fl(fl(y / s) + z) + 0.5)``: the reference's arithmetic before the clamp."""
    return tl.floor(tl.math.div_rn(y, s) + z + 0.5)


@triton.jit
def _finite(x):
    return (x == x) & (tl.abs(x) < float("inf"))


@triton.jit
def _level_threshold(u, s, z, k: tl.constexpr, CHECK: tl.constexpr):
    """(``T_k``, whether it checks out) per row, for ``u = U_k``. ``CHECK``: by the reference's
    arithmetic at ``T_k`` and its predecessor (two divisions); otherwise the derivation stands on
    its own (see ``_thresholds``) and only a non-finite ``s``, ``z`` or ``T_k`` fails."""
    uu = tl.zeros_like(s) + u
    m, odd = _above_mid(uu)
    q = _f32_at_least(m - z.to(tl.float64), odd)
    m, odd = _above_mid(q)
    t = _f32_at_least(m * s.to(tl.float64), odd)
    if CHECK:
        ok = (_level_value(t, s, z) >= k) & (_level_value(_f32_pred(t), s, z) < k)
    else:
        ok = _finite(t) & _finite(s) & (tl.abs(z) < 1125899906842624.0)  # |z| < 2^50 (and not NaN)
    return t, ok


@triton.jit
def _thresholds(s, z, CHECK: tl.constexpr = True):
    """``T_1, T_2, T_3`` per row of a group (``s, z`` float32 [BT]) and whether all check out.

    Why the derivation is exact without the check (``CHECK=False``), for finite ``s > 0`` and
    ``z``: the float64 midpoint ``m`` of two adjacent floats has at most 25 significant bits, so
    ``m * s`` (at most 49) is exact, and ``m - z`` is exact unless its bits span more than 53:
    ``|z| >= 2^26`` or ``|z|`` below about ``2^-26``. Tiny ``z``: the exact value lies within
    ``|z|`` of the midpoint ``m`` (``0.5..2.5``), so at least ~``2^-26`` from every float32, far
    more than float64's rounding error. Large ``z``: the exact value lies ``m`` above ``-z``, a
    float32, on a float32 grid at least 8 apart, so at least ~0.49 from every float32; float64's
    error (``|z| * 2^-53``) stays below that for ``|z| < 2^50``, and larger ``|z|`` (only in groups of
    nearly equal, huge values) fails the check, as do non-finite ones. ``tests`` checks both
    variants against the reference arithmetic on random and extreme ``(s, z)``."""
    t1, ok1 = _level_threshold(U1, s, z, 1, CHECK)
    t2, ok2 = _level_threshold(1.5, s, z, 2, CHECK)
    t3, ok3 = _level_threshold(2.5, s, z, 3, CHECK)
    return t1, t2, t3, ok1 & ok2 & ok3


@triton.jit
def _tplane(y, t1, t2, t3, P: tl.constexpr):
    """Codes of one plane by thresholds, already shifted to bit pair ``P``."""
    b1 = t1[:, None]
    b2 = t2[:, None]
    b3 = t3[:, None]
    return tl.where(y >= b2, tl.where(y >= b3, 3 << (2 * P), 2 << (2 * P)),
                    tl.where(y >= b1, 1 << (2 * P), 0))


@triton.jit
def _below(p, y):
    """``-1`` where ``y > p``, else ``0`` (int32): the sign of ``p - y`` (a subtraction on the FMA
    pipe and a shift, instead of a compare and a select on the ALU pipe). Exact: ``p - y`` is
    negative exactly when ``y > p``, zero results are ``+0`` (``p`` is never ``-0``, see
    :func:`_f32_pred`), and a result too small for a float keeps its sign when flushed."""
    return (p - y).to(tl.int32, bitcast=True) >> 31


@triton.jit
def _tplane_signs(y, t1, t2, t3, P: tl.constexpr):
    """:func:`_tplane` by signs: ``y >= T_k`` is ``y > pred(T_k)``."""
    neg = (_below(_f32_pred(t1)[:, None], y) + _below(_f32_pred(t2)[:, None], y)
           + _below(_f32_pred(t3)[:, None], y))
    return neg * -(1 << (2 * P))


@triton.jit
def _pack_divided(y0, y1, y2, y3, s0, z0, s1, z1, s2, z2, s3, z3):
    """The byte of four planes' codes, each by IEEE division (:func:`_qplane`)."""
    return _qplane(y0, s0, z0) | (_qplane(y1, s1, z1) << 2) | (_qplane(y2, s2, z2) << 4) | (_qplane(y3, s3, z3) << 6)


@triton.jit
def _clip4(y0, y1, y2, y3, t):
    tb = t[:, None]
    return (tl.maximum(tl.minimum(y0, tb), -tb), tl.maximum(tl.minimum(y1, tb), -tb),
            tl.maximum(tl.minimum(y2, tb), -tb), tl.maximum(tl.minimum(y3, tb), -tb))


@triton.jit
def _clip_free(t1, t3, lo, hi):
    """Whether codes by thresholds need no clip in a group whose clipped extremes are ``lo, hi``:
    a value above the clip (``> hi``) must get code 3 as ``hi`` does (``T3 <= hi``), one below it
    (``< lo``) code 0 as ``lo`` does (``T1 > lo``). Fails only for groups of (nearly) equal values."""
    return (t3 <= hi) & (t1 > lo)


@triton.jit
def group_params(lo, hi):
    """A group's INT2 scale and zero from its minimum and maximum, with the reference's IEEE
    divisions (shared with the append kernel)."""
    s = tl.maximum(tl.math.div_rn(hi - lo, tl.full(lo.shape, 3.0, tl.float32)), 1e-8)
    z = tl.math.div_rn(-lo, s)
    return s, z


@triton.jit
def _store_params(scale_ptr, off_ptr, prow, rmask, s, z, g: tl.constexpr):
    off = -(z * s)
    tl.store(scale_ptr + prow + g, tl.minimum(s, 65504.0).to(tl.float16), mask=rmask)
    tl.store(off_ptr + prow + g, tl.minimum(tl.maximum(off, -65504.0), 65504.0).to(tl.float16), mask=rmask)


@triton.jit
def quantize_kv_planes_kernel(
    x_ptr, s_xt, s_xh,
    r1_ptr, r2_ptr, kidx_ptr, c_ptr,
    codes_ptr, s_ct, s_ch,
    scale_ptr, off_ptr, s_st, s_sh,
    T,
    D: tl.constexpr, G: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, KB: tl.constexpr,
    ROT: tl.constexpr, CLIP: tl.constexpr, INTERP: tl.constexpr, KEYED: tl.constexpr = False,
    SPLIT: tl.constexpr = False, SORTED: tl.constexpr = False, RES: tl.constexpr = False,
    THRESH: tl.constexpr = False, LATE: tl.constexpr = False, TOP3: tl.constexpr = False,
    CHECKT: tl.constexpr = True, SIGNS: tl.constexpr = False, CENTER: tl.constexpr = False,
):
    """Same contract as :func:`quantize_kv_kernel` for rows of one byte block (``D == 4W``).
    ``SPLIT``: rotate with one ``[BT, D]`` product and split it into the planes (otherwise one
    product per plane). ``RES`` (with ``SPLIT`` and a 16-bit rotation): a persistent grid; each
    program loads ``R`` (high and low parts) once and takes row blocks ``pid, pid + P, ...`` of its
    head, instead of one block per program reading ``R`` from L2 each time."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    if RES:
        npg = tl.num_programs(0)
        dr = tl.arange(0, D)
        roff = h.to(tl.int64) * D * D + dr[:, None] * D + dr[None, :]
        rh = tl.load(r1_ptr + roff)
        if ROT == 1:
            rl = tl.load(r2_ptr + roff)
        else:
            rl = rh
        if INTERP:  # the interpreter's 16-bit dot is not exact; fp32 is, for 16-bit operands
            rh = rh.to(tl.float32)
            rl = rl.to(tl.float32)
        for blk in range(pid, tl.cdiv(T, BT), npg):
            _planes_rows(blk, h, x_ptr, s_xt, s_xh, r1_ptr, r2_ptr, kidx_ptr, c_ptr, codes_ptr, s_ct, s_ch,
                         scale_ptr, off_ptr, s_st, s_sh, T, rh, rl,
                         D, G, W, BT, KB, ROT, CLIP, INTERP, KEYED, SPLIT, SORTED, RES, THRESH, LATE, TOP3, CHECKT, SIGNS,
                         CENTER)
    else:
        _planes_rows(pid, h, x_ptr, s_xt, s_xh, r1_ptr, r2_ptr, kidx_ptr, c_ptr, codes_ptr, s_ct, s_ch,
                     scale_ptr, off_ptr, s_st, s_sh, T, 0, 0,
                     D, G, W, BT, KB, ROT, CLIP, INTERP, KEYED, SPLIT, SORTED, RES, THRESH, LATE, TOP3, CHECKT, SIGNS,
                     CENTER)


@triton.jit
def _planes_rows(blk, h, x_ptr, s_xt, s_xh, r1_ptr, r2_ptr, kidx_ptr, c_ptr, codes_ptr, s_ct, s_ch,
                 scale_ptr, off_ptr, s_st, s_sh, T, rh, rl,
                 D: tl.constexpr, G: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, KB: tl.constexpr,
                 ROT: tl.constexpr, CLIP: tl.constexpr, INTERP: tl.constexpr, KEYED: tl.constexpr,
                 SPLIT: tl.constexpr, SORTED: tl.constexpr, RES: tl.constexpr, THRESH: tl.constexpr,
                 LATE: tl.constexpr, TOP3: tl.constexpr, CHECKT: tl.constexpr,
                 SIGNS: tl.constexpr, CENTER: tl.constexpr):
    """Row block ``blk`` of head ``h`` (see :func:`quantize_kv_planes_kernel`)."""
    rows = blk * BT + tl.arange(0, BT)
    rmask = rows < T
    cols = tl.arange(0, W)
    xrow = x_ptr + rows.to(tl.int64)[:, None] * s_xt + h * s_xh
    rm = rmask[:, None]
    if ROT == 0:
        y0 = tl.load(xrow + cols[None, :], mask=rm, other=0.0).to(tl.float32)
        y1 = tl.load(xrow + W + cols[None, :], mask=rm, other=0.0).to(tl.float32)
        y2 = tl.load(xrow + 2 * W + cols[None, :], mask=rm, other=0.0).to(tl.float32)
        y3 = tl.load(xrow + 3 * W + cols[None, :], mask=rm, other=0.0).to(tl.float32)
    elif SPLIT:  # one [BT, D] product, then the four planes (a register-level split)
        dd = tl.arange(0, D)
        if RES:  # R loaded once per program (rh, rl): one dot per part over all of D
            xk = tl.load(xrow + dd[None, :], mask=rm, other=0.0)
            if INTERP:
                xk = xk.to(tl.float32)
            y = tl.dot(xk, rh)
            if ROT == 1:
                y = tl.dot(xk, rl, y)
        else:
            y = tl.zeros([BT, D], dtype=tl.float32)
            kk = tl.arange(0, KB)
            rbase = h.to(tl.int64) * D * D
            for kb in tl.static_range(D // KB):
                xk = tl.load(xrow + kb * KB + kk[None, :], mask=rm, other=0.0)
                y = _rdot(xk, r1_ptr, r2_ptr, rbase + (kb * KB + kk)[:, None] * D + dd[None, :], y, ROT, INTERP)
        ya, yb = tl.split(tl.reshape(tl.permute(tl.reshape(y, [BT, 4, W]), (0, 2, 1)), [BT, W, 2, 2]))
        y0, y2 = tl.split(ya)
        y1, y3 = tl.split(yb)
    else:
        y0 = tl.zeros([BT, W], dtype=tl.float32)
        y1 = tl.zeros([BT, W], dtype=tl.float32)
        y2 = tl.zeros([BT, W], dtype=tl.float32)
        y3 = tl.zeros([BT, W], dtype=tl.float32)
        kk = tl.arange(0, KB)
        rbase = h.to(tl.int64) * D * D
        for kb in tl.static_range(D // KB):
            xk = tl.load(xrow + kb * KB + kk[None, :], mask=rm, other=0.0)
            roff = rbase + (kb * KB + kk)[:, None] * D + cols[None, :]
            y0 = _rdot(xk, r1_ptr, r2_ptr, roff, y0, ROT, INTERP)
            y1 = _rdot(xk, r1_ptr, r2_ptr, roff + W, y1, ROT, INTERP)
            y2 = _rdot(xk, r1_ptr, r2_ptr, roff + 2 * W, y2, ROT, INTERP)
            y3 = _rdot(xk, r1_ptr, r2_ptr, roff + 3 * W, y3, ROT, INTERP)
    if CENTER:  # the key mean in the rotated basis, plane by plane
        cb = c_ptr + h * D + cols
        y0 = y0 - tl.load(cb)[None, :]
        y1 = y1 - tl.load(cb + W)[None, :]
        y2 = y2 - tl.load(cb + 2 * W)[None, :]
        y3 = y3 - tl.load(cb + 3 * W)[None, :]
    if CLIP:
        kq = tl.load(kidx_ptr + h)
        a0 = tl.abs(y0)
        a1 = tl.abs(y1)
        a2 = tl.abs(y2)
        a3 = tl.abs(y3)
        if KEYED:  # (the tournament is slower here: 356 against 289 us, H100; SORTED is ignored)
            if kq >= D // 2:
                t = _kth_keyed4(a0, a1, a2, a3, D - kq, True, W)
            else:
                t = _kth_keyed4(a0, a1, a2, a3, kq + 1, False, W)
        elif SORTED:
            if kq >= D // 2:
                t = _select4_sorted_y(y0, y1, y2, y3, D - kq, rmask, BT, False, TOP3, SIGNS)
            else:
                t = -_select4_sorted_y(y0, y1, y2, y3, kq + 1, rmask, BT, True, TOP3, SIGNS)
        elif kq >= D // 2:
            t = _select4(a0, a1, a2, a3, D - kq, rmask, BT)
        else:
            t = -_select4(-a0, -a1, -a2, -a3, kq + 1, rmask, BT)
        if not (LATE and THRESH):  # (LATE: the clip enters only through the group statistics)
            y0, y1, y2, y3 = _clip4(y0, y1, y2, y3, t)

    # group statistics: a group is 1, 2 or 4 planes (G = W, 2W or 4W)
    # (planes of a group combined before the row reduction: one reduction's shuffles per group)
    GP: tl.constexpr = G // W
    if GP == 4:
        l0 = tl.min(tl.minimum(tl.minimum(y0, y1), tl.minimum(y2, y3)), axis=1)
        u0 = tl.max(tl.maximum(tl.maximum(y0, y1), tl.maximum(y2, y3)), axis=1)
        l1, u1, l2, u2, l3, u3 = l0, u0, l0, u0, l0, u0
    elif GP == 2:
        l0 = tl.min(tl.minimum(y0, y1), axis=1)
        u0 = tl.max(tl.maximum(y0, y1), axis=1)
        l2 = tl.min(tl.minimum(y2, y3), axis=1)
        u2 = tl.max(tl.maximum(y2, y3), axis=1)
        l1, u1, l3, u3 = l0, u0, l2, u2
    else:
        l0 = tl.min(y0, axis=1)
        l1 = tl.min(y1, axis=1)
        l2 = tl.min(y2, axis=1)
        l3 = tl.min(y3, axis=1)
        u0 = tl.max(y0, axis=1)
        u1 = tl.max(y1, axis=1)
        u2 = tl.max(y2, axis=1)
        u3 = tl.max(y3, axis=1)
    if CLIP and LATE:  # clipping is monotone: the clipped group's extremes are the clipped extremes
        l0 = tl.maximum(l0, -t)
        u0 = tl.minimum(u0, t)
        l1 = tl.maximum(l1, -t)
        u1 = tl.minimum(u1, t)
        l2 = tl.maximum(l2, -t)
        u2 = tl.minimum(u2, t)
        l3 = tl.maximum(l3, -t)
        u3 = tl.minimum(u3, t)
    prow = rows.to(tl.int64) * s_st + h * s_sh
    s0, z0 = group_params(l0, u0)
    _store_params(scale_ptr, off_ptr, prow, rmask, s0, z0, 0)
    if GP == 4:
        s1, z1, s2, z2, s3, z3 = s0, z0, s0, z0, s0, z0
    elif GP == 2:
        s2, z2 = group_params(l2, u2)
        _store_params(scale_ptr, off_ptr, prow, rmask, s2, z2, 1)
        s1, z1, s3, z3 = s0, z0, s2, z2
    else:
        s1, z1 = group_params(l1, u1)
        s2, z2 = group_params(l2, u2)
        s3, z3 = group_params(l3, u3)
        _store_params(scale_ptr, off_ptr, prow, rmask, s1, z1, 1)
        _store_params(scale_ptr, off_ptr, prow, rmask, s2, z2, 2)
        _store_params(scale_ptr, off_ptr, prow, rmask, s3, z3, 3)
    if THRESH:  # codes by thresholds (exact; a block whose thresholds fail their check divides)
        a1, a2, a3, ok = _thresholds(s0, z0, CHECKT)
        if CLIP and LATE:
            ok = ok & _clip_free(a1, a3, l0, u0)
        if GP == 4:
            b1, b2, b3, c1, c2, c3, d1, d2, d3 = a1, a2, a3, a1, a2, a3, a1, a2, a3
        elif GP == 2:
            c1, c2, c3, okc = _thresholds(s2, z2, CHECKT)
            if CLIP and LATE:
                okc = okc & _clip_free(c1, c3, l2, u2)
            b1, b2, b3, d1, d2, d3 = a1, a2, a3, c1, c2, c3
            ok = ok & okc
        else:
            b1, b2, b3, okb = _thresholds(s1, z1, CHECKT)
            c1, c2, c3, okc = _thresholds(s2, z2, CHECKT)
            d1, d2, d3, okd = _thresholds(s3, z3, CHECKT)
            if CLIP and LATE:
                okb = okb & _clip_free(b1, b3, l1, u1)
                okc = okc & _clip_free(c1, c3, l2, u2)
                okd = okd & _clip_free(d1, d3, l3, u3)
            ok = ok & okb & okc & okd
        if SIGNS:
            packed = _tplane_signs(y0, a1, a2, a3, 0) + _tplane_signs(y1, b1, b2, b3, 1) \
                + _tplane_signs(y2, c1, c2, c3, 2) + _tplane_signs(y3, d1, d2, d3, 3)
        else:
            packed = _tplane(y0, a1, a2, a3, 0) | _tplane(y1, b1, b2, b3, 1) | _tplane(y2, c1, c2, c3, 2) \
                | _tplane(y3, d1, d2, d3, 3)
        if tl.min((ok | (rmask == 0)).to(tl.int32), axis=0) == 0:
            if CLIP and LATE:
                y0, y1, y2, y3 = _clip4(y0, y1, y2, y3, t)
            packed = _pack_divided(y0, y1, y2, y3, s0, z0, s1, z1, s2, z2, s3, z3)
    else:
        packed = _pack_divided(y0, y1, y2, y3, s0, z0, s1, z1, s2, z2, s3, z3)
    crow = codes_ptr + rows.to(tl.int64)[:, None] * s_ct + h * s_ch
    tl.store(crow + cols[None, :], packed.to(tl.uint8), mask=rm)
