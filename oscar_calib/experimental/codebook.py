"""Calibrated 4-level codebooks for the 2-bit history (an ablation that was not adopted: no kernel or
artifact stores them; the perplexity simulation reads them through :class:`CodebookScheme`).

Two codings, each with two stored numbers per group (the same bits as uniform INT2) plus four levels
per (layer, KV head) and cache, fitted once on calibration rows:

=================  ==========================================================================
coding             definition (per group of ``G`` channels; ``L`` = the head's 4 sorted levels)
=================  ==========================================================================
``range``          the group's own INT2 scale and zero (:func:`~oscar_calib.numerics.quant.quantize_int2`):
                   ``y = x/s + z`` in ``[0, 3]``, ``q = #{i : y >= (L_i + L_{i+1})/2}``,
                   ``x_hat = (L_q - z) * s``. Uniform levels ``{0, 1, 2, 3}`` are exactly
                   :func:`~oscar_calib.numerics.quant.fake_quant_int2`; levels live in ``[0, 3]`` (``u = y/3`` is the
                   position between the group's min and max).
``std``            the group's mean ``mu`` and population std ``sigma`` (``sqrt(var + 1e-8)``):
                   ``y = (x - mu)/sigma``, same nearest-level rule, ``x_hat = mu + sigma*L_q``;
                   the OSCAR fork's Lloyd-Max mode stores the fixed levels :data:`FORK_LLOYD_LEVELS`
                   in this coding, with thresholds 0, ±0.98107 instead of the midpoints
                   (:func:`~oscar_calib.numerics.quant.quantize_lloyd_fork`).
=================  ==========================================================================

Levels are fitted by weighted 1-D Lloyd (k-means) on the coordinates ``y`` of the fitting rows, each
element weighted by ``s**2`` (``range``) or ``sigma**2`` (``std``), so the objective is the squared
error of ``x`` itself; the initial levels are the uniform ones (``range``) or the fork's (``std``),
and every iteration cannot increase that objective (nearest level, then weighted cell means).

In the perplexity simulation (:class:`~oscar_calib.runtime.simulate.SimulatedKV`) a
:class:`CodebookScheme` stores its history with quantizer ``codebook`` (``range`` coding) or
``codebook-std`` (``std``), both with the two group numbers rounded to fp16 as the kernels store
parameters, so the bits are oscar's ``2 + 32/G``; with uniform levels ``codebook`` equals ``oscar``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..contract.defaults import check_group_size
from ..errors import InputError
from ..numerics.quant import (
    LEVELS,
    LLOYD_SCALE,
    LLOYD_VAR_EPS,
    clip_rows,
    quantize_int2,
)
from ..runtime.scheme import KVScheme
from ..runtime.simulate import oscar_rows, register_quantizer

CODINGS = ("range", "std")
QUANTIZERS = {"codebook": "range", "codebook-std": "std"}       # quantizer name -> coding
UNIFORM_LEVELS = (0.0, 1.0, 2.0, 3.0)
FORK_LLOYD_LEVELS = tuple(LLOYD_SCALE * (i - 1.5) for i in range(LEVELS))     # ±0.5837, ±1.7511


def initial_levels(coding: str) -> torch.Tensor:
    """The levels Lloyd starts from: uniform INT2 (``range``) or the fork's Gaussian ones (``std``)."""
    if coding not in CODINGS:
        raise InputError(f"unknown codebook coding {coding!r}; choose from {', '.join(CODINGS)}")
    return torch.tensor(UNIFORM_LEVELS if coding == "range" else FORK_LLOYD_LEVELS, dtype=torch.float32)


def _check_levels(levels: torch.Tensor) -> torch.Tensor:
    lv = torch.as_tensor(levels, dtype=torch.float32)
    if lv.shape[-1] != LEVELS or bool((lv.diff(dim=-1) < 0).any()):
        raise InputError(f"levels must be [..., {LEVELS}] in ascending order, got shape {tuple(lv.shape)}")
    return lv


def coordinates(x: torch.Tensor, group_size: int, coding: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[..., d]`` -> ``(y [..., d/G, G], a [..., d/G], b [..., d/G])`` with ``x = a + b*y``:
    ``range``: ``a = -z*s``, ``b = s`` (the INT2 scale); ``std``: ``a = mu``, ``b = sigma``."""
    d = x.shape[-1]
    check_group_size(d, group_size)
    g = x.float().reshape(*x.shape[:-1], d // group_size, group_size)
    if coding == "range":
        _, scale, zero = quantize_int2(x, group_size)
        return g / scale.unsqueeze(-1) + zero.unsqueeze(-1), -zero * scale, scale
    if coding == "std":
        mu = g.mean(-1)
        sigma = torch.sqrt(g.var(-1, unbiased=False) + LLOYD_VAR_EPS)
        return (g - mu.unsqueeze(-1)) / sigma.unsqueeze(-1), mu, sigma
    raise InputError(f"unknown codebook coding {coding!r}; choose from {', '.join(CODINGS)}")


def nearest(y: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of ``levels`` ``[4]`` for every element of ``y``, compared as
    ``y + 0.5 >= midpoint + 0.5`` so uniform levels give exactly ``clamp(floor(y + 0.5), 0, 3)``
    (:func:`~oscar_calib.numerics.quant.quantize_int2`'s rounding, ties up)."""
    lv = _check_levels(levels).to(y.device, y.dtype)
    if lv.ndim != 1:
        raise InputError(f"levels must be one codebook [{LEVELS}], got shape {tuple(lv.shape)}")
    mids = (lv[1:] + lv[:-1]) / 2 + 0.5
    return ((y + 0.5).unsqueeze(-1) >= mids).sum(-1)


def fake_quant_codebook(x: torch.Tensor, levels: torch.Tensor, group_size: int, coding: str = "range",
                        param_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Quantise ``x`` ``[..., d]`` to the nearest of ``levels`` (``[4]``) in the group coordinate of
    ``coding`` and dequantise (float32). ``param_dtype`` rounds the two stored numbers per group
    (``a``, ``b``) to that dtype before dequantising (e.g. float16, as the kernels store them)."""
    y, a, b = coordinates(x, group_size, coding)
    q = nearest(y, levels)
    lv = _check_levels(levels).to(x.device)
    if param_dtype is not None:
        a, b = a.to(param_dtype).float(), b.to(param_dtype).float()
    return (a.unsqueeze(-1) + b.unsqueeze(-1) * lv[q]).reshape(x.shape)


def codebook_mse(y: torch.Tensor, w: torch.Tensor, levels: torch.Tensor) -> float:
    """Weighted squared error ``Σ w (y − L_nearest)² / Σ w`` (the fitting objective)."""
    lv = _check_levels(levels)
    return float((w * (y - lv[nearest(y, lv)]).pow(2)).sum() / w.sum().clamp(min=1e-300))


def lloyd_levels(y: torch.Tensor, w: torch.Tensor | None = None, init: torch.Tensor | None = None,
                 iters: int = 50, tol: float = 1e-7, fixed_ends: bool = False) -> torch.Tensor:
    """Weighted 1-D Lloyd on samples ``y`` (any shape) with weights ``w`` (same shape, default 1):
    four sorted levels (float32). A level whose cell is empty keeps its value; ``fixed_ends`` keeps
    the outer two at their initial values (only the inner two move). Deterministic."""
    y = y.reshape(-1).double()
    w = torch.ones_like(y) if w is None else w.reshape(-1).double()
    lv = _check_levels(initial_levels("range") if init is None else init).double().clone()
    for _ in range(iters):
        q = nearest(y, lv)
        num = torch.zeros(LEVELS, dtype=torch.float64).index_add_(0, q, w * y)
        den = torch.zeros(LEVELS, dtype=torch.float64).index_add_(0, q, w)
        new = torch.where(den > 0, num / den.clamp(min=1e-300), lv)
        if fixed_ends:
            new[0], new[-1] = lv[0], lv[-1]
        new = new.sort().values
        done = float((new - lv).abs().max()) < tol
        lv = new
        if done:
            break
    return lv.float()


def fit_levels(rows: torch.Tensor, group_size: int, coding: str = "range", iters: int = 50,
               fixed_ends: bool = False) -> torch.Tensor:
    """Levels for one (layer, KV head) cache from its rotated, clipped rows ``[N, d]``: Lloyd on the
    group coordinates weighted by ``b²`` (squared error of ``x``), from :func:`initial_levels`
    (``fixed_ends``: see :func:`lloyd_levels`)."""
    y, _, b = coordinates(rows, group_size, coding)
    w = (b.unsqueeze(-1) ** 2).expand_as(y)
    return lloyd_levels(y, w, initial_levels(coding), iters=iters, fixed_ends=fixed_ends)


def fit_layer_levels(k_rows: torch.Tensor, v_rows: torch.Tensor, k_rot: torch.Tensor, k_clip: torch.Tensor,
                     v_rot: torch.Tensor, v_clip: torch.Tensor, group_size: int,
                     coding: str = "range", fixed_ends: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Levels ``[kv_heads, 4]`` for K and for V of one layer, fitted per KV head on its calibration
    rows ``[N, kv_heads, d]`` (e.g. the held-out rows the clips were fitted on) after the head's
    rotation and clip, i.e. on exactly the rows the cache would quantise."""
    out = []
    for x, rot, clip in ((k_rows, k_rot, k_clip), (v_rows, v_rot, v_clip)):
        levels = []
        for h in range(x.shape[1]):
            y = x[:, h].float() @ rot[h].float()
            c = float(clip[h])
            levels.append(fit_levels(clip_rows(y, c) if c < 1 else y, group_size, coding, fixed_ends=fixed_ends))
        out.append(torch.stack(levels))
    return out[0], out[1]


# -- the perplexity simulation ------------------------------------------------------------------
@dataclass
class CodebookScheme(KVScheme):
    """A :class:`~oscar_calib.runtime.scheme.KVScheme` whose INT2 history is stored with calibrated
    codebooks: ``quantizer`` ``codebook`` (``range`` coding) or ``codebook-std`` (``std``), levels
    ``k_levels[i]``/``v_levels[i]`` ``[kv_heads, 4]`` per layer (None: the coding's
    :func:`initial_levels`). Only :class:`~oscar_calib.runtime.simulate.SimulatedKV` reads it; the
    real caches refuse it (``require_oscar_quantizer``)."""

    quantizer: str = "codebook"
    k_levels: list = field(default_factory=list)
    v_levels: list = field(default_factory=list)

    quantizers: ClassVar[tuple[str, ...]] = tuple(QUANTIZERS)
    per_layer: ClassVar[tuple[str, ...]] = KVScheme.per_layer + ("k_levels", "v_levels")

    @property
    def coding(self) -> str:
        return QUANTIZERS[self.quantizer]

    @classmethod
    def of(cls, scheme: KVScheme, quantizer: str = "codebook", k_levels=(), v_levels=(),
           name: str | None = None) -> "CodebookScheme":
        """``scheme`` (its rotations, clips, groups and windows) storing its history with codebooks."""
        fields = {f.name: getattr(scheme, f.name) for f in dataclasses.fields(KVScheme)}
        return cls(**{**fields, "name": name or fields["name"], "quantizer": quantizer,
                      "k_levels": list(k_levels), "v_levels": list(v_levels)})


def codebook_rows(sch: CodebookScheme, layer: int, q, k, v):
    """:func:`~oscar_calib.runtime.simulate.oscar_rows` with the INT2 rows stored as ``sch``'s
    codebooks (the two group numbers rounded to fp16; levels per KV head). With uniform levels
    ``codebook`` equals ``oscar`` (tested)."""
    levels = {"k": sch.k_levels[layer], "v": sch.v_levels[layer]}

    def store(x, rotation, clip, group_size, cache, center=None):  # x [B, S, H, d] -> rotated, dequantised
        y = x.float()
        if rotation is not None:
            y = torch.einsum("bshd,hde->bshe", y, rotation)
        if center is not None:                               # key centering: the shift of the rotated rows
            y = y - center
        if clip is not None:
            y = clip_rows(y, clip.to(torch.float64))
        lv = levels[cache]
        return torch.stack([fake_quant_codebook(y[:, :, h], initial_levels(sch.coding) if lv is None else lv[h],
                                                group_size, sch.coding, torch.float16)
                            for h in range(y.shape[2])], dim=2)

    return oscar_rows(sch, layer, q, k, v, store=store)


register_quantizer("codebook", codebook_rows)
register_quantizer("codebook-std", codebook_rows)
