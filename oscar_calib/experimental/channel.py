"""Keys quantised per channel in blocks of tokens as they leave the window (the key axis of KIVI and
OScaR): a lever measured in the perplexity simulation only (no kernel or artifact stores it).

oscar quantises every K and V row per token, in groups of ``G`` channels. KIVI (Liu et al., 2024) and
OScaR (arXiv 2605.19660) quantise keys along the other axis: for each channel, one scale and offset
per block of ``B`` consecutive tokens, because a key's outlier channels stay outliers from token to
token, so a channel's range over a block is narrow where a token's range over its channels is not.
Values stay per token.

:class:`ChannelScheme` stores keys that way, on the scheme's rotation (``rotate=False``: the
identity, as KIVI; OScaR uses a Hadamard rotation) with or without oscar's per-row clip first
(``clip``):

=================  ==========================================================================
storage            definition
=================  ==========================================================================
key blocks         tokens ``[sink + b·B, sink + (b+1)·B)`` (``B`` a power of two); per block, KV
                   head and channel:
                   :func:`~oscar_calib.numerics.quant.quantize_int2` over the ``B`` tokens,
                   scale and offset rounded to fp16 as the kernels store parameters
when a block       when its last token leaves the recent window: until then every token of the
is INT2            block is read from the 16-bit window (:meth:`ChannelScheme.reads_window`), so the
                   window holds up to ``B − 1`` tokens more than ``recent`` (``(B − 1)/2`` on
                   average)
values             oscar's (per token, groups of ``G_V``, :func:`~oscar_calib.kernels.quantize_kv`)
bits               keys ``2 + 32/B``, values ``2 + 32/G_V`` per history element
=================  ==========================================================================

``ChannelScheme.of(scheme, block=64)`` keeps ``scheme``'s value storage, windows and key rotation;
the logit-noise correction (oscar's per-token key groups) does not apply. Importing this module
registers the ``channel`` quantiser with :func:`~oscar_calib.runtime.simulate.register_quantizer`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import InputError
from ..kernels.pack import bits_per_element, to_param
from ..numerics.quant import clip_rows, quantize_int2
from ..runtime.scheme import KVScheme
from ..runtime.simulate import kernel_store, oscar_rows, register_quantizer

QUANTIZER = "channel"


@dataclass
class ChannelScheme(KVScheme):
    """A :class:`~oscar_calib.runtime.scheme.KVScheme` whose INT2 keys are quantised per channel
    over blocks of ``k_block`` tokens (module docstring); ``k_row_clip``: clip each key row with the
    scheme's ``k_clip`` first. Only :class:`~oscar_calib.runtime.simulate.SimulatedKV` reads it."""

    quantizer: str = QUANTIZER
    k_block: int = 64
    k_row_clip: bool = False

    quantizers: ClassVar[tuple[str, ...]] = (QUANTIZER,)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.k_block, int) or self.k_block < 1 or self.k_block & (self.k_block - 1):
            raise InputError(f"{self.name}: k_block must be a power of two of tokens, got {self.k_block!r}")

    def layer_bits(self, i: int) -> float:
        """Keys ``2 + 32/B``, values oscar's ``2 + 32/G_V``, averaged."""
        return (bits_per_element(self.k_block) + bits_per_element(self.groups(i)[1])) / 2

    def reads_window(self, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
        """The sink, and every token of a block whose last token is still in the query's recent
        window (the block is quantised when that token leaves it)."""
        last = self.sink + torch.div(kpos - self.sink, self.k_block, rounding_mode="floor") * self.k_block \
            + self.k_block - 1
        return (kpos < self.sink) | (qpos - last < self.recent)

    @classmethod
    def of(cls, scheme: KVScheme, *, block: int = 64, rotate: bool = True, clip: bool = False,
           name: str | None = None) -> "ChannelScheme":
        """``scheme``'s windows, value storage and (``rotate``) key rotation, keys per channel in blocks
        of ``block`` tokens (``clip``: after the per-row clip)."""
        fields = {f.name: getattr(scheme, f.name) for f in dataclasses.fields(KVScheme)}
        n = scheme.num_layers
        fields.update(name=name or f"{scheme.name}+channel{block}", quantizer=QUANTIZER, logit_correction=0.0)
        if not rotate:
            fields["k_rotation"] = [None] * n
        return cls(**fields, k_block=block, k_row_clip=clip)


def channel_blocks(y: torch.Tensor, sink: int, block: int) -> torch.Tensor:
    """Rows ``y [B, S, H, d]`` (rotated, clipped) with every whole block of ``block`` tokens from
    ``sink`` on quantised per channel over its tokens and dequantised (float32; fp16 parameters).
    The sink's rows and a last block shorter than ``block`` stay as they are: neither is ever read
    from the history (a short block has not left the window)."""
    b, s, h, d = y.shape
    out = y.float().clone()
    full = max(0, s - sink) // block * block
    if full:
        x = out[:, sink:sink + full].reshape(b, full // block, block, h, d).permute(0, 1, 3, 4, 2)   # tokens last
        codes, scale, zero = quantize_int2(x, block)
        deq = codes.float() * to_param(scale).float() + to_param(-(zero * scale)).float()       # params [.., d, 1]
        out[:, sink:sink + full] = deq.permute(0, 1, 4, 2, 3).reshape(b, full, h, d)
    return out


def channel_rows(sch: ChannelScheme, layer: int, q, k, v):
    """:func:`~oscar_calib.runtime.simulate.oscar_rows` with the keys' history stored per channel in
    blocks (:func:`channel_blocks`), values as oscar stores them."""

    def store(x, rotation, clip, group_size, cache, center=None):   # x [B, S, H, d] -> rotated, dequantised
        if cache == "v":
            return kernel_store(x, rotation, clip, group_size, cache)
        y = x.float()
        if rotation is not None:
            y = torch.einsum("bshd,hde->bshe", y, rotation)
        if center is not None:                                  # key centering: (x − μ) @ R
            y = y - center
        if clip is not None and sch.k_row_clip:
            y = clip_rows(y, clip.to(torch.float64))
        return channel_blocks(y, sch.sink, sch.k_block)

    return oscar_rows(sch, layer, q, k, v, store=store)


register_quantizer(QUANTIZER, channel_rows)
