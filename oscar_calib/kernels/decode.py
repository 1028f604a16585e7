"""Decode attention over an INT2 + BF16 KV cache (Triton flash-decoding kernel + torch reference).

One new query token per sequence attends to every cached token of its sequence (the cache
already holds the current token). Shapes: ``q [B, Hq, d]`` (post-RoPE, *unrotated*),
``Hq = H * QG`` query heads where query head ``H_i * QG + m`` (``m < QG``) uses KV head ``H_i``
(the order of transformers' ``repeat_kv``); cache as in :mod:`.cache`. The result is
``[B, Hq, d]`` in ``q``'s dtype (or ``out_dtype``):

* ``o_rot`` (default): the attention output in the V-rotated basis, what an o_proj with the V
  rotation folded in expects;
* ``o = o_rot @ R_v^T`` with ``unrotate=True`` (needs ``v_rotation``).

The query is rotated by the layer's K rotation first (``q @ R_k[h]`` for the query heads of KV
head ``h``), so ``q_rot . k_rot = q . k``; pass ``k_rotation=None`` for an already rotated query.
Scores use ``sm_scale`` (default ``1/sqrt(d)``).

Triton kernels (flash-decoding; one split kernel launched twice, then a merge):

1. window launch, grid ``(S16, B*H)``: each program takes a chunk of one sequence's 16-bit
   window for one KV head, the whole GQA group at once (query heads as the M dimension of the
   tensor-core dots, padded to 16); 16-bit operands are split into high + residual parts, so the
   window's scores and value sums are about fp32-accurate.
2. INT2 launch, grid ``(S2, B*H)``: the same for chunks of the INT2 history. Codes are unpacked
   in registers one bit plane at a time (shift and mask; by default four bytes at once with
   inline PTX ``shr/and/prmt``), and the 2-bit code's bit pattern is fed to the tensor cores as
   an fp16 *subnormal* (``code * 2^-24``), so no int-to-float conversion is needed. Each plane is
   one group's run of channels, so scores are ``s_g * (q_g . codes_g) + offset_g * sum(q_g)``
   and values ``(p * s_g) @ codes_g + p @ offset_g``: no per-element dequantisation; fp32
   accumulation; the query in fp16. By default the key dot is transposed (tokens as M, query
   heads as N, which pads 4 heads to 8 instead of 16) and one warp handles a program.
3. merge, grid ``(B*Hq, d/32)``: log-sum-exp merge of all partials (float32 output and
   log-sum-exp in base 2 per chunk; empty chunks carry ``lse = -inf`` and weigh nothing).

The query's K-rotation (and the optional output un-rotation) are one batched matmul each in
torch. Nothing reads lengths on the host, so a decode step can be captured in a CUDA graph
(pass ``check_lengths=False``). Tuning knobs (``config``) and the measured numbers are in
``scripts/bench_kernels.py``; on an H200 the INT2 kernel is instruction-bound (about 25-30
warp instructions per token and KV head: unpacking, and softmax work on padded query rows),
reaching 20-30% of copy bandwidth, not the memory roofline.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from ..errors import InputError
from ._common import (
    check_tensor,
    interpreting,
    is_pow2,
    load_triton_module,
    next_pow2,
    resolve_backend,
    same_device,
)
from .cache import Int2KVCache
from .pack import dequantize_packed

Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _validate(q, cache, k_rotation, v_rotation, unrotate) -> tuple[int, int, int]:
    if not isinstance(cache, Int2KVCache):
        raise InputError(f"cache must be an Int2KVCache, got {type(cache).__name__}")
    cache.validate()
    check_tensor("q", q, ndim=3, dtypes=Q_DTYPES)
    b, hq, d = q.shape
    h = cache.num_kv_heads
    if b != cache.batch:
        raise InputError(f"q has batch {b}, the cache has {cache.batch}")
    if d != cache.head_dim:
        raise InputError(f"q has head_dim {d}, the cache has {cache.head_dim}")
    if hq % h:
        raise InputError(f"{hq} query heads are not a multiple of {h} KV heads")
    for name, r in (("k_rotation", k_rotation), ("v_rotation", v_rotation)):
        if r is not None:
            check_tensor(name, r, ndim=3, dtypes=(torch.float32, torch.float64))
            if tuple(r.shape) != (h, d, d):
                raise InputError(f"{name} must be [kv_heads, d, d] = {[h, d, d]}, got {list(r.shape)}")
            same_device(("q", q), (name, r))
    if unrotate and v_rotation is None:
        raise InputError("unrotate=True needs v_rotation")
    same_device(("q", q), ("cache.k_codes", cache.k_codes))
    return b, hq, h


def rotate_query(q: torch.Tensor, k_rotation: torch.Tensor | None, num_kv_heads: int) -> torch.Tensor:
    """``q [B, Hq, d]`` -> float32 ``q @ R_k[h]`` per GQA group, ``[B, Hq, d]`` contiguous."""
    b, hq, d = q.shape
    qf = q.float()
    if k_rotation is None:
        return qf.contiguous()
    return _per_head_matmul(qf, k_rotation.float(), num_kv_heads).contiguous()


def _per_head_matmul(x: torch.Tensor, r: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``x [B, Hq, d] @ r[h]`` for the query heads of KV head ``h``: one batched matmul over the
    KV heads (no broadcast copy of ``r`` per sequence)."""
    b, hq, d = x.shape
    xg = x.view(b, num_kv_heads, hq // num_kv_heads, d).transpose(0, 1).reshape(num_kv_heads, -1, d)
    y = torch.bmm(xg, r)  # [H, B*QG, d]
    return y.view(num_kv_heads, b, hq // num_kv_heads, d).transpose(0, 1).reshape(b, hq, d)


def unrotate_output(o_rot: torch.Tensor, v_rotation: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``o_rot [B, Hq, d]`` -> float32 ``o_rot @ R_v[h]^T`` per GQA group."""
    b, hq, d = o_rot.shape
    return _per_head_matmul(o_rot.float(), v_rotation.float().transpose(-1, -2), num_kv_heads)


def _history(cache: Int2KVCache, b: int, which: str) -> torch.Tensor:
    """Dequantised INT2 history of sequence ``b``: float32 ``[H, hist_len, d]``."""
    n = int(cache.hist_lens[b])
    codes, scale, off = (getattr(cache, f"{which}_{f}") for f in ("codes", "scale", "offset"))
    if cache.paged:
        page = cache.page_size
        npg = (n + page - 1) // page
        pages = cache.block_table[b, :npg].long()
        # [npg, H, page, w] -> [H, npg*page, w]
        def gather(t):
            return t[pages].transpose(0, 1).reshape(t.shape[1], npg * page, t.shape[-1])[:, :n]
        codes, scale, off = gather(codes), gather(scale), gather(off)
    else:
        codes, scale, off = codes[b, :, :n], scale[b, :, :n], off[b, :, :n]
    return dequantize_packed(codes, scale, off, cache.group_size)


def decode_attention_reference(
    q: torch.Tensor,
    cache: Int2KVCache,
    *,
    k_rotation: torch.Tensor | None = None,
    v_rotation: torch.Tensor | None = None,
    unrotate: bool = False,
    sm_scale: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Pure-torch reference of :func:`decode_attention`: dequantise the history, concatenate it
    with the 16-bit window, plain softmax attention in float32."""
    bsz, hq, h = _validate(q, cache, k_rotation, v_rotation, unrotate)
    d = q.shape[-1]
    qg = hq // h
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    qr = rotate_query(q, k_rotation, h).view(bsz, h, qg, d)
    outs = []
    for b in range(bsz):
        nw = int(cache.bf16_lens[b])
        keys = torch.cat([cache.k_bf16[b, :, :nw].float(), _history(cache, b, "k")], dim=1)
        vals = torch.cat([cache.v_bf16[b, :, :nw].float(), _history(cache, b, "v")], dim=1)
        s = torch.matmul(qr[b], keys.transpose(-1, -2)) * scale  # [H, QG, N]
        p = torch.softmax(s, dim=-1)
        outs.append(torch.matmul(p, vals).reshape(hq, d))
    o = torch.stack(outs)
    if unrotate:
        o = unrotate_output(o, v_rotation, h)
    return o.to(out_dtype or q.dtype)


def _triton_support(cache: Int2KVCache, q: torch.Tensor) -> str | None:
    d, g = cache.head_dim, cache.group_size
    if not is_pow2(d) or not 64 <= d <= 256:
        return f"head_dim {d} (the decode kernel needs 64, 128 or 256)"
    w = min(g, d // 4)
    if w < 16:
        return f"group size {g} (the decode kernel needs groups of at least 16 channels)"
    if d // (4 * w) > 2:
        return f"group size {g} with head_dim {d} (at most 8 groups per head)"
    if q.shape[1] // cache.num_kv_heads > 64:
        return "more than 64 query heads per KV head"
    return None


@lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_attention(
    q: torch.Tensor,
    cache: Int2KVCache,
    *,
    k_rotation: torch.Tensor | None = None,
    v_rotation: torch.Tensor | None = None,
    unrotate: bool = False,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
    check_lengths: bool = True,
    config: dict | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over an :class:`Int2KVCache`.

    Args:
        q: ``[B, Hq, d]`` bf16/fp16/fp32 queries (post-RoPE, unrotated).
        cache: the layer's cache (contiguous or paged, see :mod:`.cache`).
        k_rotation: ``[H, d, d]`` rotation the keys are stored in (the query is rotated by it);
            None if ``q`` is already in that basis.
        v_rotation: ``[H, d, d]``; only needed with ``unrotate=True``.
        unrotate: return ``o_rot @ R_v^T`` instead of ``o_rot``.
        sm_scale: score scale, default ``1/sqrt(d)``.
        out: optional ``[B, Hq, d]`` output tensor (written in place and returned).
        out_dtype: dtype of the result when ``out`` is None (default ``q.dtype``).
        backend: ``"auto"`` | ``"triton"`` | ``"torch"``.
        check_lengths: validate the lengths against the capacities (a host synchronisation;
            turn off inside CUDA graphs).
        config: Triton tuning overrides (``BLOCK_N``, ``num_warps``, ``num_stages``,
            ``programs_per_sm``, ``split_tokens``, ``mode``); for benchmarks.

    Returns:
        ``[B, Hq, d]``: ``o_rot`` (V-rotated basis) or, with ``unrotate``, ``o``.
    """
    bsz, hq, h = _validate(q, cache, k_rotation, v_rotation, unrotate)
    if out is not None:
        check_tensor("out", out, ndim=3, shape={0: bsz, 1: hq, 2: q.shape[-1]})
        if out.stride(-1) != 1:
            raise InputError("out must be contiguous in its last dimension")
    if check_lengths:
        cache.check_lengths()
    which = resolve_backend(backend, [q, cache.k_codes], _triton_support(cache, q))
    if which == "torch":
        res = decode_attention_reference(
            q, cache, k_rotation=k_rotation, v_rotation=v_rotation, unrotate=unrotate,
            sm_scale=sm_scale, out_dtype=out.dtype if out is not None else out_dtype,
        )
        if out is None:
            return res
        out.copy_(res)
        return out
    return _decode_triton(q, cache, k_rotation, v_rotation, unrotate, sm_scale, out, out_dtype, config or {})


# mode 0: codes as fp16 subnormals via bit ops; 1: same with inline PTX (GPU only);
# 2: integer -> fp16 conversion (codes as values). 0 and 1 are exact; 2 is the fallback.
# Defaults: the best of a sweep on an H200 (Qwen3-8B shapes, 128K context, batch 1 and 32;
# scripts/bench_kernels.py); the interpreter falls back from mode 1 to mode 0.
DEFAULT_MODE = 1
# orient 0: query heads as the M dimension of both dots (padded to 16); 1: tokens as the M
# dimension of the key dot (query heads as N), transposed back for the value dot.
DEFAULT_ORIENT = 1
DEFAULT_BLOCK_N = 64
DEFAULT_WARPS = 1
DEFAULT_STAGES = 2
DEFAULT_PROGRAMS_PER_SM = 16
# the compiled kernels of the latest Triton launch (register/spill reports for benchmarks)
LAST_LAUNCH: dict = {}


def _decode_triton(q, cache, k_rotation, v_rotation, unrotate, sm_scale, out, out_dtype, config):
    mod = load_triton_module("_decode_triton")
    bsz, hq, d = q.shape
    h = cache.num_kv_heads
    qg = hq // h
    g = cache.group_size
    w = min(g, d // 4)
    nb = d // (4 * w)
    orient = int(config.get("orient", DEFAULT_ORIENT))
    m_int2 = max(16, next_pow2(qg)) if orient == 0 else max(2, next_pow2(qg))
    dev = q.device
    mode = int(config.get("mode", DEFAULT_MODE))
    if interpreting() and mode == 1:
        mode = 0
    block_n = int(config.get("BLOCK_N", DEFAULT_BLOCK_N if d <= 128 else DEFAULT_BLOCK_N // 2))
    block16 = int(config.get("BLOCK16", 64))
    num_warps = int(config.get("num_warps", DEFAULT_WARPS))
    num_stages = int(config.get("num_stages", DEFAULT_STAGES))

    qr = rotate_query(q, k_rotation, h)
    # split sizes (host integers only: graph-safe)
    n_sm = _sm_count(dev.index if dev.index is not None else torch.cuda.current_device()) if q.is_cuda else 8
    target = int(config.get("programs_per_sm", DEFAULT_PROGRAMS_PER_SM)) * n_sm
    cap = cache.history_capacity
    if "split_tokens" in config:
        chunk = int(config["split_tokens"])
    else:
        want = max(1, -(-target // (bsz * h)))
        chunk = -(-cap // want)
    chunk = max(block_n, -(-chunk // block_n) * block_n)
    s2 = -(-cap // chunk)
    ncap = cache.window_capacity
    # window chunks: bytes per window token are ~7x an INT2 token's, so a quarter of the INT2
    # chunk keeps window programs off the critical path
    chunk16 = int(config.get("split_tokens16", min(256, max(block16, chunk // 4, ncap // 64))))
    chunk16 = -(-chunk16 // block16) * block16
    s16 = -(-ncap // chunk16)
    s_all = s16 + s2

    opart = torch.empty(bsz * h, s_all, qg, d, dtype=torch.float32, device=dev)
    lse = torch.empty(bsz * h, s_all, qg, dtype=torch.float32, device=dev)
    qk_scale = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)) * 1.4426950408889634

    if cache.paged:
        tab, s_tb, page = cache.block_table, cache.block_table.stride(0), cache.page_size
    else:
        tab, s_tb, page = cache.hist_lens, 0, 1
    kc = cache.k_codes
    ks = cache.k_scale
    w16 = cache.k_bf16
    args = (
        qr,
        kc, ks, cache.k_offset, cache.v_codes, cache.v_scale, cache.v_offset,
        kc.stride(0), kc.stride(1), kc.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        tab, s_tb, cache.hist_lens,
        w16, cache.v_bf16, w16.stride(0), w16.stride(1), w16.stride(2),
        cache.bf16_lens,
        opart, lse,
        qk_scale,
        h, qg, s16, s_all, chunk, chunk16,
    )
    common = dict(D=d, G=g, W=w, NB=nb, BLOCK_N=block_n, BLOCK16=block16, PAGED=cache.paged, PAGE=page,
                  MODE=mode, INTERP=interpreting())
    LAST_LAUNCH["window"] = mod.decode_split_kernel[(s16, bsz * h)](
        *args, **common, M=max(16, next_pow2(qg)), PART=0, ORIENT=0, num_warps=4, num_stages=2,
    )
    LAST_LAUNCH["split"] = mod.decode_split_kernel[(s2, bsz * h)](
        *args, **common, M=m_int2, PART=1, ORIENT=orient, num_warps=num_warps, num_stages=num_stages,
    )
    final_dtype = out.dtype if out is not None else (out_dtype or q.dtype)
    if unrotate:
        o_rot = torch.empty(bsz, hq, d, dtype=torch.float32, device=dev)
    elif out is not None:
        o_rot = out
    else:
        o_rot = torch.empty(bsz, hq, d, dtype=final_dtype, device=dev)
    # merge: one program per (sequence, query head, 32-channel slice), all partials in one pass
    # when they fit (up to 256 splits)
    block_s = max(16, min(256, next_pow2(s_all)))
    dc = min(d, 32)
    LAST_LAUNCH["merge"] = mod.decode_merge_kernel[(bsz * hq, d // dc)](
        opart, lse, o_rot, o_rot.stride(0), o_rot.stride(1),
        hq, qg, s_all,
        D=d, DC=dc, BLOCK_S=block_s, num_warps=4,
    )
    if not unrotate:
        return o_rot
    o = unrotate_output(o_rot, v_rotation, h)
    if out is None:
        return o.to(final_dtype)
    out.copy_(o)
    return out
