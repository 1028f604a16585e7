"""Per-layer and per-cache (K/V) group sizes in the perplexity simulation (a bit budget): the
simulation against an explicit per-(i, j) pure-torch reference, the stored bits, and the checks."""

from __future__ import annotations

import math

import pytest
import torch

from oscar_calib.errors import InputError
from oscar_calib.numerics.quant import clip_rows, quantize_int2
from oscar_calib.runtime.scheme import KVScheme
from oscar_calib.runtime.simulate import SimulatedKV


def _rotation(h: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))[0].float()


def _int2_fp16(x: torch.Tensor, g: int) -> torch.Tensor:
    """oscar's storage written out: INT2 codes, fp16 scale and fp16 offset (= −z·s) per group."""
    q, s, z = quantize_int2(x, g)
    scale, offset = s.half().float(), (-z * s).half().float()
    d = x.shape[-1]
    y = q.float().reshape(*x.shape[:-1], d // g, g) * scale.unsqueeze(-1) + offset.unsqueeze(-1)
    return y.reshape(x.shape)


def _reference(q, k, v, sch, layer, scaling):
    """Per query head, per (i, j): BF16 inside sink/window (as OscarCache's window holds them:
    rotated and rounded to BF16 again, read rotated back), else K/V rotated, clipped, quantised in
    groups of the layer's own K and V sizes, rotated back."""
    bf = lambda x: x.to(torch.bfloat16).float()  # noqa: E731
    rk, ck, rv, cv = sch.layer(layer).rotations
    gk, gv = sch.groups(layer)
    hq, t = q.shape[1], q.shape[2]
    grp = hq // k.shape[1]
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    hi = (j < sch.sink) | (i - j < sch.recent)
    out = torch.zeros(1, t, hq, q.shape[3])
    for h in range(hq):
        kv = h // grp
        kb, vb = bf(k[0, kv]), bf(v[0, kv])
        kq = _int2_fp16(clip_rows(kb @ rk[kv], float(ck[kv])), gk) @ rk[kv].T
        vq = _int2_fp16(clip_rows(vb @ rv[kv], float(cv[kv])), gv) @ rv[kv].T
        kw, vw = bf(kb @ rk[kv]) @ rk[kv].T, bf(vb @ rv[kv]) @ rv[kv].T
        s = torch.where(hi, q[0, h] @ kw.T, q[0, h] @ kq.T) * scaling
        p = torch.softmax(s.masked_fill(j > i, -math.inf), -1)
        out[0, :, h] = (p * hi) @ vw + (p * ~hi) @ vq
    return out


def _scheme(k_groups, v_groups, h=2, d=32):
    n = len(k_groups)
    return KVScheme("budget", n, max(k_groups + v_groups), [_rotation(h, d, 2 * i) for i in range(n)],
                    [_rotation(h, d, 2 * i + 1) for i in range(n)], [torch.full((h,), 0.95)] * n,
                    [torch.full((h,), 0.9)] * n, sink=3, recent=7, k_groups=k_groups, v_groups=v_groups)


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_split_and_per_layer_groups_match_the_explicit_data_path(layer):
    torch.manual_seed(layer)
    q, k, v = torch.randn(1, 4, 40, 32), 3 * torch.randn(1, 2, 40, 32), torch.randn(1, 2, 40, 32)
    sch = _scheme([8, 32, 16], [32, 8, 16])
    got = SimulatedKV(None, sch).attend(layer, q, k, v, None, 0.2, None, None)
    assert torch.allclose(got, _reference(q, k, v, sch, layer, 0.2), atol=1e-5, rtol=0)
    # the group size really matters: a uniform scheme at the nominal size reads different rows
    uniform = _scheme([32] * 3, [32] * 3)
    if sch.groups(layer) != (32, 32):
        other = SimulatedKV(None, uniform).attend(layer, q, k, v, None, 0.2, None, None)
        assert (other - got).abs().max() > 1e-3


def test_bits_average_layers_and_caches():
    sch = _scheme([8, 32, 16], [32, 8, 16])
    assert sch.layer_bits(0) == pytest.approx((2 + 32 / 8 + 2 + 32 / 32) / 2)
    assert sch.bits_per_element == pytest.approx(sum(sch.layer_bits(i) for i in range(3)) / 3)
    assert not sch.uniform_groups
    assert _scheme([16] * 3, [16] * 3).bits_per_element == pytest.approx(4.0)
    assert sch.groups(2) == (16, 16) and sch.groups(0) == (8, 32)


def test_group_lists_default_and_are_checked():
    sch = KVScheme("u", 2, 16)
    assert sch.k_groups == [16, 16] and sch.v_groups == [16, 16] and sch.uniform_groups
    with pytest.raises(InputError, match="k_groups has 1 layers"):
        KVScheme("u", 2, 16, k_groups=[16])
    with pytest.raises(InputError, match="not a power of two"):
        KVScheme("u", 2, 16, v_groups=[16, 12])
    with pytest.raises(InputError, match="nothing is quantised"):
        KVScheme("u", 2, None, k_groups=[16, 16])
