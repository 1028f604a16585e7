"""Capture oracle: what the attention interface hands us is what the KV cache holds."""

import pytest
import torch
from factories import tiny_model

from oscar_calib.model.capture import Capture
from oscar_calib.numerics.clip import HeldoutLayer


def _capture(model, ids):
    got = {}

    def obs(layer, module, q, k, v, o, kw):
        got[layer] = dict(q=q.clone(), k=k.clone(), v=v.clone(), o=o.clone(), scaling=module.scaling,
                          window=kw.get("sliding_window"))

    with torch.no_grad(), Capture(model, [obs]):
        logits = model(input_ids=ids, use_cache=False).logits
    return got, logits


def _check_against_cache(model, ids):
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        ref_logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
    got, logits = _capture(model, ids)
    assert model.config._attn_implementation != "oscar_capture"        # restored on exit
    assert torch.equal(logits, ref_logits)                               # outputs unchanged
    assert len(got) == model.config.num_hidden_layers
    for i, layer in enumerate(cache.layers):
        # a sliding-window cache layer keeps only the most recent tokens: compare that suffix
        n = layer.keys.shape[2]
        assert n == ids.shape[1] or type(layer).__name__.startswith("DynamicSliding")
        assert torch.equal(got[i]["k"][:, :, -n:], layer.keys), f"layer {i} keys differ from the cache"
        assert torch.equal(got[i]["v"][:, :, -n:], layer.values), f"layer {i} values differ from the cache"
    return got


@pytest.mark.parametrize("kind", ["llama", "llama_mha", "qwen3", "qwen2", "mistral", "gemma3"])
def test_tiny_models_capture_equals_cache(kind):
    model = tiny_model(kind, layers=2)
    ids = torch.randint(1, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    got = _check_against_cache(model, ids)
    # the captured attention output is softmax(q k^T) v with the layer's own causal/sliding mask
    for i, g in got.items():
        held = HeldoutLayer([g["q"][0].transpose(0, 1)], [g["k"][0].transpose(0, 1)], [g["v"][0].transpose(0, 1)],
                            [g["o"][0]], g["scaling"], g["window"])
        o = held.attend(held.probs()[0], held.v[0]).float()
        assert torch.allclose(o, g["o"][0], atol=2e-5), f"{kind} layer {i}: recomputed attention output differs"


def test_gemma3_sliding_window_is_honoured():
    model = tiny_model("gemma3", layers=2)   # layer 0 sliding (window 8), layer 1 full
    ids = torch.randint(1, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    got, _ = _capture(model, ids)
    assert got[0]["window"] == 8 and not got[1]["window"]
    g = got[0]
    windowed = HeldoutLayer([g["q"][0].transpose(0, 1)], [g["k"][0].transpose(0, 1)], [g["v"][0].transpose(0, 1)],
                            [g["o"][0]], g["scaling"], 8)
    full = HeldoutLayer(windowed.q, windowed.k, windowed.v, windowed.o, g["scaling"], None)
    o_w = windowed.attend(windowed.probs()[0], windowed.v[0]).float()
    o_f = full.attend(full.probs()[0], full.v[0]).float()
    assert torch.allclose(o_w, g["o"][0], atol=2e-5)
    assert not torch.allclose(o_f, g["o"][0], atol=1e-3)       # the window matters past 8 tokens


@pytest.mark.slow
def test_smollm2_capture_equals_cache_and_logits_unchanged(smollm2):
    model, tok, _ = smollm2
    ids = torch.tensor([tok("The quick brown fox jumps over the lazy dog. " * 4)["input_ids"]])
    got = _check_against_cache(model, ids)
    assert got[0]["q"].shape[1:] == (9, ids.shape[1], 64) and got[0]["k"].shape[1] == 3


def test_capture_restores_on_error():
    model = tiny_model("llama")

    def boom(*a):
        raise RuntimeError("observer failed")

    with pytest.raises(RuntimeError):
        with Capture(model, [boom]):
            model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    assert model.config._attn_implementation == "sdpa"
