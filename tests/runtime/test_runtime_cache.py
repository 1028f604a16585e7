"""OscarCache, the real cache, inside transformers models: equal to DynamicCache when nothing is
lossy, equal to the simulation (SimulatedCache) when INT2 is on, padded batches equal solo runs,
beam search, crop, sliding windows, the kernel path, and the refusal of bad artifacts.

Tolerances. The real cache and the simulation read the same values: with a float32 window the
rows as the model computed them, with the BF16 window ``bf16(bf16(k) @ R)`` in the rotated basis
(the simulation reads it rotated back); logits agree to 1e-4 (float32 summation order). Before the
simulation modelled the window's second rounding (it read ``bf16(k)``) they differed by 3e-4 to
1.3e-2 here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from factories import tiny_model
from transformers import DynamicCache

from oscar_calib.errors import ArtifactError, CacheError
from oscar_calib.model.geometry import geometry_of
from oscar_calib.runtime import KVScheme, OscarCache, SimulatedCache
from oscar_calib.runtime.attention import kernel_decodes

ON_GPU = torch.cuda.is_available()


def scheme(model, *, rotation="hadamard", group_size=8, sink=2, recent=3, window_dtype=torch.bfloat16):
    geo = geometry_of(model)
    clips = (0.96, 0.92) if rotation == "hadamard" else (1.0, 1.0)
    return KVScheme.uniform(rotation, geo.num_layers, geo.num_kv_heads, geo.head_dim, group_size,
                            rotation=rotation, clips=clips, sink=sink, recent=recent, window_dtype=window_dtype)


def step_logits(model, cache, ids, prefill: int) -> torch.Tensor:
    """Prefill ``prefill`` tokens, then one token per call."""
    ctx = cache.attach(model) if isinstance(cache, OscarCache) else torch.no_grad()
    with ctx:
        out = [model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits]
        for t in range(prefill, ids.shape[1]):
            out.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(out, 1)


def generate(model, cache, ids, **kw):
    kw = dict(dict(max_new_tokens=10, do_sample=False, pad_token_id=0), **kw)
    with cache.attach(model):
        return model.generate(ids, past_key_values=cache, **kw)


@pytest.mark.parametrize("kind", ["llama", "gemma3", "mistral"])
def test_lossless_generate_equals_dynamic_cache_with_padding_and_beams(kind):
    """Identity rotation, float32 window larger than the context: nothing is lossy, so every
    token and score equals DynamicCache (left-padded batch and beam search included)."""
    m = tiny_model(kind, layers=2)
    ids = torch.randint(1, 120, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    lossless = scheme(m, rotation="identity", sink=4, recent=64, window_dtype=None)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_scores=True)
    ref = m.generate(ids, past_key_values=DynamicCache(config=m.config), **kw)
    out = generate(m, OscarCache(m.config, lossless), ids, **kw)
    assert torch.equal(ref.sequences, out.sequences)
    assert max((a - b).abs().max() for a, b in zip(ref.scores, out.scores)) < 1e-5
    beam = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
    assert torch.equal(m.generate(ids[:1], **beam), generate(m, OscarCache(m.config, lossless), ids[:1], **beam))


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma3"])
def test_int2_decode_equals_simulation(kind):
    """Same artifact-like scheme (Hadamard, clips, INT2, sink 2 + recent 3): with a float32 window
    and with a BF16 one the real cache and the simulation read identical values at every step."""
    m = tiny_model(kind, layers=2)
    ids = torch.randint(1, 120, (1, 30), generator=torch.Generator().manual_seed(4))
    plain = m(ids).logits
    exact = scheme(m, window_dtype=None)
    sim = step_logits(m, SimulatedCache(m.config, exact), ids, 10)
    real_cache = OscarCache(m.config, exact)
    real = step_logits(m, real_cache, ids, 10)
    assert (real - sim).abs().max() < 1e-4    # float32 summation order: 4.2e-5 on torch 2.11 (GPU machine), ~1e-6 here
    assert (sim - plain).abs().max() > 1e-2                                  # INT2 really changed something
    assert real_cache.layers[-1].store.history_span() > 0
    bf16 = scheme(m)                      # the window rounded to BF16 after the rotation, in both
    sim16 = step_logits(m, SimulatedCache(m.config, bf16), ids, 10)
    real16 = step_logits(m, OscarCache(m.config, bf16), ids, 10)
    assert (real16 - sim16).abs().max() < 1e-4    # 4e-5 / 1e-7 / 2e-7 here; 3e-4 / 4e-4 / 1.3e-2 without it


def test_padded_batch_equals_solo_runs_int2():
    m = tiny_model("gemma3", layers=2)            # a sliding layer (window 8) and a full one
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(1, 120, (1, 14), generator=g), torch.randint(1, 120, (1, 9), generator=g)
    ids = torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], 1)])
    mask = (torch.arange(14) >= torch.tensor([[0], [5]])).long()
    kw = dict(return_dict_in_generate=True, output_scores=True)
    both = generate(m, OscarCache(m.config, scheme(m)), ids, attention_mask=mask, **kw)
    for row, (x, pad) in enumerate(((a, 0), (b, 5))):
        solo = generate(m, OscarCache(m.config, scheme(m)), x, **kw)
        assert torch.equal(both.sequences[row, pad:], solo.sequences[0])
        assert max((s[row] - t[0]).abs().max() for s, t in zip(both.scores, solo.scores)) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("correction,centered", [(0.0, False), (1.0, False), (0.0, True)])
def test_kernel_path_equals_torch_path(correction, centered):
    """The Triton write and decode kernels (the CPU interpreter here, the real compiler on a GPU)
    against the pure-torch path, model level, GQA (4 query / 2 KV heads), batch 2, without and
    with the logit-noise correction, and with key centering (the write kernels' shift)."""
    import dataclasses

    dev = "cuda" if ON_GPU else "cpu"
    m = tiny_model("llama", layers=2, head_dim=64).to(dev)
    # 10 tokens of prefill (an INT2 history of 5 behind the 2 + 3 window), then 3 decode steps
    ids = torch.randint(1, 120, (2, 13), generator=torch.Generator().manual_seed(3)).to(dev)
    sch = dataclasses.replace(scheme(m, group_size=32), logit_correction=correction)
    if centered:
        g = torch.Generator().manual_seed(8)
        sch = dataclasses.replace(sch, k_mean=[torch.randn(2, 64, generator=g) * 3 for _ in range(2)])
    tri_cache = OscarCache(m.config, sch, backend="triton")
    tri = step_logits(m, tri_cache, ids, 10)
    ref = step_logits(m, OscarCache(m.config, sch, backend="torch"), ids, 10)
    assert kernel_decodes(tri_cache.layers[0], torch.zeros(2, 4, 1, 64, device=dev), None)
    assert (tri - ref).abs().max() < 2e-2 * ref.abs().max()
    assert torch.equal(tri.argmax(-1), ref.argmax(-1))


def test_crop_is_exact_inside_the_window_and_refused_beyond():
    m = tiny_model("llama", layers=2)
    ids = torch.randint(1, 120, (1, 13), generator=torch.Generator().manual_seed(5))
    sch = scheme(m, sink=4, recent=8)
    cache = OscarCache(m.config, sch)
    with cache.attach(m):
        m(ids[:, :10], past_key_values=cache, use_cache=True)
        cache.crop(-3)
        assert cache.get_seq_length() == 7
        again = m(ids[:, 7:13], past_key_values=cache, use_cache=True).logits
    fresh = OscarCache(m.config, sch)
    with fresh.attach(m):
        m(ids[:, :7], past_key_values=fresh, use_cache=True)
        want = m(ids[:, 7:13], past_key_values=fresh, use_cache=True).logits
    assert (again - want).abs().max() < 1e-6
    with pytest.raises(CacheError, match="cannot crop"):
        cache.crop(-1)                           # 13 tokens > sink + recent: one is INT2 only


def test_use_without_attach_is_refused():
    m = tiny_model("llama", layers=2)
    with pytest.raises(CacheError, match="attach"):
        m(torch.ones(1, 4, dtype=torch.long), past_key_values=OscarCache(m.config, scheme(m)), use_cache=True)


def test_memory_report():
    m = tiny_model("llama", layers=2, head_dim=32)
    cache = OscarCache(m.config, scheme(m, group_size=16, sink=4, recent=8))
    with cache.attach(m):
        m(torch.randint(1, 120, (1, 40)), past_key_values=cache, use_cache=True)
    mem = cache.memory()
    geo = geometry_of(m)
    h, d = geo.num_kv_heads, geo.head_dim
    per_layer = 2 * (12 * h * d * 2 + (40 - 4) * h * (d // 4 + 2 * 2 * d // 16))
    assert mem["bytes"] == geo.num_layers * per_layer and mem["tokens"] == 40
    assert mem["allocated_bytes"] >= mem["bytes"] and mem["compression"] > 1
    assert mem["bf16_bytes"] == geo.num_layers * 2 * 40 * h * d * 2


def test_v_folded_artifact_keeps_values_rotated(zoo_smollm2):
    from oscar_calib.contract.artifact import load_artifact

    art = load_artifact(zoo_smollm2)
    assert KVScheme.from_artifact(art).v_rotation[0] is not None
    folded = KVScheme.from_artifact(dataclasses.replace(art, metadata={**art.metadata, "v_folded": "true"},
                                                        settings=None))
    assert all(r is None for r in folded.v_rotation) and folded.k_rotation[0] is not None


def test_bad_artifacts_are_refused_before_any_cache(zoo_smollm2, smollm2, tmp_path, monkeypatch):
    import shutil

    from safetensors.torch import load_file, save_file

    from oscar_calib.runtime import cache as cache_mod

    model = smollm2[0]
    built = []
    monkeypatch.setattr(cache_mod.OscarLayer, "__init__",
                        lambda self, *a, **k: built.append(1) or pytest.fail("a layer was built"))
    bad = tmp_path / "nan"
    shutil.copytree(zoo_smollm2, bad)
    tensors = load_file(str(bad / "oscar.safetensors"))
    from safetensors import safe_open

    with safe_open(str(bad / "oscar.safetensors"), "pt") as f:
        md = f.metadata()
    tensors["layers.3.k_rotation"][0, 0, 0] = float("nan")
    save_file(tensors, str(bad / "oscar.safetensors"), metadata=md)
    with pytest.raises(ArtifactError, match="layers.3.k_rotation"):
        OscarCache.from_artifact(bad, model)
    with pytest.raises(ArtifactError):
        OscarCache.from_artifact(zoo_smollm2, tiny_model("llama"))              # another model
    assert not built


def test_smollm2_zoo_artifact_generates_like_the_simulation(smollm2, zoo_smollm2):
    """Greedy text through the real cache equals the simulation on the zoo artifact (SmolLM2,
    64 + 256 BF16 tokens, G = 64; both without the artifact's logit-noise correction, which
    SimulatedCache cannot apply: tests/runtime/test_logit_correction.py checks it); the prompt is
    long enough for an INT2 history."""
    model, tok, _ = smollm2
    art = zoo_smollm2
    from oscar_calib.data.corpus import embedded_texts

    ids = tok(embedded_texts()[3][:2400], return_tensors="pt").input_ids[:, :400]
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    sim = model.generate(ids, past_key_values=SimulatedCache.from_artifact(art, model, logit_correction=0.0), **kw)
    real_cache = OscarCache.from_artifact(art, model, logit_correction=0.0)
    with real_cache.attach(model):
        real = model.generate(ids, past_key_values=real_cache, **kw)
    assert real_cache.layers[0].store.history_span() > 0
    assert torch.equal(sim, real), (tok.decode(sim[0, 400:]), tok.decode(real[0, 400:]))
