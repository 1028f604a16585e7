"""``OscarCache``: the **real** 2-bit OSCAR KV cache for transformers models (not a simulation).

>>> from oscar_calib.runtime import OscarCache
>>> cache = OscarCache.from_artifact("zoo/smollm2-135m", model)
>>> with cache.attach(model):
...     out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
>>> cache.memory()["bytes_per_token"]

Per layer it keeps the first ``sink`` tokens and the last ``recent`` tokens in BF16 and every
other token as packed INT2 codes of ``clip(x @ R)`` with fp16 scale and offset per group
(``2 + 32/G`` bits per element), in the decode kernel's layout
(:mod:`oscar_calib.runtime.storage`). Decode steps on CUDA run the Triton INT2 decode kernel on
that storage; prefill attends in full precision with SDPA and then writes the cache; the CPU and
the cases the kernel does not cover use a pure-torch path that reads the history in chunks
(:mod:`oscar_calib.runtime.attention`). ``attach(model)`` routes the model's attention through
that function for the duration of a ``with`` block; using the cache without it raises
:class:`~oscar_calib.errors.CacheError` (it would otherwise attend to the new tokens only).

Works with batches (left padding: each sequence stores only its real tokens), GQA, beam search
(``reorder_cache``), sliding-window layers (Gemma 2/3, Mistral: a ring of the window size),
chunked-attention layers (Llama 4: a ring of the chunk size, each query reading its own chunk;
unpadded batches only, as left padding moves transformers' chunk boundaries), and
``crop`` while every stored token is still BF16 (later a crop would need BF16 copies of tokens
that were quantised: it raises :class:`CacheError` instead of returning inexact results).
:class:`~oscar_calib.runtime.simulated.SimulatedCache` is the accuracy simulation it is tested
against (same numbers within the tolerances stated in ``tests/runtime``).
"""

from __future__ import annotations

import contextlib

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..contract.artifact import checked_artifact
from ..errors import CacheError, InputError
from ..model.geometry import model_identity
from .compat import (
    SUPPORTED_TRANSFORMERS,
    cache_layers,
    check_transformers,
    copy_state,
)
from .plan import LayerPlan
from .scheme import KVScheme, SchemeLayer
from .storage import LayerStore, held_slots, write_step, write_tokens


class _BatchOps:
    """Beam search and batch edits of an :class:`OscarLayer` (``self.store``, ``self.seen``)."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.store is not None:
            self.store.map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)), beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store is not None:
            idx = [i for i in range(self.store.batch) for _ in range(repeats)]
            self.store.map_batch(lambda t: t.repeat_interleave(repeats, dim=0), idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.store is not None:
            self.store.map_batch(lambda t: t[indices, ...], torch.as_tensor(indices).tolist())

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (a positive value: keep that many, the
        transformers <= 5.17 convention). Exact only while no stored token has left the window:
        later, the tokens that would come back into the window exist only as INT2."""
        remove = self.seen - tokens_to_remove if tokens_to_remove > 0 else -tokens_to_remove
        if remove <= 0:
            return
        if self.store is not None:
            if not self.store.exact_after_removing():
                raise CacheError(f"OscarCache cannot crop {remove} token(s) exactly: tokens that left the BF16 "
                                 "window are stored only as INT2 (crop is exact while the context fits in "
                                 "sink + recent)")
            self.store.set_counts([max(0, c - remove) for c in self.store.exact_counts()])
        self.seen = max(0, self.seen - remove)


class OscarLayer(_BatchOps, CacheLayerMixin):
    """One decoder layer of :class:`OscarCache` (the real cache): transformers' layer API over a
    :class:`~oscar_calib.runtime.storage.LayerStore`; the attention itself runs in
    :func:`~oscar_calib.runtime.attention.layer_attention`."""

    is_compileable = False
    is_croppable = False

    def __init__(self, scheme: SchemeLayer, *, sliding_window: int | None = None, chunk: int | None = None,
                 backend: str = "auto", layer_id: int | None = None):
        super().__init__()
        self.scheme, self.layer_id, self.backend = scheme, layer_id, backend     # layer_id: the decoder layer
        self.sliding_window, self.chunk = sliding_window, chunk
        self.is_sliding = sliding_window is not None          # a window (sliding or chunked): a ring, no kernel
        self.attached = 0            # > 0 while an OscarAttention route serves this cache
        self.reserved = 0
        self.reset()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        if self.backend == "triton":      # (auto: a head_dim the kernels do not take runs the torch path)
            from ..kernels._common import head_dim_problem

            why = head_dim_problem(d, "write") or head_dim_problem(d, "decode")
            if why:
                raise InputError(f"OscarCache(backend='triton'): layer {self.layer_id} has {why}; use backend='auto', "
                                 "which runs that layer on the torch path")
        self.dtype, self.device = key_states.dtype, key_states.device
        plan = LayerPlan.build(self.scheme, heads=h, d=d, device=self.device, dtype=key_states.dtype,
                               sliding_window=self.sliding_window, chunk=self.chunk, backend=self.backend)
        self.store = LayerStore(plan, b, h, d, self.device, reserve=self.reserved)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Hand the new tokens to the attention function (which attends and writes them)."""
        if not self.attached:
            raise CacheError("OscarCache needs its attention function: run the model inside "
                             "`with cache.attach(model):`")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending = (key_states, value_states)
        self.seen += key_states.shape[-2]
        return key_states, value_states

    def takes(self, key: torch.Tensor) -> bool:
        return self.pending is not None and self.pending[0] is key

    def write(self, k: torch.Tensor, v: torch.Tensor, valid: list) -> None:
        if k.shape[2] == 1 and all(x is None for x in valid):
            write_step(self.store, k, v)
        else:
            write_tokens(self.store, k, v, valid)

    def write_prefix(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store tokens whose attention was computed elsewhere (e.g. a shared full-precision prefill)."""
        if not self.is_initialized:
            self.lazy_initialization(k, v)
        self.write(k, v, [None] * k.shape[0])
        self.seen += k.shape[2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # the mask covers this call's tokens only: the cache knows which stored tokens are real
        return query_length, self.seen

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def reset(self) -> None:
        self.store, self.pending, self.seen, self.is_initialized = None, None, 0, False
        self.gate = None             # device bool [B] while a DecodeGraph step runs: rows that store

    def offload(self):            # the storage stays on its device
        return None

    def prefetch(self):
        return None


def not_storable(scheme: KVScheme) -> str | None:
    """Why :class:`OscarCache` cannot store ``scheme`` (one line), or None: it stores oscar's
    uniform INT2 history, nothing else (no full-precision scheme, no engine's or experimental
    quantiser, no output-side V rotation)."""
    if not scheme.quantized:
        return f"{scheme.name}: OscarCache stores an INT2 history; for full precision use DynamicCache"
    if scheme.quantizer != "oscar":
        return (f"{scheme.name}: OscarCache stores oscar's uniform INT2; the {scheme.quantizer!r} quantiser exists "
                "only in the perplexity simulation (SimulatedKV)")
    if any(r is not None for r in scheme.v_output):
        return (f"{scheme.name}: an output-side V rotation (an engine that absorbs R_v at load) is simulated by "
                "SimulatedKV only")
    return None


class OscarCache(Cache):
    """The real OSCAR cache (see the module docstring): BF16 sink and recent window, packed INT2
    history appended by the write kernel, decode attention by the INT2 kernel. Build it with
    :meth:`from_artifact`, or from any quantised :class:`KVScheme` (Hadamard / naive baselines);
    ``backend`` is the kernels' (``auto``: Triton on CUDA, torch on the CPU)."""

    def __init__(self, config, scheme: KVScheme, *, backend: str = "auto"):
        check_transformers()
        why = not_storable(scheme)
        if why:
            raise InputError(why)
        self.scheme = scheme
        layers = cache_layers(config, scheme, OscarLayer,
                              lambda slot, i: {"chunk": slot.chunk, "backend": backend, "layer_id": i})
        super().__init__(layers=layers)

    @property
    def oscar_layers(self) -> list[OscarLayer]:
        """The INT2 layers (a hybrid model's attention layers; its other layers keep transformers' own state)."""
        return [layer for layer in self.layers if isinstance(layer, OscarLayer)]

    @property
    def recurrent(self) -> str | None:
        """Why a decode step is not recorded as a CUDA graph for this cache (None: it can be): some
        layers keep a recurrent state beside or instead of the KV cache (a hybrid model), which
        transformers updates outside the cache's attention function."""
        n = sum(not isinstance(layer, OscarLayer) or type(layer) is not OscarLayer for layer in self.layers)
        return f"{n} of the model's {len(self.layers)} layers keep a recurrent state (a hybrid model)" if n else None

    @classmethod
    def from_artifact(cls, artifact, model, *, group_size: int | None = None, sink: int | None = None,
                      recent: int | None = None, window_dtype=torch.bfloat16, backend: str = "auto",
                      logit_correction: float | None = None) -> "OscarCache":
        """A cache for ``model`` (or its config: then the fingerprint is not checked) with an artifact
        (directory, ``oscar.safetensors`` or :class:`~oscar_calib.contract.artifact.Artifact`), refused
        first if invalid or made for another model
        (:func:`~oscar_calib.contract.artifact.checked_artifact`); ``logit_correction``:
        another gain than the artifact's."""
        art = checked_artifact(artifact, lambda: model_identity(model))
        scheme = KVScheme.from_artifact(art, group_size=group_size, sink=sink, recent=recent, window_dtype=window_dtype,
                                        logit_correction=logit_correction)
        return cls(getattr(model, "config", model), scheme, backend=backend)

    def attach(self, model):
        """Context manager routing ``model``'s attention through the cache's attention function."""
        from .attention import OscarAttention

        return OscarAttention(model, self)

    def reserve(self, tokens: int) -> None:
        """Preallocate room for ``tokens`` tokens per sequence (no growth copies up to there)."""
        for layer in self.oscar_layers:
            layer.reserved = max(layer.reserved, int(tokens))
            if layer.store is not None:
                layer.store.reserve(int(tokens))

    def prefill_from(self, cache) -> "OscarCache":
        """Fill the cache with the K/V of another cache's layers (e.g. a ``DynamicCache`` after a
        full-precision prefill; a hybrid's: :func:`~oscar_calib.runtime.compat.full_cache`, whose
        recurrent states are copied as they are); returns self."""
        from transformers.cache_utils import LinearAttentionCacheLayerMixin

        for layer, src in zip(self.layers, cache.layers):
            if isinstance(layer, LinearAttentionCacheLayerMixin):       # a hybrid's recurrent state, as it is
                copy_state(layer, src)
            if isinstance(layer, OscarLayer):
                layer.write_prefix(src.keys, src.values)
        return self

    def memory(self) -> dict:
        """Bytes held: ``allocated_bytes`` (all buffers, with unused preallocated room), ``bytes``
        (the slots that hold tokens: window, sink, INT2 history with its scales), and the BF16
        bytes a full-precision cache would hold for the same tokens."""
        used = alloc = bf16 = 0
        for layer in self.oscar_layers:
            st = layer.store
            if st is None:
                continue
            alloc += st.nbytes()
            per_slot = [t.element_size() * t[0, :, :, 0].numel() for t in (st.window.kv,) + st.hist.tensors()]
            hist_per_slot = sum(per_slot[1:])
            for c in st.exact_counts():
                w, h, kept = held_slots(c, st.plan.sink, st.plan.recent, st.hist.cap if st.hist.ring else None)
                used += w * per_slot[0] + h * hist_per_slot
                bf16 += 2 * 2 * st.heads * st.d * kept
        first = self.oscar_layers[0].store
        n = sum(first.exact_counts()) if first is not None else 0
        return {"bytes": used, "allocated_bytes": alloc, "tokens": n, "bytes_per_token": used / n if n else 0.0,
                "bf16_bytes": bf16, "compression": bf16 / used if used else 0.0,
                "history_bits_per_element": self.scheme.bits_per_element}


def attached(cache, model):
    """``cache.attach(model)`` for an :class:`OscarCache`, a no-op context for any other cache."""
    return cache.attach(model) if isinstance(cache, OscarCache) else contextlib.nullcontext()


__all__ = ["OscarCache", "OscarLayer", "SUPPORTED_TRANSFORMERS", "attached", "check_transformers",
           "not_storable"]
