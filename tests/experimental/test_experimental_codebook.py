"""Calibrated 4-level codebooks (experimental.codebook): uniform levels are INT2, Lloyd does not increase
its objective, fitting is deterministic, the std coding holds the fork's Lloyd-Max levels."""

from __future__ import annotations

import pytest
import torch

from oscar_calib.errors import InputError
from oscar_calib.experimental.codebook import (
    codebook_mse,
    coordinates,
    fake_quant_codebook,
    fit_levels,
    initial_levels,
    lloyd_levels,
    nearest,
)
from oscar_calib.numerics.quant import (
    clip_rows,
    fake_quant_fork,
    fake_quant_int2,
    quantize_int2,
)


def rows(n=512, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * torch.linspace(0.2, 3.0, d)


@pytest.mark.parametrize("group", [16, 64])
def test_uniform_levels_equal_fake_quant_int2(group):
    x = clip_rows(rows(), 0.95)
    got = fake_quant_codebook(x, initial_levels("range"), group)
    assert torch.allclose(got, fake_quant_int2(x, group), atol=1e-6, rtol=0)
    y, _, _ = coordinates(x, group, "range")                                # and the same codes, tie for tie
    assert torch.equal(nearest(y, initial_levels("range")).reshape(x.shape).to(torch.uint8),
                       quantize_int2(x, group)[0])


def test_std_coding_with_fork_levels_reads_the_forks_lloyd_max_levels():
    x = rows(d=32)
    got = fake_quant_codebook(x, initial_levels("std"), 32, "std")
    fork = fake_quant_fork(x, 32, lloyd=True)
    # the same four values per row (mu + sigma*L); only the thresholds differ (fork: 0, ±0.98107)
    vals = torch.stack([fork.amin(-1), fork.amax(-1)], -1)
    assert torch.allclose(torch.stack([got.amin(-1), got.amax(-1)], -1), vals, atol=1e-5, rtol=1e-5)
    assert 0 < float((~torch.isclose(got, fork, atol=1e-4)).float().mean()) < 0.2


def test_nearest_picks_the_closest_level():
    lv = torch.tensor([0.0, 0.4, 2.0, 3.0])
    y = torch.tensor([-1.0, 0.19, 0.21, 1.19, 1.21, 2.6, 9.0])
    assert nearest(y, lv).tolist() == [0, 0, 1, 1, 2, 3, 3]


@pytest.mark.parametrize("coding", ["range", "std"])
def test_lloyd_never_increases_the_error_on_its_fitting_rows(coding):
    x = clip_rows(rows(seed=1), 0.94)
    y, _, b = coordinates(x, 64, coding)
    w = (b.unsqueeze(-1) ** 2).expand_as(y)
    errs = [codebook_mse(y, w, lloyd_levels(y, w, initial_levels(coding), iters=i)) for i in range(0, 12)]
    assert all(b <= a + 1e-9 for a, b in zip(errs, errs[1:]))
    assert errs[-1] < errs[0] * 0.99                                 # and it does move on Gaussian-ish rows
    # the weighted objective is the squared error of x itself
    lv = fit_levels(x, 64, coding)
    mse_x = float((fake_quant_codebook(x, lv, 64, coding) - x).pow(2).mean())
    mse_0 = float((fake_quant_codebook(x, initial_levels(coding), 64, coding) - x).pow(2).mean())
    assert mse_x < mse_0


def test_fitting_is_deterministic_and_sorted():
    x = rows(seed=2)
    a, b = fit_levels(x, 64), fit_levels(x.clone(), 64)
    assert torch.equal(a, b)
    assert bool((a.diff() >= 0).all()) and a.shape == (4,)


def test_bad_levels_and_coding_are_input_errors():
    with pytest.raises(InputError):
        fake_quant_codebook(rows(), torch.tensor([0.0, 2.0, 1.0, 3.0]), 64)
    with pytest.raises(InputError):
        fake_quant_codebook(rows(), torch.tensor([0.0, 1.0, 3.0]), 64)
    with pytest.raises(InputError):
        initial_levels("gauss")


def test_fixed_ends_keeps_the_outer_levels_and_still_descends():
    x = clip_rows(rows(seed=3), 0.94)
    y, _, b = coordinates(x, 64, "range")
    w = (b.unsqueeze(-1) ** 2).expand_as(y)
    lv = lloyd_levels(y, w, initial_levels("range"), fixed_ends=True)
    assert lv[0] == 0 and lv[-1] == 3 and not torch.equal(lv, initial_levels("range"))
    assert codebook_mse(y, w, lv) < codebook_mse(y, w, initial_levels("range"))
    assert codebook_mse(y, w, lloyd_levels(y, w)) <= codebook_mse(y, w, lv) + 1e-9   # free ends: no worse
