"""Eigendecomposition of the objectives and composition of rotations, in float64.

=================  =========================================================================
composition        rotation ``R`` (a rotated row is ``x @ R``)
=================  =========================================================================
``u_h_pbr``        ``U · H · P_br``: eigenbasis, then Walsh–Hadamard, then bit reversal
``u``              ``U``: eigenbasis only (channels ordered by descending eigenvalue)
``h``              ``H``: data-free Hadamard (the QuaRot-style baseline)
``identity``       ``I``
=================  =========================================================================

``U``'s columns are the objective's eigenvectors sorted by descending eigenvalue, each signed so
its largest-magnitude entry is positive (eigh's signs are arbitrary; this makes runs repeatable).
``H`` is the normalised Walsh–Hadamard matrix, block-diagonal when head_dim is not a power of two.
``P_br`` is the bit-reversal permutation of :func:`oscar_calib.numerics.hadamard.bit_reversal_permutation`.
With a full-size ``H`` every output channel carries energy tr(Λ)/d whatever the permutation; with
a block-diagonal ``H`` (head_dim 96, 80, ...), ``P_br`` sends one channel of every importance
level into each block.
"""

from __future__ import annotations

import contextlib

import torch

from ..contract.defaults import (  # noqa: F401
    COMPOSITIONS,
    GRANULARITIES,
    K_OBJECTIVES,
    V_OBJECTIVES,
    choose,
)
from ..errors import InputError, NumericalError
from .hadamard import bit_reversal_permutation, hadamard

# LAPACK on a few 128 x 128 matrices gains nothing from many threads and loses to their overhead:
# a [8, 128, 128] eigh took 29 ms with the 32 threads of a 2-GPU host, 7.5 ms on 2 cores
EIGH_THREADS = 4


@contextlib.contextmanager
def _few_threads(n: int = EIGH_THREADS):
    old = torch.get_num_threads()
    if old <= n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def eig_desc(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (descending) and eigenvectors (columns, sign-normalised) of symmetric
    ``cov`` [..., d, d] in float64."""
    cov = cov.to(torch.float64)
    cov = 0.5 * (cov + cov.transpose(-1, -2))
    if not torch.isfinite(cov).all():
        raise NumericalError("non-finite covariance")
    with _few_threads():
        vals, vecs = torch.linalg.eigh(cov)
    vals, vecs = vals.flip(-1), vecs.flip(-1)
    idx = vecs.abs().argmax(dim=-2, keepdim=True)
    sign = torch.sign(vecs.gather(-2, idx))
    sign[sign == 0] = 1
    return vals, vecs * sign


def compose(u: torch.Tensor, composition: str, *, warn: bool = True) -> torch.Tensor:
    """Build ``R`` [..., d, d] from eigenvectors ``u`` [..., d, d] (float64)."""
    d = u.shape[-1]
    eye = torch.eye(d, dtype=torch.float64, device=u.device).expand_as(u)
    if composition == "identity":
        return eye.clone()
    if composition == "u":
        return u.clone()
    h = hadamard(d, warn=warn).to(u.device)
    if composition == "h":
        return h.expand_as(u).clone()
    if composition == "u_h_pbr":
        return u @ h @ bit_reversal_permutation(d).to(u.device)
    raise InputError(f"unknown composition {composition!r}; choose from {', '.join(COMPOSITIONS)}")


def rotations_from_covariance(cov: torch.Tensor, composition: str, granularity: str,
                              *, warn: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-KV-head rotations and eigenvalues from a covariance [h, d, d].

    ``granularity="layer"`` pools the heads (mean of their covariances) and repeats one
    rotation for every head; the eigenvalues reported are the pooled ones, repeated."""
    if granularity == "layer":
        pooled = cov.mean(0, keepdim=True)
        vals, vecs = eig_desc(pooled)
        r = compose(vecs, composition, warn=warn)
        h = cov.shape[0]
        return r.expand(h, -1, -1).clone(), vals.expand(h, -1).clone()
    vals, vecs = eig_desc(cov)
    return compose(vecs, composition, warn=warn), vals


def orthogonality_error(r: torch.Tensor) -> float:
    """‖R Rᵀ − I‖∞ over all heads, computed in float64."""
    r = r.to(torch.float64)
    eye = torch.eye(r.shape[-1], dtype=torch.float64, device=r.device)
    return float((r @ r.transpose(-1, -2) - eye).abs().max())
