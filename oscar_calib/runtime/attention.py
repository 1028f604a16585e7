"""The attention function of the real cache, registered with transformers' ``AttentionInterface``.

A model's attention module calls ``past_key_values.update(k, v, layer_idx)`` and then the
configured attention function. With :class:`OscarAttention` active (``with cache.attach(model):``)
the function is ``oscar_int2``; ``OscarLayer.update`` only hands the new K/V over, and the
function decides, per call:

=======================  =================================================================
call                     what runs
=======================  =================================================================
prefill (layer empty)    the model's own attention (SDPA, or eager for a model without SDPA
                         support such as gpt-oss) over the new tokens with the model's mask (full
                         precision, exactly as a ``DynamicCache`` prefill), then the write
decode step, CUDA        write the token (window slot + INT2 history slot), then the Triton
                         decode kernel (:func:`oscar_calib.kernels.decode_attention`) on the
                         packed cache: query rotated online by ``k_rotation``, output rotated
                         back by ``v_rotation`` (left rotated when V is folded into the weights)
decode step, otherwise   write, then :func:`~oscar_calib.runtime.attend.attend_cached` (pure
(CPU, sliding window,    torch, history read in chunks; the same rule and the same stored
soft-cap)                values as the kernel)
chunked prefill          :func:`~oscar_calib.runtime.attend.attend_cached` over the cache and
(tokens on a non-empty   the call's tokens at full precision, then the write
cache)
=======================  =================================================================

Calls for a cache that is not attached, or with another cache, fall through to the model's own
attention. Attention sinks (gpt-oss's ``s_aux``, a learned logit per query head) reach every path:
the model's own attention takes them, the torch path starts its softmax with them, and the decode
kernel adds them in its merge.
Padding: the model's mask tells which new tokens are real (a token is stored when it may attend
to itself); each sequence counts only its real tokens, so left padding takes no cache room and
the sink is each sequence's own first tokens. This needs torch >= 2.5 (older versions let fully
masked rows attend everywhere).
"""

from __future__ import annotations

import torch

from ..errors import CacheError
from ..model.capture import AttentionRoute, attention_function, model_attention
from .attend import allowed_mask, attend_cached
from .storage import write_step

ATTENTION_NAME = "oscar_int2"

_ACTIVE: list["OscarAttention"] = []


def registered_attention(module, query, key, value, attention_mask, **kwargs):
    """The function registered as :data:`ATTENTION_NAME`: the innermost active route's cache layer
    when it holds this call's K/V, else the model's own attention."""
    layer_idx = getattr(module, "layer_idx", None)
    for route in reversed(_ACTIVE):
        layers = route.cache.layers
        if layer_idx is None or layer_idx >= len(layers) or getattr(layers[layer_idx], "pending", None) is None:
            continue
        if not layers[layer_idx].takes(key):
            raise CacheError(f"layer {layer_idx}: the model changed K/V between cache.update and attention; "
                             "OscarCache cannot serve this attention module")
        return layer_attention(layers[layer_idx], module, query, key, value, attention_mask, kwargs, route.base)
    base = _ACTIVE[-1].base if _ACTIVE else "sdpa"
    return attention_function(base, module)(module, query, key, value, attention_mask, **kwargs)


def new_token_rows(mask: torch.Tensor | None, batch: int, t: int):
    """From the model's mask over this call's tokens: ``(valid, allowed)`` where ``valid`` is one
    index tensor per row (None: every token of the row is real) and ``allowed [B, T, T]`` bool (None:
    plain causal)."""
    if mask is None:
        return [None] * batch, None
    m = allowed_mask(mask[..., -t:])[:, 0].expand(batch, t, t)
    diag = m.diagonal(dim1=-2, dim2=-1)                                       # [B, T]: attends itself
    if bool(diag.all()):
        return [None] * batch, m
    return [None if bool(row.all()) else row.nonzero().squeeze(1) for row in diag], m


def decode_rows(mask: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """For a call of one token per row: ``[B]`` bool on the mask's device, whether each row's token
    is real (may attend to itself), or None without a mask. Nothing is read back to the host, so a
    decode step does not wait for the GPU (and a CUDA graph can capture it)."""
    return None if mask is None else allowed_mask(mask[:, 0, -1, -1]).expand(batch)


def _causal(t: int, window: int | None, device, chunk: int | None = None, start: torch.Tensor | None = None):
    """``[B|1, T, T]``: causal (and within ``window``) over a call's tokens; with ``chunk``, also within
    one chunk, the call's first token being token ``start [B]`` of its sequence."""
    i = torch.arange(t, device=device)
    ok = i.unsqueeze(1) >= i.unsqueeze(0)
    if window:
        ok &= i.unsqueeze(1) - i.unsqueeze(0) < window
    ok = ok.unsqueeze(0)
    if chunk:
        c = torch.div(start.unsqueeze(1) + i, chunk, rounding_mode="floor")                     # [B, T]
        ok = ok & (c.unsqueeze(2) == c.unsqueeze(1))
    return ok


def kernel_decodes(layer, query: torch.Tensor, softcap, sinks=None) -> bool:
    """Whether a decode step of ``layer`` runs the Triton kernel (else the chunked torch path):
    full-attention layers, no soft-cap, a 16-bit window, a shape the kernel takes, and the
    backend (``auto``: CUDA tensors); not attention sinks with key centering (a sink's logit would
    need each query's ``q·μ``, which only the torch path adds)."""
    from ..kernels.decode import decode_backend

    plan = layer.store.plan
    if layer.is_sliding or softcap or plan.window_dtype not in (torch.bfloat16, torch.float16):
        return False
    if sinks is not None and plan.k_shift is not None:
        return False
    return decode_backend(query[:, :, 0], layer.store.kernel_view(), layer.backend) == "triton"


def layer_attention(layer, module, query, key, value, mask, kwargs, base: str = "sdpa"):
    """One layer's attention for this call (see the module docstring; ``base``: the model's own
    attention implementation, which runs a prefill). Returns ``(out [B, T, Hq, d], None)`` like every
    transformers attention function."""
    layer.pending = None
    bsz, _, t, d = query.shape
    scale = kwargs.get("scaling") or d ** -0.5
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    store = layer.store
    if t == 1 and max(store.counts) > 0:          # a decode step: write the token, then read the cache
        p = store.plan
        kernel = kernel_decodes(layer, query, softcap, sinks)
        # for the kernel the write rotates the query too (its K programs hold R_k, in rot2): no
        # rotation kernel, and the decode kernel launches while the write ends
        rotate = kernel and p.k_rotation is not None
        qr = write_step(store, key, value, decode_rows(mask, bsz), layer.gate, query=query[:, :, 0] if rotate else None)
        if kernel:
            from ..kernels import decode_attention

            o = decode_attention(qr if rotate else query[:, :, 0], store.kernel_view(), k_rotation=None,
                                 v_rotation=p.v_rotation, unrotate=p.v_rotation is not None, sm_scale=scale,
                                 check_lengths=False, out_dtype=query.dtype, backend=p.backend, pdl_input=True,
                                 logit_correction=p.logit_correction, sinks=sinks)
            return o.unsqueeze(1), None
        out = attend_cached(store, query, None, None, None, store.n.unsqueeze(1) - 1, store.n, scale, softcap, sinks)
        return out.to(query.dtype), None
    valid, allowed = new_token_rows(mask, bsz, t)
    if layer.chunk and any(v is not None for v in valid):
        raise CacheError(f"layer {getattr(module, 'layer_idx', '?')}: a padded batch with chunked-attention layers "
                         "(left padding moves transformers' chunk boundaries, which OscarCache counts over real "
                         "tokens); run the sequences one at a time")
    if max(store.exact_counts()) == 0:
        out, _ = attention_function(base, module)(module, query, key, value, mask, **kwargs)
        layer.write(key, value, valid)
        return out, None
    counts = torch.tensor([t if v is None else len(v) for v in valid], device=query.device)
    if allowed is None:
        allowed = _causal(t, None if layer.chunk else layer.sliding_window, query.device, layer.chunk,
                          store.n).expand(bsz, t, t)
        qidx = store.n.unsqueeze(1) + torch.arange(t, device=query.device)
    else:
        real = allowed.diagonal(dim1=-2, dim2=-1).long()
        qidx = store.n.unsqueeze(1) + real.cumsum(1) - 1
    out = attend_cached(store, query, key, value, allowed, qidx, store.n + counts, scale, softcap, sinks)
    layer.write(key, value, valid)
    return out.to(query.dtype), None


class OscarAttention(AttentionRoute):
    """Route every attention layer of ``model`` through ``oscar_int2`` for ``cache`` (an
    :class:`~oscar_calib.runtime.cache.OscarCache`); restores the model's implementation on exit,
    also on error. Use it through :meth:`OscarCache.attach`.

    >>> with cache.attach(model):
    ...     out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
    """

    name = ATTENTION_NAME
    active = _ACTIVE

    def __init__(self, model, cache):
        self.model, self.cache = model, cache

    def __enter__(self) -> "OscarAttention":
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, registered_attention)
        self.base = model_attention(self.model)
        self._route(self.base)
        for layer in self.cache.oscar_layers:
            layer.attached += 1
        return self

    def __exit__(self, *exc) -> None:
        for layer in self.cache.oscar_layers:
            layer.attached -= 1
        super().__exit__(*exc)
