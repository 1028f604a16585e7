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
=================  ==========================================================================

Shapes: ``x`` is ``[..., d]`` where the last axis is head_dim; groups are consecutive runs of
``group_size`` channels along it (per token, per KV head, per group).
"""

from __future__ import annotations

import math

import torch

from ..spec.defaults import check_group_size

SCALE_FLOOR = 1e-8
LEVELS = 4  # 2 bits


def clip_threshold(x: torch.Tensor, ratio: torch.Tensor | float) -> torch.Tensor:
    """Per-row threshold ``t`` for clip ratio ``ratio`` (scalar, or broadcastable to ``x[..., 0]``)."""
    d = x.shape[-1]
    ratio = torch.as_tensor(ratio, dtype=torch.float64, device=x.device)
    idx = torch.clamp(torch.floor(ratio * d).long(), max=d - 1)
    srt = x.abs().sort(dim=-1).values
    idx = idx.expand(x.shape[:-1]).unsqueeze(-1)
    return srt.gather(-1, idx)


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
