"""INT2 KV-cache kernels: the write path (rotate, clip, quantise, pack) and decode attention.

Public API (every function takes ``backend="auto" | "triton" | "torch"``; the environment
variable ``OSCAR_KERNELS=torch`` forces the pure-torch references; where triton is not installed,
it has wheels for Linux only, ``"auto"`` always runs them, see :mod:`._common`):

=================================  ===========================================================
function                           what it does
=================================  ===========================================================
:func:`quantize_kv`                K/V rows ``[..., H, d]`` -> :class:`QuantizedKV` (packed
                                   codes ``uint8 [..., H, d/4]``, fp16 scale/offset
                                   ``[..., H, d/G]``), with rotation and clip
:func:`append_token`               one decode step's write: each sequence's new K/V row into
                                   its window slot and INT2 history slot, slots from the
                                   device counts (one launch)
:func:`build_cache`                full K/V ``[B, T, H, d]`` + lengths -> :class:`Int2KVCache`
                                   (16-bit sink/recent window, INT2 history; contiguous or
                                   paged)
:func:`decode_attention`           one query per sequence ``[B, Hq, d]`` over a cache ->
                                   ``o_rot`` (V-rotated basis) or ``o`` (``unrotate=True``)
:func:`quantize_kv_reference`,     the pure-torch references the kernels are tested against
:func:`decode_attention_reference`
=================================  ===========================================================

Importing this package loads neither triton nor CUDA; the Triton kernels are compiled on first
use. Storage format and packing order: :mod:`oscar_calib.kernels.pack`; cache layouts:
:mod:`oscar_calib.kernels.cache`.
"""

from ..contract.defaults import DEFAULT_RECENT, DEFAULT_SINK
from ._common import (
    BACKENDS,
    ENV_VAR,
    interpreter_problem,
    interpreting,
    triton_available,
)
from .append import append_token, append_token_reference
from .cache import Int2KVCache, build_cache, split_lengths, to_paged
from .decode import decode_attention, decode_attention_reference
from .pack import (
    QuantizedKV,
    bits_per_element,
    dequantize_packed,
    pack_codes,
    unpack_codes,
)
from .write import quantize_kv, quantize_kv_reference

__all__ = [
    "BACKENDS",
    "DEFAULT_RECENT",
    "DEFAULT_SINK",
    "ENV_VAR",
    "Int2KVCache",
    "QuantizedKV",
    "append_token",
    "append_token_reference",
    "bits_per_element",
    "build_cache",
    "decode_attention",
    "decode_attention_reference",
    "dequantize_packed",
    "interpreter_problem",
    "interpreting",
    "pack_codes",
    "quantize_kv",
    "quantize_kv_reference",
    "split_lengths",
    "to_paged",
    "triton_available",
    "unpack_codes",
]
