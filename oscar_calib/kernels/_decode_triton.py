"""Triton kernels behind :func:`oscar_calib.kernels.decode.decode_attention` (imported lazily).

Notation: ``D`` head_dim, ``G`` group size, ``W = min(G, D/4)`` bytes per bit-plane row,
``NB = D / (4W)`` byte blocks per row, ``NW = W/4`` 32-bit words per plane row, unit
``u = 4*block + plane`` covers channels ``[u*W, (u+1)*W)`` (see :mod:`.pack`). ``QG`` query heads
per KV head (padded to ``M2``), ``HP`` KV heads per program, ``NK = M2*HP`` score columns
(column ``c = hq*HP + hh``).

INT2 history (one warp per program, ``BN`` tokens per step):

* Keys, tokens as the M dimension of the dot: scores ``[BN, NK] = codes[BN, HP*W] @ q'[HP*W, NK]``
  per unit, ``q'`` block-diagonal over the ``HP`` heads (so the ``N = 8`` columns of the tensor
  core are all real query heads when ``QG = 4``). Code bytes become fp16 with one ``and`` per
  register: ``word & (0x00030003 << 2p)`` is a half2 of the codes of bytes 0 and 2, plane ``p``,
  as fp16 subnormals ``4^p * code * 2^-24`` (bytes 1 and 3 after one shift by 8, shared by
  the four planes). The factor ``4^-p``, the channel order (0, 2, 1, 3) inside each word and the
  score scale are folded into ``q'``, which is built once per program.
* Values, channel pairs as M: ``O^T[(which, word), (hq, e)] += A[(which, word), (t, e')] @
  B[(t, e'), (hq, e)]`` with ``A`` the same half2 registers (two channels of one token) and
  ``B[(t, e'), (hq, e)] = p[t, hq] * scale_v[t] * (e == e')``. The token pair in one register
  of a classic ``P @ V`` operand would need a byte transpose; this form needs none, and its
  ``N = 2 * M2`` columns are all used. Offsets enter as ``sum_t p_t * offset_t`` per group.
  The value codes are loaded as 16-bit elements (``V16``), so that each 32-bit register the
  bit operations produce stays one operand register (:func:`_vplane16`); ``V16=False`` loads
  32-bit words (:func:`_vplane`, for comparison).
* ``CORR``: the logit-noise correction (see :mod:`.decode`). The squared query norms per key
  group, ``cn_g`` per score column in base-2 score units, are computed once per program beside
  the offset sums; each group's score term ``s_g * (q'_g . c_g) + offset_g * sum(q_g)`` then
  loses ``s_g^2 * cn_g``, with the scale ``s_g`` the step already loaded (or prefetched) for it.
* Online softmax in base 2 with the rescale of the accumulators skipped when no column's
  running maximum moved (exact). Full blocks run unmasked; the last partial block masked.
* ``PF``: the loop over full blocks carries the next block's token offsets and parameters
  (loaded before the current block computes: a whole step to arrive instead of a stall in the
  middle of every step; the code bytes are software-pipelined by Triton already). Paged, the
  block-table entries come two steps ahead: the offsets of step ``i+1`` must not wait on a
  table load issued in step ``i`` (that wait cost 5% of the 128K x 1 call, H100). A step that
  lies in one page takes one entry, and with ``P32`` (every offset fits 32 bits) the offsets
  are 32-bit: the paged step is then 1539 against 1513 instructions of the contiguous one
  (batch-32 tiles, sm_90), against 1567 with per-token 64-bit offsets.
* ``PDL``: grid-dependency control for programmatic dependent launch (see :mod:`.decode`).
  ``LATE``: the kernel before wrote the lengths too (``append_token`` with the query), so the
  history programs read them, and the first step's parameters, only after the wait.
* ``L2T``: before that wait, prefetch (PTX ``prefetch.global.L2``) the code and parameter lines
  of the program's first ``L2T`` tokens (every ``L2CS``-th / ``L2PS``-th token: one per line).

Code modes (``ASM``): 1 = the bit operations as inline PTX (GPU); 0 = the same values with
plain Triton ops (the interpreter, and a GPU fallback). Both are exact.

16-bit window: programs ``pid0 < S16``, heads as the M dimension of the dots (padded to 16),
16-bit operands split into high and residual parts (about fp32 accuracy).
"""

from __future__ import annotations

import triton
import triton.language as tl

TWO24 = tl.constexpr(16777216.0)


def _k_asm(p: int) -> str:
    m = 0x00030003 << (2 * p)
    return "{\n.reg .b32 t;\nand.b32 $0, $2, %d;\nshr.b32 t, $2, 8;\nand.b32 $1, t, %d;\n}" % (m, m)


def _v_asm(p: int) -> str:
    m = 0x00030003 << (2 * p)
    return ("{\n.reg .b32 t, u;\nand.b32 t, $4, %d;\nmov.b32 {$0, $1}, t;\nshr.b32 u, $4, 8;\n"
            "and.b32 u, u, %d;\nmov.b32 {$2, $3}, u;\n}" % (m, m))


# ask L2 for the 128-byte line holding an address: no wait, no register written
L2_PREFETCH_ASM = tl.constexpr("prefetch.global.L2::evict_last [$1];\nmov.u32 $0, 0;")
K_ASM0 = tl.constexpr(_k_asm(0))
K_ASM1 = tl.constexpr(_k_asm(1))
K_ASM2 = tl.constexpr(_k_asm(2))
K_ASM3 = tl.constexpr(_k_asm(3))
V_ASM0 = tl.constexpr(_v_asm(0))
V_ASM1 = tl.constexpr(_v_asm(1))
V_ASM2 = tl.constexpr(_v_asm(2))
V_ASM3 = tl.constexpr(_v_asm(3))


@triton.jit
def _kplane(c, P: tl.constexpr, ASM: tl.constexpr):
    """Key code bytes (uint8, last dim a multiple of 4) -> fp16 ``4^P * code * 2^-24`` of plane P.

    Element ``4i + m`` holds byte ``4i + (0, 2, 1, 3)[m]``: with ASM the bytes are loaded in
    order and the ``and`` does the permutation; without, the caller loads them permuted."""
    if ASM:
        if P == 0:
            r = tl.inline_asm_elementwise(K_ASM0, "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)
        elif P == 1:
            r = tl.inline_asm_elementwise(K_ASM1, "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)
        elif P == 2:
            r = tl.inline_asm_elementwise(K_ASM2, "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)
        else:
            r = tl.inline_asm_elementwise(K_ASM3, "=r,=r,r", [c], dtype=tl.float16, is_pure=True, pack=4)
    else:
        r = (c & (3 << (2 * P))).to(tl.int16).to(tl.float16, bitcast=True)
    return r


@triton.jit
def _vplane(w, P: tl.constexpr, ASM: tl.constexpr):
    """Value code words int32 ``[HP, BN, NW]`` -> fp16 ``A [HP, 2*NW, 2*BN]`` of plane P:
    ``A[hh, which*NW + j, 2t + e] = 4^P * code(token t, byte 4j + which + 2e) * 2^-24``."""
    if ASM:
        if P == 0:
            x00, x01, x10, x11 = tl.inline_asm_elementwise(
                V_ASM0, "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                is_pure=True, pack=1)
        elif P == 1:
            x00, x01, x10, x11 = tl.inline_asm_elementwise(
                V_ASM1, "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                is_pure=True, pack=1)
        elif P == 2:
            x00, x01, x10, x11 = tl.inline_asm_elementwise(
                V_ASM2, "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                is_pure=True, pack=1)
        else:
            x00, x01, x10, x11 = tl.inline_asm_elementwise(
                V_ASM3, "=h,=h,=h,=h,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                is_pure=True, pack=1)
    else:
        x00 = (w & (3 << (2 * P))).to(tl.int16).to(tl.float16, bitcast=True)
        x01 = ((w >> 16) & (3 << (2 * P))).to(tl.int16).to(tl.float16, bitcast=True)
        x10 = ((w >> 8) & (3 << (2 * P))).to(tl.int16).to(tl.float16, bitcast=True)
        x11 = ((w >> 24) & (3 << (2 * P))).to(tl.int16).to(tl.float16, bitcast=True)
    HP: tl.constexpr = w.shape[0]
    BN: tl.constexpr = w.shape[1]
    NW: tl.constexpr = w.shape[2]
    j = tl.join(tl.join(x00, x01), tl.join(x10, x11))  # [HP, BN, NW, e, which]
    return tl.permute(j, (0, 4, 2, 1, 3)).reshape(HP, 2 * NW, 2 * BN)


@triton.jit
def _vplane16(w, P: tl.constexpr, ASM: tl.constexpr):
    """Value codes as 16-bit elements ``[HP, BN, 2*NW]`` (element ``2j + e`` = bytes ``4j + 2e``
    and ``4j + 2e + 1``) -> fp16 ``A [HP, 2*NW, 2*BN]`` of plane P, as :func:`_vplane`.

    Two elements arrive in one 32-bit register, the same word :func:`_kplane` takes, and the
    same two instructions make the half2 registers of bytes (0, 2) and (1, 3): each is already
    one register of the value product's A operand (two channels of one token), where the
    word-wide :func:`_vplane` returns four 16-bit values that the compiler packs again (about 8%
    fewer instructions per batch-1 step, sm_90)."""
    if ASM:
        if P == 0:
            x0, x1 = tl.inline_asm_elementwise(K_ASM0, "=r,=r,r", [w], dtype=(tl.float16, tl.float16),
                                               is_pure=True, pack=2)
        elif P == 1:
            x0, x1 = tl.inline_asm_elementwise(K_ASM1, "=r,=r,r", [w], dtype=(tl.float16, tl.float16),
                                               is_pure=True, pack=2)
        elif P == 2:
            x0, x1 = tl.inline_asm_elementwise(K_ASM2, "=r,=r,r", [w], dtype=(tl.float16, tl.float16),
                                               is_pure=True, pack=2)
        else:
            x0, x1 = tl.inline_asm_elementwise(K_ASM3, "=r,=r,r", [w], dtype=(tl.float16, tl.float16),
                                               is_pure=True, pack=2)
    else:
        x0 = (w & (3 << (2 * P))).to(tl.int16).to(tl.float16, bitcast=True)
        x1 = ((w >> 8) & (3 << (2 * P))).to(tl.int16).to(tl.float16, bitcast=True)
    HP: tl.constexpr = w.shape[0]
    BN: tl.constexpr = w.shape[1]
    NW2: tl.constexpr = w.shape[2]
    j = tl.join(x0.reshape(HP, BN, NW2 // 2, 2), x1.reshape(HP, BN, NW2 // 2, 2))  # [HP, BN, NW, e, which]
    return tl.permute(j, (0, 4, 2, 1, 3)).reshape(HP, NW2, 2 * BN)


@triton.jit
def _bmat(wt):
    """``w [HP, BN, M2]`` -> ``B [HP, 2*BN, 2*M2]`` with ``B[hh, 2t+e', 2m+e] = w[hh, t, m] * (e == e')``."""
    HP: tl.constexpr = wt.shape[0]
    BN: tl.constexpr = wt.shape[1]
    M2: tl.constexpr = wt.shape[2]
    z = tl.zeros_like(wt)
    r0 = tl.join(wt, z).reshape(HP, BN, 2 * M2)
    r1 = tl.join(z, wt).reshape(HP, BN, 2 * M2)
    return tl.permute(tl.join(r0, r1), (0, 1, 3, 2)).reshape(HP, 2 * BN, 2 * M2)


@triton.jit
def _cols_to_o(v, M2: tl.constexpr, HP: tl.constexpr):
    """Score-column vector ``[M2*HP]`` -> ``[HP, 1, 2*M2]`` broadcastable over value accumulators."""
    x = tl.permute(v.reshape(M2, HP), (1, 0))
    return tl.join(x, x).reshape(HP, 2 * M2)[:, None, :]


@triton.jit
def _sel8(i: tl.constexpr, x0, x1, x2, x3, x4, x5, x6, x7):
    if i == 0:
        r = x0
    elif i == 1:
        r = x1
    elif i == 2:
        r = x2
    elif i == 3:
        r = x3
    elif i == 4:
        r = x4
    elif i == 5:
        r = x5
    elif i == 6:
        r = x6
    else:
        r = x7
    return r


@triton.jit
def _qop(qr_ptr, qrow, hh_r, hh_c, hq_c, cmask, scale, U: tl.constexpr, W: tl.constexpr):
    """K-dot operand of unit U: ``[HP*W, NK]`` fp16, block-diagonal over heads, channels in the
    order the key codes arrive in (see :func:`_kplane`), scaled by ``scale * 4^-plane``."""
    kk = tl.arange(0, W)
    ch = U * W + (kk // 4) * 4 + (kk % 4 % 2) * 2 + (kk % 4) // 2
    HPW: tl.constexpr = hh_r.shape[0]
    chs = tl.broadcast_to(ch[None, :], [HPW // W, W]).reshape(HPW)
    m = (hh_r[:, None] == hh_c[None, :]) & cmask[None, :]
    v = tl.load(qr_ptr + qrow[None, :] + chs[:, None], mask=m, other=0.0).to(tl.float32)
    return (v * (scale / (1 << (2 * (U % 4))))).to(tl.float16)


@triton.jit
def _dot2(a_hi, a_lo, b, acc, INTERP: tl.constexpr):
    """``(a_hi + a_lo) @ b`` as two dots (16-bit operands, fp32 accumulation)."""
    if INTERP:  # the interpreter's 16-bit dot is not exact; fp32 is, for 16-bit operands
        a_hi = a_hi.to(tl.float32)
        a_lo = a_lo.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a_lo, b, tl.dot(a_hi, b, acc))


@triton.jit
def _kunit(kc, U: tl.constexpr, q0, q1, q2, q3, q4, q5, q6, q7, t, ASM: tl.constexpr, INTERP: tl.constexpr):
    """``t += codes(unit U) [BN, HP*W] @ q'_U [HP*W, NK]`` (key codes ``kc [HP, BN, W]``)."""
    HP: tl.constexpr = kc.shape[0]
    BN: tl.constexpr = kc.shape[1]
    W: tl.constexpr = kc.shape[2]
    a = _kplane(kc, U % 4, ASM)
    a = tl.permute(a, (1, 0, 2)).reshape(BN, HP * W)               # k = hh*W + j
    q = _sel8(U, q0, q1, q2, q3, q4, q5, q6, q7)
    if INTERP:
        a = a.to(tl.float32)
        q = q.to(tl.float32)
    return tl.dot(a, q, t)


@triton.jit
def _vunit(vw, P: tl.constexpr, bm, o, ASM: tl.constexpr, INTERP: tl.constexpr, V16: tl.constexpr):
    """``o += A(plane P of value codes vw) @ bm`` (batched over the HP heads); ``vw``: 16-bit
    pairs (``V16``) or 32-bit words."""
    if V16:
        av = _vplane16(vw, P, ASM)
    else:
        av = _vplane(vw, P, ASM)
    if INTERP:
        return tl.dot(av.to(tl.float32), bm.to(tl.float32), o)
    return tl.dot(av, bm, o)


@triton.jit
def _window_head(q_ptr, s_qb, s_qh, b, h, chunk, k16_ptr, v16_ptr, s_1b, s_1h, s_1n, len16_ptr,
                 op_ptr, lse_ptr, qk_scale, H, QG, S_ALL, CHUNK16,
                 D: tl.constexpr, W: tl.constexpr, NB: tl.constexpr, M: tl.constexpr,
                 BLOCK16: tl.constexpr, INTERP: tl.constexpr, WS: tl.constexpr):
    """Partial attention of one KV head over chunk ``chunk`` of the 16-bit window (slot ``chunk``)."""
    offs_m = tl.arange(0, M)
    mmask = offs_m < QG
    offs_w = tl.arange(0, W)
    qrow = q_ptr + b.to(tl.int64) * s_qb + (h * QG + offs_m).to(tl.int64)[:, None] * s_qh + offs_w[None, :]
    q0 = tl.load(qrow + 0 * W, mask=mmask[:, None], other=0.0).to(tl.float32)
    q1 = tl.load(qrow + 1 * W, mask=mmask[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(qrow + 2 * W, mask=mmask[:, None], other=0.0).to(tl.float32)
    q3 = tl.load(qrow + 3 * W, mask=mmask[:, None], other=0.0).to(tl.float32)
    a0 = tl.zeros([M, W], dtype=tl.float32)
    a1 = tl.zeros([M, W], dtype=tl.float32)
    a2 = tl.zeros([M, W], dtype=tl.float32)
    a3 = tl.zeros([M, W], dtype=tl.float32)
    if NB == 2:
        q4 = tl.load(qrow + 4 * W, mask=mmask[:, None], other=0.0).to(tl.float32)
        q5 = tl.load(qrow + 5 * W, mask=mmask[:, None], other=0.0).to(tl.float32)
        q6 = tl.load(qrow + 6 * W, mask=mmask[:, None], other=0.0).to(tl.float32)
        q7 = tl.load(qrow + 7 * W, mask=mmask[:, None], other=0.0).to(tl.float32)
        a4 = tl.zeros([M, W], dtype=tl.float32)
        a5 = tl.zeros([M, W], dtype=tl.float32)
        a6 = tl.zeros([M, W], dtype=tl.float32)
        a7 = tl.zeros([M, W], dtype=tl.float32)
    m_i = tl.full([M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)
    WT = k16_ptr.dtype.element_ty
    L16 = tl.load(len16_ptr + b)
    lo = chunk * CHUNK16
    hi = tl.minimum(lo + CHUNK16, L16)
    base = b.to(tl.int64) * s_1b + h * s_1h
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
    for start in tl.range(lo, hi, BLOCK16, num_stages=WS):
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
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    inv = 1.0 / l_safe
    lse_v = tl.where(has, m_i + tl.math.log2(l_safe), float("-inf"))
    prow = ((b * H + h) * S_ALL + chunk) * QG + offs_m
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
def _tok_offsets(start, hi, b, tab_ptr, s_tb, s_cb, s_cn, s_cbw, s_cw, s_pb, s_pn,
                 BN: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, MASKED: tl.constexpr,
                 P32: tl.constexpr = False):
    """Offsets ``[BN]`` of tokens ``start .. start+BN-1`` in bytes (codes), words (value codes)
    and parameters; paged: through the block table (rows past ``hi`` read page 0)."""
    n = start + tl.arange(0, BN)
    if PAGED:
        if MASKED or PAGE % BN == 0:
            pg = _page_entries(start, hi, b, tab_ptr, s_tb, BN, PAGE, P32)
        else:
            pg = tl.load(tab_ptr + b * s_tb + n // PAGE)
            if not P32:
                pg = pg.to(tl.int64)
        tc, tw, tp = _page_offsets(start, pg, s_cb, s_cn, s_cbw, s_cw, s_pb, s_pn, BN, PAGE)
    else:
        tc = n * s_cn
        tw = n * s_cw
        tp = n * s_pn
    return tc, tw, tp


@triton.jit
def _page_entries(start, hi, b, tab_ptr, s_tb, BN: tl.constexpr, PAGE: tl.constexpr, P32: tl.constexpr = False):
    """Block-table entries ``[BN]`` of tokens ``start .. start+BN-1``; rows past ``hi``: page 0.
    A step that never crosses a page (``PAGE % BN == 0``; steps start at multiples of ``BN``)
    takes its one entry as a scalar. int64, or int32 where every offset into the cache's
    tensors fits 32 bits (``P32``, checked by the caller)."""
    if PAGE % BN == 0:
        pg = tl.load(tab_ptr + b * s_tb + start // PAGE, mask=start < hi, other=0)
    else:
        n = start + tl.arange(0, BN)
        pg = tl.load(tab_ptr + b * s_tb + n // PAGE, mask=n < hi, other=0)
    if not P32:
        pg = pg.to(tl.int64)
    return pg


@triton.jit
def _page_offsets(start, pg, s_cb, s_cn, s_cbw, s_cw, s_pb, s_pn, BN: tl.constexpr, PAGE: tl.constexpr):
    """:func:`_tok_offsets` of a paged cache from the block-table entries ``pg`` of
    :func:`_page_entries` (one per token, or the step's one)."""
    if PAGE % BN == 0:
        slot = start % PAGE + tl.arange(0, BN)
    else:
        slot = (start + tl.arange(0, BN)) % PAGE
    return pg * s_cb + slot * s_cn, pg * s_cbw + slot * s_cw, pg * s_pb + slot * s_pn


@triton.jit
def _l2_prefetch(p):
    """Prefetch into L2 the line of each pointer of ``p`` (inline PTX with a side effect, so it
    stays although nothing reads its dummy result)."""
    tl.inline_asm_elementwise(L2_PREFETCH_ASM, "=r,l", [p.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _warm_l2(lo, hi, b, tab_ptr, s_tb, kc_ptr, vc_ptr, ks_ptr, ko_ptr, vs_ptr, vo_ptr, hoff_c, hoff_p,
             s_cb, s_cn, s_pb, s_pn, hoff_pv, s_vpb, s_vpn, NT: tl.constexpr, CS: tl.constexpr, PS: tl.constexpr,
             PAGED: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr):
    """L2 prefetches of the codes and parameters of tokens ``lo .. lo+NT-1`` (below ``hi``): one
    per line, i.e. every ``CS``-th token's code row and every ``PS``-th token's parameters
    (``PS`` at most the page). Tokens past ``hi`` repeat token ``lo`` (in bounds; paged: page 0).
    ``SPLIT``: the value parameters have their own base ``hoff_pv`` and strides."""
    tc = _every_nth(lo, hi, b, tab_ptr, s_tb, s_cb, s_cn, NT // CS, CS, PAGED, PAGE)
    _l2_prefetch(kc_ptr + hoff_c[:, None] + tc[None, :])
    _l2_prefetch(vc_ptr + hoff_c[:, None] + tc[None, :])
    pp = hoff_p[:, None] + _every_nth(lo, hi, b, tab_ptr, s_tb, s_pb, s_pn, NT // PS, PS, PAGED, PAGE)[None, :]
    _l2_prefetch(ks_ptr + pp)
    _l2_prefetch(ko_ptr + pp)
    if SPLIT:
        pp = hoff_pv[:, None] + _every_nth(lo, hi, b, tab_ptr, s_tb, s_vpb, s_vpn, NT // PS, PS, PAGED, PAGE)[None, :]
    _l2_prefetch(vs_ptr + pp)
    _l2_prefetch(vo_ptr + pp)


@triton.jit
def _every_nth(lo, hi, b, tab_ptr, s_tb, s_page, s_tok, COUNT: tl.constexpr, STEP: tl.constexpr,
               PAGED: tl.constexpr, PAGE: tl.constexpr):
    """Offsets (int64) of tokens ``lo, lo+STEP, ...`` (``COUNT`` of them) for page/token strides
    ``s_page``/``s_tok``; tokens past ``hi`` are replaced by ``lo`` (paged: by page 0's slot)."""
    n = lo + tl.arange(0, COUNT) * STEP
    if PAGED:
        pg = tl.load(tab_ptr + b * s_tb + n // PAGE, mask=n < hi, other=0).to(tl.int64)
        return pg * s_page + (n % PAGE) * s_tok
    return tl.where(n < hi, n, lo).to(tl.int64) * s_tok


@triton.jit
def _load_params(ks_ptr, ko_ptr, vs_ptr, vo_ptr, tp, hoff_p, nmask, g: tl.constexpr):
    """Scale/offset of group ``g`` for K and V, ``[BN, HP]`` fp16 each (masked rows read 0)."""
    pbase = tp[:, None] + hoff_p[None, :] + g
    m = nmask[:, None]
    ks = tl.load(ks_ptr + pbase, mask=m, other=0.0)
    ko = tl.load(ko_ptr + pbase, mask=m, other=0.0)
    vs = tl.load(vs_ptr + pbase, mask=m, other=0.0)
    vo = tl.load(vo_ptr + pbase, mask=m, other=0.0)
    return ks, ko, vs, vo


@triton.jit
def _group_sq(q_ptr, qrow, cmask, g: tl.constexpr, G: tl.constexpr, scale):
    """``scale * |q[g]|^2`` per score column ``[NK]``: the squared norm of the query over key
    group ``g`` (channels ``g*G .. g*G + G-1``) in float32."""
    x = tl.load(q_ptr + qrow[None, :] + (g * G + tl.arange(0, G))[:, None], mask=cmask[None, :],
                other=0.0).to(tl.float32)
    return tl.sum(x * x, axis=0) * scale


@triton.jit
def _int2_block(start, hi, kc_ptr, vcw_ptr, ks_ptr, ko_ptr, vs_ptr, vo_ptr,
                b, tab_ptr, s_tb, hoff_c, hoff_w, hoff_p, s_cb, s_cn, s_cbw, s_cw, s_pb, s_pn,
                hoff_pv, s_vpb, s_vpn,
                q0, q1, q2, q3, q4, q5, q6, q7, qs0, qs1, qs2, qs3, qs4, qs5, qs6, qs7,
                cn0, cn1, cn2, cn3, cn4, cn5, cn6, cn7,
                o0, o1, o2, o3, o4, o5, o6, o7, m_i, l_i, os_acc,
                tc, tw, tp, pks, pko, pvs, pvo,
                G: tl.constexpr, W: tl.constexpr, NB: tl.constexpr, M2: tl.constexpr, HP: tl.constexpr,
                BN: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, ASM: tl.constexpr,
                MASKED: tl.constexpr, INTERP: tl.constexpr, PF: tl.constexpr, V16: tl.constexpr,
                P32: tl.constexpr, GV: tl.constexpr, WV: tl.constexpr, NBV: tl.constexpr, SPLIT: tl.constexpr,
                CORR: tl.constexpr):
    """One step of ``BN`` history tokens for ``HP`` KV heads: scores, online softmax, values.

    ``PF``: the token offsets ``tc, tw, tp`` and the (single group's) parameters ``pks`` ..
    ``pvo`` were loaded one step earlier by the caller (software prefetch); otherwise they are
    computed and loaded here. Keys come in groups of ``G`` (plane width ``W``, ``NB`` byte
    blocks), values in groups of ``GV`` (``WV``, ``NBV``); ``SPLIT``: the value parameters have
    their own base ``hoff_pv`` and strides (otherwise the keys' offsets serve both). ``CORR``:
    each key group's score term loses ``scale^2 * cn_g`` (the logit-noise correction; ``cn0``
    .. ``cn7`` per score column, see :func:`decode_kernel`)."""
    NW: tl.constexpr = WV // 4
    NK: tl.constexpr = M2 * HP
    NGT: tl.constexpr = os_acc.shape[0]
    offs_n = tl.arange(0, BN)
    n = start + offs_n
    if not PF:
        tc, tw, tp = _tok_offsets(start, hi, b, tab_ptr, s_tb, s_cb, s_cn, s_cbw, s_cw, s_pb, s_pn,
                                  BN, PAGED, PAGE, MASKED, P32)
    if MASKED:
        nm = n < hi
    # per-(token, head) parameter offsets [BN, HP]
    pbase = tp[:, None] + hoff_p[None, :]
    if SPLIT:
        _, _, tpv = _tok_offsets(start, hi, b, tab_ptr, s_tb, s_vpb, s_vpn, s_vpb, s_vpn, s_vpb, s_vpn,
                                 BN, PAGED, PAGE, MASKED, P32)
        pbase_v = tpv[:, None] + hoff_pv[None, :]
    else:
        pbase_v = pbase
    # key codes [HP, BN, W] per block and value words [HP, BN, NW] per block
    offs_b = tl.arange(0, W)
    if ASM:
        kb = offs_b
    else:
        kb = (offs_b // 4) * 4 + (offs_b % 4 % 2) * 2 + (offs_b % 4) // 2
    kptr = kc_ptr + (hoff_c[:, None, None] + tc[None, :, None] + kb[None, None, :])
    NV: tl.constexpr = 2 * NW if V16 else NW  # value-code elements per byte block and token
    vptr = vcw_ptr + (hoff_w[:, None, None] + tw[None, :, None] + tl.arange(0, NV)[None, None, :])
    if MASKED:
        m3 = nm[None, :, None]
        kc0 = tl.load(kptr, mask=m3, other=0)
        vw0 = tl.load(vptr, mask=m3, other=0)
        if NB == 2:
            kc1 = tl.load(kptr + W, mask=m3, other=0)
        if NBV == 2:
            vw1 = tl.load(vptr + NV, mask=m3, other=0)
    else:
        kc0 = tl.load(kptr)
        vw0 = tl.load(vptr)
        if NB == 2:
            kc1 = tl.load(kptr + W)
        if NBV == 2:
            vw1 = tl.load(vptr + NV)

    # ---- scores [BN, NK] (log2 units) ----
    s = tl.zeros([BN, NK], dtype=tl.float32)
    t = tl.zeros([BN, NK], dtype=tl.float32)
    for U in tl.static_range(4 * NB):
        if U < 4:
            kc = kc0
        else:
            kc = kc1
        t = _kunit(kc, U, q0, q1, q2, q3, q4, q5, q6, q7, t, ASM, INTERP)
        if ((U + 1) * W) % G == 0:  # last unit of a group
            g = (U * W) // G
            if PF:
                sc = pks.to(tl.float32)
                of = pko.to(tl.float32)
            elif MASKED:
                sc = tl.load(ks_ptr + pbase + g, mask=nm[:, None], other=0.0).to(tl.float32)
                of = tl.load(ko_ptr + pbase + g, mask=nm[:, None], other=0.0).to(tl.float32)
            else:
                sc = tl.load(ks_ptr + pbase + g).to(tl.float32)
                of = tl.load(ko_ptr + pbase + g).to(tl.float32)
            qs = _sel8(g, qs0, qs1, qs2, qs3, qs4, qs5, qs6, qs7)
            of = tl.broadcast_to(of[:, None, :], [BN, M2, HP]).reshape(BN, NK)
            if CORR:  # with the logit-noise correction of this key group
                cn = _sel8(g, cn0, cn1, cn2, cn3, cn4, cn5, cn6, cn7)
                sc = tl.broadcast_to(sc[:, None, :], [BN, M2, HP]).reshape(BN, NK)
                term = (t * TWO24 - sc * cn[None, :]) * sc + of * qs[None, :]
            else:  # (the power-of-two factor applied per token, before the broadcast: exact)
                sc = tl.broadcast_to((sc * TWO24)[:, None, :], [BN, M2, HP]).reshape(BN, NK)
                term = t * sc + of * qs[None, :]
            if g == 0:  # the first group's term is the score (no add to zeros: one instruction less per score)
                s = term
            else:
                s += term
            t = tl.zeros([BN, NK], dtype=tl.float32)
    if MASKED:
        s = tl.where(nm[:, None], s, float("-inf"))

    # ---- online softmax; rescale only when a running maximum moved ----
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    if tl.max(m_new - m_i, axis=0) > 0:
        alpha = tl.math.exp2(m_i - m_new)
        a3 = _cols_to_o(alpha, M2, HP)
        o0 = o0 * a3
        o1 = o1 * a3
        o2 = o2 * a3
        o3 = o3 * a3
        if NBV == 2:
            o4 = o4 * a3
            o5 = o5 * a3
            o6 = o6 * a3
            o7 = o7 * a3
        l_i = l_i * alpha
        os_acc = os_acc * alpha[None, :]
        m_i = m_new
    p = tl.math.exp2(s - m_i[None, :])
    l_i += tl.sum(p, axis=0)

    # ---- values ----
    gi = tl.arange(0, NGT)
    for U in tl.static_range(4 * NBV):
        if (U * WV) % GV == 0:  # first unit of a group
            g = (U * WV) // GV
            if PF:
                vs = pvs.to(tl.float32)
                vo = pvo.to(tl.float32)
            elif MASKED:
                vs = tl.load(vs_ptr + pbase_v + g, mask=nm[:, None], other=0.0).to(tl.float32)
                vo = tl.load(vo_ptr + pbase_v + g, mask=nm[:, None], other=0.0).to(tl.float32)
            else:
                vs = tl.load(vs_ptr + pbase_v + g).to(tl.float32)
                vo = tl.load(vo_ptr + pbase_v + g).to(tl.float32)
            vs = tl.broadcast_to(vs[:, None, :], [BN, M2, HP]).reshape(BN, NK)
            vo = tl.broadcast_to(vo[:, None, :], [BN, M2, HP]).reshape(BN, NK)
            wv = (p * vs).to(tl.float16).reshape(BN, M2, HP)
            bm = _bmat(tl.permute(wv, (2, 0, 1)))                     # [HP, 2BN, 2M2]
            osum = tl.sum(p * vo, axis=0)
            os_acc += tl.where(gi[:, None] == g, osum[None, :], 0.0)
        if U < 4:
            vw = vw0
        else:
            vw = vw1
        if U == 0:
            o0 = _vunit(vw, 0, bm, o0, ASM, INTERP, V16)
        elif U == 1:
            o1 = _vunit(vw, 1, bm, o1, ASM, INTERP, V16)
        elif U == 2:
            o2 = _vunit(vw, 2, bm, o2, ASM, INTERP, V16)
        elif U == 3:
            o3 = _vunit(vw, 3, bm, o3, ASM, INTERP, V16)
        elif U == 4:
            o4 = _vunit(vw, 0, bm, o4, ASM, INTERP, V16)
        elif U == 5:
            o5 = _vunit(vw, 1, bm, o5, ASM, INTERP, V16)
        elif U == 6:
            o6 = _vunit(vw, 2, bm, o6, ASM, INTERP, V16)
        else:
            o7 = _vunit(vw, 3, bm, o7, ASM, INTERP, V16)
    return o0, o1, o2, o3, o4, o5, o6, o7, m_i, l_i, os_acc


@triton.jit
def _store_unit(o, os_acc, os3, inv3, op_ptr, off3, m3,
                U: tl.constexpr, G: tl.constexpr, W: tl.constexpr, M2: tl.constexpr, HP: tl.constexpr):
    """Store unit U of the value accumulator: ``(o * 2^24 * 4^-p + offset sum) / l``."""
    NGT: tl.constexpr = os_acc.shape[0]
    if NGT > 1:
        gi = tl.arange(0, NGT)
        os3 = _cols_to_o(tl.sum(tl.where(gi[:, None] == (U * W) // G, os_acc, 0.0), axis=0), M2, HP)
    val = (o * (TWO24 / (1 << (2 * (U % 4)))) + os3) * inv3
    tl.store(op_ptr + off3 + U * W, val, mask=m3)


@triton.jit
def decode_kernel(
    q_ptr, s_qb, s_qh,
    kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr,
    s_cb, s_ch, s_cn, s_pb, s_ph, s_pn, s_vpb, s_vph, s_vpn,
    tab_ptr, s_tb, hlen_ptr,
    k16_ptr, v16_ptr, s_1b, s_1h, s_1n,
    len16_ptr,
    op_ptr, lse_ptr,
    qk_scale, corr_scale,
    H, HG, QG, S16, S_ALL, CHUNK, CHUNK16,
    D: tl.constexpr, G: tl.constexpr, W: tl.constexpr, NB: tl.constexpr, M2: tl.constexpr,
    HP: tl.constexpr, M16: tl.constexpr, BN: tl.constexpr, BLOCK16: tl.constexpr,
    PAGED: tl.constexpr, PAGE: tl.constexpr, ASM: tl.constexpr, INTERP: tl.constexpr,
    GV: tl.constexpr, WV: tl.constexpr, NBV: tl.constexpr,
    PARTS: tl.constexpr = 3, PF: tl.constexpr = False, PDL: tl.constexpr = False,
    L2T: tl.constexpr = 0, L2CS: tl.constexpr = 4, L2PS: tl.constexpr = 64, WS: tl.constexpr = 1,
    V16: tl.constexpr = True, P32: tl.constexpr = False, LATE: tl.constexpr = False,
    SPLIT: tl.constexpr = False, CORR: tl.constexpr = False,
):
    """Grid ``(S16 + S2, B * HG)``: program ``(c, b*HG + hg)`` handles KV heads
    ``hg*HP .. hg*HP + HP-1`` of sequence ``b``: window chunk ``c`` (``c < S16``) or history
    chunk ``c - S16``; it writes partial slot ``c`` (normalised output and base-2 log-sum-exp).
    ``PARTS`` (3: both kinds of program) can compile a history-only (1, grid ``S2``) or
    window-only (2, grid ``S16``) specialisation, e.g. to read each one's register use.

    Keys are stored in groups of ``G`` channels (plane width ``W``, ``NB`` byte blocks), values in
    groups of ``GV`` (``WV``, ``NBV``; the keys' in a uniform cache). ``SPLIT``: the value parameters have
    their own strides ``s_vpb, s_vph, s_vpn`` (a cache whose K and V group sizes differ); otherwise
    the keys' parameter offsets serve the values too, the code the uniform cache compiles to.

    ``CORR``: the logit-noise correction. Each INT2 token's base-2 score loses
    ``sum_g s_g^2 * cn_g`` with ``s_g`` its key scale of group ``g`` and ``cn_g = corr_scale *
    |q_rot[g]|^2`` per score column (``corr_scale = a/2 * sm_scale^2 / 12 * log2(e)``, set by the
    caller; the scores are ``log2(e) * sm_scale * q_rot . k``). Off, none of it is compiled and
    ``corr_scale`` is not read."""
    VB: tl.constexpr = 2 if V16 else 4  # bytes per value-code element (see _int2_block)
    pid0 = tl.program_id(0) + (S16 if PARTS == 1 else 0)
    pid1 = tl.program_id(1)
    b = pid1 // HG
    h0 = (pid1 % HG) * HP
    if PDL:  # the merge kernel may launch now; it waits for this grid before reading
        tl.extra.cuda.gdc_launch_dependents()
    if PARTS == 2 or (PARTS == 3 and pid0 < S16):
        if PDL:
            tl.extra.cuda.gdc_wait()
        for hh in tl.static_range(HP):
            if h0 + hh < H:
                _window_head(q_ptr, s_qb, s_qh, b, h0 + hh, pid0, k16_ptr, v16_ptr, s_1b, s_1h, s_1n,
                             len16_ptr, op_ptr, lse_ptr, qk_scale, H, QG, S_ALL, CHUNK16,
                             D, W, NB, M16, BLOCK16, INTERP, WS)
    if PARTS == 1 or (PARTS == 3 and pid0 >= S16):
        chunk = pid0 - S16
        # cache-side set-up first: with programmatic dependent launch (PDL) it overlaps the
        # query-rotation kernel, whose output is read only after gdc_wait
        hh = tl.arange(0, HP)
        heff = tl.minimum(h0 + hh, H - 1).to(tl.int64)
        if PAGED:
            hoff_c = heff * s_ch
            hoff_w = heff * (s_ch // VB)
            hoff_p = heff * s_ph
        else:
            hoff_c = b.to(tl.int64) * s_cb + heff * s_ch
            hoff_w = b.to(tl.int64) * (s_cb // VB) + heff * (s_ch // VB)
            hoff_p = b.to(tl.int64) * s_pb + heff * s_ph
        if SPLIT:
            if PAGED:
                hoff_pv = heff * s_vph
            else:
                hoff_pv = b.to(tl.int64) * s_vpb + heff * s_vph
        else:
            hoff_pv = hoff_p
        if V16:
            vcw_ptr = vc_ptr.to(tl.pointer_type(tl.int16))
        else:
            vcw_ptr = vc_ptr.to(tl.pointer_type(tl.int32))
        L = tl.load(hlen_ptr + b)  # (LATE: the length the kernel before may still change)
        lo = chunk * CHUNK
        hi = tl.minimum(lo + CHUNK, L)
        if L2T > 0:  # while the kernel before runs (PDL), DRAM fetches this program's first tokens
            _warm_l2(lo, hi, b, tab_ptr, s_tb, kc_ptr, vc_ptr, ks_ptr, ko_ptr, vs_ptr, vo_ptr, hoff_c, hoff_p,
                     s_cb, s_cn, s_pb, s_pn, hoff_pv, s_vpb, s_vpn, L2T, L2CS, L2PS, PAGED, PAGE, SPLIT)
        if LATE:  # the lengths may come from the kernel before: read them after it ends
            tl.extra.cuda.gdc_wait()
            L = tl.load(hlen_ptr + b)
            hi = tl.minimum(lo + CHUNK, L)
        nfull = tl.maximum(hi - lo, 0) // BN
        if PF:  # offsets and parameters of the first step
            tc, tw, tp = _tok_offsets(lo, hi, b, tab_ptr, s_tb, s_cb, s_cn, s_cb // VB, s_cn // VB, s_pb, s_pn,
                                      BN, PAGED, PAGE, True, P32)
            pks, pko, pvs, pvo = _load_params(ks_ptr, ko_ptr, vs_ptr, vo_ptr, tp, hoff_p,
                                              lo + tl.arange(0, BN) < hi, 0)
        if PDL and not LATE:
            tl.extra.cuda.gdc_wait()
        NW: tl.constexpr = WV // 4      # value accumulators: 2*NW channel rows per unit
        NK: tl.constexpr = M2 * HP
        NGT: tl.constexpr = D // G       # key groups (query sums)
        NGV: tl.constexpr = D // GV     # value groups (offset sums)
        # columns c = hq*HP + hh; rows of the K operand r = hh*W + j
        cc = tl.arange(0, NK)
        hh_c = cc % HP
        hq_c = cc // HP
        hvalid_c = (h0 + hh_c) < H
        cmask = (hq_c < QG) & hvalid_c
        heff_c = tl.minimum(h0 + hh_c, H - 1)
        qrow = b.to(tl.int64) * s_qb + (heff_c * QG + hq_c).to(tl.int64) * s_qh     # [NK]
        rr = tl.arange(0, HP * W)
        hh_r = rr // W
        qsc = qk_scale
        q0 = _qop(q_ptr, qrow, hh_r, hh_c, hq_c, cmask, qsc, 0, W)
        q1 = _qop(q_ptr, qrow, hh_r, hh_c, hq_c, cmask, qsc, 1, W)
        q2 = _qop(q_ptr, qrow, hh_r, hh_c, hq_c, cmask, qsc, 2, W)
        q3 = _qop(q_ptr, qrow, hh_r, hh_c, hq_c, cmask, qsc, 3, W)
        if NB == 2:
            q4 = _qop(q_ptr, qrow, hh_r, hh_c, hq_c, cmask, qsc, 4, W)
            q5 = _qop(q_ptr, qrow, hh_r, hh_c, hq_c, cmask, qsc, 5, W)
            q6 = _qop(q_ptr, qrow, hh_r, hh_c, hq_c, cmask, qsc, 6, W)
            q7 = _qop(q_ptr, qrow, hh_r, hh_c, hq_c, cmask, qsc, 7, W)
        else:
            q4 = q0
            q5 = q0
            q6 = q0
            q7 = q0
        # per-group query sums (offset term), [NK] each
        offs_g = tl.arange(0, G)
        qs0 = tl.sum(tl.load(q_ptr + qrow[None, :] + (0 * G + offs_g)[:, None], mask=cmask[None, :],
                             other=0.0).to(tl.float32), axis=0) * qsc
        qs1 = qs0
        qs2 = qs0
        qs3 = qs0
        qs4 = qs0
        qs5 = qs0
        qs6 = qs0
        qs7 = qs0
        if NGT > 1:
            qs1 = tl.sum(tl.load(q_ptr + qrow[None, :] + (1 * G + offs_g)[:, None], mask=cmask[None, :],
                                 other=0.0).to(tl.float32), axis=0) * qsc
        if NGT > 2:
            qs2 = tl.sum(tl.load(q_ptr + qrow[None, :] + (2 * G + offs_g)[:, None], mask=cmask[None, :],
                                 other=0.0).to(tl.float32), axis=0) * qsc
            qs3 = tl.sum(tl.load(q_ptr + qrow[None, :] + (3 * G + offs_g)[:, None], mask=cmask[None, :],
                                 other=0.0).to(tl.float32), axis=0) * qsc
        if NGT > 4:
            qs4 = tl.sum(tl.load(q_ptr + qrow[None, :] + (4 * G + offs_g)[:, None], mask=cmask[None, :],
                                 other=0.0).to(tl.float32), axis=0) * qsc
            qs5 = tl.sum(tl.load(q_ptr + qrow[None, :] + (5 * G + offs_g)[:, None], mask=cmask[None, :],
                                 other=0.0).to(tl.float32), axis=0) * qsc
            qs6 = tl.sum(tl.load(q_ptr + qrow[None, :] + (6 * G + offs_g)[:, None], mask=cmask[None, :],
                                 other=0.0).to(tl.float32), axis=0) * qsc
            qs7 = tl.sum(tl.load(q_ptr + qrow[None, :] + (7 * G + offs_g)[:, None], mask=cmask[None, :],
                                 other=0.0).to(tl.float32), axis=0) * qsc
        # per-group squared query norms (logit-noise correction), [NK] each
        # (the groups a row lacks repeat group 0: _sel8 compiles its choice as a branch whose
        # values must share one type)
        cn0 = 0.0
        if CORR:
            cn0 = _group_sq(q_ptr, qrow, cmask, 0, G, corr_scale)
        cn1 = cn0
        cn2 = cn0
        cn3 = cn0
        cn4 = cn0
        cn5 = cn0
        cn6 = cn0
        cn7 = cn0
        if CORR:
            if NGT > 1:
                cn1 = _group_sq(q_ptr, qrow, cmask, 1, G, corr_scale)
            if NGT > 2:
                cn2 = _group_sq(q_ptr, qrow, cmask, 2, G, corr_scale)
                cn3 = _group_sq(q_ptr, qrow, cmask, 3, G, corr_scale)
            if NGT > 4:
                cn4 = _group_sq(q_ptr, qrow, cmask, 4, G, corr_scale)
                cn5 = _group_sq(q_ptr, qrow, cmask, 5, G, corr_scale)
                cn6 = _group_sq(q_ptr, qrow, cmask, 6, G, corr_scale)
                cn7 = _group_sq(q_ptr, qrow, cmask, 7, G, corr_scale)

        o0 = tl.zeros([HP, 2 * NW, 2 * M2], dtype=tl.float32)
        o1 = tl.zeros([HP, 2 * NW, 2 * M2], dtype=tl.float32)
        o2 = tl.zeros([HP, 2 * NW, 2 * M2], dtype=tl.float32)
        o3 = tl.zeros([HP, 2 * NW, 2 * M2], dtype=tl.float32)
        if NBV == 2:
            o4 = tl.zeros([HP, 2 * NW, 2 * M2], dtype=tl.float32)
            o5 = tl.zeros([HP, 2 * NW, 2 * M2], dtype=tl.float32)
            o6 = tl.zeros([HP, 2 * NW, 2 * M2], dtype=tl.float32)
            o7 = tl.zeros([HP, 2 * NW, 2 * M2], dtype=tl.float32)
        else:
            o4 = 0.0
            o5 = 0.0
            o6 = 0.0
            o7 = 0.0
        m_i = tl.full([NK], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([NK], dtype=tl.float32)
        os_acc = tl.zeros([NGV, NK], dtype=tl.float32)

        if PF:  # offsets and parameters of step i+1 are loaded before step i runs
            if PAGED:  # (and the block-table entries two steps ahead: the parameter loads need them)
                pgn = _page_entries(lo + BN, hi, b, tab_ptr, s_tb, BN, PAGE, P32)
            for i in range(0, nfull):
                nxt = lo + (i + 1) * BN
                if PAGED:
                    tc1, tw1, tp1 = _page_offsets(nxt, pgn, s_cb, s_cn, s_cb // VB, s_cn // VB, s_pb, s_pn, BN, PAGE)
                    pgn = _page_entries(nxt + BN, hi, b, tab_ptr, s_tb, BN, PAGE, P32)
                else:
                    tc1, tw1, tp1 = _tok_offsets(nxt, hi, b, tab_ptr, s_tb, s_cb, s_cn, s_cb // VB, s_cn // VB,
                                                 s_pb, s_pn, BN, PAGED, PAGE, True, P32)
                nks, nko, nvs, nvo = _load_params(ks_ptr, ko_ptr, vs_ptr, vo_ptr, tp1, hoff_p,
                                                  nxt + tl.arange(0, BN) < hi, 0)
                o0, o1, o2, o3, o4, o5, o6, o7, m_i, l_i, os_acc = _int2_block(
                    lo + i * BN, hi, kc_ptr, vcw_ptr, ks_ptr, ko_ptr, vs_ptr, vo_ptr,
                    b, tab_ptr, s_tb, hoff_c, hoff_w, hoff_p, s_cb, s_cn, s_cb // VB, s_cn // VB, s_pb, s_pn,
                    hoff_pv, s_vpb, s_vpn, q0, q1, q2, q3, q4, q5, q6, q7, qs0, qs1, qs2, qs3, qs4, qs5, qs6, qs7,
                    cn0, cn1, cn2, cn3, cn4, cn5, cn6, cn7,
                    o0, o1, o2, o3, o4, o5, o6, o7, m_i, l_i, os_acc,
                    tc, tw, tp, pks, pko, pvs, pvo,
                    G, W, NB, M2, HP, BN, PAGED, PAGE, ASM, False, INTERP, True, V16, P32, GV, WV, NBV, SPLIT, CORR)
                tc, tw, tp = tc1, tw1, tp1
                pks, pko, pvs, pvo = nks, nko, nvs, nvo
        else:
            for i in range(0, nfull):
                o0, o1, o2, o3, o4, o5, o6, o7, m_i, l_i, os_acc = _int2_block(
                    lo + i * BN, hi, kc_ptr, vcw_ptr, ks_ptr, ko_ptr, vs_ptr, vo_ptr,
                    b, tab_ptr, s_tb, hoff_c, hoff_w, hoff_p, s_cb, s_cn, s_cb // VB, s_cn // VB, s_pb, s_pn,
                    hoff_pv, s_vpb, s_vpn, q0, q1, q2, q3, q4, q5, q6, q7, qs0, qs1, qs2, qs3, qs4, qs5, qs6, qs7,
                    cn0, cn1, cn2, cn3, cn4, cn5, cn6, cn7,
                    o0, o1, o2, o3, o4, o5, o6, o7, m_i, l_i, os_acc,
                    0, 0, 0, 0.0, 0.0, 0.0, 0.0,
                    G, W, NB, M2, HP, BN, PAGED, PAGE, ASM, False, INTERP, False, V16, P32, GV, WV, NBV, SPLIT, CORR)
        if lo + nfull * BN < hi:
            o0, o1, o2, o3, o4, o5, o6, o7, m_i, l_i, os_acc = _int2_block(
                lo + nfull * BN, hi, kc_ptr, vcw_ptr, ks_ptr, ko_ptr, vs_ptr, vo_ptr,
                b, tab_ptr, s_tb, hoff_c, hoff_w, hoff_p, s_cb, s_cn, s_cb // VB, s_cn // VB, s_pb, s_pn,
                hoff_pv, s_vpb, s_vpn, q0, q1, q2, q3, q4, q5, q6, q7, qs0, qs1, qs2, qs3, qs4, qs5, qs6, qs7,
                cn0, cn1, cn2, cn3, cn4, cn5, cn6, cn7,
                o0, o1, o2, o3, o4, o5, o6, o7, m_i, l_i, os_acc,
                0, 0, 0, 0.0, 0.0, 0.0, 0.0,
                G, W, NB, M2, HP, BN, PAGED, PAGE, ASM, True, INTERP, False, V16, P32, GV, WV, NBV, SPLIT, CORR)

        # ---- epilogue: normalised partial output and log-sum-exp ----
        has = l_i > 0
        l_safe = tl.where(has, l_i, 1.0)
        lse_v = tl.where(has, m_i + tl.math.log2(l_safe), float("-inf"))
        split = pid0
        hrow_c = (b * H + h0 + hh_c) * S_ALL + split                     # [NK]
        tl.store(lse_ptr + hrow_c * QG + hq_c, lse_v, mask=cmask)
        inv3 = _cols_to_o(1.0 / l_safe, M2, HP)
        # output channel of accumulator element (hh, which*NW + j, 2*hq + e) of unit U:
        # U*W + 4j + which + 2e (see _vplane)
        r = tl.arange(0, 2 * NW)
        cc2 = tl.arange(0, 2 * M2)
        hrow = ((b * H + h0 + hh) * S_ALL + split).to(tl.int64) * (QG * D)                 # [HP]
        off3 = (hrow[:, None, None] + ((cc2 // 2) * D + 2 * (cc2 % 2))[None, None, :]
                + ((r % NW) * 4 + r // NW)[None, :, None])
        m3 = ((h0 + hh) < H)[:, None, None] & ((cc2 // 2) < QG)[None, None, :]
        os3 = _cols_to_o(tl.sum(os_acc, axis=0), M2, HP)  # the offset sum when there is one group
        _store_unit(o0, os_acc, os3, inv3, op_ptr, off3, m3, 0, GV, WV, M2, HP)
        _store_unit(o1, os_acc, os3, inv3, op_ptr, off3, m3, 1, GV, WV, M2, HP)
        _store_unit(o2, os_acc, os3, inv3, op_ptr, off3, m3, 2, GV, WV, M2, HP)
        _store_unit(o3, os_acc, os3, inv3, op_ptr, off3, m3, 3, GV, WV, M2, HP)
        if NBV == 2:
            _store_unit(o4, os_acc, os3, inv3, op_ptr, off3, m3, 4, GV, WV, M2, HP)
            _store_unit(o5, os_acc, os3, inv3, op_ptr, off3, m3, 5, GV, WV, M2, HP)
            _store_unit(o6, os_acc, os3, inv3, op_ptr, off3, m3, 6, GV, WV, M2, HP)
            _store_unit(o7, os_acc, os3, inv3, op_ptr, off3, m3, 7, GV, WV, M2, HP)


@triton.jit
def rotate_query_kernel(q_ptr, s_qb, s_qh, r_ptr, out_ptr, B, H, QG,
                        D: tl.constexpr, M: tl.constexpr, QG2: tl.constexpr, BC: tl.constexpr,
                        INTERP: tl.constexpr, PDL: tl.constexpr = False):
    """Grid ``(ceil(B / SB) * H, D/BC)`` with ``SB = M / QG2`` sequences per program:
    ``out[b, h*QG + m, c0:c0+BC] = q[b, h*QG + m] @ R[h][:, c0:c0+BC]`` in float32 (3xTF32
    products). Row ``r`` of the product is query head ``r % QG2`` of sequence ``b0 + r // QG2``,
    so one read of a ``D x BC`` slice of ``R`` serves ``SB`` sequences (at batch 1 the padding
    rows stay empty). ``PDL``: let the decode kernel launch at once."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    SB: tl.constexpr = M // QG2
    pid = tl.program_id(0)
    c0 = tl.program_id(1) * BC
    h = pid % H
    b0 = (pid // H) * SB
    rows = tl.arange(0, M)
    bb = b0 + rows // QG2
    m = rows % QG2
    rmask = (m < QG) & (bb < B)
    kk = tl.arange(0, D)
    cols = c0 + tl.arange(0, BC)
    qk = tl.load(q_ptr + bb.to(tl.int64)[:, None] * s_qb + (h * QG + m).to(tl.int64)[:, None] * s_qh + kk[None, :],
                 mask=rmask[:, None], other=0.0).to(tl.float32)
    rk = tl.load(r_ptr + h.to(tl.int64) * D * D + kk[:, None] * D + cols[None, :])
    if INTERP:
        acc = tl.dot(qk, rk)
    else:
        acc = tl.dot(qk, rk, input_precision="tf32x3")
    out = out_ptr + ((bb * H + h) * QG + m).to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(out, acc, mask=rmask[:, None])


@triton.jit
def decode_merge_kernel(op_ptr, lse_ptr, out_ptr, s_ob, s_oh, HQ, QG, S_ALL, sink_ptr,
                        D: tl.constexpr, DC: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False,
                        ONE_PASS: tl.constexpr = False, SINK: tl.constexpr = False):
    """Grid ``(B*Hq, D/DC)``: log-sum-exp merge of the split partials for one query head and
    ``DC`` output channels. ``PDL``: launched early, waits for the decode grid. ``ONE_PASS``
    (all partials fit one block, ``S_ALL <= BLOCK_S``): the log-sum-exps and the partial outputs
    are loaded together, one round trip to memory instead of two. ``SINK``: ``sink_ptr[hq]`` is the
    query head's attention-sink logit (natural units), merged as one more partial of output zero:
    it joins the maximum and adds ``exp2(sink * log2(e) - top)`` to the denominator."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    c0 = tl.program_id(1) * DC
    b = pid // HQ
    hq = pid % HQ
    bh = pid // QG
    m = pid % QG
    offs_s = tl.arange(0, BLOCK_S)
    cols = c0 + tl.arange(0, DC)
    if ONE_PASS:
        sm = offs_s < S_ALL
        row = (bh * S_ALL + offs_s) * QG + m
        lv = tl.load(lse_ptr + row, mask=sm, other=float("-inf"))
        o = tl.load(op_ptr + row.to(tl.int64)[:, None] * D + cols[None, :], mask=sm[:, None], other=0.0)
        top = tl.max(lv, axis=0)
        if SINK:
            sink = tl.load(sink_ptr + hq).to(tl.float32) * 1.4426950408889634
            top = tl.maximum(top, sink)
        top = tl.where(top == float("-inf"), 0.0, top)
        wgt = tl.math.exp2(lv - top)
        total = tl.sum(wgt, axis=0)
        if SINK:
            total += tl.math.exp2(sink - top)
        res = tl.sum(wgt[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + b.to(tl.int64) * s_ob + hq * s_oh + cols, res.to(out_ptr.dtype.element_ty))
        return
    mx = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, S_ALL, BLOCK_S):
        sm = s0 + offs_s < S_ALL
        lv = tl.load(lse_ptr + (bh * S_ALL + s0 + offs_s) * QG + m, mask=sm, other=float("-inf"))
        mx = tl.maximum(mx, lv)
    top = tl.max(mx, axis=0)
    if SINK:
        sink = tl.load(sink_ptr + hq).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
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
    if SINK:
        total += tl.math.exp2(sink - top)
    res = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * s_ob + hq * s_oh + cols, res.to(out_ptr.dtype.element_ty))
