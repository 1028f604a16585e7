"""``LayerPlan``: the constants of one layer of the real cache, on the model's device.

K and V are handled as one block of ``2H`` heads (K heads first): one rotation tensor
``rot2 [2H, d, d]`` and one clip tensor ``clip2 [2H]``, so a write is one kernel launch for
both. A missing rotation is the identity and a missing clip the ratio 1 (no clip), which give
exactly the codes of "no rotation" / "no clip" (``x @ I`` and a clamp at the row maximum are
exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import QuantizedKV, quantize_kv
from ..kernels.append import rotate_kv


@dataclass
class LayerPlan:
    """Rotations, clips and window rule of one layer (tensors on the model's device)."""

    k_rotation: torch.Tensor | None      # [H, d, d] float32: keys are stored as k @ R_k, queries rotated alike
    v_rotation: torch.Tensor | None      # [H, d, d] float32, None when V is folded into v_proj (or naive INT2)
    rot2: torch.Tensor | None            # [2H, d, d]: K then V rotations (identity where absent)
    clip2: torch.Tensor | None           # [2H]: K then V clip ratios (1 where absent)
    group_size: int
    sink: int
    recent: int
    sliding_window: int | None
    window_dtype: torch.dtype
    backend: str = "auto"                # kernel backend of the write and decode kernels

    @classmethod
    def build(cls, layer: tuple, *, heads: int, d: int, group_size: int, sink: int, recent: int,
              sliding_window: int | None, window_dtype: torch.dtype, device, backend: str = "auto") -> "LayerPlan":
        """From a :meth:`KVScheme.layer` tuple ``(k_rotation, k_clip, v_rotation, v_clip)``."""
        rk, ck, rv, cv = (None if t is None else t.to(device, torch.float32).contiguous() for t in layer)
        rot2 = clip2 = None
        if rk is not None or rv is not None:
            eye = torch.eye(d, device=device).expand(heads, d, d)
            rot2 = torch.cat([eye if rk is None else rk, eye if rv is None else rv]).contiguous()
        if ck is not None or cv is not None:
            one = torch.ones(heads, device=device)
            clip2 = torch.cat([one if ck is None else ck.reshape(heads), one if cv is None else cv.reshape(heads)])
        return cls(rk, rv, rot2, clip2, group_size, sink, recent, sliding_window, window_dtype, backend)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., 2, H, d]`` (K, V) -> float32 ``x @ R`` per head."""
        return rotate_kv(x, self.rot2)

    def quantize(self, x: torch.Tensor) -> QuantizedKV:
        """``x [N, 2H, d]`` -> packed INT2 of ``clip(x @ R)`` (the write kernel)."""
        return quantize_kv(x, self.rot2, self.clip2, self.group_size, backend=self.backend)
