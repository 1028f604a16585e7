"""Clip fitting and held-out error measurement.

Held-out rows are whole causal prefixes of sequences that the statistics never saw (see
:class:`oscar_calib.calibration.stats.Reservoir`). For KV head ``h`` with rotation ``R`` and clip ratio ``c``,
``x̂ = Q_int2(clip_c(x R))`` (every held-out token quantised, no BF16 sink/window: the harshest case).
With key centering (a layer's ``k_mean`` μ) the keys are quantised as the cache stores them,
``k̂ = Q_int2(clip_c((k − μ) R)) Rᵀ + μ``: every figure below compares keys in the model's basis, so
the references (logits, probabilities, outputs) are the model's own, soft-capped or not.

Objectives minimised over the clip grid, independently per layer and KV head:

* **K**: query-weighted logit error ``E_K(c) = mean_t (k̂_t − k_t R) Rᵀ C_Q R (k̂_t − k_t R)ᵀ``,
  i.e. the expected squared error of the logits ``q·kᵀ`` under the calibrated query covariance.
* **V**: attention-output error ``E_V(c) = Σ_j ‖P_j (V̂ − V R)‖² / Σ_j ‖P_j V R‖²`` over the
  query heads ``j`` sharing the KV head, with ``P_j`` the model's own causal (and sliding-window or
  chunked) attention probabilities on the held-out sequence, attention sinks included (gpt-oss: a
  learned logit per query head joins each row's softmax as a key of value zero). Rotations are orthogonal, so this equals the
  error of the un-rotated output.

The report's held-out figures are relative RMS errors: logits (``k``), attention output with V
quantised (``v``), and attention output with both quantised (``attn``). A layer given ``serving =
(sink, recent)`` measures them as a serving cache reads its rows: query ``i`` reads key ``j`` in
full precision when ``j < sink`` or ``i − j < recent``, INT2 otherwise (the bit budget's objective
on held-out sequences longer than the sliding window, :mod:`oscar_calib.calibration.budget`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from .quant import clip_rows, fake_quant_int2

CLIP_GRID = (1.0, 0.99, 0.98, 0.97, 0.96, 0.95, 0.94, 0.93, 0.92, 0.90, 0.88, 0.85, 0.80, 0.75)


def causal_mask(t: int, sliding_window: int | None = None, device=None, chunk: int | None = None) -> torch.Tensor:
    """[t, t] boolean: query i sees key j when j ≤ i (and i − j < ``sliding_window`` when given, and
    j in i's chunk of ``chunk`` tokens when given: chunked attention)."""
    i = torch.arange(t, device=device).unsqueeze(1)
    j = torch.arange(t, device=device).unsqueeze(0)
    m = j <= i
    if sliding_window:
        m &= j > i - sliding_window
    if chunk:
        m &= j // chunk == i // chunk
    return m


def attention_probs(s: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax`` over the last axis of scores ``s [J, T, S]`` where ``mask [T, S]`` allows; with
    ``sinks [J]`` (attention-sink logits) one more key per query head joins the softmax and its
    column is dropped after, so each row sums to less than one (its value is zero)."""
    s = s.masked_fill(~mask, -math.inf)
    if sinks is None:
        return torch.softmax(s, -1)
    col = sinks.to(s.dtype).view(-1, 1, 1).expand(*s.shape[:-1], 1)
    return torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]


@dataclass
class HeldoutLayer:
    """Held-out activations of one layer: lists (one entry per sequence) of q [T, Hq, d],
    k/v [T, Hkv, d] and the model's attention output o [T, Hq, d]."""

    q: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    o: list[torch.Tensor]
    scaling: float
    sliding_window: int | None = None
    softcap: float | None = None
    serving: tuple[int, int] | None = None       # (sink, recent) read in full precision by heldout_errors
    sinks: torch.Tensor | None = None            # [Hq] attention-sink logits (gpt-oss), None: none
    chunk: int | None = None                     # chunked attention (Llama 4): keys of the query's chunk only
    k_mean: torch.Tensor | None = None           # [Hkv, d]: the keys are quantised centered on it (None: raw)

    def exact(self, t: int) -> torch.Tensor | None:
        """[t, t] boolean: the (query, key) pairs a serving cache reads in full precision (None: none)."""
        if self.serving is None:
            return None
        sink, recent = self.serving
        i = torch.arange(t, device=self.device).unsqueeze(1)
        j = torch.arange(t, device=self.device).unsqueeze(0)
        return (j < sink) | (i - j < recent)

    def __post_init__(self):
        self._probs: list[torch.Tensor] | None = None

    @property
    def device(self) -> torch.device:
        return self.q[0].device

    def to(self, device) -> "HeldoutLayer":
        """The same rows on ``device`` (this object where they already are); the fits and errors
        below run where the rows are, with the rotations and covariances moved to them."""
        if torch.device(device) == self.device:
            return self
        move = lambda xs: [x.to(device) for x in xs]  # noqa: E731
        return HeldoutLayer(move(self.q), move(self.k), move(self.v), move(self.o), self.scaling,
                            self.sliding_window, self.softcap, self.serving,
                            None if self.sinks is None else self.sinks.to(device), self.chunk,
                            None if self.k_mean is None else self.k_mean.to(device))

    def uncentered(self) -> "HeldoutLayer":
        """The same rows with the keys quantised raw (no ``k_mean``), sharing the references already
        computed (they are the model's own either way)."""
        if self.k_mean is None:
            return self
        out = copy.copy(self)
        out.k_mean = None
        return out

    @property
    def group(self) -> int:
        return self.q[0].shape[1] // self.k[0].shape[1]

    def mask(self, t: int) -> torch.Tensor:
        return causal_mask(t, self.sliding_window, self.device, self.chunk)

    def logits(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """[Hq, T, T] scaled (and soft-capped) logits, GQA-expanded, unmasked."""
        kx = k.repeat_interleave(self.group, dim=1)
        s = torch.einsum("thd,shd->hts", q.double(), kx.double()) * self.scaling
        if self.softcap:
            s = torch.tanh(s / self.softcap) * self.softcap
        return s

    def probs(self) -> list[torch.Tensor]:
        if self._probs is None:
            self._probs = []
            for q, k in zip(self.q, self.k):
                self._probs.append(attention_probs(self.logits(q, k), self.mask(q.shape[0]), self.sinks))
        return self._probs

    def references(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sequence, the full-precision logits [Hq, T, T] and attention output [T, Hq, d]
        every :func:`heldout_errors` call compares against (computed once per layer object)."""
        if getattr(self, "_refs", None) is None:
            self._refs = [(self.logits(q, k), self.attend(p, v)) for q, k, v, p in zip(self.q, self.k, self.v,
                                                                                      self.probs())]
        return self._refs

    def prob_grams(self) -> list[torch.Tensor]:
        """Per sequence, ``Σ_{j∈G(h)} P_jᵀ P_j`` for every KV head h: [Hkv, T, T]."""
        if getattr(self, "_grams", None) is None:
            grp = self.group
            self._grams = []
            for p in self.probs():
                hq, t, _ = p.shape
                pg = p.reshape(hq // grp, grp, t, t)
                self._grams.append(torch.einsum("hjts,hjtu->hsu", pg, pg))
        return self._grams

    def attend(self, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[Hq, T, T] probabilities × v [T, Hkv, d] -> [T, Hq, d]."""
        vx = v.double().repeat_interleave(self.group, dim=1)
        return torch.einsum("hts,shd->thd", p, vx)

    def k_rows(self) -> torch.Tensor:
        """Every held-out key as the cache quantises it, ``[N, Hkv, d]`` float64: centered on
        ``k_mean`` when the layer has one (the clip fit's rows)."""
        rows = torch.cat(self.k).double()
        return rows if self.k_mean is None else rows - self.k_mean.to(rows)


def _quant_grid(x: torch.Tensor, grid: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [N, d] -> [len(grid), N, d] fake-quantised after clipping at every grid ratio: the
    thresholds of :func:`~oscar_calib.numerics.quant.clip_threshold`, from one sort of ``|x|``
    shared by every ratio (bit-identical to clipping at each ratio on its own)."""
    d = x.shape[-1]
    idx = torch.clamp(torch.floor(grid.to(torch.float64) * d).long(), max=d - 1)
    t = x.abs().sort(dim=-1).values[:, idx].T.unsqueeze(-1)            # [G, N, 1]
    clipped = torch.maximum(torch.minimum(x.unsqueeze(0), t), -t)
    return fake_quant_int2(clipped, group_size).double()


def fit_k_clip(k_rows: torch.Tensor, rot: torch.Tensor, cq: torch.Tensor, group_size: int,
               grid=CLIP_GRID) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-KV-head K clip minimising the query-weighted logit error.

    ``k_rows`` [N, h, d], ``rot`` [h, d, d], ``cq`` [h, d, d] (un-rotated C_Q).
    Returns the chosen ratios [h] and the error table [h, len(grid)]."""
    g = torch.tensor(grid, dtype=torch.float64)
    h, dev = k_rows.shape[1], k_rows.device
    rot, cq, g_dev = rot.double().to(dev), cq.double().to(dev), g.to(dev)
    best, table = torch.empty(h, dtype=torch.float64), torch.empty(h, len(grid), dtype=torch.float64)
    for i in range(h):
        r = rot[i]
        kr = k_rows[:, i].double() @ r
        c = r.T @ cq[i] @ r
        diff = _quant_grid(kr.float(), g_dev, group_size) - kr
        err = torch.einsum("gnd,de,gne->g", diff, c, diff).cpu() / kr.shape[0]
        table[i] = err
        best[i] = g[int(torch.argmin(err))]
    return best, table


def fit_v_clip(held: HeldoutLayer, rot: torch.Tensor, group_size: int,
               grid=CLIP_GRID) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-KV-head V clip minimising the attention-output error. Returns ratios [h], table."""
    g = torch.tensor(grid, dtype=torch.float64)
    h, dev = held.k[0].shape[1], held.device
    rot, g_dev = rot.double().to(dev), g.to(dev)
    num = torch.zeros(h, len(grid), dtype=torch.float64, device=dev)
    den = torch.zeros(h, dtype=torch.float64, device=dev)
    for gram_p, v in zip(held.prob_grams(), held.v):
        for i in range(h):
            m = gram_p[i]                                           # Σ_j P_jᵀ P_j  [T, T]
            vr = v[:, i].double() @ rot[i]                          # [T, d]
            diff = _quant_grid(vr.float(), g_dev, group_size) - vr   # [G, T, d]
            # Σ_j ‖P_j D‖² = tr(Dᵀ M D)
            num[i] += ((m @ diff) * diff).sum((1, 2))
            den[i] += ((m @ vr) * vr).sum()
    table = (num / den.clamp(min=1e-300).unsqueeze(1)).cpu()
    return g[table.argmin(1)], table


def heldout_errors(held: HeldoutLayer, k_rot, k_clip, v_rot, v_clip, group_size: int,
                   v_group_size: int | None = None) -> dict:
    """Relative RMS errors on the held-out rows for one layer (see module docstring); values in
    groups of ``v_group_size`` when given (a K/V split), else ``group_size``."""
    num = {"k": 0.0, "v": 0.0, "attn": 0.0}
    den = {"k": 0.0, "v": 0.0, "attn": 0.0}
    for q, k, v, p, (s_ref, o_ref) in zip(held.q, held.k, held.v, held.probs(), held.references()):
        m = held.mask(q.shape[0])
        kq = _dequant_heads(k, k_rot, k_clip, group_size, held.k_mean)
        vq = _dequant_heads(v, v_rot, v_clip, v_group_size or group_size)
        s_q = held.logits(q, kq)
        exact = held.exact(q.shape[0])
        if exact is not None:                 # the serving window: those pairs read the rows as they are
            s_q = torch.where(exact, s_ref, s_q)
        num["k"] += float(((s_q - s_ref) * m).pow(2).sum())
        den["k"] += float((s_ref * m).pow(2).sum())
        attend = held.attend if exact is None else (
            lambda pr, vx: held.attend(pr * exact, v) + held.attend(pr * ~exact, vx))
        num["v"] += float((attend(p, vq) - o_ref).pow(2).sum())
        p_q = attention_probs(s_q, m, held.sinks)
        num["attn"] += float((attend(p_q, vq) - o_ref).pow(2).sum())
        den["v"] += float(o_ref.pow(2).sum())
        den["attn"] += float(o_ref.pow(2).sum())
    return {key: math.sqrt(num[key] / max(den[key], 1e-300)) for key in num}


def _dequant_heads(x: torch.Tensor, rot: torch.Tensor, clip: torch.Tensor, group_size: int,
                   mean: torch.Tensor | None = None) -> torch.Tensor:
    """Quantise [T, h, d] rows per head and return them un-rotated (float64); ``mean`` [h, d]: the
    rows are quantised centered on it and it is added back."""
    r = rot.double().to(x.device)
    if mean is not None:
        return _dequant_heads(x.double() - mean.double().to(x.device), rot, clip, group_size) + mean.double().to(x.device)
    xr = torch.einsum("thd,hde->the", x.double(), r)
    out = torch.empty_like(xr)
    for i in range(x.shape[1]):
        c = float(clip[i])
        xi = clip_rows(xr[:, i].float(), c) if c < 1 else xr[:, i].float()
        out[:, i] = fake_quant_int2(xi, group_size).double()
    return torch.einsum("the,hde->thd", out, r)


def choose_global_clips(k_tables: list[torch.Tensor], v_tables: list[torch.Tensor],
                        grid=CLIP_GRID) -> tuple[float | None, float | None]:
    """One K and one V clip ratio for a whole model from per-layer error tables ``[h, len(grid)]``
    (as :func:`fit_k_clip` / :func:`fit_v_clip` return them): every (layer, KV head) row is made
    relative (K: divided by its no-clip entry, since the K objective is an absolute logit error whose
    scale varies by layer; V: already relative) and the grid ratio minimising their mean is chosen,
    so every layer counts the same. An empty list gives None for that cache."""
    col = list(grid).index(1.0)
    out = []
    for tables, relative in ((k_tables, False), (v_tables, True)):
        if not tables:
            out.append(None)
            continue
        rows = []
        for t in tables:
            t = torch.as_tensor(t, dtype=torch.float64)
            rows.append(t if relative else t / t[:, col:col + 1].clamp(min=1e-300))
        out.append(float(grid[int(torch.cat(rows).mean(0).argmin())]))
    return out[0], out[1]
