"""SimulatedCache (the accuracy simulation): lossless equality with DynamicCache, the stored
layout and its memory, sliding windows, artifacts, and agreement with the perplexity simulation."""

from __future__ import annotations

import pytest
import torch
from factories import tiny_model
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from oscar_calib.errors import ArtifactError, InputError
from oscar_calib.model.geometry import geometry_of
from oscar_calib.runtime.scheme import KVScheme
from oscar_calib.runtime.simulated import SimulatedCache, SimulatedLayer


def lossless(model, sink=3, recent=4):
    return SimulatedCache(model.config, KVScheme.full_precision(geometry_of(model).num_layers, window_dtype=None,
                                                            sink=sink, recent=recent))


def hadamard_scheme(model, group_size=8, sink=2, recent=3, window_dtype=None):
    geo = geometry_of(model)
    return KVScheme.uniform("hadamard", geo.num_layers, geo.num_kv_heads, geo.head_dim, group_size,
                            rotation="hadamard", clips=(0.96, 0.92), sink=sink, recent=recent,
                            window_dtype=window_dtype)


@pytest.mark.parametrize("kind", ["llama", "gemma3", "mistral"])
def test_lossless_generate_equals_dynamic_cache(kind):
    m = tiny_model(kind, layers=2)
    ids = torch.randint(1, 120, (2, 20), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=14, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    ref = m.generate(ids, past_key_values=DynamicCache(config=m.config), **kw)
    cache = lossless(m)
    out = m.generate(ids, past_key_values=cache, **kw)
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.scores, out.scores):
        assert torch.equal(a, b)
    # something was really moved through the history segment (not only the windows)
    assert max(layer.seg.n_hist() for layer in cache.layers) > 0


def test_lossless_step_by_step_logits_equal():
    m = tiny_model("gemma3", layers=2)
    ids = torch.randint(1, 120, (1, 24), generator=torch.Generator().manual_seed(2))
    ref_cache, cache = DynamicCache(config=m.config), lossless(m, sink=2, recent=3)
    a = m(ids[:, :9], past_key_values=ref_cache, use_cache=True).logits
    b = m(ids[:, :9], past_key_values=cache, use_cache=True).logits
    assert torch.equal(a, b)
    for t in range(9, 24):
        a = m(ids[:, t:t + 1], past_key_values=ref_cache, use_cache=True).logits
        b = m(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
        assert torch.equal(a, b), t


def test_beam_search_lossless():
    m = tiny_model("llama", layers=2)
    ids = torch.randint(1, 120, (1, 12), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)
    ref = m.generate(ids, past_key_values=DynamicCache(config=m.config), **kw)
    out = m.generate(ids, past_key_values=lossless(m), **kw)
    assert torch.equal(ref, out)


def test_smollm2_generate_identical_text(smollm2):
    model, tok, _ = smollm2
    ids = tok("The Python programming language", return_tensors="pt").input_ids
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
    out = model.generate(ids, past_key_values=lossless(model, sink=2, recent=2), **kw)
    assert tok.decode(ref[0]) == tok.decode(out[0])
    assert torch.equal(ref, out)


def test_decode_equals_perplexity_simulation():
    """Token-by-token decoding through the cache reads exactly what the ppl simulation reads."""
    from oscar_calib.runtime.simulate import SimulatedKV

    for kind in ("llama", "mistral"):
        m = tiny_model(kind, layers=2)
        ids = torch.randint(1, 120, (1, 30), generator=torch.Generator().manual_seed(4))
        scheme = hadamard_scheme(m)
        with SimulatedKV(m, scheme):
            sim = m(ids).logits
        cache = SimulatedCache(m.config, scheme)
        dec = torch.cat([m(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(30)], 1)
        plain = m(ids).logits
        assert (dec - sim).abs().max() < 1e-4    # float32 summation order (torch 2.11 on the GPU machine exceeds 1e-5)
        assert (sim - plain).abs().max() > 1e-3          # INT2 really changed something


def test_int2_changes_logits_and_saves_memory():
    m = tiny_model("llama", layers=2, head_dim=32)
    ids = torch.randint(1, 120, (1, 40), generator=torch.Generator().manual_seed(5))
    scheme = hadamard_scheme(m, group_size=16, sink=4, recent=8, window_dtype=torch.bfloat16)
    cache = SimulatedCache(m.config, scheme)
    m(ids, past_key_values=cache, use_cache=True)
    mem = cache.memory()
    geo = geometry_of(m)
    h, d, g = geo.num_kv_heads, geo.head_dim, 16
    hist = 40 - 4 - 8
    per_layer = 2 * (12 * h * d * 2 + hist * h * (d // 4 + 2 * 2 * d // g))   # K and V: bf16 windows + packed rows
    assert mem["bytes"] == geo.num_layers * per_layer
    assert mem["bytes_per_token"] == mem["bytes"] / 40
    assert mem["history_bits_per_element"] == 2 + 32 / 16
    seg = cache.layers[0].seg
    assert seg.sink_k.dtype == torch.bfloat16 and seg.hist.k.codes.dtype == torch.uint8


def test_sliding_layers_keep_window_and_mask_sizes():
    m = tiny_model("gemma3", layers=2)                 # layer 0 sliding (window 8), layer 1 full
    cache = SimulatedCache(m.config, hadamard_scheme(m, sink=2, recent=3))
    ref = DynamicSlidingWindowLayer(sliding_window=8)
    ids = torch.randint(1, 120, (1, 11), generator=torch.Generator().manual_seed(6))
    m(ids, past_key_values=cache, use_cache=True)
    k = torch.zeros(1, 1, 11, 16)
    ref.update(k, k)
    sl, full = cache.layers
    assert sl.is_sliding and not full.is_sliding
    assert sl.seg.stored() == 7 and full.seg.stored() == 11
    for q in (1, 5):
        assert sl.get_mask_sizes(q) == ref.get_mask_sizes(q)
    assert sl.get_seq_length() == 11 == cache.get_seq_length()


def test_from_artifact(zoo_smollm2, smollm2):
    model, tok, _ = smollm2
    with pytest.raises(InputError, match="cannot subtract the logit-noise correction"):
        SimulatedCache.from_artifact(zoo_smollm2, model)             # the zoo artifact asks for it
    cache = SimulatedCache.from_artifact(zoo_smollm2, model, logit_correction=0.0)
    assert cache.scheme.group_size == 64 and cache.scheme.sink == 64 and cache.scheme.recent == 256
    assert isinstance(cache.layers[0], SimulatedLayer)
    ids = tok("def f(x):\n    return", return_tensors="pt").input_ids
    out = model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False,
                         pad_token_id=tok.eos_token_id)
    assert out.shape[1] == ids.shape[1] + 3
    with pytest.raises(ArtifactError):
        SimulatedCache.from_artifact(zoo_smollm2, tiny_model("llama"))

