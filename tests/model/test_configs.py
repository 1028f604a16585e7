"""configs/*.yaml: typed sections that reject unknown keys, published geometry, and shapes that the
toolkit (geometry_of, artifact.tensor_shape) agrees on for a random-init model of every family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oscar_calib.contract.checks import check_structure
from oscar_calib.contract.config import (
    config_from_options,
    from_mapping,
    load_yaml_section,
)
from oscar_calib.contract.layout import TENSOR_KINDS, tensor_name, tensor_shape
from oscar_calib.contract.settings import ArtifactSettings
from oscar_calib.errors import InputError
from oscar_calib.model.configs import geometry_from_mapping, load_model_config
from oscar_calib.model.geometry import attention_modules, geometry_of, model_fingerprint
from oscar_calib.model.registry import ARCHITECTURES

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# (layers, query heads, KV heads, head_dim, hidden) from each model's published config.json
PUBLISHED = {
    "qwen3-4b-thinking-2507": ("qwen3", 36, 32, 8, 128, 2560),
    "qwen3-8b": ("qwen3", 36, 32, 8, 128, 4096),
    "qwen3-32b": ("qwen3", 64, 64, 8, 128, 5120),
    "glm-4.7-fp8": ("glm4_moe", 92, 96, 8, 128, 5120),
    "minimax-m2.7": ("minimax_m2", 62, 48, 8, 128, 3072),
    "smollm2-135m": ("llama", 30, 9, 3, 64, 576),
    "gemma3-270m": ("gemma3_text", 18, 4, 1, 256, 640),
    "qwen3-30b-a3b": ("qwen3_moe", 48, 32, 4, 128, 2048),
    "qwen3-235b-a22b": ("qwen3_moe", 94, 64, 4, 128, 4096),
    "gpt-oss-20b": ("gpt_oss", 24, 64, 8, 64, 2880),
    "gpt-oss-120b": ("gpt_oss", 36, 64, 8, 64, 2880),
    "qwen3.5-35b-a3b": ("qwen3_5_moe_text", 40, 16, 2, 256, 2048),
    "gemma-4-31b": ("gemma4_text", 60, 32, 16, 256, 5376),
}

def test_every_covered_model_has_a_config():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_config_geometry_and_tiny_model_shapes(name):
    mc = load_model_config(CONFIGS / f"{name}.yaml")
    g = mc.geometry
    assert (g.model_type, g.num_layers, g.num_attention_heads, g.num_kv_heads, g.head_dim, g.hidden_size) == \
        PUBLISHED[name]
    # the calibration section is what `oscar calibrate --config` reads, through the same path
    cal = from_mapping(load_yaml_section(CONFIGS / f"{name}.yaml"))
    assert cal == mc.calibration and cal.granularity == "head"
    # full-size config (no weights): transformers and the toolkit read the same geometry
    assert geometry_of(g.to_hf_config()) == g.to_geometry()
    # tiny random-init model: real heads / KV heads / head_dim, its attention layers (2; a hybrid's of 4 layers)
    model = g.tiny_model()
    geo = geometry_of(model)
    assert (geo.num_attention_heads, geo.num_kv_heads, geo.head_dim) == (g.num_attention_heads, g.num_kv_heads,
                                                                          g.head_dim)
    assert geo.num_layers == sum(t != "linear_attention" for t in g.layer_types(model.config.num_hidden_layers))
    attn = attention_modules(model)[0]
    hidden = model.config.hidden_size
    gate = 2 if g.model_type in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text") else 1   # q_proj: q and a gate
    assert attn.q_proj.weight.shape == (gate * g.num_attention_heads * g.head_dim, hidden)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (g.num_kv_heads * g.head_dim, hidden)
    assert (attn.k_proj.bias is not None) == g.attention_bias
    norm = getattr(attn, "q_norm", None)
    expected_norm = {None: None, "head": g.head_dim, "layer": g.num_attention_heads * g.head_dim}[g.qk_norm]
    assert (None if norm is None else norm.weight.shape[0]) == expected_norm
    freqs = [b for n, b in model.named_buffers() if n.endswith("inv_freq") and "original" not in n]
    if g.full_head_dim is None:           # (Gemma 4: each layer kind its own RoPE, proportional on global layers)
        assert freqs and all(2 * f.numel() == round(g.head_dim * g.partial_rotary_factor) for f in freqs)
    if g.layer_pattern:
        assert set(geo.layer_types) == set(g.layer_pattern) - {"linear_attention"}
        assert geo.sliding_window == g.sliding_window
    if g.full_head_dim:                   # the global layers' own geometry (Gemma 4)
        full = geo.layer_types.index("full_attention")
        assert (geo.kv_heads[full], geo.head_dims[full]) == (g.full_kv_heads, g.full_head_dim)
    # the artifact contract's shapes for this geometry pass the format-v1 structure check
    tensors = {tensor_name(i, k): torch.zeros(tensor_shape(k, geo.kv_heads[i], geo.head_dims[i]))
               for i in range(geo.num_layers) for k in TENSOR_KINDS}
    assert tensors[tensor_name(0, "k_rotation")].shape == (g.num_kv_heads, g.head_dim, g.head_dim)
    settings = ArtifactSettings(**geo.settings_fields(), group_size=min(128, geo.head_dim), sink_tokens=64,
                                recent_tokens=256, k_objective="qqt", v_objective="sst", composition="u_h_pbr")
    md = {"format": "oscar-rotations", "format_version": "1", "model_id": g.model_id,
          "model_fingerprint": model_fingerprint(model), "calibration": "{}", "toolkit_version": "0",
          **settings.metadata()}
    assert check_structure(tensors, md) == []


def test_smollm2_config_matches_the_real_model(smollm2):
    mc = load_model_config(CONFIGS / "smollm2-135m.yaml")
    model, _, source = smollm2
    assert geometry_of(model) == mc.geometry.to_geometry()
    assert source.model_id == mc.geometry.model_id


def test_families_missing_from_the_registry_calibrate_and_refuse_only_folding():
    """A causal LM the registry does not know (Cohere's, here) has a geometry and a fingerprint like
    any other; fold-weights alone refuses it, in one line naming what is missing."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from oscar_calib.errors import UnsupportedModelError
    from oscar_calib.tools.fold import fold_targets

    assert "cohere" not in ARCHITECTURES
    cfg = AutoConfig.for_model("cohere", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg)
    geo = geometry_of(model)
    assert (geo.model_type, geo.num_layers, geo.num_kv_heads, geo.head_dim) == ("cohere", 2, 2, 16)
    assert len(model_fingerprint(model)) == 64
    with pytest.raises(UnsupportedModelError, match="'cohere' has no entry in oscar's registry"):
        fold_targets(model)


BASE = dict(model_type="llama", num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64)


@pytest.mark.parametrize("change,message", [
    ({"num_heads": 4}, "unknown key(s) num_heads; valid: "),
    ({"num_kv_heads": 3}, "4 query heads do not split over 3 KV heads"),
    ({"head_dim": 0}, "head_dim must be a positive integer"),
    ({"qk_norm": "both"}, "qk_norm must be one of"),
    ({"tiny": {"num_layer": 1}}, "unknown key(s) in tiny: num_layer"),
    ({"layer_pattern": ["sliding_attention"]}, "sliding layers need sliding_window"),
    ({"layer_pattern": ["local"], "sliding_window": 8}, "unknown layer type 'local'"),
])
def test_geometry_rejects_bad_keys_and_values(change, message):
    with pytest.raises(InputError) as exc:
        geometry_from_mapping(dict(BASE, **change))
    assert message in str(exc.value)


def test_missing_geometry_key_and_bad_sections(tmp_path):
    with pytest.raises(InputError, match="missing key"):
        geometry_from_mapping({k: v for k, v in BASE.items() if k != "hidden_size"})
    lines = "\n".join(f"  {k}: {v}" for k, v in BASE.items())
    bad_section = tmp_path / "a.yaml"
    bad_section.write_text(f"geometry:\n{lines}\nrecipe:\n  x: 1\n")
    with pytest.raises(InputError, match="unknown section"):
        load_model_config(bad_section)
    bad_cal = tmp_path / "b.yaml"
    bad_cal.write_text(f"geometry:\n{lines}\ncalibration:\n  tokenz: 5\n")
    with pytest.raises(InputError, match="unknown key"):
        load_model_config(bad_cal)
    good = tmp_path / "c.yaml"
    good.write_text(f"geometry:\n{lines}\ncalibration:\n  tokens: 4096\n")
    assert load_model_config(good).calibration.tokens == 4096


def test_command_line_options_override_the_config_file_only_where_given(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("calibration:\n  dtype: bfloat16\n  tokens: 256\n  seed: 3\n  trust_remote_code: true\n")
    # None and an option's own default ("auto", False) leave the file's value; 0 is a value
    cfg = config_from_options(f, dict(tokens=None, seed=0, dtype="auto", device="auto", trust_remote_code=False),
                              clip="k=0.9,v=0.8")
    assert (cfg.dtype, cfg.tokens, cfg.seed, cfg.trust_remote_code, cfg.device) == ("bfloat16", 256, 0, True, "auto")
    assert (cfg.k_clip, cfg.v_clip) == (0.9, 0.8)
    cfg = config_from_options(f, dict(dtype="float32", tokens=512))
    assert (cfg.dtype, cfg.tokens, cfg.seed) == ("float32", 512, 3)
    assert config_from_options(None, dict(model="m", dtype="auto")) == from_mapping({"model": "m"})
    with pytest.raises(InputError, match="options: unknown key"):
        config_from_options(None, dict(tokenz=5))


def test_rotationzoo_sections():
    """The upstream RotationZoo recipe: the four seed models, the fork scripts' clips (0.96/0.92; V 0.96 for
    Qwen3-32B), typed and validated like every section."""
    from oscar_calib.model.configs import load_all, rotationzoo_from_mapping

    zoo = {c.name: c.rotationzoo for c in load_all(CONFIGS) if c.rotationzoo is not None}
    assert sorted(zoo) == ["glm-4.7-fp8", "qwen3-32b", "qwen3-4b-thinking-2507", "qwen3-8b"]
    assert {n: (z.k_clip, z.v_clip) for n, z in zoo.items()} == {
        "glm-4.7-fp8": (0.96, 0.92), "qwen3-32b": (0.96, 0.96), "qwen3-4b-thinking-2507": (0.96, 0.92),
        "qwen3-8b": (0.96, 0.92)}
    assert all((z.repo, z.group_size, z.sink, z.recent) == ("Zhongzhu/OSCAR-RotationZoo", 128, 64, 256)
               for z in zoo.values())
    assert zoo["qwen3-32b"].tag == "seq16000_prompt69_group128"
    for bad, message in [({"tags": "x"}, "unknown key"), ({"k_clip": 1.5}, "outside"),
                         ({"sink": 60}, "multiple of 8"), ({"recent": 0}, "at least 8"),
                         ({"group_size": 256}, "not a power of two dividing head_dim"), ({"names": "Qwen3-8B"}, "must be a list"),
                         ({"repo": "no-slash"}, "ORG/NAME")]:
        with pytest.raises(InputError, match=message):
            rotationzoo_from_mapping(bad, head_dim=128)
