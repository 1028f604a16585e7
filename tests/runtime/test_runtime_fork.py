"""The fork's quantisers in the perplexity simulation (SimulatedKV with quantizer "fork" / "fork-lloyd"):
lossless with identity rotations and wide windows, an explicit per-(i, j) reference of the fork's data
path, agreement with oscar's quantiser up to its fp16 storage, and the stored bits."""

from __future__ import annotations

import math

import pytest
import torch
from factories import tiny_model

from oscar_calib.errors import InputError
from oscar_calib.model.geometry import geometry_of
from oscar_calib.numerics.hadamard import hadamard
from oscar_calib.numerics.quant import clip_rows, fake_quant_fork
from oscar_calib.runtime.scheme import KVScheme
from oscar_calib.runtime.simulate import SimulatedKV


def random_rotation(h: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))[0].float()


def fork_scheme(n, h, d, g, *, rot=True, clips=(0.96, 0.92), sink=4, recent=10, window_dtype=torch.bfloat16,
                quantizer="fork", seed=0):
    rk = [random_rotation(h, d, seed + 2 * i) if rot else None for i in range(n)]
    rv = [random_rotation(h, d, seed + 2 * i + 1) if rot else None for i in range(n)]
    ck = [None if clips[0] >= 1 else torch.full((h,), clips[0])] * n
    cv = [None if clips[1] >= 1 else torch.full((h,), clips[1])] * n
    return KVScheme("fork", n, g, rk, rv, ck, cv, sink=sink, recent=recent, window_dtype=window_dtype,
                    quantizer=quantizer)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fork_with_identity_rotations_no_clip_and_wide_windows_is_plain_attention(kind):
    m = tiny_model(kind, layers=2)
    geo = geometry_of(m)
    ids = torch.randint(1, 120, (1, 40), generator=torch.Generator().manual_seed(0))
    plain = m(ids).logits
    for quantizer in ("fork", "fork-lloyd"):
        g = geo.head_dim if quantizer == "fork-lloyd" else 8
        wide = fork_scheme(geo.num_layers, geo.num_kv_heads, geo.head_dim, g, rot=False, clips=(1.0, 1.0), sink=0,
                           recent=40, window_dtype=None, quantizer=quantizer)
        with SimulatedKV(m, wide):
            assert torch.allclose(m(ids).logits, plain, atol=1e-5, rtol=0)
        narrow = fork_scheme(geo.num_layers, geo.num_kv_heads, geo.head_dim, g, rot=False, clips=(1.0, 1.0), sink=2,
                             recent=4, window_dtype=None, quantizer=quantizer)
        with SimulatedKV(m, narrow):                     # the INT2 path is really taken
            assert (m(ids).logits - plain).abs().max() > 1e-3
    # rotations and BF16 rounding alone (nothing INT2) stay within BF16 precision of plain attention
    rotated = fork_scheme(geo.num_layers, geo.num_kv_heads, geo.head_dim, 8, sink=0, recent=40)
    with SimulatedKV(m, rotated):
        got = m(ids).logits
    assert 0 < (got - plain).abs().max() < 2e-2 * plain.abs().max()


def _reference(q, k, v, sch, scaling):
    """The fork's data path written out per (query i, key j): rotate in BF16, the window BF16, the
    history clipped and quantised with float32 scale/zero, the output mapped back with R_vᵀ in BF16."""
    bf = lambda x: x.to(torch.bfloat16).float()  # noqa: E731
    rk, ck, rv, cv = sch.layer(0).rotations
    hq, t, d = q.shape[1], q.shape[2], q.shape[3]
    grp = hq // k.shape[1]
    lloyd = sch.quantizer == "fork-lloyd"
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    hi = (j < sch.sink) | (i - j < sch.recent)
    out = torch.zeros(1, t, hq, d)
    for h in range(hq):
        kv = h // grp
        rkb, rvb = bf(rk[kv]), bf(rv[kv])
        qr = bf(bf(q[0, h]) @ rkb)
        kr, vr = bf(bf(k[0, kv]) @ rkb), bf(bf(v[0, kv]) @ rvb)
        kq = fake_quant_fork(clip_rows(kr, float(ck[kv])), sch.group_size, lloyd=lloyd)
        vq = fake_quant_fork(clip_rows(vr, float(cv[kv])), sch.group_size, lloyd=lloyd)
        s = torch.where(hi, qr @ kr.T, qr @ kq.T) * scaling
        p = torch.softmax(s.masked_fill(j > i, -math.inf), -1)
        o_rot = (p * hi) @ vr + (p * ~hi) @ vq
        out[0, :, h] = bf(bf(o_rot) @ rvb.T)
    return out


@pytest.mark.parametrize("quantizer,g", [("fork", 8), ("fork", 16), ("fork-lloyd", 16)])
def test_fork_simulation_matches_the_explicit_data_path(quantizer, g):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 6, 50, 16), 3 * torch.randn(1, 2, 50, 16), torch.randn(1, 2, 50, 16)
    sch = fork_scheme(1, 2, 16, g, quantizer=quantizer)
    got = SimulatedKV(None, sch).attend(0, q, k, v, None, 0.25, None, None)
    assert torch.allclose(got, _reference(q, k, v, sch, 0.25), atol=1e-5, rtol=0)   # measured: equal


@pytest.mark.parametrize("window", [None, 20])
def test_attend_at_positions_equals_one_call_per_prefix(window):
    """``attend(positions=...)``: query rows at chosen positions over the longest prefix give each
    row what a call over its own prefix gives (what verify's fork figures take, one call per layer):
    sink, window and INT2 history by absolute position, a sliding window, two sequences."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 6, 50, 16, generator=g), 3 * torch.randn(2, 2, 50, 16, generator=g),
               torch.randn(2, 2, 50, 16, generator=g))
    sim = SimulatedKV(None, fork_scheme(1, 2, 16, 8))
    ends = [12, 31, 44, 50]
    got = sim.attend(0, q[:, :, [e - 1 for e in ends]], k, v, None, 0.25, window, None, positions=[e - 1 for e in ends])
    for j, e in enumerate(ends):
        one = sim.attend(0, q[:, :, e - 1:e], k[:, :, :e], v[:, :, :e], None, 0.25, window, None)[:, 0]
        assert torch.allclose(got[:, j], one, atol=1e-6, rtol=1e-5), e
    last = sim.attend(0, q, k, v, None, 0.25, window, None)            # the default: the last T positions
    assert torch.allclose(got[:, -1], last[:, -1], atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="takes no mask"):
        sim.attend(0, q, k, v, torch.ones(1, 1, 50, 50, dtype=torch.bool), 0.25, None, None, positions=range(50))


def test_fork_and_oscar_quantisers_differ_only_by_storage():
    """Without BF16 rounding the fork's rotated-basis path and oscar's rotate-back path read the same
    history; they differ only by the fork's float32 scale/zero against our fp16 scale/offset."""
    m = tiny_model("llama", layers=2)
    geo = geometry_of(m)
    ids = torch.randint(1, 120, (1, 48), generator=torch.Generator().manual_seed(2))
    h = hadamard(geo.head_dim, warn=False).float().expand(geo.num_kv_heads, -1, -1).contiguous()
    kw = dict(sink=2, recent=6, window_dtype=None)
    args = ("x", geo.num_layers, 8, [h] * 2, [h] * 2, [torch.full((geo.num_kv_heads,), 0.9)] * 2,
            [torch.full((geo.num_kv_heads,), 0.9)] * 2)
    logits = {}
    for quantizer in ("oscar", "fork"):
        with SimulatedKV(m, KVScheme(*args, quantizer=quantizer, **kw)):
            logits[quantizer] = m(ids).logits
    plain = m(ids).logits
    effect = (logits["oscar"] - plain).abs().max()
    assert effect > 1e-3
    assert (logits["fork"] - logits["oscar"]).abs().max() < 0.01 * effect     # measured: 8e-5 against 0.053


def test_fork_scheme_bits_and_checks():
    sch = fork_scheme(1, 2, 16, 8)
    assert sch.bits_per_element == 2 + 64 / 8
    assert fork_scheme(1, 2, 16, 8, quantizer="oscar").bits_per_element == 2 + 32 / 8
    with pytest.raises(InputError, match="unknown quantizer"):
        fork_scheme(1, 2, 16, 8, quantizer="gptq")
    with pytest.raises(InputError, match="group size = head_dim"):   # Lloyd-Max only with one group per row
        SimulatedKV(None, fork_scheme(1, 2, 16, 8, quantizer="fork-lloyd")).attend(
            0, torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16), None, 0.25, None, None)


@pytest.mark.parametrize("quantizer", ["fork", "fork-lloyd"])
def test_real_caches_refuse_a_quantiser_they_cannot_store(quantizer):
    """SimulatedCache and OscarCache store oscar's uniform INT2 only: the fork's quantisers are refused
    in one line instead of being stored silently as uniform INT2."""
    import dataclasses

    from oscar_calib.runtime.cache import OscarCache
    from oscar_calib.runtime.simulated import SimulatedCache

    m = tiny_model("llama", layers=2)
    geo = geometry_of(m)
    sch = fork_scheme(geo.num_layers, geo.num_kv_heads, geo.head_dim, 8, quantizer=quantizer)
    for cls in (SimulatedCache, OscarCache):
        with pytest.raises(InputError, match=f"'{quantizer}' quantiser exists only in the perplexity simulation"):
            cls(m.config, sch)
    for cls in (SimulatedCache, OscarCache):                  # the same scheme with oscar's quantiser is taken
        cls(m.config, dataclasses.replace(sch, quantizer="oscar"))
