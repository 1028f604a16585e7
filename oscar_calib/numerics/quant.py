"""Pure-torch quantisation primitives: the reference every kernel is tested against.

Conventions (fixed by DESIGN.md):

=================  ==========================================================================
operation          definition
=================  ==========================================================================
rotate             ``x @ R`` (row vectors), ``R`` orthogonal, one per KV head
clip (ratio c)     sort ``|row|`` ascending over head_dim ``d``; ``t = sorted[min(floor(c*d), d-1)]``;
                   clamp the row to ``[-t, t]``. ``c = 1`` keeps the row unchanged.
INT2 (group x)     ``s = max((max-min)/3, 1e-8)``, ``z = -min/s``,
                   ``q = clamp(floor(x/s + z + 0.5), 0, 3)``, ``x_hat = (q - z) * s``
logit noise (a)    subtracted from the logit of query ``q`` (rotated) and INT2 key ``t``:
                   ``a/2 · scale² · Σ_g |q_g|² s_{t,g}²/12`` over the key's groups:
                   :func:`logit_noise`
=================  ==========================================================================

Shapes: ``x`` is ``[..., d]`` where the last axis is head_dim; groups are consecutive runs of
``group_size`` channels along it (per token, per KV head, per group).

The OSCAR SGLang fork's quantiser (its ``sglang/QuantKernel/oscar_rotation_clip_int2_kv.py`` at
commit 473ff3f9d, read for these functions; nothing copied) differs in two places, both kept here
as their own functions so the ``fork`` evaluation method reproduces it:

==================  =========================================================================
fork quantiser      definition (float32 throughout; scale and zero stored in float32)
==================  =========================================================================
uniform (default)   ``s = max(max-min, 1e-8)/3`` (the floor on the *range*, ours on ``s``),
                    ``z = -min/s``, ``q = floor(x/s + z + 0.5)`` (always in 0..3),
                    ``x_hat = (q - z) * s``: :func:`quantize_int2_fork`
Lloyd-Max           ``SGLANG_LLOYD_MAX=1``, one group per row (G = head_dim) after the clip:
                    ``mu = mean``, ``sigma = sqrt(var + 1e-8)`` (population variance),
                    ``zr = (x - mu)/sigma``, ``q = [zr >= -0.98107] + [zr >= 0] + [zr >= 0.98107]``,
                    stored as ``s = (3.0191171/3)*1.16*sigma``, ``z = 1.5 - mu/s``: levels
                    ``mu + sigma*{-1.7511, -0.5837, 0.5837, 1.7511}``: :func:`quantize_lloyd_fork`
==================  =========================================================================

Its clip is ours (:func:`clip_rows`: the same index into the sorted ``|row|``, per row over head_dim)
for every token its prefill writes; tokens it demotes from the recent window during decode are
clipped with a bisection threshold instead (about one element more per row), not modelled here.
"""

from __future__ import annotations

import math

import torch

from ..contract.defaults import check_group_size
from ..errors import InputError

SCALE_FLOOR = 1e-8
LEVELS = 4  # 2 bits


def clip_threshold(x: torch.Tensor, ratio: torch.Tensor | float) -> torch.Tensor:
    """Per-row threshold ``t`` for clip ratio ``ratio`` (scalar, or broadcastable to ``x[..., 0]``):
    ``sorted(|row|)[min(floor(ratio * d), d - 1)]``.

    That is the ``m``-th largest ``|x|`` with ``m = d - idx``. Where the ratios are known on the
    host (a number or a CPU tensor) and every ``m`` is at most ``d / 2`` (clip ratios of 0.5 and
    up), it is taken from ``topk(max m)``: the same values as the sorted row's top, ~3x faster than
    a sort on the CPU for the usual ratios. Otherwise (and for ratios on a GPU, where reading
    ``max m`` would wait for the device) the row is sorted."""
    d = x.shape[-1]
    r = torch.as_tensor(ratio, dtype=torch.float64)
    idx = torch.clamp(torch.floor(r * d).long(), max=d - 1)
    if r.device.type == "cpu" and idx.numel() and int(idx.min()) >= d - d // 2:
        k = d - int(idx.min())
        top = x.abs().topk(k, dim=-1, largest=True, sorted=True).values      # |x|, largest first
        return top.gather(-1, (d - 1 - idx).to(x.device).expand(x.shape[:-1]).unsqueeze(-1))
    srt = x.abs().sort(dim=-1).values
    return srt.gather(-1, idx.to(x.device).expand(x.shape[:-1]).unsqueeze(-1))


def clip_rows(x: torch.Tensor, ratio: torch.Tensor | float) -> torch.Tensor:
    """Clamp every row of ``x`` to ``±t`` with ``t`` from :func:`clip_threshold`."""
    t = clip_threshold(x, ratio)
    return torch.maximum(torch.minimum(x, t), -t)


def quantize_int2(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per-group INT2. Returns codes ``uint8 [..., d]`` in 0..3, scale and zero
    ``[..., d // group_size]`` (float32)."""
    d = x.shape[-1]
    check_group_size(d, group_size)
    g = x.float().reshape(*x.shape[:-1], d // group_size, group_size)
    lo = g.amin(-1)
    hi = g.amax(-1)
    scale = torch.clamp((hi - lo) / (LEVELS - 1), min=SCALE_FLOOR)
    zero = -lo / scale
    q = torch.clamp(torch.floor(g / scale.unsqueeze(-1) + zero.unsqueeze(-1) + 0.5), 0, LEVELS - 1)
    return q.to(torch.uint8).reshape(x.shape), scale, zero


def quantize_int2_fork(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fork's per-group INT2 (module docstring): codes ``uint8 [..., d]``, float32 scale and zero
    ``[..., d // group_size]``. Differs from :func:`quantize_int2` only where a group's range is below
    ``3e-8`` (the floor sits on the range, before the division by 3)."""
    d = x.shape[-1]
    check_group_size(d, group_size)
    g = x.float().reshape(*x.shape[:-1], d // group_size, group_size)
    lo = g.amin(-1)
    scale = torch.clamp(g.amax(-1) - lo, min=SCALE_FLOOR) / (LEVELS - 1)
    zero = -lo / scale
    q = torch.floor(g / scale.unsqueeze(-1) + zero.unsqueeze(-1) + 0.5).clamp(0, LEVELS - 1)   # clamp: a no-op
    return q.to(torch.uint8).reshape(x.shape), scale, zero


# the fork's Lloyd-Max mode: thresholds on the standardised row, and the stretch of its stored scale
LLOYD_THRESHOLD = 0.98107
LLOYD_SCALE = 3.0191171 / 3 * 1.16
LLOYD_VAR_EPS = 1e-8


def quantize_lloyd_fork(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fork's Lloyd-Max bucket mode (module docstring), one group per row ``[..., d]``: codes
    ``uint8 [..., d]`` and the float32 scale and zero ``[..., 1]`` it stores (so
    :func:`dequantize_int2` with ``group_size = d`` gives its levels)."""
    xf = x.float()
    mu = xf.mean(-1, keepdim=True)
    sigma = torch.sqrt(xf.var(-1, unbiased=False, keepdim=True) + LLOYD_VAR_EPS)
    zr = (xf - mu) / sigma
    q = (zr >= -LLOYD_THRESHOLD).to(torch.uint8) + (zr >= 0).to(torch.uint8) + (zr >= LLOYD_THRESHOLD).to(torch.uint8)
    scale = LLOYD_SCALE * sigma
    zero = 1.5 - mu / scale
    return q, scale, zero


FORK_QUANTIZERS = ("fork", "fork-lloyd")
FORK_PARAM_BITS = 64      # the fork stores a float32 scale and a float32 zero per group


def fake_quant_fork(x: torch.Tensor, group_size: int, *, lloyd: bool = False) -> torch.Tensor:
    """Quantise and dequantise ``x`` ``[..., d]`` as the fork does (float32 result): uniform per group,
    or Lloyd-Max (``lloyd``; needs ``group_size == d``, the only case the fork applies it to)."""
    d = x.shape[-1]
    if lloyd:
        if group_size != d:
            raise InputError(f"the fork's Lloyd-Max mode needs group size = head_dim ({d}), got {group_size}: it "
                             "ignores SGLANG_LLOYD_MAX for grouped scales")
        return dequantize_int2(*quantize_lloyd_fork(x), d)
    return dequantize_int2(*quantize_int2_fork(x, group_size), group_size)


def dequantize_int2(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    d = q.shape[-1]
    g = q.float().reshape(*q.shape[:-1], d // group_size, group_size)
    return ((g - zero.unsqueeze(-1)) * scale.unsqueeze(-1)).reshape(q.shape)


def fake_quant_int2(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Quantise and dequantise in one step (float32 result)."""
    return dequantize_int2(*quantize_int2(x, group_size), group_size)


def simulate_kv_quant(
    x: torch.Tensor,
    rotation: torch.Tensor | None,
    clip: torch.Tensor | float,
    group_size: int,
    *,
    unrotate: bool = False,
) -> torch.Tensor:
    """Rotate, clip and fake-quantise K or V rows ``[..., kv_heads, d]`` with rotations
    ``[kv_heads, d, d]`` (or None for identity) and clip ratios ``[kv_heads]`` (or a scalar).

    The result is in the rotated basis unless ``unrotate`` is set.
    """
    xf = x.float()
    if rotation is not None:
        xf = torch.einsum("...hd,hde->...he", xf, rotation.to(xf))
    clip_t = torch.as_tensor(clip, dtype=torch.float64)
    xf = clip_rows(xf, clip_t) if bool((clip_t < 1).any()) else xf
    xq = fake_quant_int2(xf, group_size)
    if unrotate and rotation is not None:
        xq = torch.einsum("...he,hde->...hd", xq, rotation.to(xq))
    return xq


def bits_per_element(head_dim: int, group_size: int, param_bits: int = 32) -> float:
    """Storage cost of the INT2 payload plus one scale and one zero per group."""
    return 2.0 + param_bits / group_size if group_size else math.inf


def logit_noise(q_rot: torch.Tensor, k_scale: torch.Tensor, group_size: int, gain: float,
                scaling: float) -> torch.Tensor:
    """What the logit-noise correction subtracts from each (query, INT2 key) logit.

    A key stored as INT2 carries a rounding error ``e`` (per channel about uniform over one step
    ``s`` of its group: variance ``s²/12``), so its logit ``l = scaling · q·k`` carries noise of
    variance ``σ² = scaling² Σ_g |q_g|² s_g²/12``, and ``exp(l + ε)`` is on average ``exp(l) ·
    exp(σ²/2)``: INT2 keys are over-weighted in the softmax against the 16-bit window, and the
    noisier of them against the rest. The correction is ``gain · σ²/2``.

    ``q_rot [..., Q, d]``: queries in the keys' rotated basis; ``k_scale [..., K, d/G]``: the keys'
    stored group scales (``G = group_size``); leading dims broadcast. Returns ``[..., Q, K]``
    float32."""
    qn = q_rot.float().unflatten(-1, (-1, group_size)).pow(2).sum(-1)                  # [..., Q, d/G]
    return logit_noise_coefficient(gain, scaling) * (qn @ k_scale.float().pow(2).transpose(-1, -2))


def logit_noise_coefficient(gain: float, scaling: float) -> float:
    """The constant of :func:`logit_noise`: ``gain · ½ · scaling² / 12`` (the correction is this
    times ``Σ_g |q_g|² s_g²``); the decode kernel takes it as one scalar."""
    return gain * 0.5 * scaling * scaling / 12.0
