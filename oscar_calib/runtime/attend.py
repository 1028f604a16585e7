"""Pure-torch attention over one layer of the real cache, reading the INT2 history in chunks.

Used on the CPU for decode steps, and on every device for what the decode kernel does not
cover: sliding-window layers, logit soft-capping, and multi-token calls on a non-empty cache
(chunked prefill). It never builds one de-quantised copy of the history: blocks of
:data:`CHUNK_ELEMENTS` scores at most are de-quantised, scored and folded into an online
softmax (flash-attention style, float32, log-sum-exp rescaling).

What a query reads, for a call that brings sequence ``b`` from ``n`` to ``n'`` valid tokens (a
decode step writes its token first and reads it from the window, like the decode kernel; a
multi-token call reads the cache as it was before the call, plus its own tokens):

=============  ==============================================================================
block          keys a query with token index ``i`` may read
=============  ==============================================================================
window         stored token ``t`` with ``t < S`` or ``t >= n' - R`` (16-bit, rotated)
history        stored token ``t`` with ``S <= t < n' - R`` (INT2, rotated)
new tokens     the model's own mask over the call's tokens, at full precision (rotated here)
=============  ==============================================================================

and, in sliding-window layers, only ``i - t < W``; in chunked-attention layers (Llama 4), only the
tokens of ``i``'s chunk, ``t >= C * floor(i / C)``. This is the simulation's rule
(:class:`~oscar_calib.runtime.simulated.SimulatedCache`): a token pushed out of the window by
this call is read as INT2, the call's own tokens as the model computed them. Attention is
computed in the rotated basis (``q @ R_k``, values ``v @ R_v``) and the output rotated back with
``R_vᵀ`` unless V is folded. With the plan's ``logit_correction``, every INT2 key's logit loses its
logit-noise correction (:func:`~oscar_calib.numerics.quant.logit_noise`, from its stored scales).
Attention sinks (gpt-oss passes a learned logit per query head as ``s_aux``) start the online
softmax: its running maximum at the sink logit and its denominator at one, the sink counted as a
key of value zero, as the model's own attention counts it.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 24          # scores per block: bounds the temporaries (64 MiB of float32)
MIN_CHUNK = 64                    # history tokens per block at least


def allowed_mask(mask: torch.Tensor) -> torch.Tensor:
    """A transformers attention mask as bool: True where attending is allowed (an additive mask
    allows where it is not the dtype's minimum)."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def online_softmax(q: torch.Tensor, blocks, scale: float, softcap: float | None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q kᵀ · scale - noise) v`` over key blocks. ``q [B, H, G, T, d]`` float32 (G query
    heads per KV head); each block is ``(k [B, H, L, d], v [B, H, L, d], allowed [B, T|1, L] bool,
    noise)``, ``noise`` None or ``[B, H, G, T, L]`` subtracted from the (soft-capped) logits.
    ``sinks [H*G]``: one more key per query head, of that logit and value zero (None: none).
    Rows that may read no key at all return 0."""
    b, h, g, t, d = q.shape
    if sinks is None:
        m = torch.full((b, h, g, t), float("-inf"), device=q.device)
        denom = torch.zeros(b, h, g, t, device=q.device)
    else:                     # the sink is the first key read: exp(sink - m) = 1 with m = sink
        m = sinks.float().reshape(1, h, g, 1).expand(b, h, g, t).contiguous()
        denom = torch.ones(b, h, g, t, device=q.device)
    acc = torch.zeros(b, h, g, t, d, device=q.device)
    for k, v, allowed, noise in blocks:
        if k.shape[2] == 0:
            continue
        s = torch.einsum("bhgtd,bhld->bhgtl", q, k.float()) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if noise is not None:
            s = s - noise
        s = s.masked_fill(~allowed[:, None, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - base.unsqueeze(-1))
        corr = torch.exp(m - base)
        denom = denom * corr + p.sum(-1)
        acc = acc * corr.unsqueeze(-1) + torch.einsum("bhgtl,bhld->bhgtd", p, v.float())
        m = m_new
    return acc / torch.where(denom > 0, denom, torch.ones_like(denom)).unsqueeze(-1)


def _per_head(x: torch.Tensor, r: torch.Tensor | None, transpose: bool = False) -> torch.Tensor:
    """``x [B, H, ..., d] @ r[h]`` (or ``r[h]ᵀ``) in float32."""
    if r is None:
        return x.float()
    eq = "bh...d,hed->bh...e" if transpose else "bh...d,hde->bh...e"
    return torch.einsum(eq, x.float(), r)


def _cached_blocks(store, n_new: torch.Tensor, qidx: torch.Tensor, chunk: int, noise=None):
    """The window block and the history chunks with their masks (see the module docstring);
    ``noise(key_scales [B, H, L, d/G])``: the logit-noise correction of a history chunk (None: off)."""
    p = store.plan
    w = p.sliding_window
    start = None if p.chunk is None else (qidx // p.chunk * p.chunk).unsqueeze(2)   # [B, T, 1]: each query's chunk

    keep = (n_new - p.recent).unsqueeze(1)          # tokens from here on stay 16-bit after this call

    def rule(tok, in_window: bool):
        if in_window:
            ok = (tok >= 0) & ((tok < p.sink) | (tok >= keep))
        else:
            ok = (tok >= p.sink) & (tok < keep)
        ok = ok.unsqueeze(1)                                                      # [B, 1, L]
        if start is not None:
            ok = ok & (tok.unsqueeze(1) >= start)                                 # [B, T, L]
        elif w is not None:
            ok = ok & (qidx.unsqueeze(2) - tok.unsqueeze(1) < w)                  # [B, T, L]
        return ok

    win = store.window.kv[:, :, :, :p.sink + p.recent]
    yield win[:, 0], win[:, 1], rule(store.window.slot_tokens(store.n), True), None
    span = store.history_span()
    for a in range(0, span, chunk):
        length = min(chunk, span - a)
        x = store.hist.dequantize(a, length)                                      # [B, 2, H, L, d]
        yield (x[:, 0], x[:, 1], rule(store.hist.slot_tokens(store.n, p.sink, a, length), False),
               None if noise is None else noise(store.hist.key_scales(a, length)))


def attend_cached(store, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, new_allowed: torch.Tensor,
                  qidx: torch.Tensor, n_new: torch.Tensor, scale: float, softcap: float | None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output ``[B, T, Hq, d]`` (float32) of queries ``q [B, Hq, T, d]`` over the cache as
    it is (``store``) and the call's tokens ``k``/``v`` ``[B, H, T, d]`` at full precision.

    ``new_allowed [B, T, T]``: which new token each query may read (the model's mask);
    ``qidx [B, T]``: token index of each query; ``n_new [B]``: valid tokens after the call.
    ``k = v = None`` when the call's tokens are already written (a decode step reads its own
    token from the 16-bit window, exactly as the decode kernel does). ``sinks [Hq]``: attention-sink
    logits (None: none)."""
    p = store.plan
    bsz, hq, t, d = q.shape
    h = store.heads
    qr = _per_head(q.reshape(bsz, h, hq // h, t, d), p.k_rotation)                 # [B, H, G, T, d]
    chunk = max(MIN_CHUNK, CHUNK_ELEMENTS // max(1, hq * t * bsz))

    noise = None
    if p.logit_correction:
        from ..numerics.quant import logit_noise

        def noise(key_scales):                                                   # [B, H, L, d/G] -> [B, H, G, T, L]
            return logit_noise(qr, key_scales.unsqueeze(2), p.group_size, p.logit_correction, scale)

    def all_blocks():
        yield from _cached_blocks(store, n_new, qidx, chunk, noise)
        if k is not None:
            yield _per_head(k, p.k_rotation), _per_head(v, p.v_rotation), new_allowed, None

    o = online_softmax(qr, all_blocks(), scale, softcap, sinks)                   # [B, H, G, T, d]
    if p.v_rotation is not None:
        o = _per_head(o, p.v_rotation, transpose=True)
    return o.reshape(bsz, hq, t, d).transpose(1, 2)
