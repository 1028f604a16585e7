"""Levers on the INT2 error itself, simulated: what ``scripts/experiments/ablation.py`` runs for its
``lever:*`` variants. Nothing here is used by the toolkit; a lever that wins is built into the
package (cache and kernels) and its simulation here stays as the ablation's record.

A :class:`LeverScheme` is a :class:`~oscar_calib.runtime.scheme.KVScheme` (rotations, clips, K/V
group sizes, sink and window) plus the lever's options; :class:`LeverKV` is the perplexity
simulation of :class:`~oscar_calib.runtime.simulate.SimulatedKV` (every query position reads the
BF16 sink and its own recent window, the rest as stored) with the history stored the lever's way:

=====================  ===========================================================================
option                 history storage (per token, KV head and group of ``G`` channels, after the
                       rotation and the clip)
=====================  ===========================================================================
``params``             ``fp16``: oscar's fp16 scale and offset (``2 + 32/G`` bits; with every
                       other option off this equals ``SimulatedKV``, checked by :func:`self_check`);
                       ``fp8``: scale and offset as float8 e4m3 relative to a power of two per
                       (layer, cache, KV head) that puts the median scale at 1 (a constant a
                       calibration would store; here taken from the sequence itself), codes
                       computed against the stored parameters (``2 + 16/G`` bits)
``sparse``             ``n`` > 0: the ``n`` entries of each row with the largest error after the
                       clip and INT2 are corrected by their error in float8 e4m3 (dense-and-
                       sparse, as KVQuant keeps outliers; ``n * (8 + log2 d)`` bits per row)
``int3_layers``        layers whose K and V use 8 levels instead of 4 (``+1`` bit per element)
``logit_correction``   ``a`` > 0: subtract ``a · ½ Var(q·e)`` from every INT2 logit, ``e`` the key's rounding
                       error modelled per group as ``s²/12`` (the numerator ``exp(l + ε)`` is
                       ``exp(l) · exp(σ²/2)`` on average: INT2 tokens are over-weighted against
                       the BF16 window by their own noise); free in memory, one FMA per group and
                       token in a kernel
=====================  ===========================================================================

Bits per element (:meth:`LeverScheme.layer_bits`) count codes, parameters and sparse entries.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from oscar_calib.numerics.quant import clip_rows, logit_noise
from oscar_calib.runtime.scheme import KVScheme
from oscar_calib.runtime.simulate import SimulatedKV, window_rows

FP8 = torch.float8_e4m3fn


@dataclasses.dataclass
class LeverScheme(KVScheme):
    """A KV scheme with a lever's storage options (module docstring)."""

    params: str = "fp16"
    sparse: int = 0
    int3_layers: tuple = ()

    def layer_bits(self, i: int) -> float:
        d = self.head_dim
        pbits = 16 if self.params == "fp8" else 32
        code = 3 if i in self.int3_layers else 2
        extra = self.sparse * (8 + math.log2(d)) / d
        return sum(code + pbits / g + extra for g in self.groups(i)) / 2

    head_dim: int = 64


def _fp8_relative(x: torch.Tensor, dim_heads: int = -2) -> torch.Tensor:
    """``x`` (positive or signed parameters ``[..., H, NG]``) stored as e4m3 relative to a power of
    two per KV head (the median |x| of the head near 1)."""
    heads = x.transpose(0, dim_heads).reshape(x.shape[dim_heads], -1)
    med = heads.abs().median(dim=1).values.clamp(min=1e-12)
    unit = torch.exp2(torch.round(torch.log2(med)))
    shape = [1] * x.dim()
    shape[dim_heads] = -1
    u = unit.view(shape)
    return (x / u).clamp(-448, 448).to(FP8).float() * u


def fake_quant_rows(y: torch.Tensor, g: int, levels: int, params: str):
    """``y [B, S, H, d]`` (rotated, clipped) -> dequantised rows and the stored scales ``[B, S, H, d/g]``."""
    shp = y.shape
    yg = y.reshape(*shp[:-1], shp[-1] // g, g)
    lo, hi = yg.amin(-1), yg.amax(-1)
    s = torch.clamp((hi - lo) / levels, min=1e-8)
    if params == "fp16":
        z = -lo / s
        q = torch.clamp(torch.floor(yg / s.unsqueeze(-1) + z.unsqueeze(-1) + 0.5), 0, levels)
        s_st = s.clamp(-65504, 65504).half().float()
        o_st = (-(z * s)).clamp(-65504, 65504).half().float()
    else:
        s_st = _fp8_relative(s)
        o_st = _fp8_relative(lo)
        q = torch.clamp(torch.floor((yg - o_st.unsqueeze(-1)) / s_st.unsqueeze(-1) + 0.5), 0, levels)
    out = q * s_st.unsqueeze(-1) + o_st.unsqueeze(-1)
    return out.reshape(shp), s_st


def _sparse_fix(y: torch.Tensor, yq: torch.Tensor, n: int) -> torch.Tensor:
    """Correct each row's ``n`` largest errors by their e4m3-rounded error."""
    err = y - yq
    idx = err.abs().topk(n, dim=-1).indices
    e = err.gather(-1, idx)
    e8 = _fp8_relative(e.reshape(*e.shape[:-1], e.shape[-1]), dim_heads=-2)
    return yq.scatter_add(-1, idx, e8)


class LeverKV(SimulatedKV):
    """:class:`SimulatedKV` with the history stored the :class:`LeverScheme`'s way (oscar's
    quantiser only; explicit softmax, float32). Rows below ``prefill`` read every key from the
    window half (16-bit, as the window holds it) where :class:`SimulatedKV` reads them as computed:
    the scored rows are exact, the prefill rows off by one 16-bit rounding."""

    def _int2(self, layer: int, which: str, x: torch.Tensor):
        """``x [B, H, S, d]`` -> (dequantised rows in the model's basis [B, H, S, d], scales [B, S, H, NG])."""
        sch = self.scheme
        ls = sch.layer(layer)
        rk, ck, rv, cv = ls.on(x.device)
        r, c = (rk, ck) if which == "k" else (rv, cv)
        g = sch.groups(layer)[0 if which == "k" else 1]
        shift = ls.k_shift(x.device) if which == "k" else None      # key centering: y = (x - mu) @ R
        y = x.float().transpose(1, 2)                                           # [B, S, H, d]
        if r is not None:
            y = torch.einsum("bshd,hde->bshe", y, r)
        if shift is not None:
            y = y - shift
        yc = torch.stack([clip_rows(y[:, :, h], c[h].double()) for h in range(y.shape[2])], 2) if c is not None else y
        levels = 7 if layer in sch.int3_layers else 3
        yq, s = fake_quant_rows(yc, g, levels, sch.params)
        if sch.sparse:
            yq = _sparse_fix(y, yq, sch.sparse)
        back = torch.einsum("bshe,hde->bhsd", yq, r) if r is not None else yq.transpose(1, 2)
        if shift is not None:
            back = back + ls.mean_on(x.device)[:, None]
        return back, s

    def attend(self, layer, q, k, v, mask, scaling, window, softcap, positions=None):
        sch = self.scheme
        b, hq, t, d = q.shape
        hkv, s = k.shape[1], k.shape[2]
        grp = hq // hkv
        qpos = (torch.arange(t, device=q.device) + (s - t)).unsqueeze(1)
        allowed = self._allowed(mask, b, t, s, window, q.device, qpos)
        wd = sch.window_dtype
        k_in = k.to(wd) if wd is not None else k
        v_in = v.to(wd) if wd is not None else v
        k_lo, k_scales = self._int2(layer, "k", k_in)
        v_lo, _ = self._int2(layer, "v", v_in)
        kpos = torch.arange(s, device=q.device).unsqueeze(0)
        hi = sch.reads_window(qpos, kpos) | (qpos < self.prefill)     # prefill rows: the window half, every key
        rk, _, rv, _ = sch.layer(layer).rotations
        mean = sch.layer(layer).k_mean                                   # key centering: the window's keys too
        keys = torch.cat([k_lo, window_rows(k, rk, wd or k.dtype, mean)], 2).repeat_interleave(grp, 1)
        values = torch.cat([v_lo, window_rows(v, rv, wd or v.dtype)], 2).repeat_interleave(grp, 1)
        allowed = torch.cat([allowed & ~hi, allowed & hi], dim=-1)
        qf = q.float()
        sc = (qf @ keys.transpose(-1, -2)) * scaling
        if softcap:
            sc = torch.tanh(sc / softcap) * softcap
        if sch.logit_correction:
            rk = sch.layer(layer).k_rotation
            qr = qf if rk is None else torch.einsum("bhtd,hde->bhte", qf,
                                                    rk.to(q.device, torch.float32).repeat_interleave(grp, 0))
            scales = k_scales.permute(0, 2, 1, 3).repeat_interleave(grp, 1)             # [B, Hq, S, NG]
            sc[..., :s] -= logit_noise(qr, scales, sch.groups(layer)[0], float(sch.logit_correction), scaling)
        sc = sc.masked_fill(~allowed, -math.inf)
        o = torch.softmax(sc, dim=-1) @ values
        return o.transpose(1, 2)


def lever_scheme(base: KVScheme, head_dim: int, **options) -> LeverScheme:
    """``base``'s rotations, clips, groups and windows with a lever's options."""
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(KVScheme)}
    return LeverScheme(**{**fields, **options}, head_dim=head_dim)


def sequence_nll(model, ids: torch.Tensor, scheme: LeverScheme, *, scored: int | None = None) -> tuple[float, int]:
    """:func:`oscar_calib.eval.sequence_nll` through :class:`LeverKV`."""
    from oscar_calib.eval import sequence_nll as nll

    return nll(model, ids, scheme, scored=scored, simulation=LeverKV)


def self_check(scheme: KVScheme, head_dim: int, seed: int = 0) -> float:
    """Largest difference between :class:`LeverKV` with every lever off and ``SimulatedKV`` on random
    rows of layer 0 (the lever simulation's own test)."""
    g = torch.Generator().manual_seed(seed)
    rk = scheme.layer(0).k_rotation
    heads = rk.shape[0] if rk is not None else 1
    q = torch.randn(1, 2 * heads, 400, head_dim, generator=g)
    k = torch.randn(1, heads, 400, head_dim, generator=g) * 3
    v = torch.randn(1, heads, 400, head_dim, generator=g)
    plain = SimulatedKV(None, scheme).attend(0, q, k, v, None, head_dim ** -0.5, None, None)
    lever = LeverKV(None, lever_scheme(scheme, head_dim)).attend(0, q, k, v, None, head_dim ** -0.5, None, None)
    return float((plain - lever).abs().max())
