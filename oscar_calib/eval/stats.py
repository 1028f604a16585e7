"""Intervals and tests for pass/fail scores (NIAH exact match).

* :func:`wilson_interval`: the Wilson score interval of a binomial proportion (95% by default),
  which, unlike the normal approximation, stays inside [0, 1] and is not empty at 0/n or n/n.
* :func:`paired_p_value`: the exact two-sided McNemar test for two methods scored on the same
  prompts (a binomial test on the prompts where exactly one of them is right), which is sharper
  than comparing two intervals when the methods answer the same prompts.
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054     # the 0.975 quantile of the standard normal


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval ``(low, high)`` for ``successes`` out of ``n``; ``(0, 1)`` when n is 0."""
    if n < 0 or not 0 <= successes <= max(n, 0):
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_p_value(a: list[int], b: list[int]) -> float:
    """Exact two-sided McNemar p-value for paired 0/1 scores ``a`` and ``b`` (same prompts, same
    order): under "no difference" each discordant prompt is equally likely to favour either side."""
    if len(a) != len(b):
        raise ValueError(f"paired scores need equal lengths, got {len(a)} and {len(b)}")
    only_a = sum(1 for x, y in zip(a, b) if x and not y)
    only_b = sum(1 for x, y in zip(a, b) if y and not x)
    n, k = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def format_rate(rate: float, interval) -> str:
    """``0.62 [0.48, 0.74]``."""
    return f"{rate:.2f} [{interval[0]:.2f}, {interval[1]:.2f}]"
