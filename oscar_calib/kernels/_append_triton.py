"""Triton kernel behind :func:`oscar_calib.kernels.append.append_token` (imported lazily).

One program per (sequence, K/V head): load the new row, round it to the window's dtype, rotate it
(float32 products on the CUDA cores), store it in its window slot, clip it (exact row quantile by
a sort of ``|y|``), quantise it per group with the reference's arithmetic (IEEE division), pack
it into its history slot, and update the sequence's lengths. The last program of a sequence to
finish (a ticket counter) adds the token to the sequence's count, so every program reads the
count as it was before the call.

Keys and values may be stored in groups of different sizes (``SPLIT``): the K programs then
quantise with ``G`` (plane width ``W``) into ``scale``/``offset``, the V programs with ``GV``
(``WV``) into ``v_scale``/``v_offset``, each with its own strides.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._write_triton import group_params


@triton.jit
def _kth_smallest(a, k, INTERP: tl.constexpr):
    """``sorted(a)[k]`` of a row ``a [D]``, exactly. Compiled: ``tl.sort``. Under Triton's CPU
    interpreter (``INTERP``), by ranks: element ``i``'s rank is the number of elements below it
    plus the number equal to it at a lower index (ranks 0..D-1, each once), and the element of
    rank ``k`` is the answer, the same value. ``tl.sort`` there calls a Python function per
    element and compare step (seconds per launch); the ``D x D`` comparison runs in NumPy. On an
    H200 the comparison was as fast as the sort with the rotation and 3x slower without it (a
    write of 6.6 against 3.7 us at batch 1), so the GPU keeps the sort."""
    D: tl.constexpr = a.shape[0]
    i = tl.arange(0, D)
    if INTERP:
        before = (a[None, :] < a[:, None]) | ((a[None, :] == a[:, None]) & (i[None, :] < i[:, None]))
        t = tl.sum(tl.where(tl.sum(before.to(tl.int32), axis=1) == k, a, 0.0), axis=0)
    else:
        t = tl.sum(tl.where(i == k, tl.sort(a), 0.0), axis=0)
    return t


@triton.jit
def _rounded(y, WDT: tl.constexpr):
    """float32 ``y`` rounded to ``WDT`` (to nearest, ties to even), as float32. bfloat16 by integer
    arithmetic on the bits: Triton's CPU interpreter truncates in its own conversion."""
    if WDT == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return y.to(WDT).to(tl.float32)


@triton.jit
def _store_int2(y, codes_ptr, hoff, scale_ptr, off_ptr, poff, D: tl.constexpr, G: tl.constexpr,
                W: tl.constexpr):
    """Quantise the clipped row ``y [D]`` per group of ``G`` with the reference's arithmetic, pack
    it (plane width ``W``) at ``codes_ptr + hoff`` and store the group parameters at ``poff``."""
    NG: tl.constexpr = D // G
    yg = tl.reshape(y, (NG, G))
    s, z = group_params(tl.min(yg, axis=1), tl.max(yg, axis=1))
    qf = tl.floor(tl.math.div_rn(yg, tl.broadcast_to(s[:, None], yg.shape)) + z[:, None] + 0.5)
    q = tl.minimum(tl.maximum(qf, 0.0), 3.0).to(tl.int32)
    # byte bb * W + i holds channels bb * 4W + p * W + i in bits 2p, 2p + 1
    NB: tl.constexpr = D // (4 * W)
    q3 = tl.reshape(q, (NB, 4, W))
    shift = 2 * tl.arange(0, 4)
    packed = tl.sum(q3 << shift[None, :, None], axis=1)
    byte = tl.reshape(packed, (NB * W,)).to(tl.uint8)
    tl.store(codes_ptr + hoff + tl.arange(0, NB * W), byte)
    pp = poff + tl.arange(0, NG)
    off = -(z * s)
    tl.store(scale_ptr + pp, tl.minimum(s, 65504.0).to(tl.float16))
    tl.store(off_ptr + pp, tl.minimum(tl.maximum(off, -65504.0), 65504.0).to(tl.float16))


@triton.jit
def append_token_kernel(
    k_ptr, v_ptr, s_kb, s_kh, s_vb, s_vh,
    real_ptr, s_real, gate_ptr,
    n_ptr, ticket_ptr, wlen_ptr, hlen_ptr,
    win_ptr, s_wb, s_wk, s_wh, s_ws,
    codes_ptr, s_cb, s_ck, s_ch, s_cs,
    scale_ptr, off_ptr, s_pb, s_pk, s_ph, s_ps,
    vscale_ptr, voff_ptr, s_vpb, s_vph, s_vps,
    r_ptr, kidx_ptr,
    q_ptr, s_qb, s_qh, qo_ptr,
    H, SINK, RECENT, CAP,
    D: tl.constexpr, G: tl.constexpr, W: tl.constexpr, KB: tl.constexpr,
    ROT: tl.constexpr, CLIP: tl.constexpr, REAL: tl.constexpr, RING: tl.constexpr, LENS: tl.constexpr,
    GATE: tl.constexpr = False,
    QG: tl.constexpr = 0, QG2: tl.constexpr = 1,
    PDL: tl.constexpr = False,
    SPLIT: tl.constexpr = False, GV: tl.constexpr = 0, WV: tl.constexpr = 0, INTERP: tl.constexpr = False,
):
    """Grid ``(B, 2H)``. Program ``(b, kh)`` stores row ``kh`` (K heads first, then V) of
    sequence ``b``: window slot and history slot from the count ``n[b]`` (scratch slots when the
    row's token is not real), then ``n[b] += real`` by the last program of ``b``.

    With ``QG > 0`` (and ``ROT``) the K program of head ``h`` also rotates the ``QG`` query heads
    of its group with the ``R`` it holds: ``qo[b, h*QG + i] = q[b, h*QG + i] @ R[h]`` (float32,
    ``qo`` contiguous ``[B, H*QG, D]``), so the decode kernel needs no rotation of its own. ``PDL``:
    the next kernel (the decode kernel, launched with programmatic dependent launch) may start now;
    it waits for this grid to end before it reads anything written here.

    ``SPLIT``: values in groups of ``GV`` (plane width ``WV``) with their parameters at
    ``vscale``/``voff`` (strides ``s_vpb, s_vph, s_vps``); ``scale``/``off`` then hold the keys'
    only (``s_pk`` unused)."""
    b = tl.program_id(0)
    kh = tl.program_id(1)
    nprog = tl.num_programs(1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    kv = kh // H
    h = kh % H
    n = tl.load(n_ptr + b)
    if REAL:
        real = tl.load(real_ptr + b * s_real) != 0
    else:
        real = n >= 0
    if GATE:  # a second condition (e.g. the row has not finished generating)
        real = real & (tl.load(gate_ptr + b) != 0)
    cols = tl.arange(0, D)
    kbase = k_ptr + b.to(tl.int64) * s_kb + h * s_kh
    vbase = v_ptr + b.to(tl.int64) * s_vb + h * s_vh
    wdt = win_ptr.dtype.element_ty

    # the row in the window's dtype, rotated: y = x @ R[kh] (float32)
    if ROT:
        y = tl.zeros([D], dtype=tl.float32)
        rows = tl.arange(0, KB)
        qi = tl.arange(0, QG2)
        yq = tl.zeros([QG2, D], dtype=tl.float32)  # the query heads' rows, rotated (K programs)
        qbase = q_ptr + b.to(tl.int64) * s_qb + (h * QG) * s_qh
        for i0 in range(0, D, KB):
            kvr = rows * 0 + kv
            xi = (tl.load(kbase + i0 + rows, mask=kvr == 0, other=0.0)
                  + tl.load(vbase + i0 + rows, mask=kvr == 1, other=0.0))
            xi = _rounded(xi.to(tl.float32), wdt)
            r = tl.load(r_ptr + kh.to(tl.int64) * D * D + (i0 + rows)[:, None] * D + cols[None, :])
            y += tl.sum(xi[:, None] * r, axis=0)
            if QG > 0:
                if kv == 0:
                    for i in tl.static_range(QG):
                        xq = tl.load(qbase + i * s_qh + i0 + rows).to(tl.float32)
                        yq = tl.where(qi[:, None] == i, yq + tl.sum(xq[:, None] * r, axis=0)[None, :], yq)
        if QG > 0:
            if kv == 0:
                qo = qo_ptr + (b.to(tl.int64) * H * QG + h * QG + qi[:, None]) * D + cols[None, :]
                tl.store(qo, yq, mask=qi[:, None] < QG)
    else:
        kvc = cols * 0 + kv
        y = (tl.load(kbase + cols, mask=kvc == 0, other=0.0)
             + tl.load(vbase + cols, mask=kvc == 1, other=0.0))
        y = _rounded(y.to(tl.float32), wdt)

    # window slot: sink slot t, else a ring slot of the recent window (scratch: not real)
    scratch_w = SINK + RECENT
    if RECENT > 0:
        ring_w = SINK + (n - SINK) % RECENT
    else:
        ring_w = n * 0 + scratch_w
    ws = tl.where(n < SINK, n, ring_w)
    ws = tl.where(real, ws, scratch_w)
    tl.store(win_ptr + b.to(tl.int64) * s_wb + kv * s_wk + h * s_wh + ws * s_ws + cols, _rounded(y, wdt).to(wdt))

    # history slot t - S (a ring of CAP slots on sliding layers); the scratch slot CAP before the
    # sink ends, and past a full history (the caller reserves room: such a token is not stored)
    j = n - SINK
    if RING:
        hs = j % CAP
    else:
        hs = tl.where(j < CAP, j, CAP)
    hs = tl.where(real & (j >= 0), hs, CAP)

    if CLIP:  # t = sorted(|y|)[k]: the exact row quantile
        t = _kth_smallest(tl.abs(y), tl.load(kidx_ptr + kh), INTERP)
        y = tl.maximum(tl.minimum(y, t), -t)

    hoff = b.to(tl.int64) * s_cb + kv * s_ck + h * s_ch + hs.to(tl.int64) * s_cs
    if SPLIT:
        if kv == 0:
            _store_int2(y, codes_ptr, hoff, scale_ptr, off_ptr,
                        b.to(tl.int64) * s_pb + h * s_ph + hs.to(tl.int64) * s_ps, D, G, W)
        else:
            _store_int2(y, codes_ptr, hoff, vscale_ptr, voff_ptr,
                        b.to(tl.int64) * s_vpb + h * s_vph + hs.to(tl.int64) * s_vps, D, GV, WV)
    else:
        _store_int2(y, codes_ptr, hoff, scale_ptr, off_ptr,
                    b.to(tl.int64) * s_pb + kv * s_pk + h * s_ph + hs.to(tl.int64) * s_ps, D, G, W)

    n_new = n + real.to(tl.int64)
    if LENS:  # the decode kernel's lengths (every program of b stores the same values)
        tl.store(wlen_ptr + b, tl.minimum(n_new, SINK + RECENT).to(tl.int32))
        tl.store(hlen_ptr + b, tl.maximum(n_new - SINK - RECENT, 0).to(tl.int32))
    # the last program of b to get here (all others have read n[b]) stores the new count
    done = tl.atomic_add(ticket_ptr + b, 1, sem="acq_rel")
    if done == nprog - 1:
        tl.store(n_ptr + b, n_new)
        tl.store(ticket_ptr + b, 0)
