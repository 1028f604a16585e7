import math

import pytest
import torch

from oscar_calib.errors import InputError
from oscar_calib.numerics.clip import HeldoutLayer
from oscar_calib.numerics.quant import fake_quant_int2, simulate_kv_quant
from oscar_calib.numerics.refine import (
    HeadRows,
    RefineSettings,
    cayley,
    fake_quant_ste,
    refine_layer,
    refine_rotations,
    split_sequences,
)
from oscar_calib.numerics.rotation import orthogonality_error


def _rows(seed=0, t=96, j=2, d=16, seqs=2, outlier=8.0):
    """Random rows with a few outlier channels (what makes INT2 without a good rotation poor)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(d)
    scale[:2] = outlier
    q = [torch.randn(t, j, d, generator=g) for _ in range(seqs)]
    k = [torch.randn(t, d, generator=g) * scale for _ in range(seqs)]
    v = [torch.randn(t, d, generator=g) * scale.flip(0) for _ in range(seqs)]
    return HeadRows(q, k, v, scaling=d ** -0.5)


def _independent(rows, rk, ck, rv, cv, group, sink):
    """The objective recomputed from the quantiser of numerics/quant (simulate_kv_quant), per query head."""
    num = den = 0.0
    for q, k, v in zip(rows.q, rows.k, rows.v):
        t = q.shape[0]
        kq = simulate_kv_quant(k[:, None], rk[None], ck, group, unrotate=True)[:, 0].double()
        vq = simulate_kv_quant(v[:, None], rv[None], cv, group, unrotate=True)[:, 0].double()
        kq[:sink], vq[:sink] = k[:sink].double(), v[:sink].double()
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        for j in range(q.shape[1]):
            qj = q[:, j].double()
            ref = torch.softmax((qj @ k.double().T * rows.scaling).masked_fill(~causal, -math.inf), -1) @ v.double()
            out = torch.softmax((qj @ kq.T * rows.scaling).masked_fill(~causal, -math.inf), -1) @ vq
            num += float((out - ref).pow(2).sum())
            den += float(ref.pow(2).sum())
    return num / den


def test_cayley_is_orthogonal_and_zero_is_identity():
    w = torch.randn(3, 12, 12, dtype=torch.float64)
    assert orthogonality_error(cayley(w)) < 1e-12
    assert torch.equal(cayley(torch.zeros(5, 5)), torch.eye(5))


def test_ste_forward_equals_the_reference_quantiser_and_passes_gradients():
    y = torch.randn(40, 32, requires_grad=True)
    out = fake_quant_ste(y, 1.0, 16)
    assert torch.allclose(out, fake_quant_int2(y.detach(), 16), atol=1e-5)
    out.pow(2).sum().backward()
    assert y.grad is not None and y.grad.abs().sum() > 0


def test_zero_steps_returns_the_start():
    rows = _rows()
    rk0 = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64))[0]
    rv0 = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64))[0]
    rk, rv, rep = refine_rotations(rows, rk0, 0.95, rv0, 0.9, 8, RefineSettings(steps=0, sink=4))
    assert torch.equal(rk, rk0) and torch.equal(rv, rv0)
    assert rep["before"] == rep["after"] and rep["best_step"] == 0


def test_refinement_lowers_the_objective_stays_orthogonal_and_reports_it_exactly():
    rows = _rows(seed=1)
    eye = torch.eye(16, dtype=torch.float64)            # a poor start: outlier channels left in place
    st = RefineSettings(steps=40, lr=1e-2, sink=4)
    rk, rv, rep = refine_rotations(rows, eye, 1.0, eye, 1.0, 8, st)
    assert rk.dtype == torch.float64 and rv.dtype == torch.float64
    assert orthogonality_error(rk) < 1e-6 and orthogonality_error(rv) < 1e-6
    assert rep["after"] < 0.9 * rep["before"], rep
    assert rep["best_step"] > 0
    for r_k, r_v, key in ((eye, eye, "before"), (rk, rv, "after")):
        ind = _independent(rows, r_k, 1.0, r_v, 1.0, 8, st.sink)
        assert ind == pytest.approx(rep[key], rel=1e-6)


def test_refinement_with_clips_is_never_worse_than_the_start():
    rows = _rows(seed=2, outlier=1.0)                  # already benign: little or nothing to gain
    rk0 = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))[0]
    rk, rv, rep = refine_rotations(rows, rk0, 0.9, rk0, 0.94, 8, RefineSettings(steps=5, lr=0.5, sink=0))
    assert rep["after"] <= rep["before"]
    assert rep["after"] == pytest.approx(_independent(rows, rk, 0.9, rv, 0.94, 8, 0), rel=1e-6)


def test_refine_layer_splits_query_heads_by_kv_head():
    g = torch.Generator().manual_seed(4)
    t, d = 48, 8
    q = [torch.randn(t, 4, d, generator=g)]            # 4 query heads, 2 KV heads
    k = [torch.randn(t, 2, d, generator=g)]
    v = [torch.randn(t, 2, d, generator=g)]
    held = HeldoutLayer(q, k, v, [torch.zeros(t, 4, d)], scaling=d ** -0.5)
    rot = torch.eye(d, dtype=torch.float64).expand(2, d, d)
    clips = torch.ones(2, dtype=torch.float64)
    rk, rv, reps = refine_layer(held, rot, clips, rot, clips, 4, RefineSettings(steps=3, sink=2))
    assert rk.shape == (2, d, d) and rv.shape == (2, d, d) and len(reps) == 2
    rows1 = HeadRows.of_layer(held, 1)
    assert torch.equal(rows1.q[0], q[0][:, 2:4]) and torch.equal(rows1.k[0], k[0][:, 1])
    assert reps[1]["after"] == pytest.approx(_independent(rows1, rk[1], 1.0, rv[1], 1.0, 4, 2), rel=1e-6)


def test_validation_rows_choose_the_step_and_carry_the_report():
    rows = _rows(seed=5, seqs=3)
    fit = HeadRows(rows.q[:2], rows.k[:2], rows.v[:2], rows.scaling)
    valid = HeadRows(rows.q[2:], rows.k[2:], rows.v[2:], rows.scaling)
    eye = torch.eye(16, dtype=torch.float64)
    rk, rv, rep = refine_rotations(fit, eye, 1.0, eye, 1.0, 8, RefineSettings(steps=20, lr=1e-2, sink=4), valid=valid)
    assert rep["before"] == pytest.approx(_independent(valid, eye, 1.0, eye, 1.0, 8, 4), rel=1e-6)
    assert rep["after"] == pytest.approx(_independent(valid, rk, 1.0, rv, 1.0, 8, 4), rel=1e-6)
    assert rep["after"] <= rep["before"]
    assert _independent(fit, rk, 1.0, rv, 1.0, 8, 4) < _independent(fit, eye, 1.0, eye, 1.0, 8, 4)


def test_split_sequences():
    assert split_sequences(1) == ([0], None)
    assert split_sequences(2) == ([0], [1])
    assert split_sequences(8) == ([0, 1, 2, 3, 4, 5], [6, 7])


@pytest.mark.parametrize("kw", [{"steps": -1}, {"lr": 0.0}, {"lr": float("nan")}, {"sink": -2}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(InputError):
        RefineSettings(**kw)
