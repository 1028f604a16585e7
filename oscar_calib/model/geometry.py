"""Attention geometry of a decoder and the model fingerprint an artifact records.

Both are read from the model itself, for any causal LM whose attention goes through transformers'
attention interface; the architecture registry (:mod:`.registry`) is not consulted. ``geometry_of``
reads a model or its config: the text config (a multimodal wrapper's language model), one
:class:`LayerGeometry` per attention layer, and a one-line refusal for what the artifact cannot
describe (latent attention, KV caches shared between layers, layers that keep neither a KV cache
nor a recurrent state transformers knows).

A hybrid model (Qwen3-Next, Qwen3.5, LFM2) interleaves softmax-attention layers with layers that
keep a recurrent state instead of a KV cache (transformers' layer types ``linear_attention``,
``conv``): only the attention layers have artifact layers, and :attr:`Geometry.layer_ids` gives
each one's decoder-layer index (``attention_layer_ids``). Falcon-H1's ``hybrid`` layers hold both
an attention and a state-space mixer: every layer has an artifact layer. Layers may differ in
head_dim and KV heads (Gemma 4's sliding and global layers): :attr:`Geometry.layer_head_dims` and
:attr:`Geometry.layer_kv_heads`.

``decoder_attention`` finds the decoder's attention modules by structure (the layer list whose
attention layers hold an attention module numbered by its ``layer_idx``); ``model_fingerprint`` is
the sha256 of the text config (volatile keys dropped) and the names and shapes of those modules'
weights (the attention layers' only), so an artifact can tell whether it belongs to a model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ..errors import UnsupportedModelError
from .registry import refusal_for

# layer types (transformers' ``config.layer_types``) whose layers keep a per-head K/V cache
ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")
# layers that keep a recurrent state and no KV cache (transformers' cache_utils: LinearAttentionLayer in 5.17 and 5.23)
STATE_KINDS = ("linear_attention", "conv")
# layers that keep both (Falcon-H1: attention beside a Mamba-2 mixer): the attention kind their KV cache has
HYBRID_KINDS = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}


@dataclass(frozen=True)
class LayerGeometry:
    """One attention layer as its KV cache sees it."""

    kind: str                  # one of ATTENTION_KINDS
    num_kv_heads: int
    head_dim: int
    window: int | None = None  # the sliding window, or the chunk of chunked attention; None for full attention
    group: int = 1             # query heads per KV head
    layer_id: int = 0          # the decoder-layer index (the module's ``layer_idx``)


@dataclass(frozen=True)
class Geometry:
    """Attention geometry of a decoder: what an artifact's shapes depend on. ``num_layers`` counts the
    attention layers (a hybrid model's others keep no KV cache), ``layer_ids`` their decoder-layer
    indices (None: ``0..num_layers-1``); ``num_kv_heads`` / ``head_dim`` are layer 0's, and
    ``layer_kv_heads`` / ``layer_head_dims`` every layer's when they differ (None: the same for all).
    :meth:`layer` describes one layer."""

    model_type: str                  # the text model's ``model_type``
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]     # one of ATTENTION_KINDS per attention layer
    sliding_window: int | None
    attention_chunk_size: int | None = None   # chunked-attention layers (Llama 4) attend within chunks of it
    text_config: str | None = None   # where a wrapper keeps the text config: "<wrapper model_type>.<attribute>"
    layer_ids: tuple[int, ...] | None = None
    layer_head_dims: tuple[int, ...] | None = None
    layer_kv_heads: tuple[int, ...] | None = None

    @property
    def group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    @property
    def ids(self) -> tuple[int, ...]:
        """The decoder-layer index of every attention layer."""
        return self.layer_ids if self.layer_ids is not None else tuple(range(self.num_layers))

    @property
    def head_dims(self) -> tuple[int, ...]:
        return self.layer_head_dims or (self.head_dim,) * self.num_layers

    @property
    def kv_heads(self) -> tuple[int, ...]:
        return self.layer_kv_heads or (self.num_kv_heads,) * self.num_layers

    @property
    def mixed_heads(self) -> bool:
        return self.layer_head_dims is not None

    def layer(self, i: int) -> LayerGeometry:
        kind = self.layer_types[i]
        window = {"sliding_attention": self.sliding_window, "chunked_attention": self.attention_chunk_size}.get(kind)
        kv = self.kv_heads[i]
        return LayerGeometry(kind, kv, self.head_dims[i], window, self.num_attention_heads // kv, self.ids[i])

    def settings_fields(self) -> dict:
        """The artifact settings this geometry fixes (:class:`~oscar_calib.contract.settings.ArtifactSettings`)."""
        return {"num_layers": self.num_layers, "num_attention_heads": self.num_attention_heads,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "layer_ids": self.ids,
                "layer_head_dims": self.head_dims, "layer_kv_heads": self.kv_heads}


def text_config(config):
    """The decoder's text config of a model config (a multimodal wrapper nests it)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def text_config_source(config) -> str | None:
    """``"<model_type>.<attribute>"`` when ``config`` wraps its text config in a sub-config (a
    multimodal model: ``"gemma3.text_config"``), None when it is the text config itself."""
    text = text_config(config)
    if text is config:
        return None
    for name in getattr(config, "sub_configs", None) or {}:
        if getattr(config, name, None) is text:
            return f"{config.model_type}.{name}"
    return f"{config.model_type}.text_config"


def layer_kinds(config) -> list[tuple[str, dict]]:
    """``(layer type, cache kwargs)`` per decoder layer of a text config, as transformers' own caches
    read them (``transformers.cache_utils.get_layer_types_and_kwargs``: ``config.layer_types``, or
    sliding / chunked / full inferred from the config's windows; a window under ``sliding_window``).
    transformers 5.17 returns the kwargs as one dict for all layers, 5.23 as one per layer."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config)
    per_layer = kwargs if isinstance(kwargs, (list, tuple)) else [kwargs] * len(types)
    return [(kind, dict(kw or {})) for kind, kw in zip(types, per_layer)]


def _layer_configs(config, n: int) -> list:
    if getattr(config, "is_heterogeneous", False):
        return list(config.per_layer_config)
    return [config] * n


def _cached_kinds(config, n_layers: int, model_type: str) -> list[tuple[int, str]]:
    """``(decoder-layer index, attention kind)`` of every layer that keeps a KV cache, or one
    :class:`UnsupportedModelError` line for a layer that keeps neither one nor a known state."""
    types = [kind for kind, _ in layer_kinds(config)]
    if len(types) != n_layers or "dummy" in types:
        raise UnsupportedModelError(f"{model_type}: transformers' caches see {len(types) - types.count('dummy')} "
                                    f"layers with a cache of {n_layers} (layers sharing another's KV cache?); oscar "
                                    "calibrates models whose every attention layer keeps its own")
    out = []
    for i, kind in enumerate(types):
        if kind in ATTENTION_KINDS or kind in HYBRID_KINDS:
            out.append((i, HYBRID_KINDS.get(kind, kind)))
        elif kind not in STATE_KINDS:
            raise UnsupportedModelError(f"{model_type}: layer {i} is a {kind!r} layer, which keeps neither a per-head "
                                        "KV cache nor a recurrent state oscar leaves alone (linear attention, "
                                        "convolution, state-space)")
    if not out:
        raise UnsupportedModelError(f"{model_type}: none of its {n_layers} layers keeps a KV cache")
    return out


def attention_layer_ids(config) -> tuple[int, ...]:
    """The decoder-layer indices (``layer_idx``) of a text config's layers that keep a KV cache, in
    order: the artifact's layers. Every layer for a model whose layer kinds transformers cannot
    tell (or that it does not know)."""
    config = text_config(config)
    n = getattr(config, "num_hidden_layers", 0)
    try:
        types = [kind for kind, _ in layer_kinds(config)]
    except Exception:  # noqa: BLE001 - a config transformers' caches cannot read: every layer is one
        return tuple(range(n))
    return tuple(i for i, kind in enumerate(types) if kind in ATTENTION_KINDS or kind in HYBRID_KINDS)


def geometry_of(model_or_config) -> Geometry:
    """The attention geometry of a model or config (its text config), or one
    :class:`UnsupportedModelError` line saying what does not fit: latent attention (MLA), KV cache
    shared between layers, layers that keep neither a KV cache nor a known recurrent state, layers
    that differ in query heads. A hybrid model's linear-attention, convolution or state-space layers
    are left out (:attr:`Geometry.layer_ids`); layers that differ in head_dim or KV heads are
    described one by one (:attr:`Geometry.layer_head_dims`, :attr:`Geometry.layer_kv_heads`)."""
    top = getattr(model_or_config, "config", model_or_config)
    config = text_config(top)
    model_type = config.model_type
    why = refusal_for(model_type) or refusal_for(getattr(top, "model_type", ""))
    if why:
        raise UnsupportedModelError(f"unsupported architecture {model_type!r}: {why}")
    if getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        raise UnsupportedModelError(f"{model_type}: multi-head latent attention (MLA) is not supported")
    n_heads = getattr(config, "num_attention_heads", None)
    n_layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(n_heads, int) or not isinstance(n_layers, int):
        raise UnsupportedModelError(f"{model_type}: its config names no num_attention_heads / num_hidden_layers "
                                    "(not a decoder with multi-head attention)")
    shared = getattr(config, "num_kv_shared_layers", None)
    if shared:
        raise UnsupportedModelError(f"{model_type}: {shared} layers reuse another layer's KV cache; oscar calibrates "
                                    "models whose every attention layer keeps its own")
    cached = _cached_kinds(config, n_layers, model_type)
    configs = _layer_configs(config, n_layers)
    per_layer = []
    for i, _ in cached:
        lc = configs[i]
        h = getattr(lc, "num_attention_heads", n_heads)
        kv = getattr(lc, "num_key_value_heads", None) or h
        d = getattr(lc, "head_dim", None) or config.hidden_size // h
        if h != n_heads:
            raise UnsupportedModelError(f"{model_type}: layer {i} has {h} query heads, layer {cached[0][0]} "
                                        f"{n_heads}; an artifact holds one query-head count for every layer")
        if h % kv:
            raise UnsupportedModelError(f"{model_type}: {h} query heads do not split over {kv} KV heads (layer {i})")
        per_layer.append((kv, d))
    kvs, dims = (tuple(x) for x in zip(*per_layer))
    mixed = len(set(per_layer)) > 1
    ids = tuple(i for i, _ in cached)
    types = tuple(kind for _, kind in cached)
    chunk = getattr(config, "attention_chunk_size", None) if "chunked_attention" in types else None
    return Geometry(model_type, len(cached), n_heads, kvs[0], dims[0], types, getattr(config, "sliding_window", None),
                    chunk, text_config_source(top), layer_ids=None if ids == tuple(range(len(ids))) else ids,
                    layer_head_dims=dims if mixed else None, layer_kv_heads=kvs if mixed else None)


def context_length(model_or_config) -> int | None:
    """The positions a model is configured for: ``max_position_embeddings``, times the RoPE scaling
    factor where a scaling (YaRN, linear, dynamic, LongRoPE) extends it; None when not recorded."""
    config = text_config(getattr(model_or_config, "config", model_or_config))
    n = getattr(config, "max_position_embeddings", None)
    if not isinstance(n, int) or n <= 0:
        return None
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind in ("yarn", "linear", "dynamic", "longrope") and isinstance(rope.get("factor"), (int, float)):
        n = max(n, int(rope.get("original_max_position_embeddings", n) * rope["factor"]))
    return n


def _attention_child(layer, i: int):
    """``(name, module)``: the attention module of decoder layer ``i``, a child numbered ``layer_idx
    == i`` whose class is an ``...Attention`` (``self_attn`` first where there are several), or None."""
    found = [(n, m) for n, m in layer.named_children()
             if type(m).__name__.endswith("Attention") and getattr(m, "layer_idx", None) == i]
    if len(found) > 1:
        found = [(n, m) for n, m in found if n == "self_attn"] or found[:0]
    return found[0] if len(found) == 1 else None


def _decoder_stack(model) -> tuple[str, list[tuple[str, object]]]:
    """``(path of the layer list, [(attention path, attention module), ...])``; see :func:`decoder_attention`."""
    import torch

    config = text_config(model.config)
    n = config.num_hidden_layers
    ids = attention_layer_ids(config)
    lists = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == n and n > 0:
            children = [_attention_child(mod[i], i) for i in ids]
            if children and all(children):
                lists.append((name, [(f"{name}.{i}.{c[0]}", c[1]) for i, c in zip(ids, children)]))
    if len(lists) > 1:
        lists = [found for found in lists if getattr(found[1][0][1], "config", None) is config] or lists[:0]
    if len(lists) != 1:
        why = "none" if not lists else "more than one"
        raise UnsupportedModelError(f"{type(model).__name__}: {why} of its module lists holds {n} decoder layers "
                                    "whose attention layers hold one attention module each (numbered by layer_idx); "
                                    "cannot find its attention layers")
    return lists[0]


def decoder_attention(model) -> list[tuple[str, object]]:
    """``(path, module)`` of every attention layer's attention module, in layer order (a hybrid
    model's linear-attention or state-space layers have none); ``path`` is its name in
    ``model.named_modules()`` (``model.layers.0.self_attn``; a multimodal wrapper's
    ``model.language_model.layers.0.self_attn``). Found by structure: the module list of
    ``num_hidden_layers`` layers (of the text config) whose every attention layer
    (:func:`attention_layer_ids`) holds one attention module numbered by its ``layer_idx``; several
    such lists (a vision tower's) are told apart by the attention modules' config, which is the text
    config."""
    return _decoder_stack(model)[1]


def decoder_module(model):
    """The decoder (text) model that holds the layer list (``model.model``; a multimodal wrapper's
    ``model.model.language_model``): called with ``input_ids`` it returns the last hidden states."""
    path = _decoder_stack(model)[0]
    return model.get_submodule(path.rpartition(".")[0])


def attention_modules(model) -> list:
    """Every attention layer's attention module, in layer order (:func:`decoder_attention`)."""
    return [m for _, m in decoder_attention(model)]


_VOLATILE = {"transformers_version", "torch_dtype", "dtype", "quantization_config", "use_cache",
             "name_or_path", "oscar", "architectures", "attn_implementation"}


def model_fingerprint(model) -> str:
    """sha256 of the model's text config (volatile keys dropped: dtype, versions, paths,
    quantisation, attention backend) and the names and shapes of its attention layers' attention
    weights (a hybrid model's linear-attention or state-space weights do not count)."""
    cfg = text_config(model.config).to_dict()
    cfg = {k: v for k, v in cfg.items() if k not in _VOLATILE and not k.startswith("_")}
    shapes = []
    for path, attn in decoder_attention(model):
        for name, p in sorted(attn.named_parameters()):
            shapes.append((f"{path}.{name}", list(p.shape)))
    blob = json.dumps({"config": cfg, "attention_weights": shapes}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def model_identity(model_or_config) -> tuple[Geometry, str | None]:
    """``(geometry, fingerprint)`` of a model, what an artifact is checked against
    (:func:`~oscar_calib.contract.artifact.checked_artifact`); given a config: no fingerprint."""
    is_model = hasattr(model_or_config, "config")
    return geometry_of(model_or_config), (model_fingerprint(model_or_config) if is_model else None)


def config_fingerprint(config) -> str:
    """:func:`model_fingerprint` of the model ``config`` describes, built on the meta device (no weights
    are created or read): what an artifact records when only a ``config.json`` (or ``configs/``
    geometry) is at hand."""
    import torch

    from .registry import model_class

    with torch.device("meta"):
        model = model_class(config).from_config(config)
    return model_fingerprint(model)
