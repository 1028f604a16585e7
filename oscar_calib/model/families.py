"""The model families oscar is tested on, as data: each one's transformers ``model_type``, a
published model of it, and the config of a tiny random-init stand-in (2-4 layers, hidden size 64,
the family's own config class and attention code) on which the tests run the whole pipeline and
the support table (:mod:`oscar_calib.tools.support`) is computed.

=================  ===========================================================================
field              meaning
=================  ===========================================================================
``name``           the row's name: the ``model_type`` of the config a checkpoint carries
``example``        a published model of the family (the support table's link to the real thing)
``tiny``           keyword arguments of ``AutoConfig.for_model(name, ...)`` for the stand-in; a
                   multimodal wrapper's nest ``text_config`` (and a tiny ``vision_config``)
``since``          the oldest transformers minor version that has the family (None: all that
                   oscar supports)
=================  ===========================================================================

The stand-ins keep what matters to a KV cache: GQA (4 query heads over 2 KV heads), head_dim 16,
the family's layer pattern (sliding, chunked or NoPE layers, attention sinks, q/k norms, biases,
scaling multipliers) and, for mixtures of experts, a routed MLP of 4 experts. A hybrid's stand-in
interleaves its recurrent layers with attention layers so that the artifact's layers map to
decoder layers other than 0..n-1 (Qwen3.5's 3:1 pattern as ``linear, full, linear, full``);
Gemma 4's has global layers of twice the sliding layers' head_dim (and, in the wrapper, fewer KV
heads, as ``attention_k_eq_v`` gives them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# what every stand-in shares: tiny widths, GQA, a 128-token vocabulary
BASE = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=128, max_position_embeddings=512)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
TWO_KINDS = ["sliding_attention", "full_attention"]
VISION = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
# hybrids: Gated DeltaNet layers (Qwen3-Next, Qwen3.5) between attention layers
LINEAR = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, linear_num_value_heads=2,
              linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
SHARED_MOE = dict(MOE, shared_expert_intermediate_size=32)
MAMBA = dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4,
             mamba_expand=1, mamba_chunk_size=16)
# Gemma 4: sliding layers of head_dim 16, global (full) layers of 32; no per-layer input embeddings
GEMMA4 = dict(BASE, num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
              sliding_window=8, global_head_dim=32, hidden_size_per_layer_input=0, vocab_size_per_layer_input=128)


@dataclass(frozen=True)
class Family:
    name: str
    example: str
    tiny: dict = field(default_factory=dict)
    since: str | None = None

    def available(self) -> bool:
        """Whether the installed transformers has the family (``since`` or later)."""
        import transformers

        from ..versions import version_tuple

        return self.since is None or version_tuple(transformers.__version__) >= version_tuple(self.since)

    @property
    def wrapper(self) -> bool:
        """A multimodal wrapper: its language model is what oscar calibrates."""
        return "text_config" in self.tiny

    def config(self):
        """The stand-in's transformers config (no weights)."""
        from transformers import AutoConfig

        return AutoConfig.for_model(self.name, **self.tiny)

    def model(self, *, seed: int = 0):
        """The random-init stand-in: float32, eval mode, no gradients."""
        import torch

        from .registry import model_class

        config = self.config()
        torch.manual_seed(seed)
        model = model_class(config).from_config(config).eval()
        model.requires_grad_(False)
        return model


FAMILIES: dict[str, Family] = {f.name: f for f in (
    # dense families registered before (their stand-ins make the support table; tests/model/test_models.py
    # checks their fingerprints against the registry-based rule)
    Family("llama", "meta-llama/Llama-3.1-8B", dict(BASE)),
    Family("mistral", "mistralai/Mistral-7B-v0.1", dict(BASE, sliding_window=16)),
    Family("qwen2", "Qwen/Qwen2.5-7B", dict(BASE)),
    Family("qwen3", "Qwen/Qwen3-8B", dict(BASE)),
    Family("gemma2", "google/gemma-2-9b", dict(BASE, sliding_window=8, layer_types=TWO_KINDS,
                                               query_pre_attn_scalar=16)),
    Family("gemma3_text", "google/gemma-3-270m", dict(BASE, sliding_window=8, layer_types=TWO_KINDS,
                                                      query_pre_attn_scalar=16)),
    Family("olmo2", "allenai/OLMo-2-1124-7B", dict(BASE)),
    Family("glm4_moe", "zai-org/GLM-4.7-FP8", dict(BASE, n_routed_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=32, first_k_dense_replace=1,
                                                   use_qk_norm=True, partial_rotary_factor=0.5)),
    Family("minimax_m2", "MiniMaxAI/MiniMax-M2.7", dict(BASE, num_local_experts=4, num_experts_per_tok=2,
                                                        rotary_dim=8)),
    Family("phi3", "microsoft/Phi-4-mini-instruct", dict(BASE, pad_token_id=0)),
    # mixtures of experts
    Family("qwen3_moe", "Qwen/Qwen3-30B-A3B", dict(BASE, **MOE)),
    Family("qwen2_moe", "Qwen/Qwen1.5-MoE-A2.7B", dict(BASE, **MOE, shared_expert_intermediate_size=32)),
    Family("mixtral", "mistralai/Mixtral-8x7B-v0.1", dict(BASE, num_local_experts=4, num_experts_per_tok=2)),
    Family("gpt_oss", "openai/gpt-oss-20b", dict(BASE, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                                  layer_types=TWO_KINDS)),
    Family("llama4_text", "meta-llama/Llama-4-Scout-17B-16E-Instruct",
           dict(BASE, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64, no_rope_layers=[1, 0],
                attention_chunk_size=16)),
    Family("granitemoe", "ibm-granite/granite-3.1-3b-a800m-instruct",
           dict(BASE, num_local_experts=4, num_experts_per_tok=2, attention_multiplier=0.2)),
    # dense
    Family("olmo3", "allenai/Olmo-3-7B-Instruct", dict(BASE, sliding_window=8, layer_types=TWO_KINDS)),
    Family("seed_oss", "ByteDance-Seed/Seed-OSS-36B-Instruct", dict(BASE)),
    Family("smollm3", "HuggingFaceTB/SmolLM3-3B", dict(BASE, no_rope_layers=[1, 0], pad_token_id=0)),
    Family("granite", "ibm-granite/granite-3.3-8b-instruct", dict(BASE, attention_multiplier=0.2)),
    Family("exaone4", "LGAI-EXAONE/EXAONE-4.0-32B", dict(BASE, sliding_window=8, sliding_window_pattern=2)),
    Family("ernie4_5", "baidu/ERNIE-4.5-0.3B-PT", dict(BASE)),
    # multimodal wrappers: the language model is calibrated
    Family("gemma3", "google/gemma-3-27b-it",
           dict(text_config=dict(BASE, sliding_window=8, layer_types=TWO_KINDS, query_pre_attn_scalar=16),
                vision_config=VISION, mm_tokens_per_image=4)),
    Family("llama4", "meta-llama/Llama-4-Maverick-17B-128E-Instruct",
           dict(text_config=dict(BASE, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64,
                                 no_rope_layers=[1, 0], attention_chunk_size=16),
                vision_config=dict(VISION, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32))),
    Family("mistral3", "mistralai/Mistral-Small-3.2-24B-Instruct-2506",
           dict(text_config=dict(BASE, model_type="mistral"), vision_config=dict(VISION, head_dim=16))),
    Family("qwen2_5_vl", "Qwen/Qwen2.5-VL-7B-Instruct",
           dict(text_config=dict(BASE, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                            mrope_section=[2, 3, 3])),
                vision_config=dict(QWEN_VISION, fullatt_block_indexes=[0]))),
    Family("qwen3_vl", "Qwen/Qwen3-VL-8B-Instruct",
           dict(text_config=dict(BASE), vision_config=dict(QWEN_VISION, deepstack_visual_indexes=[0]))),
    # hybrids: only the attention layers have artifact layers (the others keep a recurrent state)
    Family("qwen3_next", "Qwen/Qwen3-Next-80B-A3B-Instruct", dict(BASE, **LINEAR, **SHARED_MOE)),
    Family("qwen3_5_text", "Qwen/Qwen3.5-4B", dict(BASE, **LINEAR)),
    Family("qwen3_5_moe_text", "Qwen/Qwen3.5-35B-A3B", dict(BASE, **LINEAR, **SHARED_MOE)),
    Family("qwen3_5", "Qwen/Qwen3.5-27B", dict(text_config=dict(BASE, **LINEAR), vision_config=QWEN_VISION)),
    Family("qwen3_5_moe", "Qwen/Qwen3.5-397B-A17B",
           dict(text_config=dict(BASE, **LINEAR, **SHARED_MOE), vision_config=QWEN_VISION)),
    Family("falcon_h1", "tiiuae/Falcon-H1-7B-Instruct", dict(BASE, **MAMBA)),
    Family("lfm2", "LiquidAI/LFM2-1.2B", dict(BASE, num_hidden_layers=4, full_attn_idxs=[1, 3], conv_L_cache=3)),
    # mixed head sizes per layer
    Family("gemma4_text", "google/gemma-4-31B-it", dict(GEMMA4)),
    Family("gemma4", "google/gemma-4-26B-A4B-it",
           dict(text_config=dict(GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1),
                vision_config=dict(VISION, head_dim=16))),
    Family("gemma4_unified", "google/gemma-4-12B-it",
           dict(text_config=dict(GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1),
                vision_config=dict(VISION, head_dim=16))),
)}
