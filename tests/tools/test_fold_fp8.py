"""oscar fold-weights on compressed-tensors FP8 checkpoints (per-channel and per-tensor scales): the
fork's re-quantisation rule, the config checks, and whole folds of small random-init FP8 checkpoints
saved locally (Llama, Qwen3, and GLM-4.7's architecture from configs/) with their proofs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from factories import FAST, tiny_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from oscar_calib.errors import InputError, NumericalError, UnsupportedModelError
from oscar_calib.tools.fold import (
    dequantize_fp8,
    dequantized_copy,
    fold_checkpoint,
    fp8_strategy,
    quantize_fp8,
)

FP8 = torch.float8_e4m3fn


def ct_config(strategy: str, **weights) -> dict:
    """A compressed-tensors ``quantization_config`` as FP8 checkpoints on the hub carry it."""
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                                      "symmetric": True, "dynamic": False, **weights},
                                          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                                "dynamic": True, "symmetric": True}}}}


def save_fp8(model, tokenizer, directory: Path, strategy: str) -> Path:
    """Save ``model`` as a compressed-tensors FP8 checkpoint: every 2-D linear weight of the decoder
    layers (MoE router excepted, as real checkpoints ignore it) as float8_e4m3fn with a float32
    ``weight_scale`` = amax/448, per output row ``[out, 1]`` (channel) or one ``[1]`` (tensor)."""
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    for name, w in list(tensors.items()):
        if name.endswith(".weight") and w.dim() == 2 and ".layers." in name and not name.endswith("mlp.gate.weight"):
            amax = w.abs().amax(1, keepdim=True) if strategy == "channel" else w.abs().max().reshape(1)
            scale = (amax / 448).clamp(min=1e-12).float()
            tensors[name] = (w / scale).clamp(-448, 448).to(FP8)
            tensors[name + "_scale"] = scale
    save_file(tensors, str(path), metadata={"format": "pt"})
    cfg = json.loads((directory / "config.json").read_text())
    cfg["quantization_config"] = ct_config(strategy)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return directory


def test_fp8_requantisation_follows_the_forks_rule():
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [300.0, 10.0, -448.0]], dtype=torch.float64)
    q, s = quantize_fp8(w, True, torch.zeros(3, 1))
    assert s.dtype == torch.float32 and s.shape == (3, 1)
    assert s[:, 0].tolist() == pytest.approx([2 / 448, 1e-12, 1.0], rel=1e-6)    # amax/448, floored at 1e-12
    assert q.dtype == FP8 and q[1].float().tolist() == [0.0, 0.0, 0.0]
    assert q[0].float().tolist() == [224.0, -448.0, 112.0]                         # exact powers of two
    back = dequantize_fp8(q, s)
    assert torch.allclose(back, w, rtol=2 ** -4, atol=0)                           # e4m3: 3 mantissa bits
    qt, st = quantize_fp8(w, False, torch.zeros(1))
    assert st.shape == (1,) and st.item() == pytest.approx(1.0)
    assert dequantize_fp8(qt, st)[2].tolist() == [288.0, 10.0, -448.0]


def test_fp8_config_detection():
    assert fp8_strategy({"quantization_config": ct_config("channel")}) == "channel"
    assert fp8_strategy({"quantization_config": ct_config("tensor")}) == "tensor"
    assert fp8_strategy({}) is None
    assert fp8_strategy({"quantization_config": {"quant_method": "gguf"}}) is None     # the float path's to refuse
    for qc, message in [(ct_config("block", block_structure=[128, 128]), "block FP8 scales"),
                        (ct_config("group", group_size=128), "group FP8 scales"),
                        (ct_config("channel", symmetric=False), "with a zero point"),
                        (ct_config("channel", type="int", num_bits=4), "int4"),
                        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise FP8")]:
        with pytest.raises(UnsupportedModelError, match=message):
            fp8_strategy({"quantization_config": qc})


def _calibrated(fp8_dir: Path, root: Path) -> Path:
    """An artifact calibrated on the de-quantised checkpoint (same fingerprint as the FP8 one)."""
    from oscar_calib.calibration.pipeline import calibrate
    from oscar_calib.contract.config import CalibrationConfig
    from oscar_calib.model.load import load_model

    lm = load_model(str(dequantized_copy(fp8_dir, root / "deq")), dtype="float32")
    calibrate(CalibrationConfig(**{**FAST, "tokens": 512, "seq_len": 128, "heldout_tokens": 64}), root / "art",
              loaded=lm)
    return root / "art"


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _glm_tiny(vocab: int):
    from transformers import AutoModelForCausalLM

    from oscar_calib.model.configs import configs_dir, load_model_config

    cfg = load_model_config(configs_dir() / "glm-4.7-fp8.yaml").geometry.to_hf_config(tiny=True)
    cfg.vocab_size = vocab
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("kind,strategy", [("llama", "channel"), ("qwen3", "tensor"), ("glm4_moe", "channel")])
def test_fold_weights_on_an_fp8_checkpoint(smollm2, tmp_path, kind, strategy):
    from oscar_calib.contract.artifact import load_artifact

    _, tok, _ = smollm2
    model = _glm_tiny(len(tok)) if kind == "glm4_moe" else tiny_model(kind, vocab_size=len(tok))
    src = save_fp8(model, tok, tmp_path / "fp8", strategy)
    art_dir = _calibrated(src, tmp_path)
    before = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}
    res = fold_checkpoint(str(src), art_dir, tmp_path / "out")
    r, out = res.report, tmp_path / "out"
    assert r["check"]["ok"] and r["check"]["logits_rel_diff"] < 1e-4          # the maths, on the float model
    assert r["reload"]["ok"] and r["reload"]["logits_rel_diff"] <= r["reload"]["tolerance"]
    assert r["reload"]["value_rel_err"] <= r["reload"]["value_tolerance"]
    assert r["fp8"] == {"strategy": strategy, "tensors_requantized": 4, "shards_rewritten": ["model.safetensors"]}
    assert {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()} == before      # the input is untouched
    old, new = _tensors(src), _tensors(out)
    assert set(old) == set(new)
    art = load_artifact(art_dir)
    for name, t in old.items():
        changed = ".v_proj." in name or ".o_proj." in name
        if not changed:
            assert torch.equal(new[name].view(torch.uint8) if t.dtype == FP8 else new[name],
                               t.view(torch.uint8) if t.dtype == FP8 else t), name
            continue
        assert new[name].dtype == t.dtype and new[name].shape == t.shape, name
    # the V rows hold Rᵀ W_v per KV head, to FP8 precision (an independent float64 computation)
    h, d = art.num_kv_heads, art.head_dim
    for i, layer in enumerate(art.layers):
        p = f"model.layers.{i}.self_attn.v_proj."
        want = torch.einsum("hde,hdk->hek", layer.v_rotation.double(),
                            dequantize_fp8(old[p + "weight"], old[p + "weight_scale"]).reshape(h, d, -1))
        got = dequantize_fp8(new[p + "weight"], new[p + "weight_scale"]).reshape(h, d, -1)
        assert (got - want).abs().max() <= 2 ** -4 * want.abs().max()
        if p + "bias" in old:                                      # GLM: biased projections, b_h R
            bias = torch.einsum("hd,hde->he", old[p + "bias"].double().reshape(h, d), layer.v_rotation.double())
            assert torch.allclose(new[p + "bias"].double(), bias.reshape(-1), atol=1e-6)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == ct_config(strategy) and cfg["oscar"]["v_folded"] is True
    assert (out / "oscar" / "oscar.safetensors").exists() and (out / "tokenizer.json").exists()
    assert load_artifact(out / "oscar").metadata["v_folded"] == "true"


def test_fp8_fold_refuses_a_broken_result_and_writes_nothing(smollm2, tmp_path, monkeypatch):
    """The proof on the written checkpoint: V rotated with Rᵀ instead of R is caught by the values check
    (its logits on a random-init model barely move), nothing appears at --out."""
    import oscar_calib.tools.fold.fp8 as fp8
    import oscar_calib.tools.fold.weights as weights

    _, tok, _ = smollm2
    src = save_fp8(tiny_model("llama", vocab_size=len(tok)), tok, tmp_path / "fp8", "channel")
    art_dir = _calibrated(src, tmp_path)
    good = weights.fold_layer
    refold = fp8.refold_fp8

    def wrong(*args):
        monkeypatch.setattr(weights, "fold_layer", lambda t, r, n: good(t, r.transpose(-1, -2).contiguous(), n))
        try:
            return refold(*args)
        finally:
            monkeypatch.setattr(weights, "fold_layer", good)

    monkeypatch.setattr(fp8, "refold_fp8", wrong)
    with pytest.raises(NumericalError, match=r"values vs original·R .* nothing written"):
        fold_checkpoint(str(src), art_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]      # no scratch left behind
    with pytest.raises(InputError, match="--dtype"):
        fold_checkpoint(str(src), art_dir, tmp_path / "out", dtype="bfloat16")
    # an unsupported FP8 layout is one line, before any work
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = ct_config("block", block_structure=[128, 128])
    blocked = tmp_path / "blocked"
    shutil.copytree(src, blocked)
    (blocked / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="block FP8 scales"):
        fold_checkpoint(str(blocked), art_dir, tmp_path / "out")
