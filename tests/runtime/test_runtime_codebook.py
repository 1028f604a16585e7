"""Codebook quantisers in the perplexity simulation (SimulatedKV with quantizer "codebook" /
"codebook-std"): uniform levels give oscar's INT2 logits, other levels change them, bits are oscar's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from factories import tiny_model

from oscar_calib.errors import InputError
from oscar_calib.model.geometry import geometry_of
from oscar_calib.numerics.codebook import initial_levels
from oscar_calib.runtime.scheme import KVScheme
from oscar_calib.runtime.simulate import SimulatedKV


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
            cb = dataclasses.replace(base, quantizer="codebook", k_levels=levels, v_levels=levels)
            with SimulatedKV(m, cb):
                got = m(ids).logits
            assert torch.allclose(got, ref, atol=1e-5, rtol=0)
        assert (ref - plain).abs().max() > 1e-3                    # the INT2 path is really taken
        skew = [torch.tensor([0.0, 0.6, 1.4, 3.0]).expand(geo.num_kv_heads, -1)] * geo.num_layers
        with SimulatedKV(m, dataclasses.replace(base, quantizer="codebook", k_levels=skew, v_levels=skew)):
            assert (m(ids).logits - ref).abs().max() > 1e-4
        with SimulatedKV(m, dataclasses.replace(base, quantizer="codebook-std")):
            std = m(ids).logits
        assert (std - ref).abs().max() > 1e-4 and (std - plain).abs().max() < (ref - plain).abs().max() * 10


def test_codebook_bits_and_bad_quantizer():
    geo = geometry_of(tiny_model("llama", layers=1))
    base = oscar_scheme(geo)
    for q in ("codebook", "codebook-std"):
        assert dataclasses.replace(base, quantizer=q).bits_per_element == base.bits_per_element == 2 + 32 / 8
    with pytest.raises(InputError):
        dataclasses.replace(base, quantizer="codebook-gauss")
    with pytest.raises(InputError):
        dataclasses.replace(base, quantizer="codebook", k_levels=[None] * 3)


@pytest.mark.parametrize("quantizer", ["codebook", "codebook-std", "fork", "fork-lloyd"])
def test_real_caches_refuse_a_quantiser_they_cannot_store(quantizer):
    """SimulatedCache and OscarCache store oscar's uniform INT2 only: any other quantiser is refused in
    one line instead of being stored silently as uniform INT2."""
    from oscar_calib.runtime.cache import OscarCache
    from oscar_calib.runtime.simulated import SimulatedCache

    m = tiny_model("llama", layers=2)
    sch = dataclasses.replace(oscar_scheme(geometry_of(m)), quantizer=quantizer)
    for cls in (SimulatedCache, OscarCache):
        with pytest.raises(InputError, match=f"'{quantizer}' quantiser exists only in the perplexity simulation"):
            cls(m.config, sch)
    for cls in (SimulatedCache, OscarCache):                  # the same scheme with oscar's quantiser is taken
        cls(m.config, dataclasses.replace(sch, quantizer="oscar"))
