"""Hadamard matrices, the bit-reversal permutation, and rotation composition primitives.

Everything is built in float64; callers cast on save.
"""

from __future__ import annotations

import warnings

import torch

from ..contract.defaults import is_power_of_two


def walsh_hadamard(n: int, dtype=torch.float64) -> torch.Tensor:
    """Normalised Sylvester–Walsh–Hadamard matrix of order ``n`` (a power of two): ``H Hᵀ = I``."""
    if not is_power_of_two(n):
        raise ValueError(f"Walsh–Hadamard order must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / h.shape[0] ** 0.5).to(dtype)


def largest_pow2_block(n: int) -> int:
    """Largest power of two dividing ``n`` (the block of a block-diagonal Hadamard)."""
    return n & -n


def hadamard(n: int, dtype=torch.float64, *, warn: bool = True) -> torch.Tensor:
    """A normalised Hadamard-like orthogonal matrix of order ``n``.

    For a power of two this is :func:`walsh_hadamard`. Otherwise (head_dim 96, 80, ...) it is
    block-diagonal with Walsh–Hadamard blocks of the largest power of two dividing ``n``
    (32 for 96, 16 for 80): still orthogonal, but it only mixes channels inside each block, so
    outliers spread less; a warning says so.
    """
    if is_power_of_two(n):
        return walsh_hadamard(n, dtype)
    b = largest_pow2_block(n)
    if warn:
        warnings.warn(
            f"head_dim {n} is not a power of two: using a block-diagonal Hadamard of "
            f"{n // b} blocks of {b}",
            stacklevel=2,
        )
    return torch.block_diag(*[walsh_hadamard(b, torch.float64)] * (n // b)).to(dtype)


def bit_reversal_order(n: int) -> list[int]:
    """``order[j]`` = the index whose bits (over log2(n) bits) reversed give ``j``.

    For ``n = 8``: ``[0, 4, 2, 6, 1, 5, 3, 7]``. For ``n`` not a power of two the permutation is
    built on the next power of two and indices ``>= n`` are dropped (order is preserved).
    """
    bits = max(1, (max(n, 2) - 1).bit_length())
    full = [int(format(i, f"0{bits}b")[::-1], 2) for i in range(1 << bits)]
    return [i for i in full if i < n]


def bit_reversal_permutation(n: int, dtype=torch.float64) -> torch.Tensor:
    """Permutation matrix ``P`` with ``(x @ P)[j] = x[order[j]]`` (see :func:`bit_reversal_order`).

    Applied to channels sorted by descending importance, consecutive power-of-two groups of
    the output each take one channel from every importance level: for ``n = 8`` and groups of
    two, the pairs are (0, 4), (2, 6), (1, 5), (3, 7).
    """
    order = bit_reversal_order(n)
    p = torch.zeros(n, n, dtype=dtype)
    p[order, torch.arange(n)] = 1
    return p
