"""Rotation refinement on the real objective: the attention output under fake INT2 quantisation.

Starting from the composed rotations ``R_k``, ``R_v`` of one layer and KV head (``U·H·P_br``), the
refinement minimises the relative error of the attention output of the query heads that share
that KV head, on the calibration's held-out rows, with keys and values stored as the cache stores
them:

    E(R_k, R_v) = Σ_j ‖softmax(q_j K̂ᵀ·scale) V̂ − softmax(q_j Kᵀ·scale) V‖² / Σ_j ‖softmax(q_j Kᵀ·scale) V‖²

with ``K̂ = Q(clip(K R_k)) R_kᵀ`` and ``V̂ = Q(clip(V R_v)) R_vᵀ`` (``Q`` the INT2 fake quantiser of
:mod:`.quant`, the clip ratios fixed), the causal (and sliding-window, soft-capped) attention of the
layer, and the first ``sink`` tokens kept exact as the cache keeps them in BF16. Every other token
is quantised (no recent window: the harshest case, as in the clip fit of :mod:`.clip`).

Generalisation: fitted and judged on one sequence's 512 rows, the rotations fit that sequence
(measured on SmolLM2, ``scripts/experiments/refine_generalisation.py``: the objective drops 20–65% per head on
it and −5% to +3% on average on other sequences; docs/design/numerics.md). With several held-out sequences (``heldout_seqs``) the last quarter only chooses the
step and the rest is fitted (:func:`split_sequences`).

Parametrisation: ``R = R₀ · C(A)``, ``C(A) = (I − A)⁻¹(I + A)`` the Cayley transform of a
skew-symmetric ``A = W − Wᵀ`` (``W = 0``: no change), so ``R`` is orthogonal at every step.
The rounding in ``Q`` passes gradients straight through (``round(u) ≈ u``); the clip threshold and
the group minimum and maximum pass their exact gradients. Adam on ``W`` (float32). Every step's
objective is recorded (on the validation rows when given); the candidates (the start and the step
with the lowest recorded objective) are then scored exactly (:func:`attention_error` with
:func:`~.quant.clip_rows` and :func:`~.quant.fake_quant_int2`, float64 attention) and the better one
is returned, so the result is never worse than the start on the exact objective of the rows that
judge it, and the reported figures are exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..contract.defaults import DEFAULT_REFINE_LR, DEFAULT_SINK
from ..errors import InputError
from .clip import attention_probs, causal_mask
from .quant import LEVELS, SCALE_FLOOR, clip_rows, fake_quant_int2


@dataclass(frozen=True)
class RefineSettings:
    """``steps`` Adam steps at learning rate ``lr`` on the skew parameters; ``sink`` tokens kept exact."""

    steps: int = 64
    lr: float = DEFAULT_REFINE_LR
    sink: int = DEFAULT_SINK

    def __post_init__(self):
        if int(self.steps) < 0:
            raise InputError(f"refine steps must be >= 0, got {self.steps}")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise InputError(f"refine learning rate must be a positive number, got {self.lr}")
        if int(self.sink) < 0:
            raise InputError(f"refine sink must be >= 0, got {self.sink}")


def cayley(w: torch.Tensor) -> torch.Tensor:
    """Orthogonal ``(I − A)⁻¹(I + A)`` for ``A = W − Wᵀ`` (``W`` [..., d, d])."""
    a = w - w.transpose(-1, -2)
    eye = torch.eye(w.shape[-1], dtype=w.dtype, device=w.device).expand_as(a)
    return torch.linalg.solve(eye - a, eye + a)


def fake_quant_ste(y: torch.Tensor, clip: float, group_size: int) -> torch.Tensor:
    """Clip (ratio ``clip``, :func:`~.quant.clip_rows`' rule) and INT2-fake-quantise ``y`` [..., d]
    per group (:func:`~.quant.quantize_int2`'s rule), rounding with a straight-through gradient."""
    d = y.shape[-1]
    if clip < 1:
        idx = min(int(math.floor(clip * d)), d - 1)
        t = y.abs().sort(dim=-1).values[..., idx:idx + 1]
        y = torch.maximum(torch.minimum(y, t), -t)
    g = y.reshape(*y.shape[:-1], d // group_size, group_size)
    lo = g.amin(-1, keepdim=True)
    s = ((g.amax(-1, keepdim=True) - lo) / (LEVELS - 1)).clamp(min=SCALE_FLOOR)
    u = (g - lo) / s
    q = u + (torch.floor(u + 0.5).clamp(0, LEVELS - 1) - u).detach()
    return (q * s + lo).reshape(y.shape)


def fake_quant_exact(y: torch.Tensor, clip: float, group_size: int) -> torch.Tensor:
    """The reference path (what :func:`~.clip.heldout_errors` and the cache compute): clip and
    quantise in float32 with :mod:`.quant`'s functions; the result in ``y``'s dtype."""
    yf = y.float()
    yf = clip_rows(yf, clip) if clip < 1 else yf
    return fake_quant_int2(yf, group_size).to(y.dtype)


@dataclass
class HeadRows:
    """Held-out rows of one KV head: per sequence ``q`` [T, J, d] (its J query heads), ``k``/``v`` [T, d]."""

    q: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    scaling: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None        # [J] attention-sink logits of the J query heads (None: none)
    chunk: int | None = None                 # chunked attention: keys of the query's chunk only

    def mask(self, t: int) -> torch.Tensor:
        return causal_mask(t, self.sliding_window, chunk=self.chunk)

    def to(self, dtype: torch.dtype) -> "HeadRows":
        return HeadRows([x.to(dtype) for x in self.q], [x.to(dtype) for x in self.k],
                        [x.to(dtype) for x in self.v], self.scaling, self.sliding_window, self.softcap,
                        None if self.sinks is None else self.sinks.to(dtype), self.chunk)

    @classmethod
    def of_layer(cls, held, head: int, seqs: list[int] | None = None) -> "HeadRows":
        """KV head ``head`` of a :class:`~.clip.HeldoutLayer` (its query heads ``head·J … head·J+J−1``,
        the GQA order of ``repeat_interleave``), of the sequences ``seqs`` (default: all)."""
        grp = held.group
        sl = slice(head * grp, (head + 1) * grp)
        idx = range(len(held.q)) if seqs is None else seqs
        return cls([held.q[i][:, sl] for i in idx], [held.k[i][:, head] for i in idx],
                   [held.v[i][:, head] for i in idx], held.scaling, held.sliding_window, held.softcap,
                   None if held.sinks is None else held.sinks[sl], held.chunk)


def split_sequences(n: int) -> tuple[list[int], list[int] | None]:
    """Held-out sequences that fit the rotations and those that choose the step: the last quarter
    (at least one) validates once there are two or more; one sequence does both (None)."""
    if n < 2:
        return list(range(n)), None
    n_valid = max(1, n // 4)
    return list(range(n - n_valid)), list(range(n - n_valid, n))


def _attend(q, k, v, mask, scaling, softcap, sinks=None):
    s = torch.einsum("tjd,sd->jts", q, k) * scaling
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    return torch.einsum("jts,sd->tjd", attention_probs(s, mask, sinks), v)


def attention_error(rows: HeadRows, rk: torch.Tensor, ck: float, rv: torch.Tensor, cv: float, group_size: int,
                    sink: int, refs: list | None = None, *, quantise=fake_quant_ste) -> torch.Tensor:
    """The objective ``E`` of the module docstring for rotations ``rk``, ``rv`` [d, d], in the rows'
    dtype; differentiable with the default ``quantise`` (:func:`fake_quant_ste`), exact with
    :func:`fake_quant_exact`. ``refs``: the full-precision outputs, if already computed."""
    num = den = 0.0
    for n, (q, k, v) in enumerate(zip(rows.q, rows.k, rows.v)):
        mask = rows.mask(q.shape[0])
        ref = refs[n] if refs is not None else _attend(q, k, v, mask, rows.scaling, rows.softcap, rows.sinks)
        kq = quantise(k @ rk, ck, group_size) @ rk.T
        vq = quantise(v @ rv, cv, group_size) @ rv.T
        keep = (torch.arange(k.shape[0]) < sink).unsqueeze(-1)
        kq, vq = torch.where(keep, k, kq), torch.where(keep, v, vq)
        out = _attend(q, kq, vq, mask, rows.scaling, rows.softcap, rows.sinks)
        num = num + (out - ref).pow(2).sum()
        den = den + float(ref.pow(2).sum())
    return num / max(den, 1e-300)


def exact_error(rows: HeadRows, rk: torch.Tensor, ck: float, rv: torch.Tensor, cv: float, group_size: int,
                sink: int) -> float:
    """:func:`attention_error` on the reference quantiser, attention in float64."""
    with torch.no_grad():
        return float(attention_error(rows.to(torch.float64), rk.double(), ck, rv.double(), cv, group_size, sink,
                                     quantise=fake_quant_exact))


def _references(rows: HeadRows) -> list[torch.Tensor]:
    with torch.no_grad():
        return [_attend(q, k, v, rows.mask(q.shape[0]), rows.scaling, rows.softcap, rows.sinks)
                for q, k, v in zip(rows.q, rows.k, rows.v)]


def refine_rotations(rows: HeadRows, rk0: torch.Tensor, ck: float, rv0: torch.Tensor, cv: float, group_size: int,
                     settings: RefineSettings = RefineSettings(),
                     valid: HeadRows | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Refined ``(R_k, R_v)`` (float64, orthogonal) for one KV head, and a report ``{"before",
    "after", "steps", "best_step"}``: the exact objective (:func:`exact_error`) of the start and of
    the result, and the step the result comes from (0: the start).

    ``valid``: other held-out rows that choose the step (the objective on them after every step)
    and that the report's figures are measured on; the gradient only ever sees ``rows``. Without
    it, ``rows`` choose too (the result can then fit those rows better than unseen ones)."""
    judge = valid if valid is not None else rows
    rk0, rv0 = rk0.double(), rv0.double()
    before = exact_error(judge, rk0, ck, rv0, cv, group_size, settings.sink)
    if settings.steps == 0:
        return rk0.clone(), rv0.clone(), {"before": before, "after": before, "steps": 0, "best_step": 0}
    dt = torch.float32
    rows32 = rows.to(dt)
    refs = _references(rows32)
    judge32 = judge.to(dt) if valid is not None else None
    judge_refs = _references(judge32) if valid is not None else None
    d = rk0.shape[-1]
    wk = torch.zeros(d, d, dtype=dt, requires_grad=True)
    wv = torch.zeros(d, d, dtype=dt, requires_grad=True)
    rk0f, rv0f = rk0.to(dt), rv0.to(dt)
    opt = torch.optim.Adam([wk, wv], lr=settings.lr)
    best = (math.inf, 0, None, None)
    for step in range(settings.steps + 1):
        rk, rv = rk0f @ cayley(wk), rv0f @ cayley(wv)
        loss = attention_error(rows32, rk, ck, rv, cv, group_size, settings.sink, refs)
        val = float(loss.detach())
        if judge32 is not None:
            with torch.no_grad():
                val = float(attention_error(judge32, rk, ck, rv, cv, group_size, settings.sink, judge_refs))
        if step > 0 and val < best[0]:
            best = (val, step, wk.detach().clone(), wv.detach().clone())
        if step == settings.steps or not math.isfinite(float(loss.detach())):
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    if best[2] is None:
        return rk0.clone(), rv0.clone(), {"before": before, "after": before, "steps": settings.steps, "best_step": 0}
    rk = rk0 @ cayley(best[2].double())
    rv = rv0 @ cayley(best[3].double())
    after = exact_error(judge, rk, ck, rv, cv, group_size, settings.sink)
    if not after < before:
        return rk0.clone(), rv0.clone(), {"before": before, "after": before, "steps": settings.steps, "best_step": 0}
    return rk, rv, {"before": before, "after": after, "steps": settings.steps, "best_step": best[1]}


def refine_layer(held, k_rot: torch.Tensor, k_clip: torch.Tensor, v_rot: torch.Tensor, v_clip: torch.Tensor,
                 group_size: int, settings: RefineSettings) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """:func:`refine_rotations` for every KV head of a :class:`~.clip.HeldoutLayer`, its sequences
    split by :func:`split_sequences`: rotations ``[h, d, d]`` (float64) and one report per head."""
    train, valid = split_sequences(len(held.q))
    ks, vs, reports = [], [], []
    for h in range(k_rot.shape[0]):
        rk, rv, rep = refine_rotations(HeadRows.of_layer(held, h, train), k_rot[h], float(k_clip[h]), v_rot[h],
                                       float(v_clip[h]), group_size, settings,
                                       valid=None if valid is None else HeadRows.of_layer(held, h, valid))
        ks.append(rk)
        vs.append(rv)
        reports.append(rep)
    return torch.stack(ks), torch.stack(vs), reports
