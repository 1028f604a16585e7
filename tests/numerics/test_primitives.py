import math
import warnings

import pytest
import torch

from oscar_calib.contract.defaults import check_group_size, default_group_size
from oscar_calib.errors import InputError
from oscar_calib.numerics.hadamard import (
    bit_reversal_order,
    bit_reversal_permutation,
    hadamard,
    walsh_hadamard,
)
from oscar_calib.numerics.quant import (
    clip_rows,
    clip_threshold,
    dequantize_int2,
    fake_quant_int2,
    quantize_int2,
)


@pytest.mark.parametrize("n", [1, 2, 8, 64, 128, 256])
def test_walsh_hadamard_is_orthogonal_and_equalises(n):
    h = walsh_hadamard(n)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=h.dtype), atol=1e-12)
    assert torch.allclose(h.abs(), torch.full_like(h, n ** -0.5))
    lam = torch.diag(torch.rand(n, dtype=torch.float64) * 10)
    diag = torch.diagonal(h.T @ lam @ h)
    assert torch.allclose(diag, torch.full_like(diag, float(torch.trace(lam)) / n), atol=1e-10)


@pytest.mark.parametrize("n,block", [(96, 32), (80, 16), (48, 16)])
def test_block_diagonal_hadamard_for_non_power_of_two(n, block):
    with pytest.warns(UserWarning, match="not a power of two"):
        h = hadamard(n)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=h.dtype), atol=1e-12)
    # nothing leaks between blocks; inside a block every entry has magnitude block^-1/2
    for i in range(0, n, block):
        blk = h[i:i + block, i:i + block]
        assert torch.allclose(blk.abs(), torch.full_like(blk, block ** -0.5))
        assert float(h[i:i + block].abs().sum()) == pytest.approx(float(blk.abs().sum()))


def test_power_of_two_hadamard_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hadamard(64)


def test_bit_reversal_hand_checked_for_8():
    assert bit_reversal_order(8) == [0, 4, 2, 6, 1, 5, 3, 7]
    p = bit_reversal_permutation(8)
    x = torch.arange(8, dtype=torch.float64).unsqueeze(0)
    assert (x @ p).squeeze(0).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    assert torch.equal(p @ p.T, torch.eye(8, dtype=p.dtype))
    # groups of two take one channel from each half; groups of four one from each quarter
    for g, levels in ((2, 2), (4, 4)):
        order = bit_reversal_order(8)
        for start in range(0, 8, g):
            assert sorted(i // (8 // levels) for i in order[start:start + g]) == list(range(levels))


def test_bit_reversal_non_power_of_two_is_a_permutation():
    order = bit_reversal_order(96)
    assert sorted(order) == list(range(96))


def test_int2_formula_hand_checked():
    x = torch.tensor([[-1.0, 0.0, 0.5, 2.0]])
    q, s, z = quantize_int2(x, 4)
    assert s.item() == pytest.approx(1.0)            # (2 - -1) / 3
    assert z.item() == pytest.approx(1.0)            # -min / s
    assert q.tolist() == [[0, 1, 2, 3]]              # floor(x/s + z + 0.5): 0, 1, 2.0->2, 3
    assert dequantize_int2(q, s, z, 4).tolist() == [[-1.0, 0.0, 1.0, 2.0]]


def test_int2_constant_group_uses_scale_floor():
    x = torch.full((1, 8), 3.0)
    q, s, z = quantize_int2(x, 8)
    assert s.item() == pytest.approx(1e-8)
    assert torch.allclose(fake_quant_int2(x, 8), x)


def test_int2_error_bounded_by_half_step():
    x = torch.randn(50, 4, 64)
    xq = fake_quant_int2(x, 32)
    g = x.reshape(50, 4, 2, 32)
    step = (g.amax(-1) - g.amin(-1)) / 3
    err = (xq - x).abs().reshape(50, 4, 2, 32).amax(-1)
    assert bool((err <= step / 2 + 1e-5).all())


def test_clip_rule_matches_design():
    row = torch.tensor([[0.1, -5.0, 0.3, 2.0, -0.2, 0.4, 0.5, 1.0]])
    # sorted |row| = .1 .2 .3 .4 .5 1 2 5; c=0.75 -> idx floor(6)=6 -> t=2
    assert clip_threshold(row, 0.75).item() == pytest.approx(2.0)
    assert clip_rows(row, 0.75).tolist()[0][1] == pytest.approx(-2.0)
    assert torch.equal(clip_rows(row, 1.0), row)      # idx d-1 = max |x|: unchanged


def test_clip_threshold_top_k_equals_the_sorted_rule():
    """The top-k path returns the sorted row's element at the clip index, bit for bit: per-head
    ratios (high ones take top-k, a 0.4 takes the sort), ties, zeros of both signs, infinities
    and NaN, float32 and float64, a ratio tensor on the rows' device or not."""
    g = torch.Generator().manual_seed(0)

    def by_sort(x, ratio):
        d = x.shape[-1]
        idx = torch.clamp(torch.floor(torch.as_tensor(ratio, dtype=torch.float64) * d).long(), max=d - 1)
        return x.abs().sort(dim=-1).values.gather(-1, idx.expand(x.shape[:-1]).unsqueeze(-1))

    for dtype in (torch.float32, torch.float64):
        x = torch.randn(500, 4, 64, generator=g).to(dtype)
        x[:50] = torch.round(x[:50] * 2) / 2                         # many ties
        x[50, 0, :8] = 0.0
        x[50, 0, 8:16] = -0.0
        x[51, 1, 3] = float("inf")
        x[52, 2, 5] = float("-inf")
        x[53, 3, 7] = float("nan")
        heads = torch.tensor([0.88, 0.95, 0.92, 0.99], dtype=torch.float64)
        mixed = torch.tensor([0.9, 0.3, 0.92, 0.99], dtype=torch.float64)
        for rows, ratio in ((x, 0.96), (x, 1.0), (x, 0.5), (x, 0.4), (x, heads), (x, mixed),
                            (x.transpose(0, 1), heads.view(-1, 1)), (x.transpose(0, 1), mixed.view(-1, 1))):
            got, want = clip_threshold(rows, ratio), by_sort(rows, ratio)
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(), want.nan_to_num())
            assert got.shape == want.shape == (*rows.shape[:-1], 1)


def test_group_size_checks():
    assert default_group_size(64) == 64 and default_group_size(256) == 128 and default_group_size(96) == 32
    with pytest.raises(InputError, match="power of two"):
        check_group_size(64, 48)
    with pytest.raises(InputError, match="32 is not a power of two dividing head_dim 80"):
        check_group_size(80, 32)
    with pytest.raises(InputError, match="below the smallest group size 4"):      # before any model is known
        check_group_size(None, 2)
    assert math.isclose(2 + 32 / 128, 2.25)


# ----------------------------------------------------------------------------- the fork's quantiser

def test_fork_quantiser_against_a_hand_computation():
    """One group of 4 worked by hand with the fork's rule: s = max(max − min, 1e-8)/3, z = −min/s,
    q = floor(x/s + z + 0.5), x̂ = (q − z)·s, in float32."""
    from oscar_calib.numerics.quant import fake_quant_fork, quantize_int2_fork

    x = torch.tensor([[-1.0, 0.2, 0.45, 2.0]])
    q, s, z = quantize_int2_fork(x, 4)
    # range 3 -> s = 1, z = 1; x/s + z + 0.5 = 0.5, 1.7, 1.95, 3.5 -> 0, 1, 1, 3
    assert s.tolist() == [[1.0]] and z.tolist() == [[1.0]]
    assert q.tolist() == [[0, 1, 1, 3]]
    assert fake_quant_fork(x, 4).tolist() == [[-1.0, 0.0, 0.0, 2.0]]
    # two groups of 4: each with its own scale and zero
    y = torch.tensor([[0.0, 0.0, 0.0, 3.0, -6.0, 0.0, 0.0, 0.0]])
    q2, s2, z2 = quantize_int2_fork(y, 4)
    assert s2.tolist() == [[1.0, 2.0]] and z2.tolist() == [[0.0, 3.0]] and q2.tolist() == [[0, 0, 0, 3, 0, 3, 3, 3]]
    # the floor sits on the range: a constant group gets s = 1e-8/3 (ours floors s itself at 1e-8)
    c = torch.full((1, 4), 0.5)
    _, sc, zc = quantize_int2_fork(c, 4)
    _, so, _ = quantize_int2(c, 4)
    assert sc.item() == pytest.approx(1e-8 / 3, rel=1e-6) and so.item() == pytest.approx(1e-8, rel=1e-6)
    assert torch.equal(fake_quant_fork(c, 4), c)
    # elsewhere it agrees with ours to float32 rounding, on random data
    r = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(fake_quant_fork(r, 8), fake_quant_int2(r, 8), atol=1e-6)


def test_fork_lloyd_max_levels():
    """Lloyd-Max buckets: thresholds at zr = ±0.98107 and 0 of the standardised row; levels
    mu + sigma·{−1.7511, −0.5837, 0.5837, 1.7511}."""
    from oscar_calib.numerics.quant import fake_quant_fork, quantize_lloyd_fork

    g = torch.Generator().manual_seed(1)
    x = 3 + 2 * torch.randn(16, 128, generator=g)
    x[0, :4] = torch.tensor([-10.0, 10.0, 2.9, 3.1])
    q, s, z = quantize_lloyd_fork(x)
    mu, sigma = x.mean(-1, keepdim=True), torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-8)
    zr = (x - mu) / sigma
    want = (zr >= -0.98107).int() + (zr >= 0).int() + (zr >= 0.98107).int()
    assert torch.equal(q.int(), want)
    assert q[0, :2].tolist() == [0, 3]
    deq = fake_quant_fork(x, 128, lloyd=True)
    levels = mu + sigma * torch.tensor([-1.7511, -0.5837, 0.5837, 1.7511])
    assert torch.allclose(deq, levels.gather(-1, q.long()), atol=2e-4 * float(sigma.max()))
    assert len({round(v, 4) for v in deq[3].tolist()}) == 4            # four distinct levels per row
    with pytest.raises(InputError, match="group size = head_dim"):
        fake_quant_fork(x, 64, lloyd=True)
