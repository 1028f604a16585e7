"""Architecture knowledge as data: where each supported model family keeps its attention.

Every entry names the decoder-layer list, the attention module inside a layer, its projections
(or the fused projection and how it splits), its q/k norms, and whether layers can use a
sliding window. Capture itself never needs these names (it reads post-RoPE Q/K/V through
transformers' attention interface); weight folding and fingerprints do.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class ArchSpec:
    layers: str = "model.layers"          # attribute path from the CausalLM to the layer list
    attention: str = "self_attn"           # attribute of a decoder layer
    q_proj: str | None = "q_proj"
    k_proj: str | None = "k_proj"
    v_proj: str | None = "v_proj"
    o_proj: str = "o_proj"
    fused_qkv: str | None = None           # one Linear producing [q | k | v] along its output rows
    q_norm: str | None = None              # applied before RoPE (per head, or per layer for MiniMax-M2)
    k_norm: str | None = None
    sliding_window: bool = False           # some layers attend to a window only
    bias: bool = False                     # q/k/v projections may carry a bias


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(),
    "mistral": ArchSpec(sliding_window=True),
    "qwen2": ArchSpec(sliding_window=True, bias=True),
    "qwen3": ArchSpec(q_norm="q_norm", k_norm="k_norm", sliding_window=True),
    "gemma2": ArchSpec(sliding_window=True),
    "gemma3_text": ArchSpec(q_norm="q_norm", k_norm="k_norm", sliding_window=True),
    "olmo2": ArchSpec(q_norm="q_norm", k_norm="k_norm"),
    # GLM-4.5/4.6/4.7 (GLM-4.7-FP8): q/k norms when use_qk_norm, q/k/v bias, partial RoPE
    "glm4_moe": ArchSpec(q_norm="q_norm", k_norm="k_norm", bias=True),
    # MiniMax-M2.x: q/k norms over the whole projection (qk_norm_type per_layer), partial RoPE
    "minimax_m2": ArchSpec(q_norm="q_norm", k_norm="k_norm"),
    "phi3": ArchSpec(q_proj=None, k_proj=None, v_proj=None, fused_qkv="qkv_proj", sliding_window=True),
}

# Families known not to fit: the reason is shown to the user.
UNSUPPORTED: dict[str, str] = {
    "deepseek_v2": "multi-head latent attention (MLA) caches a compressed latent, not per-head K/V",
    "deepseek_v3": "multi-head latent attention (MLA) caches a compressed latent, not per-head K/V",
    "kimi_k2": "multi-head latent attention (MLA) caches a compressed latent, not per-head K/V",
    "minicpm3": "multi-head latent attention (MLA) caches a compressed latent, not per-head K/V",
    "mamba": "state-space model without a KV cache",
    "mamba2": "state-space model without a KV cache",
    "rwkv": "recurrent model without a KV cache",
}


def arch_for(model_type: str) -> ArchSpec:
    """The registry entry for ``config.model_type``, or a clear error."""
    if model_type in UNSUPPORTED:
        raise UnsupportedModelError(f"unsupported architecture {model_type!r}: {UNSUPPORTED[model_type]}")
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[model_type]


def get_attr_path(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj
