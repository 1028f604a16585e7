import pytest
import torch

from oscar_calib.errors import InputError
from oscar_calib.numerics.hadamard import bit_reversal_permutation, walsh_hadamard
from oscar_calib.numerics.rotation import (
    COMPOSITIONS,
    compose,
    eig_desc,
    orthogonality_error,
    rotations_from_covariance,
)


def _cov(h, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(h, 4 * d, d, generator=g, dtype=torch.float64) * torch.logspace(0, 2, d, dtype=torch.float64)
    return a.transpose(1, 2) @ a / (4 * d)


@pytest.mark.parametrize("composition", COMPOSITIONS)
@pytest.mark.parametrize("d", [8, 64, 96])
def test_every_rotation_is_orthogonal(composition, d):
    r, vals = rotations_from_covariance(_cov(3, d), composition, "head", warn=False)
    assert r.shape == (3, d, d) and vals.shape == (3, d)
    assert orthogonality_error(r.float()) < 1e-5
    assert orthogonality_error(r) < 1e-10


def test_eigenvectors_descending_and_deterministic_sign():
    c = _cov(2, 16)
    vals, vecs = eig_desc(c)
    assert bool((vals[:, :-1] >= vals[:, 1:]).all())
    assert torch.allclose(vecs @ torch.diag_embed(vals) @ vecs.transpose(1, 2), c, atol=1e-8)
    idx = vecs.abs().argmax(1, keepdim=True)
    assert bool((vecs.gather(1, idx) > 0).all())
    vals2, vecs2 = eig_desc(c.clone())
    assert torch.equal(vecs, vecs2)


def test_u_h_pbr_is_the_documented_product():
    c = _cov(1, 8)
    _, u = eig_desc(c)
    r = compose(u, "u_h_pbr")
    assert torch.allclose(r, u @ walsh_hadamard(8) @ bit_reversal_permutation(8))
    # it diagonalises to equal channel energies: diag(Rᵀ C R) = tr(C)/d
    diag = torch.diagonal(r[0].T @ c[0] @ r[0])
    assert torch.allclose(diag, torch.full_like(diag, float(torch.trace(c[0])) / 8), rtol=1e-8)


def test_u_puts_the_largest_eigen_direction_first():
    c = _cov(1, 16)
    r, vals = rotations_from_covariance(c, "u", "head")
    energy = torch.diagonal(r[0].T @ c[0] @ r[0])
    assert torch.allclose(energy, vals[0], rtol=1e-8)


def test_layer_granularity_repeats_one_rotation():
    c = _cov(4, 16)
    r, vals = rotations_from_covariance(c, "u_h_pbr", "layer")
    assert all(torch.equal(r[0], r[i]) for i in range(4))
    ref_vals, _ = eig_desc(c.mean(0, keepdim=True))
    assert torch.allclose(vals[0], ref_vals[0])


def test_unknown_composition():
    with pytest.raises(InputError, match="composition"):
        compose(torch.eye(4, dtype=torch.float64).unsqueeze(0), "qr")


def test_eig_desc_runs_on_few_threads_and_gives_the_threads_back(monkeypatch):
    from oscar_calib.numerics import rotation

    g = torch.Generator().manual_seed(3)
    a = torch.randn(4, 64, 64, generator=g, dtype=torch.float64)
    cov = a @ a.transpose(1, 2)
    seen, real = [], torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda x: (seen.append(torch.get_num_threads()), real(x))[1])
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(rotation.EIGH_THREADS + 2)
        vals, vecs = eig_desc(cov)
        assert torch.get_num_threads() == rotation.EIGH_THREADS + 2
    finally:
        torch.set_num_threads(old)
    assert seen == [rotation.EIGH_THREADS]
    torch.testing.assert_close(vecs @ torch.diag_embed(vals) @ vecs.transpose(1, 2), cov, rtol=1e-10, atol=1e-9)
