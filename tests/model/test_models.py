"""Model resolution (aliases, GGUF files and directories, checkpoints, hub ids), the registry and
fingerprints."""

from pathlib import Path

import pytest
import torch
from factories import byte_tokenizer, tiny_model

from oscar_calib.errors import (
    InputError,
    ModelLoadError,
    UnsupportedModelError,
)
from oscar_calib.model.geometry import geometry_of, model_fingerprint
from oscar_calib.model.load import gguf_cache_dir, load_model
from oscar_calib.model.registry import ARCHITECTURES, arch_for
from oscar_calib.model.source import ALIASES, resolve_model, spec_for_model_id


def test_alias_resolves_to_the_wheel_gguf():
    src = resolve_model("smollm2-135m")
    assert src.kind == "alias" and src.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert src.model_id == ALIASES["smollm2-135m"]["model_id"]
    assert spec_for_model_id(src.model_id) == "smollm2-135m"
    assert gguf_cache_dir(src) is not None


def test_gguf_file_and_directory(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.gguf").write_bytes(b"GGUF")
    assert resolve_model(str(one)).gguf_file == "m.gguf"
    assert resolve_model(str(one / "m.gguf")).kind == "gguf"
    (one / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(InputError, match="2 .gguf files"):
        resolve_model(str(one))
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(InputError, match="must be .gguf"):
        resolve_model(str(tmp_path / "w.bin"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no config.json"):
        resolve_model(str(empty))


def test_hub_id_offline_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("some-org/some-model").kind == "hub"
    with pytest.raises(ModelLoadError, match="hub"):
        load_model("some-org/some-model")


def test_not_a_model_name():
    with pytest.raises(InputError, match="not found"):
        resolve_model("./definitely/not/here")


def test_checkpoint_dir_loads_and_keeps_fingerprint(tiny_llama_dir):
    lm = load_model(str(tiny_llama_dir), device="cpu")
    model, src = lm.model, lm.source
    assert src.kind == "local" and geometry_of(model).num_kv_heads == 2
    ref = tiny_model("llama", vocab_size=len(byte_tokenizer()))
    assert model_fingerprint(model) == model_fingerprint(ref)


def test_fingerprint_ignores_dtype_but_not_geometry():
    a = tiny_model("llama")
    b = tiny_model("llama").to(dtype=__import__("torch").bfloat16)
    assert model_fingerprint(a) == model_fingerprint(b)
    assert model_fingerprint(a) != model_fingerprint(tiny_model("llama_mha"))


def test_registry_is_data_and_refuses_mla():
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma3_text"} <= set(ARCHITECTURES)
    assert ARCHITECTURES["qwen3"].k_norm == "k_norm" and ARCHITECTURES["qwen2"].bias
    with pytest.raises(UnsupportedModelError, match="latent attention"):
        arch_for("deepseek_v3")
    with pytest.raises(UnsupportedModelError, match="no entry in oscar's registry .* value and output projections"):
        arch_for("bert")


# the families registered before the fingerprint stopped reading the registry: the zoo's artifacts
# (SmolLM2/llama, Gemma-3) and every user's record fingerprints made by the registry-based rule
REGISTERED_BEFORE = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2", "glm4_moe", "minimax_m2",
                     "phi3")


def _registry_fingerprint(model) -> str:
    """The fingerprint as the registry-based rule computed it: the text config (volatile keys
    dropped) and the attention weights of ``model.layers.{i}.self_attn`` (every family it knew
    kept its layers at ``model.layers`` and its attention at ``self_attn``)."""
    import hashlib
    import json

    from oscar_calib.model.geometry import _VOLATILE, text_config

    cfg = {k: v for k, v in text_config(model.config).to_dict().items() if k not in _VOLATILE and not k.startswith("_")}
    shapes = [(f"model.layers.{i}.self_attn.{name}", list(p.shape))
              for i, layer in enumerate(model.model.layers) for name, p in sorted(layer.self_attn.named_parameters())]
    blob = json.dumps({"config": cfg, "attention_weights": shapes}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


@pytest.mark.parametrize("name", REGISTERED_BEFORE)
def test_generic_fingerprint_equals_the_registry_based_one(name):
    """The fingerprint finds the attention modules by structure, with no registry entry; for every
    family the registry knew before, it is byte for byte the registry-based one, so the artifacts
    made then still match their models."""
    from oscar_calib.model.families import FAMILIES

    model = FAMILIES[name].model()
    assert model_fingerprint(model) == _registry_fingerprint(model)


def test_geometry_and_fingerprint_need_no_registry_entry():
    """A family the registry does not know is calibrated all the same (geometry and fingerprint
    from the model's structure); only fold-weights names the missing entry."""
    from oscar_calib.model.families import FAMILIES
    from oscar_calib.model.geometry import decoder_attention

    model = FAMILIES["qwen3_vl"].model()
    assert "qwen3_vl" not in ARCHITECTURES
    geo = geometry_of(model)
    assert (geo.model_type, geo.text_config, geo.num_kv_heads) == ("qwen3_vl_text", "qwen3_vl.text_config", 2)
    assert [p for p, _ in decoder_attention(model)] == [f"model.language_model.layers.{i}.self_attn" for i in range(2)]
    assert len(model_fingerprint(model)) == 64


def test_geometry_of_gemma3_layer_types():
    g = geometry_of(tiny_model("gemma3"))
    assert g.layer_types == ("sliding_attention", "full_attention") and g.sliding_window == 8 and g.group == 4


def test_gguf_cache_is_installed_whole_and_only_once(tmp_path):
    """The de-quantised copy goes through fsutil.staged_dir: a failed save leaves nothing, and a
    second writer keeps the first writer's copy."""
    import types

    from oscar_calib.model.load import _save_gguf_cache

    class Saver:
        def __init__(self, name: str, fail: bool = False, dtype=torch.float32):
            self.name, self.fail, self.dtype = name, fail, dtype
            self.config, self.hf_quantizer = types.SimpleNamespace(quantization_config={}), object()

        def parameters(self):
            return iter([torch.zeros(1, dtype=self.dtype)])

        def save_pretrained(self, d):
            if self.fail:
                raise OSError("disk full")
            (Path(d) / self.name).write_text(self.name)

    target = tmp_path / "gguf" / "m-0123"
    # a model loaded in bfloat16 is not cached: the copy is what dtype="auto" loads later (float32)
    _save_gguf_cache(Saver("model.safetensors", dtype=torch.bfloat16), Saver("tokenizer.json"), target)
    assert not target.exists()
    _save_gguf_cache(Saver("model.safetensors", fail=True), Saver("tokenizer.json"), target)
    assert not target.exists() and not list(target.parent.iterdir())
    _save_gguf_cache(Saver("model.safetensors"), Saver("tokenizer.json"), target)
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors", "tokenizer.json"]
    _save_gguf_cache(Saver("other.safetensors"), Saver("tokenizer.json"), target)
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors", "tokenizer.json"]
    assert [p.name for p in target.parent.iterdir()] == ["m-0123"]           # no staging left behind
