"""The real cache on every model family's tiny stand-in (``oscar_calib.model.families``), at both
ends of the transformers range (``make test-low`` runs this file at 5.17): ``OscarCache.generate``
gives the tokens and scores of the simulation (``SimulatedCache``) with an INT2 history, or the
cache is refused in one line where the support table says so (chunked attention). gpt-oss's
attention sinks through the Triton decode kernel (the CPU interpreter here) equal the torch path."""

from __future__ import annotations

import pytest
import torch
from factories import build_artifact

from oscar_calib.errors import UnsupportedModelError
from oscar_calib.model.families import FAMILIES
from oscar_calib.runtime import OscarCache, SimulatedCache
from oscar_calib.runtime.attention import kernel_decodes
from oscar_calib.versions import version_tuple

ON_GPU = torch.cuda.is_available()
# 4 BF16 sink + 8 recent tokens: a 20-token prompt leaves 8 tokens of INT2 history, which grows as it decodes
WINDOWS = dict(sink=4, recent=8)


def _installed(family) -> bool:
    import transformers

    return family.since is None or version_tuple(transformers.__version__) >= version_tuple(family.since)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_cache_generates_like_the_simulation(name):
    fam = FAMILIES[name]
    if not _installed(fam):
        pytest.skip(f"{name} needs transformers >= {fam.since}")
    model = fam.model()
    art = build_artifact(model, seed=3)
    ids = torch.randint(1, 120, (1, 20), generator=torch.Generator().manual_seed(5))
    if any(t == "chunked_attention" for t in getattr(model.config.get_text_config(decoder=True), "layer_types", ())):
        with pytest.raises(UnsupportedModelError, match="'chunked_attention' layer; the OSCAR caches support full "
                                                        "and sliding-window attention only"):
            OscarCache.from_artifact(art, model, **WINDOWS)
        return
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    real_cache = OscarCache.from_artifact(art, model, window_dtype=None, **WINDOWS)
    real = real_cache.generate(model, ids, **kw)
    sim = model.generate(ids, past_key_values=SimulatedCache.from_artifact(art, model, window_dtype=None, **WINDOWS),
                         **kw)
    # every token but the last generated one is cached, past the BF16 windows: an INT2 history was read
    assert real_cache.memory()["tokens"] == real.sequences.shape[1] - 1 > sum(WINDOWS.values())
    assert torch.equal(real.sequences, sim.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(real.scores, sim.scores)) < 1e-4
    plain = model.generate(ids, **kw)
    assert max(float((a - b).abs().max()) for a, b in zip(real.scores, plain.scores)) > 1e-3   # INT2 is lossy


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
    for layer in model.model.layers:
        layer.self_attn.sinks.copy_(torch.linspace(1.0, 3.0, 4))
    art = build_artifact(model, seed=3)
    ids = torch.randint(1, 120, (2, 16), generator=torch.Generator().manual_seed(3)).to(dev)

    def logits(backend):
        cache = OscarCache.from_artifact(art, model, group_size=32, sink=2, recent=3, backend=backend)
        with cache.attach(model), torch.no_grad():
            out = [model(ids[:, :12], past_key_values=cache, use_cache=True).logits]
            for t in range(12, ids.shape[1]):
                out.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
        return cache, torch.cat(out, 1)

    tri_cache, tri = logits("triton")
    _, ref = logits("torch")
    q = torch.zeros(2, 4, 1, 64, device=dev)
    assert kernel_decodes(tri_cache.layers[1], q, None) and not kernel_decodes(tri_cache.layers[0], q, None)
    assert (tri - ref).abs().max() < 2e-2 * ref.abs().max()
    assert torch.equal(tri.argmax(-1), ref.argmax(-1))
