"""The transformers versions the runtime supports, and what it reads from a model's config.

:data:`SUPPORTED_TRANSFORMERS` is the range the caches are *tested* on: its lower bound in CI by
``make test-low`` (a venv under ``.make/`` with that exact version), its upper end by the normal
``make test``. :func:`check_transformers` refuses anything else with one line that says so.

:func:`cache_slots` reads the per-layer attention type through transformers' own
``get_layer_types_and_kwargs`` (:func:`oscar_calib.model.geometry.layer_kinds`, which also
evens out the shape of its return value inside the range); :func:`state_layer` gives a hybrid
model's recurrent-state layers transformers' own cache layer.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from ..errors import ArtifactError, UnsupportedModelError
from ..versions import version_tuple

SUPPORTED_TRANSFORMERS = (">=5.17", "<5.24")
_LOW, _HIGH = (5, 17), (5, 24)          # inclusive, exclusive (major, minor)


def check_transformers(version: str | None = None) -> None:
    """Raise :class:`UnsupportedModelError` unless ``version`` (default: the installed one) lies
    in :data:`SUPPORTED_TRANSFORMERS`."""
    if version is None:
        import transformers

        version = transformers.__version__
    if not _LOW <= version_tuple(version) < _HIGH:
        raise UnsupportedModelError(
            f"the OSCAR caches are tested with transformers {','.join(SUPPORTED_TRANSFORMERS)} "
            f"(5.17 and 5.23 in CI); found {version}: install a version in that range")


class CacheSlot(NamedTuple):
    """One decoder layer as the caches hold it: an attention layer's window rule, and whether the
    layer keeps a recurrent state (``state``: the keyword arguments of transformers' own
    linear-attention cache layer for it, which the OSCAR caches hold unchanged)."""

    attention: bool
    window: int | None = None
    chunk: int | None = None
    state: dict | None = None


def cache_slots(config) -> list[CacheSlot]:
    """Per decoder layer, from the layer kinds of :func:`~oscar_calib.model.geometry.layer_kinds`
    (transformers' own reading): an attention layer's ``(window, chunk)`` (``(None, None)`` for
    full attention, ``(W, None)`` for a sliding window of ``W`` tokens, ``(C, C)`` for chunked
    attention in chunks of ``C``: Llama 4, a query reads the tokens of its own chunk, never more than
    ``C``, so the layer keeps a window of ``C`` as transformers' own caches do), and the recurrent
    state of a hybrid model's linear-attention, convolution or state-space layer (Falcon-H1's
    ``hybrid`` layers hold both). Other layer kinds (KV shared with another layer) are refused."""
    from ..model.geometry import HYBRID_KINDS, STATE_KINDS, layer_kinds, text_config

    out: list[CacheSlot] = []
    for i, (kind, kw) in enumerate(layer_kinds(text_config(config))):
        w = kw.get("sliding_window")
        state = {k: v for k, v in kw.items() if k == "number_of_states"} \
            if kind in STATE_KINDS or kind in HYBRID_KINDS else None
        attn = HYBRID_KINDS.get(kind, kind)
        if kind in STATE_KINDS:
            out.append(CacheSlot(False, state=state))
        elif attn == "full_attention":
            out.append(CacheSlot(True, state=state))
        elif attn in ("sliding_attention", "chunked_attention") and w:
            out.append(CacheSlot(True, int(w), int(w) if attn == "chunked_attention" else None, state))
        else:
            raise UnsupportedModelError(f"layer {i} is a {kind!r} layer; the OSCAR caches support full, "
                                        "sliding-window and chunked attention, beside linear-attention and "
                                        "state-space layers")
    if not any(slot.attention for slot in out):
        raise UnsupportedModelError("the model config names no attention layers")
    return out


def layer_windows(config) -> list[tuple[int | None, int | None]]:
    """``(window, chunk)`` of every attention layer (the artifact's layers), see :func:`cache_slots`."""
    return [(slot.window, slot.chunk) for slot in cache_slots(config) if slot.attention]


def cache_layers(config, scheme, cls, options=None) -> list:
    """The layers of an OSCAR cache for ``config``: per attention layer an instance of ``cls``
    (``with_state(cls)`` where the layer also keeps a recurrent state), built from the scheme's
    layers in order as ``cls(scheme.layer(j), sliding_window=W, **options(slot, i))`` (``i`` the
    layer's index in the model; no options: none), and transformers' own state layer for every
    other layer. Refuses a scheme whose layer count is not the model's attention layers'."""
    slots = cache_slots(config)
    attention = [slot for slot in slots if slot.attention]
    if len(attention) != scheme.num_layers:
        raise ArtifactError(f"{scheme.name}: {scheme.num_layers} layers of rotations for a model with "
                            f"{len(attention)} attention layers")
    layers, j = [], 0
    for slot in slots:                 # the model's layers; a hybrid's recurrent states as transformers keeps them
        if not slot.attention:
            layers.append(state_layer(slot.state))
            continue
        kind, extra = (cls, {}) if slot.state is None else (with_state(cls), slot.state)
        more = options(slot, len(layers)) if options else {}
        layers.append(kind(scheme.layer(j), sliding_window=slot.window, **more, **extra))
        j += 1
    return layers


def state_layer(state: dict):
    """transformers' linear-attention cache layer for a layer's recurrent state (``state``: its
    keyword arguments, :attr:`CacheSlot.state`), which the OSCAR caches hold as transformers does."""
    from transformers.cache_utils import LinearAttentionLayer

    return LinearAttentionLayer(**state)


@functools.lru_cache(maxsize=None)
def with_state(cls):
    """``cls`` (an OSCAR cache layer class) with a linear-attention state beside it, as transformers'
    ``LinearAttentionAndFullAttentionLayer`` holds one beside a ``DynamicLayer`` (``cache_utils`` in
    5.17 and 5.23): the attention calls ``update`` and ``lazy_initialization(keys, values)``, the
    state ``update_conv_state`` / ``update_recurrent_state`` and ``lazy_initialization`` with keyword
    arguments only; ``reset``, ``reorder_cache`` and ``crop`` act on both (transformers' state refuses
    a crop unless it records its past)."""
    from transformers.cache_utils import LinearAttentionLayer

    def __init__(self, *args, number_of_states: int = 1, **kwargs):
        cls.__init__(self, *args, **kwargs)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs):
        if args and not kwargs:
            cls.lazy_initialization(self, *args)
        else:
            LinearAttentionLayer.lazy_initialization(self, *args, **kwargs)

    def both(name):
        def method(self, *args):
            getattr(LinearAttentionLayer, name)(self, *args)
            return getattr(cls, name)(self, *args)
        return method

    def reset(self):
        if hasattr(self, "conv_states"):             # cls.__init__ resets before the state exists
            LinearAttentionLayer.reset(self)
        cls.reset(self)

    return type(f"{cls.__name__}WithState", (LinearAttentionLayer, cls), {
        "__init__": __init__, "lazy_initialization": lazy_initialization, "reset": reset,
        "reorder_cache": both("reorder_cache"), "offload": both("offload"), "prefetch": both("prefetch"),
        "crop": both("crop"), "is_compileable": False, "is_croppable": False, "get_max_length": cls.get_max_length,
        "__repr__": cls.__repr__})


def full_cache(config):
    """A transformers cache whose attention layers keep every token (``DynamicLayer``, whatever their
    window) and whose recurrent-state layers are transformers' own (:func:`cache_slots`): a
    full-precision prefill from which any method's cache can be built (``OscarCache.prefill_from``)."""
    from transformers.cache_utils import (
        Cache,
        DynamicLayer,
        LinearAttentionAndFullAttentionLayer,
    )

    layers = []
    for slot in cache_slots(config):
        if slot.attention and slot.state is not None:
            layers.append(LinearAttentionAndFullAttentionLayer(**slot.state))
        else:
            layers.append(DynamicLayer() if slot.attention else state_layer(slot.state))
    return Cache(layers=layers)


# what a linear-attention cache layer holds (transformers' LinearAttentionCacheLayerMixin, 5.17 and 5.23)
STATE_ATTRIBUTES = ("conv_states", "recurrent_states", "is_conv_states_initialized", "is_recurrent_states_initialized",
                    "has_previous_state", "conv_kernel_size", "device", "dtype", "record_past", "number_of_states")


def copy_state(dst, src) -> None:
    """Copy the recurrent state of transformers' linear-attention cache layer ``src`` into ``dst``."""
    import copy

    for name in STATE_ATTRIBUTES:
        if hasattr(src, name):
            setattr(dst, name, copy.deepcopy(getattr(src, name)))
