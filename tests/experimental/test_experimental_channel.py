"""Keys per channel in blocks of tokens (experimental.channel.ChannelScheme, quantizer "channel"): the
block quantiser against an explicit loop, the rule of when a block leaves the window, the perplexity
simulation against an explicit per-(query, key) data path, bits; the real cache refuses it."""

from __future__ import annotations

import math

import pytest
import torch

from oscar_calib.errors import InputError
from oscar_calib.experimental.channel import ChannelScheme, channel_blocks
from oscar_calib.kernels import quantize_kv
from oscar_calib.runtime.cache import not_storable
from oscar_calib.runtime.scheme import KVScheme
from oscar_calib.runtime.simulate import SimulatedKV


def _base(h=2, d=16, g=8, sink=3, recent=6):
    gen = torch.Generator().manual_seed(0)
    rot = [torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0].float() for _ in range(2)]
    return KVScheme("oscar", 1, g, rot[:1], rot[1:], [torch.full((h,), 0.9)], [torch.full((h,), 0.9)], sink=sink,
                    recent=recent)


def _block_ref(y, sink, block):
    """Per block, KV head and channel: INT2 over the block's tokens (the DESIGN formula), fp16 params."""
    out = y.clone()
    s = y.shape[1]
    for a in range(sink, s - block + 1, block):
        x = y[:, a:a + block]                                              # [B, L, H, d]
        lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
        sc = torch.clamp((hi - lo) / 3, min=1e-8)
        q = torch.clamp(torch.floor(x / sc - lo / sc + 0.5), 0, 3)
        out[:, a:a + x.shape[1]] = q * sc.half().float() + (-((-lo / sc) * sc)).half().float()
    return out


def test_blocks_quantise_each_channel_over_its_tokens():
    y = torch.randn(2, 23, 2, 8, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 5, 8)
    got = channel_blocks(y, 3, 8)                                          # blocks of 8, 8 and a short one of 4
    assert torch.equal(got[:, :3], y[:, :3]) and torch.equal(got[:, 19:], y[:, 19:])   # never read from the history
    assert torch.allclose(got, _block_ref(y, 3, 8), atol=1e-5, rtol=0)
    err = (got - y)[:, 3:].abs()
    assert err.max() > 1e-3
    assert len(torch.unique(got[0, 3:11, 0, 0])) <= 4                      # 4 levels per channel and block


def test_a_block_stays_in_the_window_until_its_last_token_leaves():
    sch = ChannelScheme.of(_base(sink=3, recent=6), block=4)
    kpos = torch.arange(20).unsqueeze(0)
    hi = sch.reads_window(torch.tensor([[17]]), kpos)[0]
    # blocks [3, 7), [7, 11), [11, 15), [15, 19): from query 17, [3, 7) and [7, 11) have left (17 - 10 >= 6),
    # [11, 15) has not (17 - 14 < 6): token 11 is read from the window although 17 - 11 = 6
    assert hi.tolist() == [True] * 3 + [False] * 8 + [True] * 9
    plain = _base(sink=3, recent=6).reads_window(torch.tensor([[17]]), kpos)[0]
    assert (hi | ~plain).all() and hi[11] and not plain[11]


def test_simulation_reads_channel_blocks_as_the_explicit_data_path():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 40, 16), 3 * torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    base = _base()
    sch = ChannelScheme.of(base, block=8)
    got = SimulatedKV(None, sch).attend(0, q, k, v, None, 0.25, None, None)
    rk, _, rv, cv = sch.layer(0).rotations
    kb, vb = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
    kr = torch.einsum("bhsd,hde->bshe", kb, rk)
    kq = torch.einsum("bshe,hde->bhsd", _block_ref(kr, 3, 8), rk)          # per channel, no row clip
    vq = torch.einsum("bshe,hde->bhsd", quantize_kv(vb.transpose(1, 2), rv, cv, 8).dequantize(), rv)
    kw = torch.einsum("bhse,hde->bhsd", torch.einsum("bhsd,hde->bhse", kb, rk).to(torch.bfloat16).float(), rk)
    vw = torch.einsum("bhse,hde->bhsd", torch.einsum("bhsd,hde->bhse", vb, rv).to(torch.bfloat16).float(), rv)
    i, j = torch.arange(40)[:, None], torch.arange(40)[None, :]
    hi = sch.reads_window(i, j)
    want = torch.zeros(1, 40, 4, 16)
    for h in range(4):
        kv = h // 2
        s = torch.where(hi, q[0, h] @ kw[0, kv].T, q[0, h] @ kq[0, kv].T) * 0.25
        p = torch.softmax(s.masked_fill(j > i, -math.inf), -1)
        want[0, :, h] = (p * hi) @ vw[0, kv] + (p * ~hi) @ vq[0, kv]
    assert torch.allclose(got, want, atol=2e-5, rtol=0)
    per_token = SimulatedKV(None, base).attend(0, q, k, v, None, 0.25, None, None)
    assert (got - per_token).abs().max() > 1e-3


def test_bits_options_and_refusals():
    base = _base(g=8)
    sch = ChannelScheme.of(base, block=32, rotate=False, clip=True)
    assert sch.layer_bits(0) == pytest.approx((2 + 32 / 32 + 2 + 32 / 8) / 2) and sch.k_rotation == [None]
    assert sch.v_rotation[0] is base.v_rotation[0] and sch.k_row_clip and sch.name == "oscar+channel32"
    assert sch.logit_correction == 0.0
    for bad in (0, 24):
        with pytest.raises(InputError, match="k_block must be a power of two"):
            ChannelScheme.of(base, block=bad)
    assert "exists only in the perplexity simulation" in not_storable(sch)
