"""``OscarCache``: a transformers KV cache that keeps an attention sink and a recent window in
BF16 and the history between them as INT2 rotated with an artifact's rotations and clips.

>>> from oscar_calib.runtime.cache import OscarCache
>>> cache = OscarCache.from_artifact("zoo/smollm2-135m", model)
>>> out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
>>> cache.memory()["bytes_per_token"]

Supported transformers: ``>=5.0,<6`` (the layered ``Cache``/``CacheLayerMixin`` API; tested
with 5.23). :data:`SUPPORTED_TRANSFORMERS` holds the range and :func:`check_transformers`
refuses others with a typed error.

Layout of one layer (positions in order; ``n = tokens seen``):

==========  ===========================  ===================================================
segment     positions                     storage
==========  ===========================  ===================================================
sink        ``[0, sink)``                 BF16 (``window_dtype``), un-rotated
history     ``[sink, n - recent)``        INT2 codes of ``clip(x @ R)``, packed 4 per byte, fp16
                                          scale and offset per group of ``G`` channels
                                          (:mod:`oscar_calib.kernels.pack`: ``2 + 32/G`` bits)
recent      ``[n - recent, n)``           BF16, un-rotated; a token that leaves it is quantised
==========  ===========================  ===================================================

What attention reads. ``update`` returns everything cached *before* the call in its stored form
(sink and window as stored, history de-quantised and rotated back, ``x̂ = Q(clip(xR))·Rᵀ``), then
the call's new tokens exactly as the model computed them. A decode step (one new token) thus
sees the serving-time cache exactly: its query times ``x̂`` equals ``(qR)·Q(clip(kR))ᵀ``, which is
what a kernel computes with the query rotated online. A multi-token call (the prefill) attends
in full precision, as serving engines prefill, and stores what it wrote in the layout above.
Values are rotated back the same way; at serving time that inverse is folded into ``o_proj``.

Sliding-window layers (Gemma 2/3, Mistral) keep only their last ``window - 1`` tokens, like
transformers' ``DynamicSlidingWindowLayer`` (same mask sizes); inside them the same sink/recent
rule applies by absolute position.

With identity rotations, ``quantize=False`` and ``window_dtype=None`` nothing is lossy and
generation equals :class:`transformers.DynamicCache` exactly (tested).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ArtifactError, UnsupportedModelError
from ..spec.defaults import BASELINE_CLIPS, DEFAULT_RECENT, DEFAULT_SINK
from .scheme import KVScheme

SUPPORTED_TRANSFORMERS = (">=5.0", "<6")


def check_transformers(version: str | None = None) -> None:
    """Refuse transformers versions outside :data:`SUPPORTED_TRANSFORMERS`."""
    if version is None:
        import transformers

        version = transformers.__version__
    parts = []
    for p in version.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    major = parts[0]
    if not 5 <= major < 6:
        raise UnsupportedModelError(
            f"OscarCache supports transformers {','.join(SUPPORTED_TRANSFORMERS)} (the layered Cache API); "
            f"found {version}")


# ----------------------------------------------------------------------------- the scheme


# ----------------------------------------------------------------------------- one layer

def _cat(a: torch.Tensor | None, b: torch.Tensor, dim: int) -> torch.Tensor:
    return b if a is None or a.shape[dim] == 0 else torch.cat([a, b], dim)


class _Int2Rows:
    """Packed INT2 history of one layer: codes ``[B, T, H, d/4]`` uint8, scale/offset
    ``[B, T, H, d/G]`` fp16 (the kernels' storage format), for K and for V."""

    def __init__(self):
        self.k = None      # QuantizedKV with leading [B, T]
        self.v = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.codes.shape[1]

    def append(self, kq, vq) -> None:
        from ..kernels.pack import QuantizedKV

        if self.k is None:
            self.k, self.v = kq, vq
            return
        self.k = QuantizedKV(*(torch.cat([getattr(self.k, n), getattr(kq, n)], 1) for n in ("codes", "scale", "offset")),
                             self.k.group_size)
        self.v = QuantizedKV(*(torch.cat([getattr(self.v, n), getattr(vq, n)], 1) for n in ("codes", "scale", "offset")),
                             self.v.group_size)

    def drop_front(self, n: int) -> None:
        if n and self.k is not None:
            self.k, self.v = self.k[:, n:], self.v[:, n:]

    def tensors(self) -> list[torch.Tensor]:
        if self.k is None:
            return []
        return [self.k.codes, self.k.scale, self.k.offset, self.v.codes, self.v.scale, self.v.offset]

    def map_batch(self, fn) -> None:
        from ..kernels.pack import QuantizedKV

        if self.k is not None:
            self.k = QuantizedKV(fn(self.k.codes), fn(self.k.scale), fn(self.k.offset), self.k.group_size)
            self.v = QuantizedKV(fn(self.v.codes), fn(self.v.scale), fn(self.v.offset), self.v.group_size)


try:  # the layer base class; a clear error if transformers lacks the layered cache API
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as _e:  # pragma: no cover - depends on the install
    raise UnsupportedModelError(f"OscarCache needs transformers {','.join(SUPPORTED_TRANSFORMERS)}: {_e}") from None


class OscarLayer(CacheLayerMixin):
    """One decoder layer of :class:`OscarCache` (see the module docstring for the layout)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, *, k_rotation=None, k_clip=None, v_rotation=None, v_clip=None, group_size: int | None = None,
                 sink: int = DEFAULT_SINK, recent: int = DEFAULT_RECENT, window_dtype=torch.bfloat16,
                 sliding_window: int | None = None):
        super().__init__()
        self.k_rotation, self.k_clip, self.v_rotation, self.v_clip = k_rotation, k_clip, v_rotation, v_clip
        self.group_size = group_size
        self.sink, self.recent = int(sink), int(recent)
        self.window_dtype = window_dtype
        self.sliding_window = int(sliding_window) if sliding_window else None
        self.is_sliding = self.sliding_window is not None
        self.cumulative_length = 0
        self._clear()

    def _clear(self) -> None:
        self.sink_k = self.sink_v = None        # [B, H, n, d]
        self.recent_k = self.recent_v = None    # [B, H, n, d]
        self.hist = _Int2Rows() if self.group_size is not None else None
        self.hist_k = self.hist_v = None        # unquantised history (quantize off): [B, H, n, d]
        self.dropped = 0                        # tokens evicted from the front (sliding window)

    # -- transformers' layer API -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.store_dtype = self.window_dtype or key_states.dtype
        for name in ("k_rotation", "v_rotation", "k_clip", "v_clip"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(self.device, torch.float32))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens, then return every cached token as stored (a token that this call
        pushed out of the window already as INT2) followed by the new tokens as computed."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self._append(key_states, value_states)
        if self.stored_tokens() > n:
            keys = torch.cat([self._materialize("k", skip_last=n), key_states], dim=-2)
            values = torch.cat([self._materialize("v", skip_last=n), value_states], dim=-2)
        else:
            keys, values = key_states, value_states
        if self.is_sliding:          # after attention: keep the last window - 1 tokens
            self._evict(self.stored_tokens() - (self.sliding_window - 1))
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if not self.is_sliding:
            return self.cumulative_length + query_length, 0
        w = self.sliding_window
        offset = max(self.cumulative_length - w + 1, 0)
        if self.cumulative_length >= w:
            return w - 1 + query_length, offset
        return self.cumulative_length + query_length, offset

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def reset(self) -> None:
        self._clear()
        self.cumulative_length = 0

    def offload(self):        # the segments stay where they are (no offloading support)
        return None

    def prefetch(self):
        return None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("OscarCache cannot be cropped (quantised tokens cannot be restored)")

    def _map_batch(self, fn) -> None:
        for name in ("sink_k", "sink_v", "recent_k", "recent_v", "hist_k", "hist_v"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))
        if self.hist is not None:
            self.hist.map_batch(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices, ...])

    # -- storage -----------------------------------------------------------------------------
    def _n(self, t) -> int:
        return 0 if t is None else t.shape[-2]

    def n_hist(self) -> int:
        return len(self.hist) if self.hist is not None else self._n(self.hist_k)

    def stored_tokens(self) -> int:
        return self._n(self.sink_k) + self.n_hist() + self._n(self.recent_k)

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[-2]
        start = self.cumulative_length
        to_sink = max(0, min(n, self.sink - start))
        ks, vs = k.to(self.store_dtype), v.to(self.store_dtype)
        if to_sink:
            self.sink_k = _cat(self.sink_k, ks[..., :to_sink, :], -2)
            self.sink_v = _cat(self.sink_v, vs[..., :to_sink, :], -2)
        if to_sink < n:
            self.recent_k = _cat(self.recent_k, ks[..., to_sink:, :], -2)
            self.recent_v = _cat(self.recent_v, vs[..., to_sink:, :], -2)
        self.cumulative_length += n
        over = self._n(self.recent_k) - self.recent
        if over > 0:
            old_k, old_v = self.recent_k[..., :over, :], self.recent_v[..., :over, :]
            self.recent_k, self.recent_v = self.recent_k[..., over:, :], self.recent_v[..., over:, :]
            self._to_history(old_k, old_v)

    def _to_history(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.hist is None:          # quantisation off: keep the rows as they are
            self.hist_k, self.hist_v = _cat(self.hist_k, k, -2), _cat(self.hist_v, v, -2)
            return
        from ..kernels import quantize_kv

        kq = quantize_kv(k.transpose(1, 2), self.k_rotation, self.k_clip, self.group_size)
        vq = quantize_kv(v.transpose(1, 2), self.v_rotation, self.v_clip, self.group_size)
        self.hist.append(kq, vq)

    def _evict(self, n: int) -> None:
        """Drop the ``n`` oldest stored tokens (sink first, then history, then window)."""
        if n <= 0:
            return
        self.dropped += n
        for seg in ("sink", "hist", "recent"):
            if n <= 0:
                break
            if seg == "hist":
                m = min(n, self.n_hist())
                if self.hist is not None:
                    self.hist.drop_front(m)
                elif m:
                    self.hist_k, self.hist_v = self.hist_k[..., m:, :], self.hist_v[..., m:, :]
            else:
                a, b = getattr(self, f"{seg}_k"), getattr(self, f"{seg}_v")
                m = min(n, self._n(a))
                if m:
                    setattr(self, f"{seg}_k", a[..., m:, :])
                    setattr(self, f"{seg}_v", b[..., m:, :])
            n -= m

    def _materialize(self, which: str, skip_last: int = 0) -> torch.Tensor:
        """Stored keys (``k``) or values (``v``) ``[B, H, n - skip_last, d]`` in the model's dtype
        (the last ``skip_last`` stored tokens left out)."""
        parts = []
        sink, recent = getattr(self, f"sink_{which}"), getattr(self, f"recent_{which}")
        if self._n(sink):
            parts.append(sink.to(self.dtype))
        if self.n_hist():
            if self.hist is None:
                parts.append(getattr(self, f"hist_{which}").to(self.dtype))
            else:
                q = getattr(self.hist, which)
                x = q.dequantize()                                           # [B, T, H, d] rotated
                rot = getattr(self, f"{which}_rotation")
                if rot is not None:
                    x = torch.einsum("bthe,hde->bhtd", x, rot)
                else:
                    x = x.transpose(1, 2)
                parts.append(x.to(self.dtype))
        if self._n(recent):
            parts.append(recent.to(self.dtype))
        out = torch.cat(parts, dim=-2) if len(parts) > 1 else parts[0]
        return out[..., :out.shape[-2] - skip_last, :] if skip_last else out

    def stored_bytes(self) -> int:
        ts = [self.sink_k, self.sink_v, self.recent_k, self.recent_v, self.hist_k, self.hist_v]
        if self.hist is not None:
            ts += self.hist.tensors()
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


# ----------------------------------------------------------------------------- the cache

def _layer_windows(config) -> list[int | None]:
    """Per decoder layer: its sliding window, or None for full attention (the layer types
    transformers' own ``DynamicCache`` would build)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types, kwargs = get_layer_types_and_kwargs(cfg)
    out = []
    for t, kw in zip(types, kwargs):
        if t == "full_attention":
            out.append(None)
        elif t == "sliding_attention":
            out.append(int(kw["sliding_window"]))
        else:
            raise UnsupportedModelError(f"OscarCache does not support {t!r} layers")
    return out


class OscarCache(Cache):
    """A transformers :class:`~transformers.Cache` with a BF16 sink and recent window and an INT2
    history rotated by OSCAR rotations; pass it to ``model(...)`` or ``model.generate(...)`` as
    ``past_key_values``. Build it with :meth:`from_artifact` (an artifact's rotations and clips)
    or from any :class:`KVScheme` (identity / Hadamard baselines, lossless)."""

    def __init__(self, config, scheme: KVScheme):
        check_transformers()
        windows = _layer_windows(config)
        if len(windows) != scheme.num_layers:
            raise ArtifactError(f"{scheme.name}: {scheme.num_layers} layers of rotations for a model with "
                                f"{len(windows)} layers")
        self.scheme = scheme
        layers = []
        for i, w in enumerate(windows):
            rk, ck, rv, cv = scheme.layer(i)
            layers.append(OscarLayer(k_rotation=rk, k_clip=ck, v_rotation=rv, v_clip=cv, group_size=scheme.group_size,
                                     sink=scheme.sink, recent=scheme.recent, window_dtype=scheme.window_dtype,
                                     sliding_window=w))
        super().__init__(layers=layers)

    @classmethod
    def from_artifact(cls, artifact, model, *, group_size: int | None = None, sink: int | None = None,
                      recent: int | None = None, window_dtype=torch.bfloat16, check: bool = True) -> "OscarCache":
        """A cache for ``model`` (or its config) with an artifact (directory, file or
        :class:`~oscar_calib.spec.artifact.Artifact`). With a model, ``check`` refuses an artifact
        calibrated for another model (fingerprint and shapes)."""
        from ..model.geometry import geometry_of
        from ..spec.artifact import Artifact, load_artifact

        art = artifact if isinstance(artifact, Artifact) else load_artifact(Path(artifact))
        config = getattr(model, "config", model)
        geo = geometry_of(config)
        got = (art.num_layers, art.num_kv_heads, art.head_dim)
        if got != (geo.num_layers, geo.num_kv_heads, geo.head_dim):
            raise ArtifactError(f"artifact shapes (layers, kv heads, head_dim) = {got} do not match the model's "
                                f"{(geo.num_layers, geo.num_kv_heads, geo.head_dim)}")
        if check and hasattr(model, "config"):
            from ..model.geometry import model_fingerprint

            if art.metadata.get("model_fingerprint") != model_fingerprint(model):
                raise ArtifactError(f"artifact was calibrated for another model ({art.metadata.get('model_id')})")
        scheme = KVScheme.from_artifact(art, group_size=group_size, sink=sink, recent=recent,
                                        window_dtype=window_dtype)
        return cls(config, scheme)

    def memory(self) -> dict:
        """Real storage of the cache (sink, window, packed history with its scales/offsets; the
        rotations are model constants and not counted), and what a BF16 cache of the same
        tokens would hold."""
        total = sum(layer.stored_bytes() for layer in self.layers)
        n = self.get_seq_length()
        bf16 = 0
        for layer in self.layers:
            t = layer.sink_k if layer.sink_k is not None else layer.recent_k
            if t is None:
                continue
            b, h, _, d = t.shape
            bf16 += 2 * 2 * b * h * d * layer.stored_tokens()
        history = sum(layer.n_hist() for layer in self.layers)
        return {"bytes": total, "tokens": n, "bytes_per_token": total / n if n else 0.0,
                "bf16_bytes": bf16, "bf16_bytes_per_token": bf16 / n if n else 0.0,
                "compression": bf16 / total if total else 0.0, "history_tokens_per_layer": history / len(self.layers),
                "history_bits_per_element": self.scheme.bits_per_element}


__all__ = ["OscarCache", "OscarLayer", "KVScheme", "SUPPORTED_TRANSFORMERS", "check_transformers",
           "DEFAULT_SINK", "DEFAULT_RECENT", "BASELINE_CLIPS"]
