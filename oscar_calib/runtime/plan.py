"""``LayerPlan``: the constants of one layer of the real cache, on the model's device.

K and V are handled as one block of ``2H`` heads (K heads first): one rotation tensor
``rot2 [2H, d, d]`` and one clip tensor ``clip2 [2H]``, so a write is one kernel launch for
both. A missing rotation is the identity and a missing clip the ratio 1 (no clip), which give
exactly the codes of "no rotation" / "no clip" (``x @ I`` and a clamp at the row maximum are
exact). Keys and values may be stored in groups of different sizes (``group_size`` and
``v_group_size``); the write then quantises the K and V heads in two launches. With key centering
``center2 [2H, d]`` holds the keys' shift ``μ @ R_k`` and zeros for the values: every row is
stored as ``x @ R − center2`` (the write kernels' one extra operand), in the window and the history.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract.defaults import group_pair
from ..errors import InputError
from ..kernels import QuantizedKV, quantize_kv
from ..kernels.append import rotate_kv
from .scheme import SchemeLayer


@dataclass
class LayerPlan:
    """Rotations, clips and window rule of one layer (tensors on the model's device)."""

    k_rotation: torch.Tensor | None      # [H, d, d] float32: keys are stored as k @ R_k, queries rotated alike
    v_rotation: torch.Tensor | None      # [H, d, d] float32, None when V is folded into v_proj (or naive INT2)
    rot2: torch.Tensor | None            # [2H, d, d]: K then V rotations (identity where absent)
    clip2: torch.Tensor | None           # [2H]: K then V clip ratios (1 where absent)
    group_size: int                      # the keys' INT2 group size
    sink: int
    recent: int
    sliding_window: int | None
    window_dtype: torch.dtype
    backend: str = "auto"                # kernel backend of the write and decode kernels
    v_group_size: int | None = None      # the values' group size (None: group_size)
    logit_correction: float = 0.0        # gain of the logit-noise correction of the INT2 keys (0: off)
    chunk: int | None = None             # chunked attention: a query reads its own chunk (sliding_window = chunk)
    k_shift: torch.Tensor | None = None  # [H, d] float32: the keys' centering shift μ @ R_k (None: none)
    center2: torch.Tensor | None = None  # [2H, d]: k_shift, then zeros for the values

    def __post_init__(self) -> None:
        self.group_size, self.v_group_size = group_pair(self.group_size, self.v_group_size)

    @property
    def groups(self) -> tuple[int, int]:
        """``(G_K, G_V)``."""
        return self.group_size, self.v_group_size

    @property
    def split(self) -> bool:
        return self.group_size != self.v_group_size

    @classmethod
    def build(cls, layer: SchemeLayer, *, heads: int, d: int, device, dtype: torch.dtype,
              sliding_window: int | None = None, chunk: int | None = None, backend: str = "auto") -> "LayerPlan":
        """From one quantised layer of a scheme (:meth:`~.scheme.KVScheme.layer`) for ``heads`` KV
        heads of ``d`` on ``device``; ``dtype``: the model's, the window's where the scheme keeps the
        model's dtype."""
        if layer.groups is None:
            raise InputError("a LayerPlan stores an INT2 history: the scheme's layer quantises nothing")
        rk, ck, rv, cv = layer.on(device)
        shift = layer.k_shift(device)                              # key centering: μ @ R_k (None: off)
        center2 = None if shift is None else torch.cat([shift, torch.zeros_like(shift)]).contiguous()
        rot2 = clip2 = None
        if rk is not None or rv is not None:
            eye = torch.eye(d, device=device).expand(heads, d, d)
            rot2 = torch.cat([eye if rk is None else rk, eye if rv is None else rv]).contiguous()
        if ck is not None or cv is not None:
            one = torch.ones(heads, device=device)
            clip2 = torch.cat([one if ck is None else ck.reshape(heads), one if cv is None else cv.reshape(heads)])
        return cls(rk, rv, rot2, clip2, layer.groups[0], layer.sink, layer.recent, sliding_window,
                   layer.window_dtype or dtype, backend, layer.groups[1], layer.logit_correction, chunk, shift,
                   center2)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., 2, H, d]`` (K, V) -> float32 ``x @ R − center2`` per head (the rows as the window
        holds them, before its rounding)."""
        y = rotate_kv(x, self.rot2)
        return y if self.center2 is None else y - self.center2.view(2, -1, self.center2.shape[-1])

    def rotate_keys(self, k: torch.Tensor) -> torch.Tensor:
        """Keys ``k [B, H, T, d]`` as the cache stores them, float32 ``k @ R_k − k_shift`` per head."""
        y = k.float() if self.k_rotation is None else torch.einsum("bhtd,hde->bhte", k.float(), self.k_rotation)
        return y if self.k_shift is None else y - self.k_shift[:, None]

    def quantize(self, x: torch.Tensor) -> list[QuantizedKV]:
        """``x [N, 2H, d]`` -> packed INT2 of ``clip(x @ R − center2)`` (the write kernel): one result
        for the ``2H`` heads, or with K and V group sizes apart one for the K heads and one for the V
        heads."""
        if not self.split:
            return [quantize_kv(x, self.rot2, self.clip2, self.group_size, center=self.center2, backend=self.backend)]
        h = x.shape[1] // 2
        return [quantize_kv(x[:, part], None if self.rot2 is None else self.rot2[part],
                            None if self.clip2 is None else self.clip2[part], g,
                            center=None if self.center2 is None else self.center2[part], backend=self.backend)
                for part, g in ((slice(0, h), self.group_size), (slice(h, 2 * h), self.v_group_size))]
