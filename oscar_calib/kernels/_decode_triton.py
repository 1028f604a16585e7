"""Triton kernels behind :func:`oscar_calib.kernels.decode.decode_attention` (imported lazily).

Notation: ``W`` channels per bit plane, ``NB`` byte blocks per row (``NB * 4`` planes, "units"),
``M`` padded GQA group (>= 16 rows for the tensor cores). Unit ``u = 4*block + plane`` covers
channels ``[u*W, (u+1)*W)`` (see :mod:`.pack`), so a per-unit accumulator stores to that range.

Code modes (``MODE``):

* 0: ``((byte >> 2p) & 3)`` reinterpreted as fp16 bits: the subnormal ``code * 2^-24``; dots
  are scaled back by ``2^24`` through the group scale (keys) or at the end (values). Exact.
* 1: mode 0 done by inline PTX on four bytes at once (``shr``, ``and``, two ``prmt``); GPU only.
* 2: integer-to-fp16 conversion (plain values); a fallback.
"""

from __future__ import annotations

import triton
import triton.language as tl

TWO24 = tl.constexpr(16777216.0)


@triton.jit
def _plane(c, P: tl.constexpr, MODE: tl.constexpr):
    """Bit plane ``P`` of packed bytes ``c`` (uint8, any shape) as float16 (see MODE)."""
    if MODE == 1:
        if P == 0:
            r = tl.inline_asm_elementwise(
                "{\n.reg .b32 t, z;\nand.b32 t, $2, 0x03030303;\nmov.b32 z, 0;\n"
                "prmt.b32 $0, t, z, 0x4140;\nprmt.b32 $1, t, z, 0x4342;\n}",
                "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)
        elif P == 1:
            r = tl.inline_asm_elementwise(
                "{\n.reg .b32 t, z;\nshr.b32 t, $2, 2;\nand.b32 t, t, 0x03030303;\nmov.b32 z, 0;\n"
                "prmt.b32 $0, t, z, 0x4140;\nprmt.b32 $1, t, z, 0x4342;\n}",
                "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)
        elif P == 2:
            r = tl.inline_asm_elementwise(
                "{\n.reg .b32 t, z;\nshr.b32 t, $2, 4;\nand.b32 t, t, 0x03030303;\nmov.b32 z, 0;\n"
                "prmt.b32 $0, t, z, 0x4140;\nprmt.b32 $1, t, z, 0x4342;\n}",
                "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)
        else:
            r = tl.inline_asm_elementwise(
                "{\n.reg .b32 t, z;\nshr.b32 t, $2, 6;\nand.b32 t, t, 0x03030303;\nmov.b32 z, 0;\n"
                "prmt.b32 $0, t, z, 0x4140;\nprmt.b32 $1, t, z, 0x4342;\n}",
                "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)
    elif MODE == 0:
        r = ((c >> (2 * P)) & 3).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        r = ((c >> (2 * P)) & 3).to(tl.float16)
    return r


@triton.jit
def _dot(a, b, acc, INTERP: tl.constexpr):
    if INTERP:  # the interpreter's bf16 dot is wrong; fp32 is exact for 16-bit operands
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def _dot2(a_hi, a_lo, b, acc, INTERP: tl.constexpr):
    """``(a_hi + a_lo) @ b`` as two dots (16-bit operands, fp32 accumulation)."""
    return _dot(a_lo, b, _dot(a_hi, b, acc, INTERP), INTERP)


@triton.jit
def _int2_scores(q0, q1, q2, q3, qs0, qs1, qs2, qs3, kc, ks_ptr, ko_ptr, pb, nm, kscale,
                 BETA: tl.constexpr, G: tl.constexpr, W: tl.constexpr, M: tl.constexpr,
                 BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    """Scores (log2 units) of one byte block: sum over its 4 planes, scaled per group."""
    s = tl.zeros([M, BLOCK_N], dtype=tl.float32)
    t = tl.zeros([M, BLOCK_N], dtype=tl.float32)
    tq = tl.zeros([M], dtype=tl.float32)
    for P in tl.static_range(4):
        if P == 0:
            qp = q0
            qsp = qs0
        elif P == 1:
            qp = q1
            qsp = qs1
        elif P == 2:
            qp = q2
            qsp = qs2
        else:
            qp = q3
            qsp = qs3
        t = tl.dot(qp, tl.trans(_plane(kc, P, MODE)), t)
        tq += qsp
        if ((P + 1) * W) % G == 0:  # last plane of a group
            g = (BETA * 4 * W + P * W) // G
            sc = tl.load(ks_ptr + pb + g, mask=nm, other=0.0).to(tl.float32) * kscale
            of = tl.load(ko_ptr + pb + g, mask=nm, other=0.0).to(tl.float32)
            s += t * sc[None, :] + tq[:, None] * of[None, :]
            t = tl.zeros([M, BLOCK_N], dtype=tl.float32)
            tq = tl.zeros([M], dtype=tl.float32)
    return s


@triton.jit
def _int2_scores_t(g0, g1, g2, g3, qs0, qs1, qs2, qs3, kc, ks_ptr, ko_ptr, pb, nm, kscale,
                   BETA: tl.constexpr, G: tl.constexpr, W: tl.constexpr, M: tl.constexpr,
                   BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    """As :func:`_int2_scores`, transposed: ``[BLOCK_N, M]`` (tokens as the dot's M dimension)."""
    s = tl.zeros([BLOCK_N, M], dtype=tl.float32)
    t = tl.zeros([BLOCK_N, M], dtype=tl.float32)
    tq = tl.zeros([M], dtype=tl.float32)
    for P in tl.static_range(4):
        if P == 0:
            gp = g0
            qsp = qs0
        elif P == 1:
            gp = g1
            qsp = qs1
        elif P == 2:
            gp = g2
            qsp = qs2
        else:
            gp = g3
            qsp = qs3
        t = tl.dot(_plane(kc, P, MODE), gp, t)
        tq += qsp
        if ((P + 1) * W) % G == 0:  # last plane of a group
            g = (BETA * 4 * W + P * W) // G
            sc = tl.load(ks_ptr + pb + g, mask=nm, other=0.0).to(tl.float32) * kscale
            of = tl.load(ko_ptr + pb + g, mask=nm, other=0.0).to(tl.float32)
            s += t * sc[:, None] + of[:, None] * tq[None, :]
            t = tl.zeros([BLOCK_N, M], dtype=tl.float32)
            tq = tl.zeros([M], dtype=tl.float32)
    return s


@triton.jit
def _int2_values(a0, a1, a2, a3, p, vc, vs_ptr, vo_ptr, pb, nm, ounit,
                 BETA: tl.constexpr, G: tl.constexpr, W: tl.constexpr, MODE: tl.constexpr):
    """Accumulate ``p @ v_hat`` for the 4 planes of one byte block (accumulators pre-scaled)."""
    for P in tl.static_range(4):
        if (P * W) % G == 0:  # first plane of a group
            g = (BETA * 4 * W + P * W) // G
            vs = tl.load(vs_ptr + pb + g, mask=nm, other=0.0).to(tl.float32)
            vo = tl.load(vo_ptr + pb + g, mask=nm, other=0.0).to(tl.float32)
            pv = (p * vs[None, :]).to(tl.float16)
            osum = tl.sum(p * vo[None, :], axis=1) * ounit
        cv = _plane(vc, P, MODE)
        if P == 0:
            a0 = tl.dot(pv, cv, a0) + osum[:, None]
        elif P == 1:
            a1 = tl.dot(pv, cv, a1) + osum[:, None]
        elif P == 2:
            a2 = tl.dot(pv, cv, a2) + osum[:, None]
        else:
            a3 = tl.dot(pv, cv, a3) + osum[:, None]
    return a0, a1, a2, a3


@triton.jit
def decode_split_kernel(
    qr_ptr,
    kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr,
    s_cb, s_ch, s_cn, s_pb, s_ph, s_pn,
    tab_ptr, s_tb, hlen_ptr,
    k16_ptr, v16_ptr, s_1b, s_1h, s_1n,
    len16_ptr,
    op_ptr, lse_ptr,
    qk_scale,
    KVH, QG, S16, S_ALL, CHUNK, CHUNK16,
    D: tl.constexpr, G: tl.constexpr, W: tl.constexpr, NB: tl.constexpr, M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK16: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
    MODE: tl.constexpr, INTERP: tl.constexpr, PART: tl.constexpr, ORIENT: tl.constexpr,
):
    # PART 0: 16-bit window chunks (partial slots 0..S16-1); PART 1: INT2 history chunks
    # (slots S16..). Two launches of one kernel keep each specialisation's registers and shared
    # memory small.
    chunk = tl.program_id(0)
    split = chunk + PART * S16
    bh = tl.program_id(1)
    b = bh // KVH
    h = bh % KVH
    offs_m = tl.arange(0, M)
    mmask = offs_m < QG
    offs_w = tl.arange(0, W)
    qrow = qr_ptr + (bh * QG + offs_m).to(tl.int64)[:, None] * D + offs_w[None, :]
    q0 = tl.load(qrow + 0 * W, mask=mmask[:, None], other=0.0)
    q1 = tl.load(qrow + 1 * W, mask=mmask[:, None], other=0.0)
    q2 = tl.load(qrow + 2 * W, mask=mmask[:, None], other=0.0)
    q3 = tl.load(qrow + 3 * W, mask=mmask[:, None], other=0.0)
    a0 = tl.zeros([M, W], dtype=tl.float32)
    a1 = tl.zeros([M, W], dtype=tl.float32)
    a2 = tl.zeros([M, W], dtype=tl.float32)
    a3 = tl.zeros([M, W], dtype=tl.float32)
    if NB == 2:
        q4 = tl.load(qrow + 4 * W, mask=mmask[:, None], other=0.0)
        q5 = tl.load(qrow + 5 * W, mask=mmask[:, None], other=0.0)
        q6 = tl.load(qrow + 6 * W, mask=mmask[:, None], other=0.0)
        q7 = tl.load(qrow + 7 * W, mask=mmask[:, None], other=0.0)
        a4 = tl.zeros([M, W], dtype=tl.float32)
        a5 = tl.zeros([M, W], dtype=tl.float32)
        a6 = tl.zeros([M, W], dtype=tl.float32)
        a7 = tl.zeros([M, W], dtype=tl.float32)
    m_i = tl.full([M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)

    if PART == 0:
        # ---- 16-bit window: chunk [lo, hi) of this sequence's window tokens ----
        WT = k16_ptr.dtype.element_ty
        L16 = tl.load(len16_ptr + b)
        lo = chunk * CHUNK16
        hi = tl.minimum(lo + CHUNK16, L16)
        base = b.to(tl.int64) * s_1b + h * s_1h
        # 16-bit operands split into a high part and a residual (two dots each): scores and
        # the value sum come out at about fp32 accuracy; the window is small, so this is cheap.
        w0 = q0.to(WT)
        w1 = q1.to(WT)
        w2 = q2.to(WT)
        w3 = q3.to(WT)
        e0 = (q0 - w0.to(tl.float32)).to(WT)
        e1 = (q1 - w1.to(tl.float32)).to(WT)
        e2 = (q2 - w2.to(tl.float32)).to(WT)
        e3 = (q3 - w3.to(tl.float32)).to(WT)
        if NB == 2:
            w4 = q4.to(WT)
            w5 = q5.to(WT)
            w6 = q6.to(WT)
            w7 = q7.to(WT)
            e4 = (q4 - w4.to(tl.float32)).to(WT)
            e5 = (q5 - w5.to(tl.float32)).to(WT)
            e6 = (q6 - w6.to(tl.float32)).to(WT)
            e7 = (q7 - w7.to(tl.float32)).to(WT)
        offs16 = tl.arange(0, BLOCK16)
        for start in range(lo, hi, BLOCK16):
            n = start + offs16
            nm = n < hi
            rp = base + n.to(tl.int64)[:, None] * s_1n + offs_w[None, :]
            km = nm[:, None]
            s = tl.zeros([M, BLOCK16], dtype=tl.float32)
            s = _dot2(w0, e0, tl.trans(tl.load(k16_ptr + rp + 0 * W, mask=km, other=0.0)), s, INTERP)
            s = _dot2(w1, e1, tl.trans(tl.load(k16_ptr + rp + 1 * W, mask=km, other=0.0)), s, INTERP)
            s = _dot2(w2, e2, tl.trans(tl.load(k16_ptr + rp + 2 * W, mask=km, other=0.0)), s, INTERP)
            s = _dot2(w3, e3, tl.trans(tl.load(k16_ptr + rp + 3 * W, mask=km, other=0.0)), s, INTERP)
            if NB == 2:
                s = _dot2(w4, e4, tl.trans(tl.load(k16_ptr + rp + 4 * W, mask=km, other=0.0)), s, INTERP)
                s = _dot2(w5, e5, tl.trans(tl.load(k16_ptr + rp + 5 * W, mask=km, other=0.0)), s, INTERP)
                s = _dot2(w6, e6, tl.trans(tl.load(k16_ptr + rp + 6 * W, mask=km, other=0.0)), s, INTERP)
                s = _dot2(w7, e7, tl.trans(tl.load(k16_ptr + rp + 7 * W, mask=km, other=0.0)), s, INTERP)
            s = tl.where(nm[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
            ph = p.to(WT)
            pl = (p - ph.to(tl.float32)).to(WT)
            a0 = _dot2(ph, pl, tl.load(v16_ptr + rp + 0 * W, mask=km, other=0.0), a0 * alpha[:, None], INTERP)
            a1 = _dot2(ph, pl, tl.load(v16_ptr + rp + 1 * W, mask=km, other=0.0), a1 * alpha[:, None], INTERP)
            a2 = _dot2(ph, pl, tl.load(v16_ptr + rp + 2 * W, mask=km, other=0.0), a2 * alpha[:, None], INTERP)
            a3 = _dot2(ph, pl, tl.load(v16_ptr + rp + 3 * W, mask=km, other=0.0), a3 * alpha[:, None], INTERP)
            if NB == 2:
                a4 = _dot2(ph, pl, tl.load(v16_ptr + rp + 4 * W, mask=km, other=0.0), a4 * alpha[:, None], INTERP)
                a5 = _dot2(ph, pl, tl.load(v16_ptr + rp + 5 * W, mask=km, other=0.0), a5 * alpha[:, None], INTERP)
                a6 = _dot2(ph, pl, tl.load(v16_ptr + rp + 6 * W, mask=km, other=0.0), a6 * alpha[:, None], INTERP)
                a7 = _dot2(ph, pl, tl.load(v16_ptr + rp + 7 * W, mask=km, other=0.0), a7 * alpha[:, None], INTERP)
    else:
        # ---- INT2 history: chunk [lo, hi) of this sequence's history tokens ----
        L = tl.load(hlen_ptr + b)
        lo = chunk * CHUNK
        hi = tl.minimum(lo + CHUNK, L)
        if MODE == 2:
            kscale = qk_scale
            ounit = 1.0
        else:
            kscale = qk_scale * TWO24
            ounit = 1.0 / TWO24
        f0 = q0.to(tl.float16)
        f1 = q1.to(tl.float16)
        f2 = q2.to(tl.float16)
        f3 = q3.to(tl.float16)
        qs0 = tl.sum(q0, axis=1) * qk_scale
        qs1 = tl.sum(q1, axis=1) * qk_scale
        qs2 = tl.sum(q2, axis=1) * qk_scale
        qs3 = tl.sum(q3, axis=1) * qk_scale
        if NB == 2:
            f4 = q4.to(tl.float16)
            f5 = q5.to(tl.float16)
            f6 = q6.to(tl.float16)
            f7 = q7.to(tl.float16)
            qs4 = tl.sum(q4, axis=1) * qk_scale
            qs5 = tl.sum(q5, axis=1) * qk_scale
            qs6 = tl.sum(q6, axis=1) * qk_scale
            qs7 = tl.sum(q7, axis=1) * qk_scale
        if ORIENT == 1:
            g0 = tl.trans(f0)
            g1 = tl.trans(f1)
            g2 = tl.trans(f2)
            g3 = tl.trans(f3)
            if NB == 2:
                g4 = tl.trans(f4)
                g5 = tl.trans(f5)
                g6 = tl.trans(f6)
                g7 = tl.trans(f7)
        offs_n = tl.arange(0, BLOCK_N)
        hb = h.to(tl.int64)
        for start in range(lo, hi, BLOCK_N):
            n = start + offs_n
            nm = n < hi
            if PAGED:
                pg = tl.load(tab_ptr + b * s_tb + n // PAGE, mask=nm, other=0).to(tl.int64)
                slot = n % PAGE
                cb = pg * s_cb + hb * s_ch + slot * s_cn
                pb = pg * s_pb + hb * s_ph + slot * s_pn
            else:
                n64 = n.to(tl.int64)
                cb = b.to(tl.int64) * s_cb + hb * s_ch + n64 * s_cn
                pb = b.to(tl.int64) * s_pb + hb * s_ph + n64 * s_pn
            cptr = cb[:, None] + offs_w[None, :]
            kc = tl.load(kc_ptr + cptr, mask=nm[:, None], other=0)
            if ORIENT == 0:
                s = _int2_scores(f0, f1, f2, f3, qs0, qs1, qs2, qs3, kc, ks_ptr, ko_ptr, pb, nm, kscale,
                                 0, G, W, M, BLOCK_N, MODE)
                if NB == 2:
                    kc1 = tl.load(kc_ptr + cptr + W, mask=nm[:, None], other=0)
                    s += _int2_scores(f4, f5, f6, f7, qs4, qs5, qs6, qs7, kc1, ks_ptr, ko_ptr, pb, nm,
                                      kscale, 1, G, W, M, BLOCK_N, MODE)
                s = tl.where(nm[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.math.exp2(m_i - m_new)
                p = tl.math.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                m_i = m_new
            else:
                # tokens as the M dimension of the key dot, query heads as N
                st = _int2_scores_t(g0, g1, g2, g3, qs0, qs1, qs2, qs3, kc, ks_ptr, ko_ptr, pb, nm, kscale,
                                    0, G, W, M, BLOCK_N, MODE)
                if NB == 2:
                    kc1 = tl.load(kc_ptr + cptr + W, mask=nm[:, None], other=0)
                    st += _int2_scores_t(g4, g5, g6, g7, qs4, qs5, qs6, qs7, kc1, ks_ptr, ko_ptr, pb, nm,
                                         kscale, 1, G, W, M, BLOCK_N, MODE)
                st = tl.where(nm[:, None], st, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(st, axis=0))
                alpha = tl.math.exp2(m_i - m_new)
                pt = tl.math.exp2(st - m_new[None, :])
                l_i = l_i * alpha + tl.sum(pt, axis=0)
                m_i = m_new
                p = tl.trans(pt)
            vc = tl.load(vc_ptr + cptr, mask=nm[:, None], other=0)
            a0, a1, a2, a3 = _int2_values(
                a0 * alpha[:, None], a1 * alpha[:, None], a2 * alpha[:, None], a3 * alpha[:, None],
                p, vc, vs_ptr, vo_ptr, pb, nm, ounit, 0, G, W, MODE)
            if NB == 2:
                vc1 = tl.load(vc_ptr + cptr + W, mask=nm[:, None], other=0)
                a4, a5, a6, a7 = _int2_values(
                    a4 * alpha[:, None], a5 * alpha[:, None], a6 * alpha[:, None], a7 * alpha[:, None],
                    p, vc1, vs_ptr, vo_ptr, pb, nm, ounit, 1, G, W, MODE)

    if PART == 0 or MODE == 2:
        out_mul = 1.0
    else:
        out_mul = TWO24
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    inv = out_mul / l_safe
    lse_v = tl.where(has, m_i + tl.math.log2(l_safe), float("-inf"))
    prow = (bh * S_ALL + split) * QG + offs_m
    tl.store(lse_ptr + prow, lse_v, mask=mmask)
    optr = op_ptr + prow.to(tl.int64)[:, None] * D + offs_w[None, :]
    om = mmask[:, None]
    tl.store(optr + 0 * W, a0 * inv[:, None], mask=om)
    tl.store(optr + 1 * W, a1 * inv[:, None], mask=om)
    tl.store(optr + 2 * W, a2 * inv[:, None], mask=om)
    tl.store(optr + 3 * W, a3 * inv[:, None], mask=om)
    if NB == 2:
        tl.store(optr + 4 * W, a4 * inv[:, None], mask=om)
        tl.store(optr + 5 * W, a5 * inv[:, None], mask=om)
        tl.store(optr + 6 * W, a6 * inv[:, None], mask=om)
        tl.store(optr + 7 * W, a7 * inv[:, None], mask=om)


@triton.jit
def decode_merge_kernel(op_ptr, lse_ptr, out_ptr, s_ob, s_oh, HQ, QG, S_ALL,
                        D: tl.constexpr, DC: tl.constexpr, BLOCK_S: tl.constexpr):
    """Grid ``(B*Hq, D/DC)``: log-sum-exp merge of the split partials for one query head and
    ``DC`` output channels."""
    pid = tl.program_id(0)
    c0 = tl.program_id(1) * DC
    b = pid // HQ
    hq = pid % HQ
    bh = pid // QG
    m = pid % QG
    offs_s = tl.arange(0, BLOCK_S)
    cols = c0 + tl.arange(0, DC)
    mx = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, S_ALL, BLOCK_S):
        sm = s0 + offs_s < S_ALL
        lv = tl.load(lse_ptr + (bh * S_ALL + s0 + offs_s) * QG + m, mask=sm, other=float("-inf"))
        mx = tl.maximum(mx, lv)
    top = tl.max(mx, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    acc = tl.zeros([DC], dtype=tl.float32)
    den = tl.zeros([BLOCK_S], dtype=tl.float32)
    for s0 in range(0, S_ALL, BLOCK_S):
        sm = s0 + offs_s < S_ALL
        row = (bh * S_ALL + s0 + offs_s) * QG + m
        lv = tl.load(lse_ptr + row, mask=sm, other=float("-inf"))
        wgt = tl.math.exp2(lv - top)
        o = tl.load(op_ptr + row.to(tl.int64)[:, None] * D + cols[None, :], mask=sm[:, None], other=0.0)
        acc += tl.sum(wgt[:, None] * o, axis=0)
        den += wgt
    total = tl.sum(den, axis=0)
    res = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * s_ob + hq * s_oh + cols, res.to(out_ptr.dtype.element_ty))
