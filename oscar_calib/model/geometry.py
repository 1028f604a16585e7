"""Attention geometry of a decoder and the model fingerprint an artifact records.

``geometry_of`` reads a model or its config (refusing families the registry marks unsupported);
``model_fingerprint`` is the sha256 of the config (volatile keys dropped) and the names and shapes
of the attention weights, so an artifact can tell whether it belongs to a model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ..errors import UnsupportedModelError
from .registry import ArchSpec, arch_for, get_attr_path


@dataclass(frozen=True)
class Geometry:
    """Attention geometry of a decoder: what an artifact's shapes depend on."""

    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]   # "full_attention" / "sliding_attention" per layer
    sliding_window: int | None

    @property
    def group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def geometry_of(model_or_config) -> Geometry:
    config = text_config(getattr(model_or_config, "config", model_or_config))
    model_type = config.model_type
    arch_for(model_type)  # raises for unsupported families
    if getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        raise UnsupportedModelError(f"{model_type}: multi-head latent attention (MLA) is not supported")
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    if n_heads % n_kv:
        raise UnsupportedModelError(f"{model_type}: {n_heads} query heads do not split over {n_kv} KV heads")
    n_layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * n_layers
    return Geometry(model_type, n_layers, n_heads, n_kv, head_dim, tuple(types),
                    getattr(config, "sliding_window", None))


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


def attention_modules(model) -> list:
    spec: ArchSpec = arch_for(text_config(model.config).model_type)
    layers = get_attr_path(model, spec.layers)
    return [getattr(layer, spec.attention) for layer in layers]


_VOLATILE = {"transformers_version", "torch_dtype", "dtype", "quantization_config", "use_cache",
             "name_or_path", "oscar", "architectures", "attn_implementation"}


def model_fingerprint(model) -> str:
    """sha256 of the model's config (volatile keys dropped: dtype, versions, paths, quantisation,
    attention backend) and the names and shapes of its attention weights."""
    cfg = text_config(model.config).to_dict()
    cfg = {k: v for k, v in cfg.items() if k not in _VOLATILE and not k.startswith("_")}
    spec = arch_for(text_config(model.config).model_type)
    shapes = []
    for i, attn in enumerate(attention_modules(model)):
        for name, p in sorted(attn.named_parameters()):
            shapes.append((f"{spec.layers}.{i}.{spec.attention}.{name}", list(p.shape)))
    blob = json.dumps({"config": cfg, "attention_weights": shapes}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def config_fingerprint(config) -> str:
    """:func:`model_fingerprint` of the model ``config`` describes, built on the meta device (no weights
    are created or read): what an artifact records when only a ``config.json`` (or ``configs/``
    geometry) is at hand."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model_fingerprint(model)
