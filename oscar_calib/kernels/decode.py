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

Logit-noise correction (``logit_correction = a``, default 0: off): an INT2 key's rounding error is
per channel about uniform, of variance ``s_g^2 / 12`` in a key group of scale (step) ``s_g``, so it
adds zero-mean noise of variance ``Var = sm_scale^2 * sum_g |q_rot[g]|^2 * s_g^2 / 12`` to that
token's logit. Since ``E[exp(l + eps)] = exp(l) * exp(Var / 2)``, INT2 tokens are over-weighted
against the 16-bit window; with ``a > 0`` each INT2 history token's logit is lowered by
``a * Var / 2`` (:func:`~oscar_calib.numerics.quant.logit_noise`; ``a = 1`` cancels the expected
factor ``exp(Var / 2)``).
The 16-bit window tokens are not corrected.

Attention sinks (``sinks``, default None: none): a learned logit per query head (gpt-oss's
``sinks``, which its attention concatenates to every row's scores before the softmax and drops
after) acts as one more key with that logit and a zero value: it enlarges the softmax's
denominator and adds nothing to the output. Both paths add ``exp(sink[h] - m)`` to the
denominator; the Triton path in the merge step, where the partials' log-sum-exps meet.

Triton path (flash-decoding; three launches, all graph-capturable):

1. ``rotate_query_kernel``, grid ``(ceil(B/SB) * H, d/32)``: ``q @ R_k[h]`` in float32 (3xTF32
   products), ``SB = 16 / QG`` sequences per program (their query heads fill the product's 16
   rows; each slice of ``R`` is read once per group). Skipped when ``k_rotation`` is None (the
   main kernel reads ``q`` in its own dtype).
2. ``decode_kernel``, grid ``(S16 + S2, B * ceil(H/HP))``, one warp per program. Programs
   ``c < S16`` take chunk ``c`` of the 16-bit window (query heads as the M dimension of the
   tensor-core dots, operands split into high + residual 16-bit parts: about fp32 accuracy);
   the others take a chunk of the INT2 history for ``HP`` KV heads at once. INT2 arithmetic,
   with no per-element dequantisation (details in :mod:`._decode_triton`):

   * scores ``s_g * (q'_g . c_g) + offset_g * sum(q_g)`` with tokens as the M dimension of the
     key dot and the ``HP`` heads' query rows as N (``HP = 2`` fills the 8 columns of the
     tensor core when ``QG = 4``); a 32-bit word of codes becomes fp16 operands with one
     ``and`` per register (codes as fp16 subnormals; the plane weight ``4^-p`` and the byte
     order are folded into ``q'``);
   * values ``sum_t (p_t * s_t) * c_t + sum_t p_t * offset_t``: channel pairs as M, token x
     channel-parity as K, so the operand registers hold two channels of one token exactly as
     they come out of the word (no byte transpose) and all N columns are real query heads;
   * with the logit-noise correction (a constexpr: without it the kernel is the uncorrected
     one), ``|q_g|^2`` per key group and query head is computed once per program, and each key
     group's score term loses ``s_g^2`` times it where the group's scale is read;
   * online softmax in base 2; the accumulator rescale is skipped when no running maximum
     moved (exact); full steps run unmasked and the last partial step masked;
   * ``prefetch``: the token offsets and the scale/offset parameters of step ``i+1`` are
     loaded before step ``i`` computes, so their latency hides behind a whole step instead of
     stalling every step (one group per row, ``G = d``); a paged cache's block-table entries
     are loaded two steps ahead, so the parameter loads never wait on them;
   * ``pdl`` (Hopper): programmatic dependent launch; the decode kernel starts while the
     rotation kernel runs, does its cache-side set-up (lengths, offsets, first parameters) and
     waits (``griddepcontrol.wait``) only before reading the rotated query; the merge kernel
     likewise waits for the decode grid. Nothing is written before the wait. Programs of a
     short chunk (``l2_prefetch``) also prefetch all their codes and parameters into L2 before
     the wait, so DRAM is busy while the rotation kernel runs;
   * ``window_stages``: software-pipeline stages of the window loop. Its two-stage buffers set
     the kernel's shared memory (24 KB with 32-token window steps, 16 KB with 16) and with it how many
     one-warp programs fit an SM; one stage needs 9-10 KB.
3. ``decode_merge_kernel``, grid ``(B*Hq, d/32)``: log-sum-exp merge of all partials (float32
   output and base-2 log-sum-exp per chunk; empty chunks carry ``lse = -inf``); with ``sinks``
   (a constexpr) the query head's sink logit joins the merge as one more partial of zero output.

The optional output un-rotation is one batched matmul in torch. Nothing reads lengths on the
host (pass ``check_lengths=False`` inside CUDA graphs). Tuning knobs (``config``, defaults in
:data:`TUNING` per regime): ``mode`` (1 inline PTX, 0 plain Triton), ``BLOCK_N``, ``BLOCK16``,
``heads_per_program``, ``programs_per_sm``, ``min_chunk``, ``split_tokens``, ``split_tokens16``,
``num_stages``, ``num_stages_long`` and ``long_chunk`` (the history loop's stages for programs of
at least ``long_chunk`` tokens; 0 = ``num_stages``), ``prefetch``, ``maxnreg``, ``pdl``,
``l2_prefetch``, ``l2_head`` (tokens a longer chunk's program prefetches into L2 before the
wait; default 0, off), ``window_stages``, ``merge_two_pass`` (the merge's two-pass loop even when all
partials fit one block; for comparison), ``rotate_batched`` (False: one sequence per rotation
program; for comparison), ``rotate_cols`` (columns of ``R`` per rotation program, default 32),
``value_pairs`` (False: value codes loaded as 32-bit words instead of 16-bit pairs; for
comparison), ``offsets32`` (False: a paged cache's per-step offsets in 64 bits even where 32
suffice; for comparison), ``num_warps`` (warps per decode program, default 1; 2 and 4 were slower
at every shape measured), ``merge_cols`` / ``merge_warps`` (output channels and warps
per merge program, default 32 / 4; for comparison).

Measured (H100, Qwen3-8B shapes: 32 query / 8 KV heads, d=128, G=128, 64 + 256 BF16 window
tokens; ``scripts/bench/bench_kernels.py``, CUDA-graph replays; docs/design/kernels.md): at 128K
context, batch 1, 50 us against 193 us for BF16 ``scaled_dot_product_attention`` (3.8x, 51% of
the 3.0 TB/s copy bandwidth end to end); batch 32, 0.94 ms against 5.51 ms (5.9x, 87%). The H200
gives 45 us and 0.84 ms (68% of its 4.24 TB/s). Nsight Compute finds the batch-32 decode kernel
memory-bound on the H100 (81% of DRAM peak) and the batch-1 kernel (and the H200's) latency-bound
(issue active ~50-56%). At batch 1 the query rotation adds 2.1-3.2 us and the merge 1.3-2.7 us
to a call at 512-128K tokens (the call with each left out); a graph of one trivial kernel, which
every timed call includes, takes ~4.8 us.
"""

from __future__ import annotations

import math

import torch

from ..contract.defaults import check_logit_correction
from ..errors import InputError
from ..numerics.quant import logit_noise, logit_noise_coefficient
from ._common import (
    check_tensor,
    derived,
    head_dim_problem,
    interpreting,
    load_triton_module,
    next_pow2,
    pdl_capable,
    resolve_backend,
    same_device,
    sm_count,
)
from .cache import Int2KVCache
from .pack import bits_per_element, dequantize_packed

Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOG2E = 1.4426950408889634


def _validate(q, cache, k_rotation, v_rotation, unrotate, logit_correction=0.0, sinks=None) -> tuple[int, int, int]:
    check_logit_correction(logit_correction, "logit_correction")
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
    if sinks is not None:
        check_tensor("sinks", sinks, ndim=1, dtypes=(torch.float32, torch.bfloat16, torch.float16), shape={0: hq})
        same_device(("q", q), ("sinks", sinks))
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


def _history_params(cache: Int2KVCache, b: int, which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scales and offsets of sequence ``b``'s INT2 history (``which`` = ``"k"`` or ``"v"``),
    ``[H, hist_len, ...]`` each, gathered through the block table of a paged cache."""
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
    return codes, scale, off


def _history(cache: Int2KVCache, b: int, which: str) -> torch.Tensor:
    """Dequantised INT2 history of sequence ``b``: float32 ``[H, hist_len, d]``."""
    codes, scale, off = _history_params(cache, b, which)
    return dequantize_packed(codes, scale, off, cache.group_size if which == "k" else cache.v_group_size)


def decode_attention_reference(
    q: torch.Tensor,
    cache: Int2KVCache,
    *,
    k_rotation: torch.Tensor | None = None,
    v_rotation: torch.Tensor | None = None,
    unrotate: bool = False,
    sm_scale: float | None = None,
    out_dtype: torch.dtype | None = None,
    logit_correction: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch reference of :func:`decode_attention`: dequantise the history, concatenate it
    with the 16-bit window, plain softmax attention in float32 (with ``logit_correction > 0``
    the history's scores less :func:`~oscar_calib.numerics.quant.logit_noise`; with ``sinks`` one
    more score column per query head, of value zero)."""
    bsz, hq, h = _validate(q, cache, k_rotation, v_rotation, unrotate, logit_correction, sinks)
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
        if logit_correction:  # the history comes after the window
            k_scale = _history_params(cache, b, "k")[1]
            s[..., nw:] -= logit_noise(qr[b], k_scale, cache.group_size, logit_correction, scale)
        if sinks is not None:     # a key of logit sinks[j] and value 0 for query head j
            s = torch.cat([s, sinks.float().view(h, qg, 1)], dim=-1)
            vals = torch.cat([vals, vals.new_zeros(h, 1, d)], dim=1)
        p = torch.softmax(s, dim=-1)
        outs.append(torch.matmul(p, vals).reshape(hq, d))
    o = torch.stack(outs)
    if unrotate:
        o = unrotate_output(o, v_rotation, h)
    return o.to(out_dtype or q.dtype)


def _triton_support(cache: Int2KVCache, q: torch.Tensor) -> str | None:
    d, g = cache.head_dim, min(cache.group_size, cache.v_group_size)
    why = head_dim_problem(d, "decode")
    if why:
        return why
    if g < 32:
        return f"group size {g} (the decode kernel needs groups of at least 32 channels)"
    if q.shape[1] // cache.num_kv_heads > 64:
        return "more than 64 query heads per KV head"
    codes = (cache.k_codes, cache.v_codes)
    if any(t.data_ptr() % 4 or any(st % 4 for st in t.stride()[:-1]) for t in codes):
        return "code tensors whose rows are not 4-byte aligned (the kernel reads 32-bit words)"
    return None


def decode_backend(q: torch.Tensor, cache: Int2KVCache, backend: str = "auto") -> str:
    """``"triton"`` or ``"torch"``: what :func:`decode_attention` runs for ``q [B, Hq, d]`` over
    ``cache`` with ``backend`` (see :mod:`._common`; ``"auto"`` takes the kernel for CUDA tensors of a
    shape it supports when triton imports, the reference otherwise)."""
    return resolve_backend(backend, [q, cache.k_codes], _triton_support(cache, q))


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
    pdl_input: bool = False,
    config: dict | None = None,
    logit_correction: float = 0.0,
    sinks: torch.Tensor | None = None,
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
        pdl_input: the query and the cache's lengths may come from the kernel launched just before
            (e.g. :func:`~oscar_calib.kernels.append_token` with ``query=``): the decode kernel
            then launches while that kernel ends (programmatic dependent launch, Hopper and later)
            and reads them only after it. Only with ``k_rotation=None`` (with a rotation the
            rotation kernel comes first anyway).
        config: Triton tuning overrides (keys of :data:`TUNING`, ``split_tokens``,
            ``split_tokens16``); for benchmarks.
        logit_correction: gain ``a >= 0`` of the logit-noise correction (0, the default: none).
            An INT2 key's rounding error (per channel uniform, variance ``s_g^2/12`` in key group
            ``g`` of scale ``s_g``) adds zero-mean noise to its logit, and ``E[exp(l + eps)] =
            exp(l) * exp(Var/2)`` over-weights INT2 tokens against the 16-bit window; each INT2
            history token's score (natural units) is lowered by ``a/2 * sm_scale^2 *
            sum_g |q_rot[g]|^2 * s_g^2 / 12`` (:func:`~oscar_calib.numerics.quant.logit_noise`; ``q_rot`` the rotated
            query, ``g`` over the key groups). Window tokens are not corrected.
        sinks: ``[Hq]`` attention-sink logits (natural units, compared with the scaled scores), one
            per query head, or None: the softmax of query head ``j`` gets one more key of logit
            ``sinks[j]`` and value zero (gpt-oss).

    Returns:
        ``[B, Hq, d]``: ``o_rot`` (V-rotated basis) or, with ``unrotate``, ``o``.
    """
    bsz, hq, h = _validate(q, cache, k_rotation, v_rotation, unrotate, logit_correction, sinks)
    if out is not None:
        check_tensor("out", out, ndim=3, shape={0: bsz, 1: hq, 2: q.shape[-1]})
        if out.stride(-1) != 1:
            raise InputError("out must be contiguous in its last dimension")
    if check_lengths:
        cache.check_lengths()
    which = decode_backend(q, cache, backend)
    if which == "torch":
        res = decode_attention_reference(
            q, cache, k_rotation=k_rotation, v_rotation=v_rotation, unrotate=unrotate,
            sm_scale=sm_scale, out_dtype=out.dtype if out is not None else out_dtype,
            logit_correction=logit_correction, sinks=sinks,
        )
        if out is None:
            return res
        out.copy_(res)
        return out
    return _decode_triton(q, cache, k_rotation, v_rotation, unrotate, sm_scale, out, out_dtype, config or {},
                          pdl_input, float(logit_correction), sinks)


# Tuning defaults per regime: "small" below SMALL_BATCH_HEADS (sequence, KV head) pairs, "large" from
# there on, "_paged" for a cache with a block table. scripts/bench/bench_kernels.py sweeps every key; the
# measurements behind each choice and the variants not adopted: see docs/design/kernels.md. Figures are
# H100 CUDA-graph replays at Qwen3-8B shapes (32 query / 8 KV heads, d = 128), context x batch.
#   mode              1: bit operations as inline PTX (GPU); 0: plain Triton ops (the interpreter)
#   BLOCK_N, BLOCK16  history / window tokens per step: 64 / 32 (128-token steps: no faster at batch 1)
#   num_stages        pipeline stages of the history loop: 2
#   num_stages_long,  3 stages for programs of at least long_chunk tokens at batch 1 (Triton fetches the
#   long_chunk        codes two steps ahead): 128K x 1 50.3 against 53.6 us; nothing gained at 32K x 1
#                     (4 steps per program) and no better at batch 32
#   heads_per_program KV heads per program: 1 at small batch; "fill" (enough that the key dot's 8
#                     columns are all real query heads) at large batch, with 64-token steps and no
#                     register cap: 32K x 32 274 against 314 us for one head, 32-token steps, 128 registers
#   programs_per_sm   sets the split count: 8 at small batch; 40 at large (32K x 32: 274 us, 280-289 at
#                     32, 48 or 64)
#   min_chunk         history tokens per program at least: 320 at large batch (at 8K x 32 fewer, longer
#                     programs win)
#   prefetch          load the next step's token offsets and parameters one step ahead, so their
#                     latency hides behind a whole step (a paged cache's block table two steps ahead)
#   maxnreg           register cap per thread (0: none): 184 at small contiguous batch, still 8 programs
#                     per SM (32K x 1 23.4 against 24.7 us); paged it was slower, so no cap there
#   pdl               programmatic dependent launch of the decode and merge kernels: 128K x 1 54.7
#                     against 60.5 us
#   l2_prefetch       with PDL, programs of at most this many history tokens prefetch all of them into
#                     L2 while the query rotation runs: 8K x 1 17.3 against 18.3 us; longer chunks lose
#                     (their prefetches queue in front of the rotation's own loads)
#   l2_head           off (0): prefetching only the first 64-128 tokens of longer chunks gained 1-2% at
#                     128K x 1 and under 1% at 32K x 1 (H200, two runs; 256 tokens lost 5%), less than
#                     the 3% a default must win by
#   window_stages     pipeline stages of the 16-bit window loop, or "auto" (see _window_stages): 2
_LARGE = {"mode": 1, "BLOCK_N": 64, "BLOCK16": 32, "num_stages": 2, "heads_per_program": "fill",
          "programs_per_sm": 40, "min_chunk": 320, "prefetch": True, "maxnreg": 0, "pdl": True,
          "l2_prefetch": 192, "window_stages": 2}
TUNING = {
    "small": {"mode": 1, "BLOCK_N": 64, "BLOCK16": 32, "num_stages": 2, "num_stages_long": 3, "long_chunk": 512,
              "heads_per_program": 1, "programs_per_sm": 8, "prefetch": True, "maxnreg": 184, "pdl": True,
              "l2_prefetch": 192, "window_stages": 2},
    "small_paged": {"mode": 1, "BLOCK_N": 64, "BLOCK16": 32, "num_stages": 2, "num_stages_long": 3,
                    "long_chunk": 512, "heads_per_program": 1, "programs_per_sm": 8, "prefetch": True, "maxnreg": 0,
                    "pdl": True, "l2_prefetch": 192, "window_stages": 2},
    "large": _LARGE,
    "large_paged": dict(_LARGE),
}
SMALL_BATCH_HEADS = 64
# the compiled kernels of the latest Triton launch (register/spill reports for benchmarks)
LAST_LAUNCH: dict = {}


def tuning(bsz: int, num_kv_heads: int, config: dict | None = None, *, paged: bool = False) -> dict:
    """The effective tuning: the regime's defaults overridden by ``config``."""
    regime = ("small" if bsz * num_kv_heads < SMALL_BATCH_HEADS else "large") + ("_paged" if paged else "")
    return {**TUNING[regime], **(config or {})}


def _heads_per_program(qg: int, h: int, cfg: dict) -> int:
    """KV heads per program: an integer, or "fill": enough that the key dot's ``N = 8`` columns
    are real query heads (``HP * next_pow2(QG) >= 8``, at most 4 and at most the heads)."""
    if cfg["heads_per_program"] != "fill":
        return int(cfg["heads_per_program"])
    m2 = next_pow2(qg)
    hp = 1
    while m2 * hp < 8 and hp < 4 and 2 * hp <= next_pow2(h):
        hp *= 2
    return hp


def _window_stages(cfg: dict, cache: Int2KVCache) -> int:
    """Pipeline stages of the 16-bit window loop: the configured number, or for ``"auto"`` one
    stage when the INT2 history holds at least 8x the window's bytes (two otherwise). One stage
    needs less shared memory (9 instead of 16 KB), so more one-warp programs fit an SM: it paid for
    one-head, 128-register tiles where the history dominates (128K x 32) and lost where the window's
    share is large (8K x 32). The default tiles are register-bound and keep two stages
    (see docs/design/kernels.md)."""
    ws = cfg["window_stages"]
    if ws != "auto":
        return int(ws)
    d = cache.head_dim
    bits = bits_per_element(cache.group_size) + bits_per_element(cache.v_group_size)
    hist = cache.history_capacity * d * bits / 8
    window = cache.window_capacity * 2 * d * cache.k_bf16.element_size()
    return 1 if hist >= 8 * window else 2


def _history_stages(cfg: dict, chunk: int) -> int:
    """Software-pipeline stages of the history loop (Triton's ``num_stages``): ``num_stages_long``
    for programs of at least ``long_chunk`` tokens (0: ``num_stages`` for all)."""
    if int(cfg.get("num_stages_long", 0)) and chunk >= int(cfg.get("long_chunk", 512)):
        return int(cfg["num_stages_long"])
    return int(cfg["num_stages"])


def _offsets32(cache: Int2KVCache, cfg: dict) -> bool:
    """A paged cache whose code and parameter tensors hold fewer than 2^31 elements: the kernel's
    per-step offsets stay 32-bit (``config={"offsets32": False}`` keeps them 64-bit, for comparison)."""
    tensors = (cache.k_codes, cache.v_codes, cache.k_scale, cache.k_offset, cache.v_scale, cache.v_offset)
    return bool(cache.paged and cfg.get("offsets32", True) and all(t.numel() < 2**31 for t in tensors))


def _l2_warm_args(cfg: dict, chunk: int, d: int, g: int, page: int, paged: bool, pdl: bool) -> dict:
    """Constexprs of the L2 warm-up: with PDL and history chunks of at most ``l2_prefetch``
    tokens, each program prefetches its whole chunk into L2 before it waits for the query
    rotation; one prefetch per 128-byte line of code rows (``d/4`` bytes per token) and of
    parameters (2 bytes per group and token; at most a page apart). ``l2_head`` (default 0: off):
    programs of longer chunks prefetch their first ``l2_head`` tokens (rounded up to a power of
    two), so their first steps' loads need not wait for DRAM after the rotation ends."""
    limit = int(cfg.get("l2_prefetch", 0))
    head = int(cfg.get("l2_head", 0))
    if not pdl or (chunk > limit and not head):
        return {}
    cs = max(1, 512 // d)
    ps = max(1, 64 // (d // g))
    if paged:
        cs, ps = min(cs, page), min(ps, page)
    n = chunk if chunk <= limit else min(chunk, head)
    return {"L2T": next_pow2(max(n, cs, ps)), "L2CS": cs, "L2PS": ps}


def _rotate_query_triton(mod, q, r, h: int, cfg: dict, pdl: bool) -> torch.Tensor:
    """``q [B, Hq, d] @ R[h]`` per KV head in float32 with ``rotate_query_kernel``: one program per
    KV head, 32-column slice of ``R`` and group of sequences whose query heads fill the product's
    16 rows (4 sequences when a KV head has 4 query heads), so each slice of ``R`` is read once
    per group instead of once per sequence."""
    bsz, hq, d = q.shape
    qg = hq // h
    interp = interpreting()
    qr = torch.empty(bsz, hq, d, dtype=torch.float32, device=q.device)
    bc = d if interp else min(int(cfg.get("rotate_cols", 32)), d)  # (the interpreter: fewer, larger programs)
    qg2 = next_pow2(qg)
    rows = max(16, qg2)
    seqs = rows // qg2 if cfg.get("rotate_batched", True) else 1
    LAST_LAUNCH["rotate"] = mod.rotate_query_kernel[(-(-bsz // seqs) * h, d // bc)](
        q, q.stride(0), q.stride(1), r, qr, bsz, h, qg,
        D=d, M=rows, QG2=rows // seqs, BC=bc, INTERP=interp, PDL=pdl, num_warps=4,
    )
    return qr


def _decode_triton(q, cache, k_rotation, v_rotation, unrotate, sm_scale, out, out_dtype, config, pdl_input=False,
                   logit_correction=0.0, sinks=None):
    mod = load_triton_module("_decode_triton")
    bsz, hq, d = q.shape
    h = cache.num_kv_heads
    qg = hq // h
    g, gv = cache.group_size, cache.v_group_size
    w, wv = min(g, d // 4), min(gv, d // 4)
    nb, nbv = d // (4 * w), d // (4 * wv)
    ks, vs = cache.k_scale, cache.v_scale
    # K and V groups of different sizes (or value parameters laid out apart): the kernel's value loop
    # takes its own group size, plane width and parameter strides; otherwise it compiles to the
    # uniform cache's code
    split = gv != g or vs.stride() != ks.stride()
    dev = q.device
    interp = interpreting()
    cfg = tuning(bsz, h, config, paged=cache.paged)
    asm = int(cfg["mode"]) == 1 and not interp
    block_n = int(cfg["BLOCK_N"])
    block16 = int(cfg["BLOCK16"])
    hp = _heads_per_program(qg, h, cfg)
    # software prefetch of the next step's offsets and parameters (one group per row only)
    pf = bool(cfg["prefetch"]) and d == g and not split
    m2 = next_pow2(qg)
    hgroups = -(-h // hp)
    # programmatic dependent launch (Hopper+): each kernel launches while the previous one runs
    # and waits (griddepcontrol) before reading its output; graph-capturable
    pdl = bool(cfg["pdl"]) and pdl_capable(dev)

    # the query in the keys' basis: one small kernel (3xTF32 products, about fp32 accuracy)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_rotation is not None:
        r = k_rotation
        if r.dtype != torch.float32 or not r.is_contiguous():  # once per rotation tensor, not per call
            r = derived(k_rotation, ("f32",), lambda: k_rotation.float().contiguous())
        qr = _rotate_query_triton(mod, q, r, h, cfg, pdl)
    else:
        qr = q

    # split sizes (host integers only: graph-safe)
    # (the interpreter runs programs one after another: one "SM" keeps CPU runs short)
    n_sm = sm_count(dev) if q.is_cuda else 1
    target = int(cfg["programs_per_sm"]) * n_sm
    cap = cache.history_capacity
    if "split_tokens" in cfg:
        chunk = int(cfg["split_tokens"])
    else:
        want = max(1, -(-target // (bsz * hgroups)))
        chunk = max(-(-cap // want), int(cfg.get("min_chunk", 0)))
    chunk = max(block_n, -(-chunk // block_n) * block_n)
    num_stages = _history_stages(cfg, chunk)
    s2 = -(-cap // chunk)
    ncap = cache.window_capacity
    wstages = _window_stages(cfg, cache)
    # window chunks: a window token is ~7x an INT2 token's bytes; small chunks keep window
    # programs off the critical path (smaller still when their loop is not pipelined)
    per = 10 if wstages == 1 else 4
    chunk16 = int(cfg.get("split_tokens16", min(256, max(block16, chunk // per, ncap // 64))))
    chunk16 = -(-chunk16 // block16) * block16
    s16 = -(-ncap // chunk16)
    s_all = s16 + s2

    opart = torch.empty(bsz * h, s_all, qg, d, dtype=torch.float32, device=dev)
    lse = torch.empty(bsz * h, s_all, qg, dtype=torch.float32, device=dev)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    qk_scale = scale * LOG2E
    # the logit-noise correction per key group and score column is corr_scale * |q_rot[g]|^2 * s_g^2
    # in the kernel's base-2 score units: a/2 * sm_scale^2 / 12 * log2(e)
    corr_scale = logit_noise_coefficient(logit_correction, scale) * LOG2E

    if cache.paged:
        tab, s_tb, page = cache.block_table, cache.block_table.stride(0), cache.page_size
    else:
        tab, s_tb, page = cache.hist_lens, 0, 1
    kc = cache.k_codes
    w16 = cache.k_bf16
    # the decode kernel overlaps the kernel before it: the rotation kernel, or (pdl_input) the one
    # that wrote the query and the lengths, which are then read after the wait (LATE)
    late = pdl_input and k_rotation is None
    pdl_decode = pdl and (k_rotation is not None or late)
    launch = {}
    if pdl_decode:
        launch["launch_pdl"] = True
    maxnreg = int(cfg["maxnreg"])
    if maxnreg and not interp:  # a register cap: more resident warps (ptxas spills past it)
        launch["maxnreg"] = maxnreg
    LAST_LAUNCH["split"] = mod.decode_kernel[(s_all, bsz * hgroups)](
        qr, qr.stride(0), qr.stride(1),
        kc, ks, cache.k_offset, cache.v_codes, cache.v_scale, cache.v_offset,
        kc.stride(0), kc.stride(1), kc.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
        tab, s_tb, cache.hist_lens,
        w16, cache.v_bf16, w16.stride(0), w16.stride(1), w16.stride(2),
        cache.bf16_lens,
        opart, lse,
        qk_scale, corr_scale,
        h, hgroups, qg, s16, s_all, chunk, chunk16,
        D=d, G=g, W=w, NB=nb, M2=m2, HP=hp, M16=max(16, next_pow2(qg)), BN=block_n, BLOCK16=block16,
        PAGED=cache.paged, PAGE=page, ASM=asm, INTERP=interp, PF=pf, PDL=pdl_decode,
        WS=wstages, V16=bool(cfg.get("value_pairs", True)), P32=_offsets32(cache, cfg), LATE=late and pdl_decode,
        GV=gv, WV=wv, NBV=nbv, SPLIT=split, CORR=logit_correction > 0,
        **_l2_warm_args(cfg, chunk, d, min(g, gv), page, cache.paged, pdl_decode),
        num_warps=int(cfg.get("num_warps", 1)), num_stages=num_stages, **launch,
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
    dc = d if interp else min(d, int(cfg.get("merge_cols", 32)))
    # attention sinks: one more partial per query head, of log-sum-exp sink (base 2: sink * log2(e)) and output 0
    LAST_LAUNCH["merge"] = mod.decode_merge_kernel[(bsz * hq, d // dc)](
        opart, lse, o_rot, o_rot.stride(0), o_rot.stride(1),
        hq, qg, s_all, lse if sinks is None else sinks,
        D=d, DC=dc, BLOCK_S=block_s, PDL=pdl, ONE_PASS=s_all <= block_s and not cfg.get("merge_two_pass", False),
        SINK=sinks is not None,
        num_warps=int(cfg.get("merge_warps", 4)), **({"launch_pdl": True} if pdl else {}),
    )
    if not unrotate:
        return o_rot
    o = unrotate_output(o_rot, v_rotation, h)
    if out is None:
        return o.to(final_dtype)
    out.copy_(o)
    return out
