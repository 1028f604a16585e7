"""The real cache on every model family's tiny stand-in (``oscar_calib.model.families``), at both
ends of the transformers range (``make test-low`` runs this file at 5.17): ``oscar_calib.runtime.generate``
gives the tokens and scores of the simulation (``SimulatedCache``) with an INT2 history, or the
chunked-attention layers (Llama 4) read their own chunk, and a padded batch is refused there in
one line. gpt-oss's attention sinks through the Triton decode kernel (the CPU interpreter here)
equal the torch path."""

from __future__ import annotations

import pytest
import torch
from factories import build_artifact, family_model, share_sinks

from oscar_calib.errors import CacheError
from oscar_calib.model.families import FAMILIES
from oscar_calib.runtime import OscarCache, SimulatedCache, generate
from oscar_calib.runtime.attention import kernel_decodes

ON_GPU = torch.cuda.is_available()
# 4 BF16 sink + 8 recent tokens: a 20-token prompt leaves 8 tokens of INT2 history, which grows as it decodes
WINDOWS = dict(sink=4, recent=8)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_cache_generates_like_the_simulation(name):
    model = family_model(name)
    art = build_artifact(model, seed=3)
    ids = torch.randint(1, 120, (1, 20), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    real_cache = OscarCache.from_artifact(art, model, window_dtype=None, **WINDOWS)
    real = generate(model, ids, real_cache, **kw)
    sim = model.generate(ids, past_key_values=SimulatedCache.from_artifact(art, model, window_dtype=None, **WINDOWS),
                         **kw)
    # every token but the last generated one is cached, past the BF16 windows: an INT2 history was read
    assert real_cache.memory()["tokens"] == real.sequences.shape[1] - 1 > sum(WINDOWS.values())
    assert torch.equal(real.sequences, sim.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(real.scores, sim.scores)) < 1e-4
    plain = model.generate(ids, **kw)
    assert max(float((a - b).abs().max()) for a, b in zip(real.scores, plain.scores)) > 1e-3   # INT2 is lossy


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_perplexity_simulation_is_the_model_when_nothing_is_lossy(name):
    """``SimulatedKV`` (``oscar eval``'s attention) with nothing quantised gives the model's own
    logits: its masks, windows (EXAONE 4 passes no window on its global layers), chunks and sinks
    are the model's."""
    from oscar_calib.runtime import KVScheme, SimulatedKV

    model = family_model(name)
    n = model.config.get_text_config(decoder=True).num_hidden_layers
    ids = torch.randint(1, 120, (1, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        with SimulatedKV(model, KVScheme.full_precision(n, window_dtype=None, sink=4, recent=8)):
            got = model(input_ids=ids).logits
    assert (got - ref).abs().max() < 1e-4 * ref.abs().max()


def test_chunked_attention_reads_the_query_chunk_and_refuses_padding():
    """Llama 4's chunked layers (chunks of 16 here) past two chunk boundaries: every decode step
    reads its own chunk only, as the simulation (transformers' chunked mask) does; a left-padded
    batch is refused in one line (transformers' chunk boundaries then count the pads)."""
    model = FAMILIES["llama4_text"].model()
    assert model.config.layer_types == ["chunked_attention", "full_attention"]
    art = build_artifact(model, seed=3)
    ids = torch.randint(1, 120, (1, 30), generator=torch.Generator().manual_seed(6))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    real = generate(model, ids, OscarCache.from_artifact(art, model, window_dtype=None, **WINDOWS), **kw)
    sim = model.generate(ids, past_key_values=SimulatedCache.from_artifact(art, model, window_dtype=None, **WINDOWS),
                         **kw)
    assert torch.equal(real.sequences, sim.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(real.scores, sim.scores)) < 1e-4
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :3] = 0
    with pytest.raises(CacheError, match="padded batch with chunked-attention layers"):
        generate(model, ids[:, :20].repeat(2, 1), OscarCache.from_artifact(art, model, **WINDOWS), attention_mask=mask,
                 max_new_tokens=2, pad_token_id=0)


@pytest.mark.slow
def test_gpt_oss_sinks_through_the_decode_kernel_equal_the_torch_path():
    """gpt-oss at head_dim 64 (what the kernel takes), sinks that take a real share: the full-attention
    layer decodes through the Triton kernel (sinks added in its merge), the sliding one through the
    torch path; logits equal the all-torch cache's."""
    from oscar_calib.model.families import Family

    dev = "cuda" if ON_GPU else "cpu"
    fam = FAMILIES["gpt_oss"]
    tiny = dict(fam.tiny, head_dim=64, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    model = Family("gpt_oss", fam.example, tiny).model().to(dev)
    share_sinks(model)
    art = build_artifact(model, seed=3)
    # 12 tokens of prefill (an INT2 history behind the 2 + 3 window), then 2 decode steps
    ids = torch.randint(1, 120, (1, 14), generator=torch.Generator().manual_seed(3)).to(dev)

    def logits(backend):
        cache = OscarCache.from_artifact(art, model, group_size=32, sink=2, recent=3, backend=backend)
        with cache.attach(model), torch.no_grad():
            out = [model(ids[:, :12], past_key_values=cache, use_cache=True).logits]
            for t in range(12, ids.shape[1]):
                out.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
        return cache, torch.cat(out, 1)

    tri_cache, tri = logits("triton")
    _, ref = logits("torch")
    q = torch.zeros(1, 4, 1, 64, device=dev)
    assert kernel_decodes(tri_cache.layers[1], q, None) and not kernel_decodes(tri_cache.layers[0], q, None)
    assert (tri - ref).abs().max() < 2e-2 * ref.abs().max()
    assert torch.equal(tri.argmax(-1), ref.argmax(-1))


def test_a_hybrids_recurrent_layers_stay_transformers_own():
    """Qwen3.5 (linear, full, linear, full) and Falcon-H1 (a Mamba-2 mixer beside attention in every
    layer): the caches hold transformers' own linear-attention layer where the model keeps a
    recurrent state, beside (or in the same layer as) the INT2 layers; with nothing quantised the
    simulation is the model's own DynamicCache, token for token; the CUDA-graph path is refused in
    one line (the states step outside the cache's attention function)."""
    from transformers.cache_utils import LinearAttentionLayer

    from oscar_calib.errors import InputError
    from oscar_calib.runtime import KVScheme
    from oscar_calib.runtime.cache import OscarLayer

    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    ids = torch.randint(1, 120, (1, 20), generator=torch.Generator().manual_seed(5))
    for name, kinds in (("qwen3_5_text", [(True, False), (False, True), (True, False), (False, True)]),
                        ("falcon_h1", [(True, True), (True, True)])):
        model = family_model(name)
        cache = OscarCache.from_artifact(build_artifact(model, seed=3), model, **WINDOWS)
        assert [(isinstance(layer, LinearAttentionLayer), isinstance(layer, OscarLayer)) for layer in cache.layers] \
            == kinds
        assert cache.recurrent and "keep a recurrent state" in cache.recurrent
        with pytest.raises(InputError, match="no graph decoding here"):
            generate(model, ids, cache, fast=True, max_new_tokens=2)
        exact = SimulatedCache(model.config, KVScheme.full_precision(len(cache.oscar_layers), window_dtype=None,
                                                                     **WINDOWS))
        sim, plain = model.generate(ids, past_key_values=exact, **kw), model.generate(ids, **kw)
        assert torch.equal(sim.sequences, plain.sequences)
        assert all(torch.equal(a, b) for a, b in zip(sim.scores, plain.scores))


def test_a_layer_the_kernels_cannot_take_is_refused_under_backend_triton():
    """Gemma 4's layers differ in head_dim (16 and 32 here; 256 and 512 in the published models):
    ``backend='auto'`` runs a layer whose head_dim the Triton kernels do not take on the torch path,
    ``backend='triton'`` refuses it in one line before anything is stored."""
    from oscar_calib.errors import InputError

    model = family_model("gemma4")
    cache = OscarCache.from_artifact(build_artifact(model, seed=3), model, backend="triton", **WINDOWS)
    with pytest.raises(InputError) as e, cache.attach(model), torch.no_grad():
        model(torch.randint(1, 120, (1, 6)), past_key_values=cache, use_cache=True)
    assert str(e.value) == ("OscarCache(backend='triton'): layer 0 has head_dim 16 (the decode kernel needs a power "
                            "of two in 64..256); use backend='auto', which runs that layer on the torch path")
    assert all(layer.store is None for layer in cache.oscar_layers)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("name", ["gemma4_text", "qwen3_5_text"])
def test_published_head_sizes_through_the_kernels_equal_the_torch_path(name):
    """Gemma 4 at its published head sizes (sliding layers 256, the global layer 512) and Qwen3.5 at
    256, on CUDA (backend auto): Qwen3.5's attention layers decode through the Triton kernel, its
    recurrent layers step as transformers has them; Gemma 4's 256-wide layers write through the
    kernels and read through the torch path (sliding windows), its 512-wide layer runs the torch
    path throughout. The logits equal the all-torch cache's."""
    from oscar_calib.model.families import Family

    fam = FAMILIES[name]
    extra = dict(global_head_dim=512) if name == "gemma4_text" else {}
    model = Family(name, fam.example, dict(fam.tiny, head_dim=256, hidden_size=128, **extra)).model().cuda()
    art = build_artifact(model, seed=3)
    ids = torch.randint(1, 120, (1, 24), generator=torch.Generator().manual_seed(3)).cuda()

    def logits(backend):
        cache = OscarCache.from_artifact(art, model, sink=4, recent=8, backend=backend)
        with cache.attach(model), torch.no_grad():
            out = [model(ids[:, :20], past_key_values=cache, use_cache=True).logits]
            for t in range(20, ids.shape[1]):
                out.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
        return cache, torch.cat(out, 1)

    auto_cache, auto = logits("auto")
    _, ref = logits("torch")
    q = torch.zeros(1, 4, 1, 256, device="cuda")
    decodes = [kernel_decodes(layer, q[..., :layer.store.d], None) for layer in auto_cache.oscar_layers]
    assert decodes == ([False, False, False] if name == "gemma4_text" else [True, True])  # sliding or 512: torch
    assert (auto - ref).abs().max() < 2e-2 * ref.abs().max()
    assert torch.equal(auto.argmax(-1), ref.argmax(-1))
