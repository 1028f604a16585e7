"""``SimulatedCache``: an **accuracy simulation** of the OSCAR cache as a transformers ``Cache``
(not the real thing: :class:`~oscar_calib.runtime.cache.OscarCache` is the real cache).

It stores what the real cache stores (BF16 sink and recent window, the history between them as
packed INT2 of ``clip(x @ R)``), but every ``update`` de-quantises the whole history, rotates it
back and hands full-precision K/V to the model's own attention: memory and time grow like a
BF16 cache, so it measures accuracy only. It is the reference the real cache is tested against.

Layout of one layer (positions in order; ``n`` = tokens seen):

==========  ===========================  ===================================================
segment     positions                     storage
==========  ===========================  ===================================================
sink        ``[0, sink)``                 BF16 (``window_dtype``), un-rotated
history     ``[sink, n - recent)``        INT2 codes of ``clip(x @ R)``, fp16 scale and offset
recent      ``[n - recent, n)``           BF16, un-rotated; a token that leaves it is quantised
==========  ===========================  ===================================================

``update`` returns everything cached *before* the call in its stored form (history as
``Q(clip(xR))·Rᵀ``, with key centering ``Q(clip(xR − μR))·Rᵀ + μ``; a token this call pushed out
of the window already INT2; sink and window as the real cache's rotated window holds them,
``bf16(bf16(x)R)·Rᵀ``, centered keys ``bf16(bf16(x)R − μR)·Rᵀ + μ``), then the call's new tokens
exactly as the model computed them; a decode step (one new token) reads its own token from the
window too, as the real cache does. A decode step therefore reads what a kernel reads with the
query rotated online; a multi-token call (the prefill) attends in full precision.
Sliding-window layers keep their last ``window - 1`` tokens like ``DynamicSlidingWindowLayer``, and
so do chunked-attention layers with the chunk as the window (as transformers' ``DynamicCache`` keeps
them; the model's chunked mask picks the query's chunk).
With identity rotations, ``quantize`` off and ``window_dtype=None`` it equals ``DynamicCache``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..contract.artifact import checked_artifact
from ..errors import CacheError, InputError
from ..model.geometry import model_identity
from .compat import cache_layers, check_transformers
from .scheme import KVScheme, SchemeLayer


def _cat(a: torch.Tensor | None, b: torch.Tensor, dim: int) -> torch.Tensor:
    return b if a is None or a.shape[dim] == 0 else torch.cat([a, b], dim)


def _n(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.shape[-2]


class _Int2Rows:
    """Packed INT2 history of one layer, ``[B, T, H, ·]`` per K and V (the kernels' row format)."""

    def __init__(self):
        self.k = self.v = None                 # QuantizedKV with leading [B, T]

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.codes.shape[1]

    @staticmethod
    def _join(a, b, fn):
        from ..kernels.pack import QuantizedKV

        return QuantizedKV(*(fn(getattr(a, f), None if b is None else getattr(b, f))
                             for f in ("codes", "scale", "offset")), a.group_size)

    def append(self, kq, vq) -> None:
        if self.k is None:
            self.k, self.v = kq, vq
            return
        self.k = self._join(self.k, kq, lambda x, y: torch.cat([x, y], 1))
        self.v = self._join(self.v, vq, lambda x, y: torch.cat([x, y], 1))

    def drop_front(self, n: int) -> None:
        if n and self.k is not None:
            self.k, self.v = self.k[:, n:], self.v[:, n:]

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.k is None else [getattr(q, f) for q in (self.k, self.v) for f in ("codes", "scale", "offset")]

    def map_batch(self, fn) -> None:
        if self.k is not None:
            self.k = self._join(self.k, None, lambda x, _: fn(x))
            self.v = self._join(self.v, None, lambda x, _: fn(x))


class _Segments:
    """Sink, history and recent segments of one simulated layer (see the module docstring)."""

    def __init__(self, layer: SchemeLayer, device):
        self.k_rotation, self.k_clip, self.v_rotation, self.v_clip = layer.on(device)
        self.groups, self.sink, self.recent = layer.groups, layer.sink, layer.recent
        self.k_mean, self.k_shift = layer.mean_on(device), layer.k_shift(device)   # key centering (None: off)
        self.sink_k = self.sink_v = self.recent_k = self.recent_v = None       # [B, H, n, d]
        self.hist = _Int2Rows() if self.groups is not None else None
        self.hist_k = self.hist_v = None        # history kept as it is when quantisation is off

    def n_hist(self) -> int:
        return len(self.hist) if self.hist is not None else _n(self.hist_k)

    def stored(self) -> int:
        return _n(self.sink_k) + self.n_hist() + _n(self.recent_k)

    def append(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Store rows ``k``/``v`` ``[B, H, n, d]`` (already in the storage dtype) whose first row is
        token ``start``; rows pushed out of the recent window go to the history."""
        to_sink = max(0, min(k.shape[-2], self.sink - start))
        self.sink_k, self.sink_v = _cat(self.sink_k, k[..., :to_sink, :], -2), _cat(self.sink_v, v[..., :to_sink, :], -2)
        self.recent_k = _cat(self.recent_k, k[..., to_sink:, :], -2)
        self.recent_v = _cat(self.recent_v, v[..., to_sink:, :], -2)
        over = _n(self.recent_k) - self.recent
        if over > 0:
            old_k, old_v = self.recent_k[..., :over, :], self.recent_v[..., :over, :]
            self.recent_k, self.recent_v = self.recent_k[..., over:, :], self.recent_v[..., over:, :]
            if self.hist is None:
                self.hist_k, self.hist_v = _cat(self.hist_k, old_k, -2), _cat(self.hist_v, old_v, -2)
            else:
                from ..kernels import quantize_kv

                gk, gv = self.groups
                self.hist.append(quantize_kv(old_k.transpose(1, 2), self.k_rotation, self.k_clip, gk,
                                             center=self.k_shift),
                                 quantize_kv(old_v.transpose(1, 2), self.v_rotation, self.v_clip, gv))

    def evict(self, n: int) -> None:
        """Drop the ``n`` oldest stored tokens (sink first, then history, then window)."""
        for seg in ("sink", "hist", "recent"):
            if n <= 0:
                return
            if seg == "hist":
                m = min(n, self.n_hist())
                if self.hist is not None:
                    self.hist.drop_front(m)
                elif m:
                    self.hist_k, self.hist_v = self.hist_k[..., m:, :], self.hist_v[..., m:, :]
            else:
                m = min(n, _n(getattr(self, f"{seg}_k")))
                for which in "kv":
                    setattr(self, f"{seg}_{which}", getattr(self, f"{seg}_{which}")[..., m:, :])
            n -= m

    def materialize(self, which: str, dtype, skip_last: int = 0) -> torch.Tensor:
        """Stored keys (``k``) or values (``v``) ``[B, H, n - skip_last, d]`` in ``dtype``: the history
        de-quantised and rotated back, the sink and the window as the real cache's window holds
        them (:func:`~oscar_calib.runtime.simulate.window_rows`: rounded again after the rotation)."""
        from .simulate import window_rows

        rot = getattr(self, f"{which}_rotation") if self.hist is not None else None
        mean = self.k_mean if which == "k" and self.hist is not None else None       # key centering

        def window(x):
            return x if not _n(x) else window_rows(x, rot, x.dtype, mean)

        parts = [window(getattr(self, f"sink_{which}"))]
        if self.hist is None:
            parts.append(getattr(self, f"hist_{which}"))
        elif len(self.hist):
            x = getattr(self.hist, which).dequantize()                          # [B, T, H, d] rotated
            x = torch.einsum("bthe,hde->bhtd", x, rot) if rot is not None else x.transpose(1, 2)
            parts.append(x if mean is None else x + mean[:, None])
        parts.append(window(getattr(self, f"recent_{which}")))
        out = torch.cat([p.to(dtype) for p in parts if _n(p)], dim=-2)
        return out[..., :out.shape[-2] - skip_last, :]

    def tensors(self) -> list[torch.Tensor]:
        ts = [self.sink_k, self.sink_v, self.recent_k, self.recent_v, self.hist_k, self.hist_v]
        return [t for t in ts if t is not None] + (self.hist.tensors() if self.hist is not None else [])

    def map_batch(self, fn) -> None:
        for name in ("sink_k", "sink_v", "recent_k", "recent_v", "hist_k", "hist_v"):
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))
        if self.hist is not None:
            self.hist.map_batch(fn)


class SimulatedLayer(CacheLayerMixin):
    """One decoder layer of :class:`SimulatedCache` (an accuracy simulation)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, scheme: SchemeLayer, *, sliding_window: int | None = None):
        super().__init__()
        self.scheme = scheme
        self.sliding_window = int(sliding_window) if sliding_window else None
        self.is_sliding = self.sliding_window is not None
        self.reset()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        s = self.scheme
        self.store_dtype = s.window_dtype or key_states.dtype
        self.seg = _Segments(s, self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self.seg.append(key_states.to(self.store_dtype), value_states.to(self.store_dtype), self.cumulative_length)
        self.cumulative_length += n
        if self.seg.stored() > n and n == 1 and self.seg.recent:     # a decode step reads its token from the window
            keys, values = self.seg.materialize("k", self.dtype), self.seg.materialize("v", self.dtype)
        elif self.seg.stored() > n:
            keys = torch.cat([self.seg.materialize("k", self.dtype, skip_last=n), key_states], dim=-2)
            values = torch.cat([self.seg.materialize("v", self.dtype, skip_last=n), value_states], dim=-2)
        else:
            keys, values = key_states, value_states
        if self.is_sliding:          # after attention: keep the last window - 1 tokens
            self.seg.evict(self.seg.stored() - (self.sliding_window - 1))
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if not self.is_sliding:
            return self.cumulative_length + query_length, 0
        w = self.sliding_window
        offset = max(self.cumulative_length - w + 1, 0)
        return min(self.cumulative_length, w - 1) + query_length, offset

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def reset(self) -> None:
        self.seg = None
        self.is_initialized = False
        self.cumulative_length = 0

    def offload(self):        # the segments stay where they are
        return None

    def prefetch(self):
        return None

    def crop(self, tokens_to_remove: int) -> None:
        raise CacheError("SimulatedCache cannot be cropped (quantised tokens cannot be restored)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.seg is not None:
            self.seg.map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.seg is not None:
            self.seg.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.seg is not None:
            self.seg.map_batch(lambda t: t[indices, ...])


class SimulatedCache(Cache):
    """Accuracy simulation of the OSCAR cache (see the module docstring): stores the INT2 layout,
    attends over a de-quantised copy. Pass it to ``model.generate`` as ``past_key_values``."""

    def __init__(self, config, scheme: KVScheme):
        check_transformers()
        scheme.require_oscar_quantizer("SimulatedCache")
        if scheme.logit_correction:
            raise InputError(f"{scheme.name}: SimulatedCache hands K/V to the model's own attention, which cannot "
                             "subtract the logit-noise correction; use OscarCache (or SimulatedKV for perplexity)")
        self.scheme = scheme
        layers = cache_layers(config, scheme, SimulatedLayer)
        super().__init__(layers=layers)

    @classmethod
    def from_artifact(cls, artifact, model, *, group_size: int | None = None, sink: int | None = None,
                      recent: int | None = None, window_dtype=torch.bfloat16,
                      logit_correction: float | None = None) -> "SimulatedCache":
        """The artifact's rotations and clips (the same checks as :meth:`OscarCache.from_artifact`).
        An artifact with a logit-noise correction is refused unless ``logit_correction=0`` asks for
        its cache without it (this simulation cannot subtract it)."""
        art = checked_artifact(artifact, lambda: model_identity(model))
        scheme = KVScheme.from_artifact(art, group_size=group_size, sink=sink, recent=recent, window_dtype=window_dtype,
                                        logit_correction=logit_correction)
        return cls(getattr(model, "config", model), scheme)

    def memory(self) -> dict:
        """Bytes the simulation stores (sink, window, packed history; rotations not counted)."""
        total = sum(sum(t.numel() * t.element_size() for t in layer.seg.tensors())
                    for layer in self.layers if getattr(layer, "seg", None) is not None)
        n = self.get_seq_length()
        return {"bytes": total, "tokens": n, "bytes_per_token": total / n if n else 0.0,
                "history_bits_per_element": self.scheme.bits_per_element}
