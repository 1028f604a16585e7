"""The K/V bit budget (calibration.budget): candidate sizes, the greedy allocation within the mean and
long-context bounds, and the error table against heldout_errors."""

from __future__ import annotations

import pytest
import torch

from oscar_calib.calibration.budget import allocate, candidate_sizes, error_table
from oscar_calib.errors import InputError
from oscar_calib.kernels.pack import bits_per_element
from oscar_calib.numerics.clip import HeldoutLayer, heldout_errors

SIZES = (256, 128, 64, 32)


def _table(scale: float, k_weight: float = 1.0) -> torch.Tensor:
    """A made-up layer: error falls as either size halves; ``k_weight`` says how much K matters."""
    t = torch.empty(len(SIZES), len(SIZES), dtype=torch.float64)
    for a, gk in enumerate(SIZES):
        for b, gv in enumerate(SIZES):
            t[a, b] = scale * (k_weight * gk + gv) ** 0.5
    return t


def test_candidate_sizes():
    assert candidate_sizes(256) == SIZES
    assert candidate_sizes(64) == (64, 32)
    with pytest.raises(InputError, match="no power-of-two group size"):
        candidate_sizes(16)


def test_greedy_spends_the_budget_where_the_error_is():
    tables = [_table(1.0), _table(0.01), _table(1.0), _table(0.01), _table(0.01), _table(0.01)]
    alloc = allocate(tables, SIZES, 2.5)                         # layers 0 and 2 matter, the rest hardly
    assert alloc.tied and alloc.mean_bits <= 2.5 + 1e-9
    assert alloc.groups == [(32, 32), (128, 128), (32, 32), (128, 128), (128, 128), (128, 128)]
    # nothing within the budget is left: one more halving anywhere would exceed it
    assert alloc.mean_bits > 2.5 - (bits_per_element(32) - bits_per_element(64))
    assert alloc.heldout_mse == pytest.approx(sum(float(t[SIZES.index(g), SIZES.index(g)] ** 2)
                                                  for t, (g, _) in zip(tables, alloc.groups)))


def test_split_favours_the_cache_that_matters():
    tables = [_table(1.0, k_weight=20.0)] * 4
    alloc = allocate(tables, SIZES, 2.5, tied=False)
    assert all(gk < gv for gk, gv in alloc.groups)
    assert alloc.mean_bits <= 2.5 + 1e-9


def test_long_context_bound_caps_the_full_attention_layers():
    tables = [_table(0.01)] * 5 + [_table(1.0)]                # the one full-attention layer matters most
    free = allocate(tables, SIZES, 2.5)
    assert free.groups[5] == (32, 32) and free.long_bits == pytest.approx(free.mean_bits)   # None: every layer
    capped = allocate(tables, SIZES, 2.5, long_layers=[5])
    assert capped.long_bits <= 2.5 + 1e-9 and capped.mean_bits <= 2.5 + 1e-9
    assert capped.groups[5] == (64, 64)
    with pytest.raises(InputError, match="below the largest group size"):
        allocate(tables, SIZES, 2.0)


def test_error_table_is_heldout_errors_per_pair():
    torch.manual_seed(0)
    t, hkv, grp, d = 24, 1, 2, 16
    q, k, v = torch.randn(t, hkv * grp, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    s = torch.einsum("thd,shd->hts", q, k.repeat_interleave(grp, 1)) * 0.25
    p = torch.softmax(s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")), -1)
    o = torch.einsum("hts,shd->thd", p, v.repeat_interleave(grp, 1))
    held = HeldoutLayer([q], [k], [v], [o], 0.25)
    rot = torch.linalg.qr(torch.randn(hkv, d, d, dtype=torch.float64))[0]
    sizes = (16, 8, 4)
    clips = {(w, g): torch.full((hkv,), 0.9, dtype=torch.float64) for w in "kv" for g in sizes}
    tab = error_table(held, rot, rot, clips, sizes)
    want = heldout_errors(held, rot, clips[("k", 8)], rot, clips[("v", 4)], 8, 4)["attn"]
    assert tab[1, 2] == pytest.approx(want)
    assert tab[2, 2] < tab[0, 0]            # smaller groups, smaller error on these rows
    assert tab[1, 2] != pytest.approx(float(tab[2, 1]))
