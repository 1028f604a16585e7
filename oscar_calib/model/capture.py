"""Capture post-RoPE Q/K/V and the per-head attention output through transformers' attention
interface.

The model's attention modules call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
with query/key/value exactly as the KV cache holds them (after q/k norms and RoPE) and the mask
(causal, padding, sliding window) already built for that layer. :class:`Capture` registers one
function, ``oscar_capture``, that calls the model's own implementation (``sdpa`` or ``eager``),
hands its inputs and output to an observer, and returns the output unchanged, so the model's
logits do not change. It is the single owner of this registration: entering switches every
config of the model to ``oscar_capture`` and exiting restores what was there, also on error.

Observers receive ``(layer, module, q, k, v, o, kwargs)`` with ``q`` [B, Hq, T, d],
``k``/``v`` [B, Hkv, T, d], ``o`` [B, T, Hq, d]; ``layer`` is the artifact's layer: the module's
position among the model's attention layers (:func:`attention_slots`; its ``layer_idx`` for a model
whose every layer is attention, not for a hybrid model's).
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Callable

import torch

from ..errors import UnsupportedModelError

CAPTURE_NAME = "oscar_capture"

Observer = Callable[..., None]

_ACTIVE: list["Capture"] = []


def attention_function(name: str, module):
    """transformers' attention function ``name`` (``"eager"``: the one of ``module``'s modelling file)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        mod = sys.modules.get(type(module).__module__)
        fn = getattr(mod, "eager_attention_forward", None)
        if fn is None:
            raise UnsupportedModelError(f"{type(module).__name__}: no eager attention function found")
        return fn
    if name not in ALL_ATTENTION_FUNCTIONS:
        raise UnsupportedModelError(f"attention implementation {name!r} cannot be captured; use sdpa or eager")
    return ALL_ATTENTION_FUNCTIONS[name]


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    cap = _ACTIVE[-1]
    fn = attention_function(cap.base, module)
    out, weights = fn(module, query, key, value, attention_mask, **kwargs)
    layer = attention_slot(cap.slots, module)
    cap.calls += 1
    for obs in cap.observers:
        obs(layer, module, query, key, value, out, kwargs)
    return out, weights


def attention_slots(model) -> dict[int, int]:
    """``{layer_idx: artifact layer}`` of ``model``'s attention layers
    (:func:`~oscar_calib.model.geometry.attention_layer_ids`: a hybrid model's linear-attention and
    state-space layers have none)."""
    from .geometry import attention_layer_ids

    return {lid: j for j, lid in enumerate(attention_layer_ids(model.config))}


def attention_slot(slots: dict[int, int], module) -> int:
    """The artifact layer of the attention ``module`` (its ``layer_idx`` through ``slots``), or one
    :class:`UnsupportedModelError` line."""
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise UnsupportedModelError(f"{type(module).__name__} has no layer_idx; cannot attribute captures")
    if layer not in slots:
        raise UnsupportedModelError(f"{type(module).__name__} (layer_idx {layer}) runs attention in a layer the "
                                    "model's config gives no KV cache")
    return slots[layer]


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(CAPTURE_NAME, _capture_attention)


def _configs(model):
    seen, out = set(), []
    stack = [model.config]
    while stack:
        c = stack.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        out.append(c)
        for key in getattr(c, "sub_configs", {}) or {}:
            sub = getattr(c, key, None)
            if sub is not None and hasattr(sub, "_attn_implementation"):
                stack.append(sub)
    return out


def model_attention(model) -> str:
    """The attention implementation a route runs for ``model``'s own attention: its configured
    ``sdpa`` or ``eager``; in place of any other (flash and flex kernels do not return what the
    routes need on every device) ``sdpa`` where the model supports it, else ``eager`` (gpt-oss, whose
    attention sinks SDPA cannot express, declares no SDPA support)."""
    base = _configs(model)[0]._attn_implementation or "sdpa"
    if base in ("sdpa", "eager"):
        return base
    return "sdpa" if getattr(model, "_supports_sdpa", True) else "eager"


class AttentionRoute:
    """Base of the context managers that route every attention layer of a model through one
    registered transformers attention function (``name``, registered by the subclass): on enter
    each attention config of ``self.model`` gets ``name`` and the mask function of ``mask_base``;
    on exit the previous implementations come back. ``active`` is the subclass's stack of live
    routes; the registered function serves the innermost one."""

    name: str
    active: list

    def _route(self, mask_base: str):
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        ALL_MASK_ATTENTION_FUNCTIONS.register(self.name, ALL_MASK_ATTENTION_FUNCTIONS[mask_base])
        self._saved: list[tuple[object, str]] = []
        for c in _configs(self.model):
            self._saved.append((c, c._attn_implementation))
            c._attn_implementation = self.name
        self.active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        for c, impl in reversed(self._saved):
            c._attn_implementation = impl
        self._saved.clear()
        if self.active and self.active[-1] is self:
            self.active.pop()


class Capture(AttentionRoute):
    """Context manager that routes a model's attention through observers.

    >>> with Capture(model, [observer]) as cap:
    ...     model(input_ids)
    """

    name = CAPTURE_NAME
    active = _ACTIVE

    def __init__(self, model, observers: list[Observer]):
        self.model = model
        self.observers = list(observers)
        self.calls = 0
        self.base = "sdpa"
        self.slots: dict[int, int] = {}

    def __enter__(self) -> "Capture":
        _register()
        if _configs(self.model)[0]._attn_implementation == CAPTURE_NAME:
            raise RuntimeError("capture is already active on this model")
        self.base = model_attention(self.model)
        self.slots = attention_slots(self.model)
        return self._route(self.base)


def call_window(module, kwargs: dict) -> int | None:
    """The sliding window of one attention call: the ``sliding_window`` the model passes (None on
    its full-attention layers: EXAONE 4 keeps the config's window on every module and passes None
    for its global ones), else the module's own attribute; None for full attention."""
    w = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    return int(w) if w else None


def capture_forward(model, ids: torch.Tensor) -> None:
    """A forward pass for its captures only: no KV cache and, where the model allows, logits for
    the last position only (the full [tokens, vocab] logits are the largest activation: 0.8 GB in
    float32 for 2 × 2048 tokens of a 49K-token vocabulary)."""
    kw = {"logits_to_keep": 1} if _takes_logits_to_keep(type(model)) else {}
    model(input_ids=ids, use_cache=False, **kw)


@functools.lru_cache(maxsize=None)
def _takes_logits_to_keep(cls) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False
