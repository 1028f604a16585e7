"""Storage format of the INT2 KV cache: code packing, per-group scale/offset, :class:`QuantizedKV`.

Per token, per KV head, a row of ``d`` rotated-and-clipped channels is quantised per group of
``G`` channels with :func:`oscar_calib.numerics.quant.quantize_int2` (codes ``q`` in 0..3, scale ``s``,
zero ``z``). What is stored:

==========  ==========================  ==========================================================
tensor      shape, dtype                 content
==========  ==========================  ==========================================================
``codes``   ``[..., d/4]`` uint8         four 2-bit codes per byte (packing order below)
``scale``   ``[..., d/G]`` float16       ``s`` (saturated to ±65504)
``offset``  ``[..., d/G]`` float16       ``-z * s`` (= the group minimum; saturated to ±65504)
==========  ==========================  ==========================================================

Dequantisation is ``x_hat = q * scale + offset`` in float32, which is
:func:`~oscar_calib.numerics.quant.dequantize_int2`'s ``(q - z) * s`` rewritten with ``offset = -z*s``.

Why fp16 scale and fp16 *offset* (not fp16 zero): the zero point ``z = -min/s`` overflows fp16
when a group's range is small compared with its mean (``z`` reaches 1e5 for a nearly constant
group, and ``s`` can be floored at 1e-8, which is 0 in fp16: ``(q - inf) * 0`` is NaN).
The offset stays within the value range, a constant group reconstructs exactly, and fp16
keeps 11 significant bits (bf16 only 8). Values must lie within fp16's range (|x| < 65504),
which K/V activations do; larger values saturate. Cost: 2 bits per element plus two 16-bit
numbers per group, ``2 + 32/G`` bits per element: 2.25 at G=128, 2.5 at G=64, 3.0 at G=32.

Packing order
-------------
Let ``W = min(G, d/4)`` and split the row into ``NB = d / (4W)`` blocks of ``4W`` channels.
Inside block ``b``, byte ``b*W + j`` (``0 <= j < W``) holds channel ``b*4W + p*W + j`` in bits
``[2p, 2p+2)`` for ``p = 0..3`` (bit pair 0 = least significant). In other words, view the row
as ``[NB, 4, W]`` (row-major) and ``byte[b, j] = sum_p code[b, p, j] << 2p``.

==========  =====  ===  ======================================================================
d, G        W      NB   byte ``j`` holds channels (bits 1:0, 3:2, 5:4, 7:6)
==========  =====  ===  ======================================================================
128, 128    32     1    ``j, j+32, j+64, j+96``
128, 32     32     1    ``j, j+32, j+64, j+96`` (each bit plane is one group)
256, 32     32     2    ``b*128 + (j', j'+32, j'+64, j'+96)`` with ``j = b*32 + j'``
64, 64      16     1    ``j, j+16, j+32, j+48``
==========  =====  ===  ======================================================================

Why: every bit plane of a block is a run of ``W`` consecutive channels inside one
quantisation group, so the decode kernel turns a 32-bit word of codes into fp16 tensor-core
operands with one ``and`` per register (``word & (0x00030003 << 2p)`` holds the plane-``p``
codes of bytes 0 and 2 as fp16 subnormals; bytes 1 and 3 after one shift by 8), runs the dots
over a group's channels, and applies that group's scale to the partial sums afterwards: no
per-element dequantisation and no interleaving shuffle (:mod:`._decode_triton`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from ._common import check_group

CODE_BITS = 2
PARAM_DTYPE = torch.float16
PARAM_BITS = 16


def plane_width(head_dim: int, group_size: int) -> int:
    """``W = min(G, d/4)``: channels per bit plane of a block (see the module docstring)."""
    return min(group_size, head_dim // 4)


def pack_codes(codes: torch.Tensor, group_size: int) -> torch.Tensor:
    """Pack codes ``uint8 [..., d]`` (values 0..3) into ``uint8 [..., d/4]`` (module docstring order)."""
    d = codes.shape[-1]
    check_group(d, group_size)
    w = plane_width(d, group_size)
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], d // (4 * w), 4, w)
    shifts = (2 * torch.arange(4, device=codes.device, dtype=torch.int32)).view(4, 1)
    packed = (c << shifts).sum(-2)
    return packed.reshape(*codes.shape[:-1], d // 4).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``uint8 [..., d/4]`` -> codes ``uint8 [..., d]``."""
    d = packed.shape[-1] * 4
    check_group(d, group_size)
    w = plane_width(d, group_size)
    p = packed.to(torch.int32).reshape(*packed.shape[:-1], d // (4 * w), 1, w)
    shifts = (2 * torch.arange(4, device=packed.device, dtype=torch.int32)).view(4, 1)
    codes = (p >> shifts) & 3
    return codes.reshape(*packed.shape[:-1], d).to(torch.uint8)


def to_param(x: torch.Tensor) -> torch.Tensor:
    """float32 -> stored 16-bit parameter, saturating at fp16's finite range."""
    return x.clamp(-65504.0, 65504.0).to(PARAM_DTYPE)


def bits_per_element(group_size: int) -> float:
    """Stored bits per K/V element: 2-bit code + fp16 scale + fp16 offset per group."""
    return CODE_BITS + 2 * PARAM_BITS / group_size


@dataclass
class QuantizedKV:
    """Packed INT2 rows: the output of :func:`oscar_calib.kernels.quantize_kv`.

    ``codes`` uint8 ``[..., d/4]``, ``scale`` and ``offset`` float16 ``[..., d/G]``, with the
    same leading shape (e.g. ``[tokens, kv_heads]``). Values are in the rotated basis.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group_size: int

    def __post_init__(self) -> None:
        d = self.codes.shape[-1] * 4
        check_group(d, self.group_size)
        lead = tuple(self.codes.shape[:-1])
        ng = d // self.group_size
        for name in ("scale", "offset"):
            t = getattr(self, name)
            if tuple(t.shape) != lead + (ng,):
                raise InputError(f"QuantizedKV.{name} has shape {tuple(t.shape)}, expected {lead + (ng,)}")
            if t.dtype != PARAM_DTYPE:
                raise InputError(f"QuantizedKV.{name} must be float16, got {t.dtype}")
        if self.codes.dtype != torch.uint8:
            raise InputError(f"QuantizedKV.codes must be uint8, got {self.codes.dtype}")

    @property
    def head_dim(self) -> int:
        return self.codes.shape[-1] * 4

    @property
    def bits_per_element(self) -> float:
        return bits_per_element(self.group_size)

    def unpacked_codes(self) -> torch.Tensor:
        """Codes ``uint8 [..., d]`` in channel order."""
        return unpack_codes(self.codes, self.group_size)

    def dequantize(self) -> torch.Tensor:
        """``q * scale + offset`` in float32, ``[..., d]`` (rotated basis)."""
        return dequantize_packed(self.codes, self.scale, self.offset, self.group_size)

    def __getitem__(self, idx) -> "QuantizedKV":
        """Index the leading (token) axes, e.g. ``qkv[10:20]``."""
        return QuantizedKV(self.codes[idx], self.scale[idx], self.offset[idx], self.group_size)


def dequantize_packed(
    codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``q * scale + offset`` in float32 from packed storage: ``[..., d/4]`` -> ``[..., d]``."""
    q = unpack_codes(codes, group_size).float()
    d = q.shape[-1]
    g = q.reshape(*q.shape[:-1], d // group_size, group_size)
    x = g * scale.float().unsqueeze(-1) + offset.float().unsqueeze(-1)
    return x.reshape(q.shape)
