"""Decode steps of the real cache replayed from a CUDA graph: :class:`DecodeGraph`.

An eager decode step launches ~100 small kernels per layer from Python, so on a small or
mid-sized model it is bound by the host, not the GPU. The step is graph-safe (device ops only,
slots from the device counts; a masked step decides on the device which rows store their token),
so it can be recorded once and replayed per token.

>>> cache.reserve(prompt_len + new_tokens)          # a replay cannot grow the history
>>> with cache.attach(model), torch.no_grad():
...     logits = model(ids, past_key_values=cache).logits[:, -1:]      # prefill, eager
...     step = DecodeGraph(model, cache)
...     for i in range(new_tokens):
...         tok = logits.argmax(-1)                                     # [B, 1]
...         logits = step(tok, pos + i)                                 # [B, 1, vocab]

The first call runs eagerly (it compiles the kernels), the second records the step and replays
it, every later call replays it; each call stores one token per sequence, as an eager step does.
The returned logits live in the graph's output buffer: the next call overwrites them.
"""

from __future__ import annotations

import torch

from ..errors import CacheError, InputError


class DecodeGraph:
    """One decode step of ``model`` (any transformers causal LM) over an attached, prefilled
    :class:`~oscar_calib.runtime.cache.OscarCache`, captured in a CUDA graph (see the module
    docstring). ``room``: tokens per sequence the reserved history still takes."""

    def __init__(self, model, cache):
        from .cache import OscarCache

        if not isinstance(cache, OscarCache):
            raise InputError(f"DecodeGraph needs an OscarCache, got {type(cache).__name__}")
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise InputError(f"DecodeGraph needs a CUDA model (CUDA graphs); the model is on {device.type}")
        layers = cache.layers
        if not layers or any(layer.store is None for layer in layers):
            raise CacheError("DecodeGraph needs a prefilled cache: run the prompt through the model first")
        if any(not layer.attached for layer in layers):
            raise CacheError("DecodeGraph needs the cache attached: call it inside `with cache.attach(model):`")
        self.model, self.cache, self.device = model, cache, device
        self.batch = layers[0].store.batch
        full = [layer.store for layer in layers if not layer.store.hist.ring]
        self.room = min((st.hist.cap + st.plan.sink - max(st.exact_counts()) for st in full), default=1 << 62)
        self.calls = 0
        self.graph = None
        self._ids = self._pos = self._logits = None

    def _step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True).logits

    def _host_state(self) -> list:
        return [(layer.seen, list(layer.store.counts), layer.store.counts_stale) for layer in self.cache.layers]

    def _set_host_state(self, state: list) -> None:
        for layer, (seen, counts, stale) in zip(self.cache.layers, state):
            layer.seen, layer.store.counts, layer.store.counts_stale, layer.pending = seen, counts, stale, None

    def _advance_host(self) -> None:
        """What an eager step does on the host, which a replay skips: one more token per row."""
        for layer in self.cache.layers:
            layer.seen += 1
            layer.store.counts = [c + 1 for c in layer.store.counts]
            layer.store.counts_stale = True       # (a masked row may not have stored its token)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, 1, vocab]`` of the next tokens ``ids`` at ``positions`` (both ``[B, 1]``)."""
        want = (self.batch, 1)
        for name, t in (("ids", ids), ("positions", positions)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise InputError(f"DecodeGraph: {name} must be a tensor of shape {want}, got {got}")
        if self.calls >= self.room:
            raise CacheError(f"DecodeGraph: the reserved history is full after {self.calls} steps; "
                             "call cache.reserve(total tokens) before building the graph")
        self.calls += 1
        if self.calls == 1:                                   # eager: compiles and warms up
            return self._step(ids.to(self.device), positions.to(self.device))
        if self.graph is None:
            self._ids = ids.to(self.device, torch.long).clone()
            self._pos = positions.to(self.device, torch.long).clone()
            torch.cuda.synchronize(self.device)
            before = self._host_state()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):               # recorded, not run
                self._logits = self._step(self._ids, self._pos)
            self._set_host_state(before)
        else:
            self._ids.copy_(ids)
            self._pos.copy_(positions)
        self.graph.replay()
        self._advance_host()
        return self._logits


__all__ = ["DecodeGraph"]
