"""Codebook quantisers in the perplexity simulation (experimental.codebook.CodebookScheme, quantizer
"codebook" / "codebook-std"): uniform levels give oscar's INT2 logits, other levels change them, bits are
oscar's; the product's KVScheme does not know them, the real caches refuse them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from factories import tiny_model

from oscar_calib.errors import InputError
from oscar_calib.experimental.codebook import CodebookScheme, initial_levels
from oscar_calib.model.geometry import geometry_of
from oscar_calib.runtime.scheme import KVScheme
from oscar_calib.runtime.simulate import ROWS, SimulatedKV, register_quantizer


def oscar_scheme(geo, g=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n, h, d = geo.num_layers, geo.num_kv_heads, geo.head_dim
    rot = [torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0].float() for _ in range(2 * n)]
    return KVScheme("oscar", n, g, rot[:n], rot[n:], [torch.full((h,), 0.94)] * n, [torch.full((h,), 0.9)] * n,
                    sink=2, recent=5)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_codebook_with_uniform_levels_gives_oscars_logits(kind):
    m = tiny_model(kind, layers=2)
    geo = geometry_of(m)
    ids = torch.randint(1, 120, (1, 40), generator=torch.Generator().manual_seed(1))
    base = oscar_scheme(geo)
    with torch.no_grad():
        plain = m(ids).logits
        with SimulatedKV(m, base):
            ref = m(ids).logits
        uniform = [initial_levels("range").expand(geo.num_kv_heads, -1)] * geo.num_layers
        for levels in (uniform, []):                       # explicit uniform levels, or the default (None)
            with SimulatedKV(m, CodebookScheme.of(base, "codebook", levels, levels)):
                got = m(ids).logits
            assert torch.allclose(got, ref, atol=1e-5, rtol=0)
        assert (ref - plain).abs().max() > 1e-3                    # the INT2 path is really taken
        skew = [torch.tensor([0.0, 0.6, 1.4, 3.0]).expand(geo.num_kv_heads, -1)] * geo.num_layers
        with SimulatedKV(m, CodebookScheme.of(base, "codebook", skew, skew)):
            assert (m(ids).logits - ref).abs().max() > 1e-4
        with SimulatedKV(m, CodebookScheme.of(base, "codebook-std")):
            std = m(ids).logits
        assert (std - ref).abs().max() > 1e-4 and (std - plain).abs().max() < (ref - plain).abs().max() * 10


def test_codebook_scheme_keeps_the_base_and_checks_its_fields():
    geo = geometry_of(tiny_model("llama", layers=1))
    base = oscar_scheme(geo)
    for q in ("codebook", "codebook-std"):
        cb = CodebookScheme.of(base, q, name="cb")
        assert cb.bits_per_element == base.bits_per_element == 2 + 32 / 8
        assert cb.name == "cb" and cb.quantizer == q and cb.k_levels == [None]
        assert torch.equal(cb.k_rotation[0], base.k_rotation[0]) and (cb.sink, cb.recent) == (base.sink, base.recent)
    assert CodebookScheme.of(base).coding == "range" and CodebookScheme.of(base, "codebook-std").coding == "std"
    with pytest.raises(InputError, match="choose from codebook, codebook-std"):
        CodebookScheme.of(base, "codebook-gauss")
    with pytest.raises(InputError, match="k_levels has 3 layers"):
        CodebookScheme.of(base, "codebook", k_levels=[None] * 3)


def test_the_product_scheme_and_registry_do_not_name_codebooks():
    """KVScheme accepts only the product's quantisers; the simulation reads a codebook only through
    the experimental module's registration, and a built-in name cannot be taken over."""
    geo = geometry_of(tiny_model("llama", layers=1))
    base = oscar_scheme(geo)
    with pytest.raises(InputError, match="choose from oscar, fork, fork-lloyd"):
        dataclasses.replace(base, quantizer="codebook")
    assert {"codebook", "codebook-std"} <= set(ROWS)
    with pytest.raises(ValueError, match="built in"):
        register_quantizer("oscar", ROWS["codebook"])


@pytest.mark.parametrize("quantizer", ["codebook", "codebook-std"])
def test_real_caches_refuse_a_codebook(quantizer):
    from oscar_calib.runtime.cache import OscarCache
    from oscar_calib.runtime.simulated import SimulatedCache

    m = tiny_model("llama", layers=2)
    sch = CodebookScheme.of(oscar_scheme(geometry_of(m)), quantizer)
    for cls in (SimulatedCache, OscarCache):
        with pytest.raises(InputError, match=f"'{quantizer}' quantiser exists only in the perplexity simulation"):
            cls(m.config, sch)
