"""``SimulatedKV``: attention that reads K/V as a :class:`~oscar_calib.runtime.scheme.KVScheme`
stores them, per query position (an accuracy tool, not a cache).

For every query position ``i``, key/value ``j`` is read in BF16 when ``j < sink`` or
``i − j < recent`` and as INT2 (rotated, clipped, quantised, stored with fp16 scale/offset
exactly as :mod:`oscar_calib.kernels` stores it) otherwise. One forward pass per sequence through
an attention function registered with transformers' ``AttentionInterface``; the model's causal and
sliding-window masks and GQA are honoured, math is float32. With nothing quantised it equals
plain attention (tested). It de-quantises every key for every layer: memory and time grow with
the context like a full-precision cache, so it measures accuracy only.
"""

from __future__ import annotations

import math

import torch

from ..errors import EvalError
from ..model.capture import AttentionRoute
from .scheme import KVScheme

SIM_NAME = "oscar_kv_sim"


_ACTIVE: list["SimulatedKV"] = []


def _sim_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                   softcap=None, **kwargs):
    sim = _ACTIVE[-1]
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise EvalError(f"{type(module).__name__} has no layer_idx")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = sim.attend(layer, query, key, value, attention_mask, scale,
                     sliding_window or getattr(module, "sliding_window", None), softcap)
    return out.to(query.dtype), None


class SimulatedKV(AttentionRoute):
    """Route a model's attention through :meth:`attend`, which reads K/V as ``scheme`` stores
    them (per query position: sink and recent window in BF16, the rest INT2). Sets and restores
    the attention implementation of every config of the model, also on error.

    >>> with SimulatedKV(model, scheme):
    ...     logits = model(ids).logits
    """

    name = SIM_NAME
    active = _ACTIVE

    def __init__(self, model, scheme: KVScheme):
        self.model, self.scheme = model, scheme

    def __enter__(self) -> "SimulatedKV":
        from transformers import AttentionInterface

        AttentionInterface.register(SIM_NAME, _sim_attention)
        return self._route("sdpa")

    @staticmethod
    def _allowed(mask, b: int, t: int, s: int, window: int | None, device) -> torch.Tensor:
        """Boolean [B|1, 1, T, S]: the model's mask, or causal (+ sliding window) when it is None."""
        if mask is None:
            qpos = torch.arange(t, device=device).unsqueeze(1) + (s - t)
            kpos = torch.arange(s, device=device).unsqueeze(0)
            m = kpos <= qpos
            if window:
                m &= qpos - kpos < window
            return m.view(1, 1, t, s)
        if mask.dtype == torch.bool:
            return mask[..., -s:]
        return (mask > torch.finfo(mask.dtype).min / 2)[..., -s:]

    def attend(self, layer: int, q, k, v, mask, scaling: float, window: int | None, softcap) -> torch.Tensor:
        """q [B, Hq, T, d], k/v [B, Hkv, S, d] -> attention output [B, T, Hq, d] (float32).

        Exact per-(i, j) selection with one attention call: the keys are the INT2 version
        rotated back (``K̂Rᵀ``, so ``q·(K̂Rᵀ)ᵀ = (qR)·K̂ᵀ``) followed by the BF16 version, values
        likewise, and the mask lets row ``i`` read column ``j`` of the BF16 half when
        ``j < sink`` or ``i − j < recent`` and of the INT2 half otherwise (both within the
        model's own mask). The softmax over the ``2S`` columns is then the softmax over the
        ``S`` keys each read in the right precision, and ``P·V`` sums each part."""
        from ..kernels import quantize_kv

        sch = self.scheme
        b, hq, t, d = q.shape
        hkv, s = k.shape[1], k.shape[2]
        grp = hq // hkv
        allowed = self._allowed(mask, b, t, s, window, q.device)                          # [B|1, 1, T, S]
        wd = sch.window_dtype
        k_in = k.to(wd) if wd is not None else k
        v_in = v.to(wd) if wd is not None else v
        keys, values = k_in.float(), v_in.float()
        if sch.quantized:
            rk, ck, rv, cv = (None if x is None else x.to(q.device, torch.float32) for x in sch.layer(layer))
            kq = quantize_kv(k_in.transpose(1, 2), rk, ck, sch.group_size).dequantize()     # [B, S, Hkv, d] rotated
            vq = quantize_kv(v_in.transpose(1, 2), rv, cv, sch.group_size).dequantize()
            k_lo = torch.einsum("bshe,hde->bhsd", kq, rk) if rk is not None else kq.transpose(1, 2)
            v_lo = torch.einsum("bshe,hde->bhsd", vq, rv) if rv is not None else vq.transpose(1, 2)
            qpos = torch.arange(t, device=q.device).unsqueeze(1) + (s - t)
            kpos = torch.arange(s, device=q.device).unsqueeze(0)
            hi = (kpos < sch.sink) | (qpos - kpos < sch.recent)                             # [T, S]
            keys = torch.cat([k_lo, keys], dim=2)
            values = torch.cat([v_lo, values], dim=2)
            allowed = torch.cat([allowed & ~hi, allowed & hi], dim=-1)                     # [B|1, 1, T, 2S]
        keys, values = keys.repeat_interleave(grp, 1), values.repeat_interleave(grp, 1)
        qf = q.float()
        if not softcap:
            o = torch.nn.functional.scaled_dot_product_attention(qf, keys, values, attn_mask=allowed, scale=scaling)
        else:
            sc = (qf @ keys.transpose(-1, -2)) * scaling
            sc = torch.tanh(sc / softcap) * softcap
            o = torch.softmax(sc.masked_fill(~allowed, -math.inf), dim=-1) @ values
        out_rot = sch.v_output[layer]
        if out_rot is not None:                     # absorbed R_v: map the output back, o @ Rᵀ per KV head
            r = out_rot.to(o.device, torch.float32).repeat_interleave(grp, 0)            # [Hq, d, d]
            o = torch.einsum("bhtd,hed->bhte", o, r)
        return o.transpose(1, 2)
