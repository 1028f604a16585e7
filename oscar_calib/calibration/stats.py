"""Streaming float64 statistics per layer × KV head ("observers").

For KV head ``h`` with query heads ``G(h)`` (GQA: query head ``j`` reads KV head ``j // group``),
over calibration tokens ``t``:

==============  ===========================================  ==================================
accumulator     sum                                           used for
==============  ===========================================  ==================================
``q``           Σ_t Σ_{j∈G(h)} q_tjᵀ q_tj                     C_Q, the key objective ``qqt``
``s``           Σ_t Σ_{j∈G(h)} o_tjᵀ o_tj  (o = softmax·V)    exact C_S, value objective ``sst``
``s_approx``    Σ_t w_t v_tᵀ v_t,  w_t = k_t C̃_Q k_tᵀ          reference repo's ``sst-approx``
``k`` / ``v``   Σ_t k_tᵀ k_t / Σ_t v_tᵀ v_t                    baselines ``ktk`` / ``vtv``
``k_sum``       Σ_t k_t  (``[kv_heads, d]``)                  the mean key μ (key centering)
==============  ===========================================  ==================================

Memory is fixed by the geometry (five ``[kv_heads, d, d]`` float64 matrices and one
``[kv_heads, d]`` vector per layer) and does not grow with the token budget. Every accumulator is a
sum, so checkpoints, the data-parallel all-reduce and the layer-split ranks carry them alike.

Precision: sums are float64. With float32 activations every gram is computed in float64. With
bf16/fp16 activations (a bf16 model on a GPU) the q/s/k/v grams of one batch are one batched GEMM
with float32 output (exact products, float32 sums over at most one sequence), added into the
float64 sums: 5e-6 relative to the all-float64 path (measured on an H200, 2 × 2048-token
sequences per batch), and ~3× faster there, where float64 GEMMs of these shapes run far below peak.
``OSCAR_EXACT_GRAMS=1`` forces float64 everywhere.

How ``sst-approx`` gets C_Q before the weights: a bounded **pilot buffer**. The K and V rows of
the first ``pilot_tokens`` calibration tokens are kept (per layer, float32); once that many tokens
have been seen, ``C̃_Q`` is frozen as the query covariance of those same tokens, the buffered rows
are weighted and folded in, the buffer is dropped, and every later token is weighted with the
frozen ``C̃_Q`` as it streams. Weights are normalised to mean 1 at the end (``Σ w v vᵀ / Σ w``), as
the reference does. With ``pilot_tokens ≥`` the token budget this equals the two-pass definition
exactly; with a smaller pilot, ``C̃_Q`` is an estimate from the first tokens (one pass, bounded
memory). The pilot size is recorded in the report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import NumericalError

ACCUMULATORS = ("q", "s", "s_approx", "k", "v", "k_sum")
VECTORS = ("k_sum",)          # accumulators of shape [kv_heads, d]; the others are [kv_heads, d, d]


def gram(x: torch.Tensor) -> torch.Tensor:
    """Σ over rows of xᵀx for ``x`` [heads, n, d] in float64 -> [heads, d, d]."""
    x = x.to(torch.float64)
    return x.transpose(-1, -2) @ x


@dataclass
class LayerStats:
    """Accumulators of one decoder layer (the table above), and its sst-approx pilot buffer."""

    num_kv_heads: int
    group: int
    head_dim: int
    pilot_tokens: int
    device: str | torch.device = "cpu"
    approx: bool = True     # accumulate ``s_approx`` (and its pilot); off when sst-approx is not asked for

    def __post_init__(self):
        h, d = self.num_kv_heads, self.head_dim
        self.sums = {name: torch.zeros((h, d) if name in VECTORS else (h, d, d), dtype=torch.float64, device=self.device)
                     for name in ACCUMULATORS}
        self.tokens = 0                 # KV rows seen (per head)
        self.w_sum = torch.zeros(h, dtype=torch.float64, device=self.device)
        self.pilot_cq: torch.Tensor | None = None
        self._pilot_k: list[torch.Tensor] = []
        self._pilot_v: list[torch.Tensor] = []

    def update(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
               valid: torch.Tensor | None = None) -> None:
        """Fold one batch in: ``q`` [B, Hq, T, d], ``k``/``v`` [B, Hkv, T, d] (what attention receives),
        ``o`` [B, T, Hq, d] (its output, before o_proj), ``valid`` [B, T] bool or None (all tokens)."""
        half = valid is None and half_precision_grams(q, k, v, o)
        if half and not self.approx:                    # the fast path needs no per-head rows at all
            kh = vh = None
            n = k.shape[0] * k.shape[2]
        else:
            kh = _rows(k.transpose(1, 2), valid).permute(1, 0, 2)      # [Hkv, n, d]
            vh = _rows(v.transpose(1, 2), valid).permute(1, 0, 2)
            n = kh.shape[1]
        if not n:
            return
        grams = _half_grams(q, k, v, o, self.num_kv_heads) if half else _exact_grams(q, o, kh, vh, valid)
        for name, g in grams.items():
            self.sums[name] += g
        self.tokens += n
        if not self.approx:
            return
        if self.pilot_cq is not None:
            return self._weighted(kh, vh)
        self._pilot_k.append(kh.float())
        self._pilot_v.append(vh.float())
        if self.tokens >= self.pilot_tokens:
            self.freeze_pilot()

    def freeze_pilot(self, cq: torch.Tensor | None = None) -> None:
        """Fix C̃_Q from the tokens seen so far, or to ``cq`` [h, d, d] (every data-parallel rank's pilot,
        :mod:`oscar_calib.calibration.parallel`), and fold the buffered rows in."""
        if self.pilot_cq is None and self.approx:
            q = self.sums["q"]
            self.pilot_cq = q / max(self.tokens * self.group, 1) if cq is None else cq.to(q.device, torch.float64)
            for kh, vh in zip(self._pilot_k, self._pilot_v):
                self._weighted(kh, vh)
            self._pilot_k, self._pilot_v = [], []

    def _weighted(self, kh: torch.Tensor, vh: torch.Tensor) -> None:
        s, w = _approx_sums(kh, vh, self.pilot_cq)
        self.sums["s_approx"] += s
        self.w_sum += w

    def covariance(self, name: str, *, centered: bool = False) -> torch.Tensor:
        """Normalised covariance [h, d, d] (float64) of accumulator ``name``; ``centered`` (keys
        only): of the keys minus their mean, ``Σ kᵀk / n − μᵀμ``."""
        if centered:
            if name != "k":
                raise ValueError(f"only the key accumulator has a centered form, not {name!r}")
            mu = self.key_mean()
            return self.covariance("k") - mu.unsqueeze(-1) * mu.unsqueeze(-2)
        if name in VECTORS:
            raise ValueError(f"{name!r} is a sum of rows, not a covariance")
        if name != "s_approx":
            return self.sums[name] / max(self.tokens * (self.group if name in ("q", "s") else 1), 1)
        if not self.approx:
            raise ValueError("s_approx was not accumulated (LayerStats(approx=False))")
        self.freeze_pilot()
        return self.sums["s_approx"] / self.w_sum.clamp(min=1e-300).view(-1, 1, 1)

    def key_mean(self) -> torch.Tensor:
        """The mean post-RoPE key of every KV head, ``[h, d]`` float64 (what key centering subtracts)."""
        return self.sums["k_sum"] / max(self.tokens, 1)

    def to(self, device: str | torch.device) -> "LayerStats":
        """Move every accumulator (and the pilot buffer) to ``device``, in place."""
        self.load_state_dict(self.state_dict(device), device)
        return self

    def state_dict(self, device: str | torch.device = "cpu") -> dict:
        """Every tensor (on the CPU: what a checkpoint holds) and the token count."""
        return _to({"sums": self.sums, "tokens": self.tokens, "w_sum": self.w_sum, "pilot_cq": self.pilot_cq,
                    "pilot_k": self._pilot_k, "pilot_v": self._pilot_v}, device)

    def load_state_dict(self, state: dict, device: str | torch.device | None = None) -> None:
        """Take ``state`` (a :meth:`state_dict`), onto ``device`` (default: where this layer lives)."""
        self.device = self.device if device is None else torch.device(device)
        st = _to(state, self.device)
        self.sums, self.tokens, self.w_sum = st["sums"], int(st["tokens"]), st["w_sum"]
        self.pilot_cq, self._pilot_k, self._pilot_v = st["pilot_cq"], st["pilot_k"], st["pilot_v"]


def half_precision_grams(*xs: torch.Tensor) -> bool:
    """Whether :meth:`LayerStats.update` computes the q/s/k/v grams with half-precision inputs:
    activations all bf16 or all fp16 (what a bf16/fp16 model produces), unless
    ``OSCAR_EXACT_GRAMS=1``. Their products are exact in float32 (8- or 11-bit mantissas), so the
    only rounding is float32 summation within one sequence (~1e-6 to 1e-5 relative, far below the
    activations' own bf16 rounding of ~4e-3); the running sums stay float64. Float32 activations
    (CPU runs, the tests) always take the float64 path."""
    import os

    dt = xs[0].dtype
    return (dt in (torch.bfloat16, torch.float16) and all(x.dtype == dt for x in xs)
            and os.environ.get("OSCAR_EXACT_GRAMS", "0") != "1")


_OUT_DTYPE_BMM: bool | None = None      # torch.bmm(..., out_dtype=float32) works here (CUDA, torch >= 2.8)


def _bmm_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of half-precision batches with float32 products and sums: cuBLAS's half GEMM with
    float32 output where torch offers it, else a float32 GEMM (TF32 is exact for these inputs)."""
    global _OUT_DTYPE_BMM
    if a.is_cuda and _OUT_DTYPE_BMM is not False:
        try:
            out = torch.bmm(a, b, out_dtype=torch.float32)
            _OUT_DTYPE_BMM = True
            return out
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE_BMM = False
    return torch.bmm(a.float(), b.float())


FINITE_CHECKED = (("k", "key"), ("v", "value"), ("q", "query"), ("s", "attention output"))


def require_finite(layer: int, tensors: dict[str, torch.Tensor]) -> None:
    """Raise :class:`NumericalError` naming the layer and the first activation (``k``, ``v``, ``q``,
    ``s``: the attention output) whose tensor holds NaN/Inf."""
    for name, what in FINITE_CHECKED:
        if not torch.isfinite(tensors[name]).all():
            raise NumericalError(f"layer {layer}: non-finite {what} activations (NaN/Inf)")


def check_finite(stats: list[LayerStats]) -> None:
    """Raise :class:`NumericalError` naming the first layer whose sums hold NaN/Inf. One device
    sync: the norms of all sums at once (a non-finite entry makes its norm non-finite)."""
    by_dev: dict = {}
    for t in (s.sums[n] for s in stats for n, _ in FINITE_CHECKED):
        by_dev.setdefault(t.device, []).append(t)
    norms = [torch.stack(torch._foreach_norm(ts)).isfinite().all().cpu() for ts in by_dev.values()]
    if not all(bool(x) for x in norms):
        for i, s in enumerate(stats):
            require_finite(i, s.sums)


def _approx_sums(kh: torch.Tensor, vh: torch.Tensor, cq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ w vᵀv [h, d, d] and Σ w [h] of K/V rows [h, n, d], w = k C̃_Q kᵀ (float64)."""
    k64, v64 = kh.to(torch.float64), vh.to(torch.float64)
    w = torch.einsum("hnd,hde,hne->hn", k64, cq, k64)      # [h, n]
    return (v64 * w.unsqueeze(-1)).transpose(-1, -2) @ v64, w.sum(-1)


def _exact_grams(q: torch.Tensor, o: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                 valid: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The q/s/k/v grams of one batch in float64; ``kh``/``vh`` are its K/V rows [h, n, d]."""
    h, n, d = kh.shape
    qr, orr = _rows(q.transpose(1, 2), valid), _rows(o, valid)        # [n, Hq, d]
    # [n, h*g, d] -> [h, n*g, d]: query heads of one KV head are pooled
    qh = qr.reshape(n, h, -1, d).permute(1, 0, 2, 3).reshape(h, -1, d)
    oh = orr.reshape(n, h, -1, d).permute(1, 0, 2, 3).reshape(h, -1, d)
    return {"q": gram(qh), "s": gram(oh), "k": gram(kh), "v": gram(vh), "k_sum": kh.to(torch.float64).sum(1)}


def _half_grams(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                h: int) -> dict[str, torch.Tensor]:
    """The q/s/k/v grams of bf16/fp16 activations in one batched GEMM: exact products, float32
    sums over at most one sequence (chunks of ≤ 4096 rows), float64 from there on; the key sum
    in float64."""
    b, hq, t, d = q.shape
    x = torch.cat([q, o.transpose(1, 2), k, v], dim=1)           # [B, 2Hq + 2h, T, d]
    c = math.gcd(t, 4096) if t > 4096 and math.gcd(t, 4096) >= 512 else t
    x = x.reshape(-1, c, d)
    grams = _bmm_float32(x.transpose(1, 2), x).view(b, -1, t // c, d, d).to(torch.float64).sum((0, 2))
    return {"q": grams[:hq].view(h, hq // h, d, d).sum(1), "s": grams[hq:2 * hq].view(h, hq // h, d, d).sum(1),
            "k": grams[2 * hq:2 * hq + h], "v": grams[2 * hq + h:], "k_sum": k.to(torch.float64).sum((0, 2))}


def _to(tree, device):
    """Tensors of a nested dict/list (None kept) moved to ``device``."""
    if isinstance(tree, dict):
        return {k: _to(v, device) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to(v, device) for v in tree]
    return tree.to(device) if isinstance(tree, torch.Tensor) else tree


def _rows(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """[B, T, H, d] -> [n, H, d] keeping valid tokens only."""
    if valid is None:
        return x.reshape(-1, *x.shape[2:])
    return x[valid.to(torch.bool)]


class Reservoir:
    """Held-out rows of one layer, capped at ``max_tokens`` causal positions per sequence.

    Stores q [n_seq, T, Hq, d], k/v [n_seq, T, Hkv, d] on the CPU: float32 rows of a CPU model as they
    are; rows captured on a GPU in the dtype they come in (bf16: half the bytes), in pinned memory,
    widened to float32 where they are fitted (:func:`oscar_calib.calibration.fit.heldout_layer`),
    with the values and layout ``.cpu().float()`` gave. On 4 H100s (random-init Qwen3-8B shape, 512
    held-out tokens, 36 layers) the held-out capture took 1.39 s with ``.cpu().float()`` and 0.05 s
    this way (scripts/bench/results/scale-h100x4.json). Truncating a sequence to a prefix keeps it
    exact: causal attention at position i only reads keys ≤ i.
    """

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.q: list[torch.Tensor] = []
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.o: list[torch.Tensor] = []

    def add(self, q, k, v, o) -> None:
        t = min(self.max_tokens, q.shape[2])
        for b in range(q.shape[0]):
            self.q.append(_host(q[b, :, :t].transpose(0, 1)))
            self.k.append(_host(k[b, :, :t].transpose(0, 1)))
            self.v.append(_host(v[b, :, :t].transpose(0, 1)))
            self.o.append(_host(o[b, :t]))

    def __len__(self) -> int:
        return len(self.q)


def _host(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the CPU, laid out as ``x.cpu()`` would be: float32 from a CPU model, pinned and in its
    own dtype from a GPU."""
    if not x.is_cuda:
        return x.float()
    layout = torch.empty_like(x)                    # the strides .cpu() would give (a permuted view stays so)
    try:
        out = torch.empty_strided(x.shape, layout.stride(), dtype=x.dtype, device="cpu", pin_memory=True)
    except RuntimeError:                            # no pinned memory to be had: pageable, slower
        return x.cpu()
    return out.copy_(x)


def rows_on(rows: list[torch.Tensor], device: str | torch.device) -> list[torch.Tensor]:
    """Held-out rows (a :class:`Reservoir`'s) as float32 on ``device``: pinned rows are copied
    without blocking and widened there (exact: bf16/fp16 → float32)."""
    dev = torch.device(device)
    return [x.to(dev, non_blocking=x.is_pinned()).float() for x in rows]
