"""A K/V bit budget: per-layer (and per-cache) INT2 group sizes chosen by the held-out objective.

Stored bits per element are ``2 + 32/G`` (:func:`oscar_calib.kernels.pack.bits_per_element`), so
halving a group size buys accuracy for bits. :func:`error_table` measures, for one layer and
every pair of candidate sizes ``(G_K, G_V)``, the calibration's own held-out figure: the relative
RMS error of the attention output with keys and values quantised
(:func:`~oscar_calib.numerics.clip.heldout_errors` ``attn``), clips refitted for each size.
:func:`allocate` spends a budget greedily: every (layer, cache) starts at the largest size, and
the halving that removes the most squared error per bit is taken while the average stays within
the budget.

Bits are counted two ways, both must stay within the budget (``long_layers``):

* **mean**: every layer holds as many history tokens (a context within every sliding window);
* **long**: only the full-attention layers hold a growing history (a sliding-window layer keeps at
  most its window), so at long contexts the average tends to the full-attention layers' mean.

At any context length the true average lies between the two, so bounding both bounds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..contract.defaults import check_group_size
from ..errors import InputError
from ..kernels.pack import bits_per_element
from ..numerics.clip import HeldoutLayer, heldout_errors

MIN_BUDGET_GROUP = 32      # smallest candidate group size (3 bits per element)


def candidate_sizes(head_dim: int, smallest: int = MIN_BUDGET_GROUP) -> tuple[int, ...]:
    """Powers of two from ``head_dim`` down to ``smallest`` (descending)."""
    out, g = [], head_dim
    while g >= smallest and g & (g - 1) == 0:
        check_group_size(head_dim, g)
        out.append(g)
        g //= 2
    if not out:
        raise InputError(f"head_dim {head_dim} has no power-of-two group size of at least {smallest}")
    return tuple(out)


def error_table(held: HeldoutLayer, k_rot: torch.Tensor, v_rot: torch.Tensor, clips: dict,
                sizes: tuple[int, ...], *, full: dict | None = None) -> torch.Tensor:
    """``[len(sizes), len(sizes)]``: held-out relative attention-output error (``attn``) of one layer
    with keys in groups of ``sizes[a]`` and values in groups of ``sizes[b]``. ``clips[("k", G)]`` /
    ``clips[("v", G)]`` hold the per-KV-head clip ratios fitted for each size. ``full``: filled with
    each pair's whole :func:`heldout_errors` record, keyed ``(G_K, G_V)``."""
    out = torch.empty(len(sizes), len(sizes), dtype=torch.float64)
    for a, gk in enumerate(sizes):
        for b, gv in enumerate(sizes):
            res = heldout_errors(held, k_rot, clips[("k", gk)], v_rot, clips[("v", gv)], gk, gv)
            if full is not None:
                full[(gk, gv)] = res
            out[a, b] = res["attn"]
    return out


@dataclass
class LayerFits:
    """What the budget's tables fitted for one layer, kept for the artifact's own fits: per cache
    and size ``fits[("k", G)] = (clip ratios, clip table or None)``, and per size pair the held-out
    record (``errors[(G_K, G_V)]``)."""

    fits: dict
    errors: dict

    def clips(self, gk: int, gv: int) -> tuple:
        """``(k_clip, k_table, v_clip, v_table)`` as :func:`~oscar_calib.calibration.fit.fit_clips` returns them."""
        return (*self.fits[("k", gk)], *self.fits[("v", gv)])


@dataclass
class Allocation:
    """Per layer ``(G_K, G_V)`` and the figures it was chosen on."""

    groups: list[tuple[int, int]]
    mean_bits: float
    long_bits: float
    heldout_mse: float           # Σ over layers of the squared relative attention error

    @property
    def tied(self) -> bool:
        return all(k == v for k, v in self.groups)


def _bits(sizes, idx: list[int]) -> float:
    return sum(bits_per_element(sizes[i]) for i in idx) / len(idx)


def allocate(tables: list[torch.Tensor], sizes: tuple[int, ...], budget: float, *, tied: bool = True,
             long_layers: list[int] | None = None) -> Allocation:
    """Greedy group sizes within ``budget`` bits per element (module docstring).

    ``tables[i]`` is :func:`error_table` of layer ``i``; ``tied`` keeps K and V of a layer at one
    size (what one kernel call per layer stores) and halves both at once; otherwise K and V move
    on their own. ``long_layers``: the layers whose history grows with the context (full
    attention); None = every layer."""
    n = len(tables)
    longs = list(range(n)) if long_layers is None else list(long_layers)
    if not longs:
        longs = list(range(n))
    if bits_per_element(sizes[0]) > budget + 1e-9:
        raise InputError(f"a budget of {budget} bits per element is below the largest group size's "
                         f"{bits_per_element(sizes[0])}")
    ik, iv = [0] * n, [0] * n

    def fits(k, v) -> bool:
        return (_bits(sizes, k + v) <= budget + 1e-9
                and _bits(sizes, [k[i] for i in longs] + [v[i] for i in longs]) <= budget + 1e-9)

    while True:
        best = None
        base = _bits(sizes, ik + iv)
        for i in range(n):
            moves = [(1, 1)] if tied else [(1, 0), (0, 1)]
            for dk, dv in moves:
                a, b = ik[i] + dk, iv[i] + dv
                if a >= len(sizes) or b >= len(sizes):
                    continue
                k2, v2 = list(ik), list(iv)
                k2[i], v2[i] = a, b
                if not fits(k2, v2):
                    continue
                gain = float(tables[i][ik[i], iv[i]] ** 2 - tables[i][a, b] ** 2)
                cost = _bits(sizes, k2 + v2) - base
                if gain > 0 and (best is None or gain / cost > best[0]):
                    best = (gain / cost, i, a, b)
        if best is None:
            break
        _, i, ik[i], iv[i] = best
    return Allocation(groups=[(sizes[a], sizes[b]) for a, b in zip(ik, iv)], mean_bits=_bits(sizes, ik + iv),
                      long_bits=_bits(sizes, [ik[i] for i in longs] + [iv[i] for i in longs]),
                      heldout_mse=sum(float(t[a, b] ** 2) for t, a, b in zip(tables, ik, iv)))


def budget_tables(held_layers, rotations: list, covariances: list, cfg, heads: int,
                  sizes: tuple[int, ...], *, keep: list | None = None) -> list[torch.Tensor]:
    """:func:`error_table` of every layer. ``held_layers(i)`` gives layer ``i``'s held-out rows,
    ``rotations[i]`` its ``(k_rot, v_rot)``, ``covariances[i]`` its query covariance; clips are
    fitted (or fixed) as ``cfg`` says, once per layer, cache and size. ``keep``: a list that gets
    each layer's :class:`LayerFits`."""
    from ..numerics.clip import fit_k_clip, fit_v_clip

    out = []
    for i, (k_rot, v_rot) in enumerate(rotations):
        held = held_layers(i)
        fits = {}
        for g in sizes:
            fits[("k", g)] = (fit_k_clip(held.k_rows(), k_rot, covariances[i], g) if cfg.k_clip is None
                              else (torch.full((heads,), cfg.k_clip, dtype=torch.float64), None))
            fits[("v", g)] = (fit_v_clip(held, v_rot, g) if cfg.v_clip is None
                              else (torch.full((heads,), cfg.v_clip, dtype=torch.float64), None))
        full = {} if keep is not None else None
        out.append(error_table(held, k_rot.double(), v_rot.double(), {key: f[0] for key, f in fits.items()}, sizes,
                               full=full))
        if keep is not None:
            keep.append(LayerFits(fits, full))
    return out


def closest_uniform(sizes: tuple[int, ...], budget: float) -> int:
    """The one group size for every layer that spends the most of ``budget`` without exceeding it
    (what an engine with one size serves instead of a per-layer allocation)."""
    within = [g for g in sizes if bits_per_element(g) <= budget + 1e-9]
    if not within:
        raise InputError(f"a budget of {budget} bits per element is below every group size's cost "
                         f"({', '.join(f'{g}: {bits_per_element(g):g}' for g in sizes)})")
    return min(within)


def spend_budget(tables: list[torch.Tensor], layer_info: dict, cfg, geo) -> tuple[Allocation, dict]:
    """``oscar calibrate --bit-budget``: per-layer group sizes chosen by :func:`allocate` on every
    layer's held-out table (:func:`budget_tables` over :func:`candidate_sizes` of the head dim),
    within the mean and long-context bounds (full-attention layers: those without a sliding window
    in ``layer_info``); K and V of a layer at one size, or apart with ``cfg.split_kv``. Returns the
    allocation and its record for the report, with the closest uniform size and both schemes'
    held-out attention errors (mean over layers)."""
    sizes = candidate_sizes(geo.head_dim)
    longs = [i for i in range(len(tables)) if not (layer_info.get(i) or {}).get("sliding_window")]
    split = bool(getattr(cfg, "split_kv", False))
    alloc = allocate(tables, sizes, cfg.bit_budget, tied=not split, long_layers=longs)
    uniform = closest_uniform(sizes, cfg.bit_budget)
    u = sizes.index(uniform)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    record = {"bits": cfg.bit_budget, "mean_bits": alloc.mean_bits, "long_bits": alloc.long_bits,
              "full_attention_layers": longs, "layer_group_sizes": [k for k, _ in alloc.groups],
              **({"layer_v_group_sizes": [v for _, v in alloc.groups]} if split else {}),
              "uniform_group_size": uniform, "uniform_bits": bits_per_element(uniform),
              "heldout_attn": {"per_layer": mean([float(t[sizes.index(k), sizes.index(v)])
                                                  for t, (k, v) in zip(tables, alloc.groups)]),
                               "uniform": mean([float(t[u, u]) for t in tables])}}
    return alloc, record


def budget_calibration(calibration: str, record: dict) -> str:
    """The artifact's ``calibration`` JSON with the bit budget added (the per-layer sizes themselves
    are settings: :func:`~oscar_calib.calibration.pipeline.artifact_settings`)."""
    extra = {"bit_budget": record["bits"], **({"split_kv": True} if "layer_v_group_sizes" in record else {})}
    return json.dumps({**json.loads(calibration), **extra}, sort_keys=True)
