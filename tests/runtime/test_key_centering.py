"""Key centering in the serving path: every stored key is ``(k − μ) @ R_k`` (window and history), the
call's own keys too, a soft-capped layer gets ``q·μ`` back before the cap; the real cache (torch
path) equals both simulations, and a lossless scheme stays lossless."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from factories import tiny_model

from oscar_calib.errors import InputError
from oscar_calib.model.geometry import geometry_of
from oscar_calib.runtime import KVScheme, OscarCache, SimulatedCache
from oscar_calib.runtime.scheme import SchemeLayer
from oscar_calib.runtime.simulate import SimulatedKV


def centered(scheme: KVScheme, model, scale: float = 2.0, seed: int = 0) -> KVScheme:
    """``scheme`` with a random mean key per layer and KV head."""
    geo = geometry_of(model)
    g = torch.Generator().manual_seed(seed)
    means = [torch.randn(geo.num_kv_heads, geo.head_dim, generator=g) * scale for _ in range(geo.num_layers)]
    return dataclasses.replace(scheme, k_mean=means)


def hadamard(model, *, window_dtype=None, sink=2, recent=3, rotation="hadamard"):
    geo = geometry_of(model)
    clips = (0.96, 0.92) if rotation == "hadamard" else (1.0, 1.0)
    return KVScheme.uniform(rotation, geo.num_layers, geo.num_kv_heads, geo.head_dim, 8, rotation=rotation,
                            clips=clips, sink=sink, recent=recent, window_dtype=window_dtype)


def decode(model, cache, ids, prefill: int, chunk: int = 1) -> torch.Tensor:
    """Logits of a prefill of ``prefill`` tokens, then calls of ``chunk`` tokens."""
    ctx = cache.attach(model) if isinstance(cache, OscarCache) else torch.no_grad()
    with ctx, torch.no_grad():
        out = [model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits]
        for t in range(prefill, ids.shape[1], chunk):
            out.append(model(ids[:, t:t + chunk], past_key_values=cache, use_cache=True).logits)
    return torch.cat(out, 1)


def test_the_layer_scheme_carries_the_shift_in_the_rotated_basis():
    m = tiny_model("llama", layers=2)
    sch = centered(hadamard(m), m)
    ls = sch.layer(1)
    assert isinstance(ls, SchemeLayer) and ls.groups == (8, 8) and ls.sink == 2 and ls.recent == 3
    want = torch.einsum("hd,hde->he", sch.k_mean[1].double(), sch.k_rotation[1].double()).float()
    assert torch.equal(ls.k_shift(), want) and hadamard(m).layer(1).k_shift() is None
    k = torch.randn(5, 2, 16)
    stored = torch.einsum("thd,hde->the", k, ls.k_rotation) - ls.k_shift()      # (k − μ) @ R
    assert torch.allclose(stored, torch.einsum("thd,hde->the", k - ls.k_mean, ls.k_rotation), atol=1e-5)
    with pytest.raises(InputError, match="the 'fork' simulation stores the keys as that engine does"):
        dataclasses.replace(sch, quantizer="fork")
    with pytest.raises(InputError, match="k_mean has 1 layers, expected 2"):
        dataclasses.replace(sch, k_mean=sch.k_mean[:1])


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_a_lossless_centered_cache_equals_the_model(kind):
    """Identity rotation, a float32 window wider than the context: centering changes no logit, in
    decode steps and in chunked calls (the call's keys centered like the stored ones), with a
    logit soft-cap too (gemma2 here: its cap is 1.0, where tanh is far from linear)."""
    m = tiny_model(kind, layers=2)
    ids = torch.randint(1, 120, (2, 20), generator=torch.Generator().manual_seed(1))
    plain = m(ids).logits
    for chunk in (1, 4):
        real = decode(m, OscarCache(m.config, centered(hadamard(m, rotation="identity", recent=64), m, 5.0)), ids,
                      8, chunk)
        assert (real - plain).abs().max() < 1e-4, chunk


@pytest.mark.parametrize("kind", ["llama", "gemma3", "gemma2"])
def test_centered_real_cache_equals_both_simulations(kind):
    """INT2 with Hadamard rotations and clips, float32 window: step by step the real cache (torch
    path), SimulatedCache and the perplexity simulation read the same keys; without centering the
    logits differ by far more than the tolerance."""
    m = tiny_model(kind, layers=2)
    if kind == "gemma2":
        # SimulatedCache hands its keys to the model's own attention: transformers 5.17 builds this
        # tiny Gemma 2 on SDPA, whose integration (integrations/sdpa_attention.py) takes no soft-cap,
        # while the simulation and the real cache cap every logit; 5.23 builds it eager
        m.set_attn_implementation("eager")
    ids = torch.randint(1, 120, (1, 26), generator=torch.Generator().manual_seed(7))
    sch = centered(hadamard(m), m)
    with SimulatedKV(m, sch), torch.no_grad():
        ppl_sim = m(ids).logits
    real = decode(m, OscarCache(m.config, sch, backend="torch"), ids, 1)
    cache_sim = decode(m, SimulatedCache(m.config, sch), ids, 1)
    with SimulatedKV(m, hadamard(m)), torch.no_grad():
        uncentered = m(ids).logits
    assert (real - ppl_sim).abs().max() < 1e-4
    assert (cache_sim - ppl_sim).abs().max() < 1e-4
    assert (ppl_sim - uncentered).abs().max() > 1e-2          # centering changed what INT2 stores


@pytest.mark.parametrize("name", ["gemma4_text", "qwen3_5_text"])
def test_hybrid_layers_center_with_their_own_heads(name):
    """Layers of their own head geometry (Gemma 4: 256/512-style head sizes and KV heads per layer)
    or mapped to the model's layer ids (Qwen3.5: attention beside linear-attention layers): every
    layer's ``k_mean`` is ``[h_kv_i, d_i]``, the artifact validates, and the real cache reads what
    the simulation reads, which centering changed."""
    from factories import build_artifact, family_model

    from oscar_calib.contract.artifact import valid_artifact
    from oscar_calib.runtime import generate

    model = family_model(name)
    art = valid_artifact(build_artifact(model, seed=3, centered=True))
    st = art.settings
    assert st.key_centering and (st.mixed_heads or st.mapped_layers)
    assert [tuple(lr.k_mean.shape) for lr in art.layers] == [st.layer_heads(i) for i in range(st.num_layers)]
    windows = dict(sink=4, recent=8, window_dtype=None)
    ids = torch.randint(1, 120, (1, 20), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    real = generate(model, ids, OscarCache.from_artifact(art, model, backend="torch", **windows), **kw)
    sim = model.generate(ids, past_key_values=SimulatedCache.from_artifact(art, model, **windows), **kw)
    assert max(float((a - b).abs().max()) for a, b in zip(real.scores, sim.scores)) < 1e-4
    raw = model.generate(ids, past_key_values=SimulatedCache.from_artifact(build_artifact(model, seed=3), model,
                                                                             **windows), **kw)
    assert max(float((a - b).abs().max()) for a, b in zip(raw.scores, sim.scores)) > 1e-3


def test_a_calibration_of_layers_of_their_own_heads_stores_each_layers_mean(tmp_path):
    """``center_keys`` on Gemma 4's stand-in (its global layer has another head_dim): every layer's
    mean key comes from its own statistics, ``[h_kv_i, d_i]``."""
    from factories import CharTokenizer, calibrate_tiny, family_model

    from oscar_calib.model.families import FAMILIES
    from oscar_calib.model.load import LoadedModel, ModelSource

    fam = FAMILIES["gemma4_text"]
    lm = LoadedModel.wrap(family_model("gemma4_text"), CharTokenizer(),
                          ModelSource("tiny-gemma4_text", "tiny-gemma4_text", "", kind="local"), fam.config())
    res = calibrate_tiny(tmp_path / "c", loaded=lm, center_keys=True)
    st = res.artifact.settings
    assert st.key_centering and st.mixed_heads
    for i, lr in enumerate(res.artifact.layers):
        assert tuple(lr.k_mean.shape) == st.layer_heads(i)
        assert torch.equal(lr.k_mean, res.stats.stats[i].key_mean().float())
