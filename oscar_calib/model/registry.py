"""Architecture knowledge as data: which transformers class builds a family's model with its
language-model head (:func:`model_class`), where each family keeps the projections that weight
folding rewrites, and the families that do not fit with the reason.

Calibration, verify, eval and the runtime cache need no entry here: they read post-RoPE Q/K/V
through transformers' attention interface and find the attention modules by structure
(:func:`oscar_calib.model.geometry.decoder_attention`), for any causal LM. Only ``oscar
fold-weights`` touches weights, and it needs to know which projection yields V (its rows are
rotated) and which one reads the attention output (its columns are). An entry is keyed by the
text model's ``config.model_type`` (a multimodal wrapper's language model: ``gemma3_text``,
``qwen2_5_vl_text``, ...); it names the projections inside the attention module, its q/k norms, and
whether its layers can use a sliding window or carry projection biases (what the support table
shows).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..contract.features import SINK_MODEL_TYPES  # noqa: F401 - the families with attention sinks, beside the others
from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class ArchSpec:
    q_proj: str | None = "q_proj"
    k_proj: str | None = "k_proj"
    v_proj: str | None = "v_proj"
    o_proj: str = "o_proj"
    fused_qkv: str | None = None           # one Linear producing [q | k | v] along its output rows
    q_norm: str | None = None              # applied before RoPE (per head, or per layer for MiniMax-M2 and OLMo)
    k_norm: str | None = None
    sliding_window: bool = False           # some layers attend to a window only
    bias: bool = False                     # q/k/v projections may carry a bias
    fold_refusal: str | None = None        # why the value rotation cannot be folded into this family's weights
    values_from_keys: str | None = None    # a config flag under which some layers take their values from k_proj


_QK = dict(q_norm="q_norm", k_norm="k_norm")
_GATED = ("its attention output is multiplied elementwise by a gate before o_proj, so R_v cannot move into o_proj "
          "(caches rotate V online instead)")

ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(),
    "mistral": ArchSpec(sliding_window=True),
    "qwen2": ArchSpec(sliding_window=True, bias=True),
    "qwen3": ArchSpec(**_QK, sliding_window=True),
    "gemma2": ArchSpec(sliding_window=True),
    "gemma3_text": ArchSpec(**_QK, sliding_window=True),
    "olmo2": ArchSpec(**_QK),
    # GLM-4.5/4.6/4.7 (GLM-4.7-FP8): q/k norms when use_qk_norm, q/k/v bias, partial RoPE
    "glm4_moe": ArchSpec(**_QK, bias=True),
    # MiniMax-M2.x: q/k norms over the whole projection (qk_norm_type per_layer), partial RoPE
    "minimax_m2": ArchSpec(**_QK),
    "phi3": ArchSpec(q_proj=None, k_proj=None, v_proj=None, fused_qkv="qkv_proj", sliding_window=True),
    # mixtures of experts: the attention is a dense Llama/Qwen block, only the MLP is routed
    "qwen3_moe": ArchSpec(**_QK, sliding_window=True),
    "qwen2_moe": ArchSpec(sliding_window=True, bias=True),
    "mixtral": ArchSpec(sliding_window=True),
    # gpt-oss: q/k/v/o biases, a learned attention-sink logit per query head (``sinks``, which folding
    # leaves alone: the sink's value is zero), sliding and full layers alternating
    "gpt_oss": ArchSpec(sliding_window=True, bias=True),
    "granitemoe": ArchSpec(),
    # Llama 4: weightless L2 q/k norms on RoPE layers, which attend within chunks
    "llama4_text": ArchSpec(),
    "olmo3": ArchSpec(**_QK, sliding_window=True),
    "seed_oss": ArchSpec(bias=True),
    "smollm3": ArchSpec(sliding_window=True),
    "granite": ArchSpec(),
    "exaone4": ArchSpec(**_QK, sliding_window=True),
    "ernie4_5": ArchSpec(bias=True),
    # hybrids (oscar_calib.model.geometry: their attention layers only). Qwen3-Next and Qwen3.5 multiply the
    # attention output elementwise by a sigmoid gate (the second half of q_proj) before o_proj: o_proj then reads
    # (o ⊙ g), and folding R_v would hand it (o R_v) ⊙ g, which is not (o ⊙ g) R_v
    "qwen3_next": ArchSpec(**_QK, fold_refusal=_GATED),
    "qwen3_5_text": ArchSpec(**_QK, fold_refusal=_GATED),
    "qwen3_5_moe_text": ArchSpec(**_QK, fold_refusal=_GATED),
    # Falcon-H1: attention beside a Mamba-2 mixer in every layer; keys scaled by key_multiplier
    "falcon_h1": ArchSpec(bias=True),
    # LFM2: attention layers between short convolutions; the output projection is out_proj
    "lfm2": ArchSpec(o_proj="out_proj", q_norm="q_layernorm", k_norm="k_layernorm"),
    # Gemma 4: sliding layers of one head size, global layers of another; a scale-free RMSNorm over each value head
    # (rotation-invariant); with attention_k_eq_v the global layers have no v_proj (their values are k_proj's)
    "gemma4_text": ArchSpec(**_QK, sliding_window=True, values_from_keys="attention_k_eq_v"),
    "gemma4_unified_text": ArchSpec(**_QK, sliding_window=True, values_from_keys="attention_k_eq_v"),
    # the language models of multimodal wrappers (gemma3 and mistral3 wrap gemma3_text and mistral)
    "qwen2_5_vl_text": ArchSpec(bias=True),
    "qwen3_vl_text": ArchSpec(**_QK),
}

_MLA = "multi-head latent attention (MLA) caches a compressed latent, not per-head K/V"

# Families known not to fit: the reason is shown to the user.
UNSUPPORTED: dict[str, str] = {
    "deepseek_v2": _MLA,
    "deepseek_v3": _MLA,
    "deepseek_v32": _MLA,
    "kimi_k2": _MLA,
    "glm_moe_dsa": _MLA,
    "minicpm3": _MLA,
    "mamba": "state-space model without a KV cache",
    "mamba2": "state-space model without a KV cache",
    "rwkv": "recurrent model without a KV cache",
}


def refusal_for(model_type: str) -> str | None:
    """Why the family ``model_type`` cannot be calibrated at all (None: nothing known against it)."""
    return UNSUPPORTED.get(model_type)


def arch_for(model_type: str, config=None) -> ArchSpec:
    """The registry entry for ``config.model_type`` (the text model's), or one line saying why weight
    folding cannot use it: no entry (it names the projections folding rewrites), a family whose value
    rotation cannot be folded, or (given the text ``config``) layers without a value projection."""
    if model_type in UNSUPPORTED:
        raise UnsupportedModelError(f"unsupported architecture {model_type!r}: {UNSUPPORTED[model_type]}")
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {model_type!r} has no entry in oscar's registry (oscar_calib/model/registry.py), which "
            "names the value and output projections that fold-weights rewrites; registered: "
            f"{', '.join(sorted(ARCHITECTURES))}")
    spec = ARCHITECTURES[model_type]
    if spec.fold_refusal:
        raise UnsupportedModelError(f"{model_type}: {spec.fold_refusal}")
    if spec.values_from_keys and config is not None and getattr(config, spec.values_from_keys, False):
        raise UnsupportedModelError(f"{model_type}: with {spec.values_from_keys} its global layers take their values "
                                    f"from k_proj (no {spec.v_proj}), so folding R_v would rotate the keys too")
    return spec


def model_class(config):
    """The transformers auto class that builds the model of ``config`` (None: a GGUF file's) with its
    language-model head:
    ``AutoModelForCausalLM``, or for a multimodal wrapper that transformers maps only as image-text
    to text (Mistral 3, Qwen2.5-VL, Qwen3-VL) ``AutoModelForImageTextToText``. oscar runs the
    wrapper on text alone; its language model is what gets calibrated."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM
