"""The decode-time KV cache: BF16 window + INT2 history, contiguous or paged, and its builder.

A sequence of ``T`` tokens keeps its first ``n_sink = min(sink, T)`` tokens (attention sink)
and its last ``n_recent = min(recent, T - n_sink)`` tokens in 16-bit; the
``hist = T - n_sink - n_recent`` tokens between them are INT2 (:mod:`.pack`). Everything is
stored in the *rotated* basis (keys ``k @ R_k``, values ``v @ R_v``), per KV head.

Attention over a cache does not depend on the order of its tokens (RoPE is already applied),
so the decode kernel only needs, per sequence, how many 16-bit tokens and how many INT2 tokens
are valid; where they sit in the sequence is the caller's business (a serving engine keeps the
recent window as a ring buffer and moves its oldest token into the history).

Layouts (``B`` sequences, ``H`` KV heads, ``d`` head_dim, ``NG = d/G`` groups; keys and values may
use different group sizes, ``group_size`` and ``v_group_size``, and then ``NG`` differs between
``k_*`` and ``v_*``):

=================  =================================  ===========================================
tensor             contiguous                          paged (``block_table`` given)
=================  =================================  ===========================================
``k_codes``        uint8 ``[B, H, Lcap, d/4]``         uint8 ``[P, H, page, d/4]`` (page pool)
``k_scale``        fp16 ``[B, H, Lcap, NG]``           fp16 ``[P, H, page, NG]``
``k_offset``       fp16 ``[B, H, Lcap, NG]``           fp16 ``[P, H, page, NG]``
``v_*``            as ``k_*`` (``NG = d/G_V``)          as ``k_*`` (``NG = d/G_V``)
``hist_lens``      int32 ``[B]``, ``<= Lcap``          int32 ``[B]``, ``<= max_pages * page``
``block_table``    —                                   int32 ``[B, max_pages]``: INT2 token ``t`` of
                                                       sequence ``b`` is slot ``t % page`` of page
                                                       ``block_table[b, t // page]``
``k_bf16/v_bf16``  bf16/fp16 ``[B, H, Ncap, d]``       same (the window is small; not paged)
``bf16_lens``      int32 ``[B]``, ``<= Ncap``          same
=================  =================================  ===========================================

Head-major order (``H`` before tokens) keeps one head's tokens contiguous, so the kernel reads
each token's 32 code bytes (d = 128) and its 4 parameter bytes without gaps. Only the last
dimension must be contiguous; other strides are free, but the K and V code tensors must share
strides, as must each cache's scale and offset. ``page`` is a power of two.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..contract.defaults import (
    DEFAULT_RECENT,
    DEFAULT_SINK,
    default_group_size,
    group_pair,
    is_power_of_two,
)
from ..errors import InputError
from ._common import check_group, check_tensor
from .pack import PARAM_DTYPE
from .write import quantize_kv

WINDOW_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class Int2KVCache:
    """One layer's decode cache (see the module docstring for shapes and layouts)."""

    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_offset: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_offset: torch.Tensor
    hist_lens: torch.Tensor
    k_bf16: torch.Tensor
    v_bf16: torch.Tensor
    bf16_lens: torch.Tensor
    group_size: int
    block_table: torch.Tensor | None = None
    v_group_size: int | None = None      # the values' group size (None: ``group_size``)

    def __post_init__(self) -> None:
        self.group_size, self.v_group_size = group_pair(self.group_size, self.v_group_size)

    @property
    def split(self) -> bool:
        """Keys and values stored in groups of different sizes."""
        return self.v_group_size != self.group_size

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def batch(self) -> int:
        return self.hist_lens.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_codes.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k_codes.shape[-1] * 4

    @property
    def page_size(self) -> int | None:
        return self.k_codes.shape[2] if self.paged else None

    @property
    def history_capacity(self) -> int:
        """Most INT2 tokens one sequence can hold."""
        if self.paged:
            return self.block_table.shape[1] * self.k_codes.shape[2]
        return self.k_codes.shape[2]

    @property
    def window_capacity(self) -> int:
        return self.k_bf16.shape[2]

    def validate(self) -> None:
        """Check dtypes, shapes and strides; raise :class:`InputError` naming the field."""
        d = self.head_dim
        check_group(d, self.group_size)
        check_group(d, self.v_group_size)
        ngs = {"k": d // self.group_size, "v": d // self.v_group_size}
        check_tensor("cache.k_codes", self.k_codes, ndim=4, dtypes=(torch.uint8,))
        lead = tuple(self.k_codes.shape[:3])
        for name in ("k_codes", "v_codes", "k_scale", "k_offset", "v_scale", "v_offset"):
            t = getattr(self, name)
            want = lead + ((d // 4,) if name.endswith("codes") else (ngs[name[0]],))
            dt = torch.uint8 if name.endswith("codes") else PARAM_DTYPE
            check_tensor(f"cache.{name}", t, dtypes=(dt,))
            if tuple(t.shape) != want:
                raise InputError(f"cache.{name} has shape {tuple(t.shape)}, expected {want}")
            if t.stride(-1) != 1:
                raise InputError(f"cache.{name} must be contiguous in its last dimension")
        if self.v_codes.stride() != self.k_codes.stride():
            raise InputError("cache.k_codes and cache.v_codes must have the same strides")
        for which in "kv":
            if getattr(self, f"{which}_offset").stride() != getattr(self, f"{which}_scale").stride():
                raise InputError(f"cache.{which}_offset must have the same strides as cache.{which}_scale")
        b = self.hist_lens.shape[0] if self.hist_lens.ndim == 1 else -1
        check_tensor("cache.hist_lens", self.hist_lens, ndim=1, dtypes=(torch.int32,))
        check_tensor("cache.bf16_lens", self.bf16_lens, ndim=1, dtypes=(torch.int32,), shape={0: b})
        h = self.k_codes.shape[1]
        check_tensor("cache.k_bf16", self.k_bf16, ndim=4, dtypes=WINDOW_DTYPES, shape={0: b, 1: h, 3: d})
        check_tensor("cache.v_bf16", self.v_bf16, ndim=4, dtypes=(self.k_bf16.dtype,))
        if tuple(self.v_bf16.shape) != tuple(self.k_bf16.shape) or self.v_bf16.stride() != self.k_bf16.stride():
            raise InputError("cache.v_bf16 must have the shape and strides of cache.k_bf16")
        if self.k_bf16.stride(-1) != 1:
            raise InputError("cache.k_bf16 must be contiguous in its last dimension")
        if self.paged:
            check_tensor("cache.block_table", self.block_table, ndim=2, dtypes=(torch.int32,), shape={0: b})
            if not is_power_of_two(self.k_codes.shape[2]):
                raise InputError(f"page size {self.k_codes.shape[2]} is not a power of two")
        elif self.k_codes.shape[0] != b:
            raise InputError(f"cache.k_codes has batch {self.k_codes.shape[0]}, hist_lens has {b}")
        devs = {getattr(self, n).device for n in ("k_codes", "hist_lens", "k_bf16", "bf16_lens")}
        if self.paged:
            devs.add(self.block_table.device)
        if len(devs) > 1:
            raise InputError(f"cache tensors are on several devices: {sorted(map(str, devs))}")

    def check_lengths(self) -> None:
        """Check the lengths against the capacities (reads them: synchronises a GPU)."""
        h = self.hist_lens.cpu()
        w = self.bf16_lens.cpu()
        if (h < 0).any() or (h > self.history_capacity).any():
            raise InputError(f"hist_lens must be in [0, {self.history_capacity}], got {h.tolist()}")
        if (w < 0).any() or (w > self.window_capacity).any():
            raise InputError(f"bf16_lens must be in [0, {self.window_capacity}], got {w.tolist()}")
        if ((h + w) < 1).any():
            raise InputError("every sequence needs at least one cached token")
        if self.paged:
            if self.block_table.shape[0] and self.block_table.numel():
                tab = self.block_table.cpu()
                pages = self.k_codes.shape[0]
                page = self.k_codes.shape[2]
                for b in range(tab.shape[0]):
                    used = tab[b, : (int(h[b]) + page - 1) // page]
                    if used.numel() and ((used < 0).any() or (used >= pages).any()):
                        raise InputError(f"block_table row {b} points outside the page pool of {pages}")


def split_lengths(total: int, sink: int = DEFAULT_SINK, recent: int = DEFAULT_RECENT) -> tuple[int, int, int]:
    """``(n_sink, n_hist, n_recent)`` for a sequence of ``total`` tokens."""
    n_sink = min(sink, total)
    n_recent = min(recent, total - n_sink)
    return n_sink, total - n_sink - n_recent, n_recent


def build_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    lengths: torch.Tensor | list[int] | None = None,
    k_rotation: torch.Tensor | None = None,
    v_rotation: torch.Tensor | None = None,
    k_clip: torch.Tensor | float | None = None,
    v_clip: torch.Tensor | float | None = None,
    group_size: int | None = None,
    v_group_size: int | None = None,
    sink: int = DEFAULT_SINK,
    recent: int = DEFAULT_RECENT,
    window_dtype: torch.dtype = torch.bfloat16,
    page_size: int | None = None,
    generator: torch.Generator | None = None,
    backend: str = "auto",
) -> Int2KVCache:
    """Build a decode cache from full (unrotated) keys and values.

    Args:
        k, v: ``[B, T, H, d]`` keys (post-RoPE) and values, any float dtype.
        lengths: tokens per sequence (``<= T``); default ``T`` for all.
        k_rotation, v_rotation: ``[H, d, d]`` rotations (None = identity). For values the
            rotation normally lives in v_proj already; pass None then.
        k_clip, v_clip: clip ratios (``[H]`` or a float; None = no clip).
        group_size: INT2 group size (default ``min(128, d)``); of the keys when
            ``v_group_size`` is given.
        v_group_size: the values' group size (default ``group_size``).
        sink, recent: 16-bit tokens kept at the start and at the end of each sequence.
        window_dtype: dtype of the 16-bit window (bf16 or fp16).
        page_size: None for the contiguous layout; a power of two for the paged layout.
        generator: with ``page_size``, shuffle the page pool with this generator (pages of a
            sequence are then scattered, as in a serving engine); None keeps them in order.
        backend: backend of :func:`quantize_kv`.

    The history of sequence ``b`` has ``split_lengths(lengths[b], sink, recent)[1]`` tokens.
    """
    check_tensor("k", k, ndim=4, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    check_tensor("v", v, ndim=4, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    if k.shape != v.shape:
        raise InputError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if window_dtype not in WINDOW_DTYPES:
        raise InputError(f"window_dtype must be bfloat16 or float16, got {window_dtype}")
    if sink < 0 or recent < 0:
        raise InputError(f"sink and recent must be >= 0, got {sink} and {recent}")
    B, T, H, d = k.shape
    if group_size is None:
        group_size = default_group_size(d)
    group_size, v_group_size = group_pair(group_size, v_group_size)
    check_group(d, group_size)
    check_group(d, v_group_size)
    if lengths is None:
        lens = [T] * B
    else:
        lens = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
        if len(lens) != B or any(not 1 <= n <= T for n in lens):
            raise InputError(f"lengths must be {B} values in [1, {T}], got {lens}")
    if page_size is not None and not is_power_of_two(page_size):
        raise InputError(f"page size {page_size} is not a power of two")
    dev = k.device
    parts = [split_lengths(n, sink, recent) for n in lens]

    def rot(x, r):
        x = x.float()
        return x if r is None else torch.einsum("bthd,hde->bthe", x, r.float())

    kr, vr = rot(k, k_rotation), rot(v, v_rotation)
    ncap = max(1, max(s + r for s, _, r in parts))
    k16 = torch.zeros(B, H, ncap, d, dtype=window_dtype, device=dev)
    v16 = torch.zeros_like(k16)
    for b, (ns, nh, nr) in enumerate(parts):
        idx = torch.cat([torch.arange(ns), torch.arange(ns + nh, ns + nh + nr)]).to(dev)
        k16[b, :, : ns + nr] = kr[b, idx].transpose(0, 1).to(window_dtype)
        v16[b, :, : ns + nr] = vr[b, idx].transpose(0, 1).to(window_dtype)

    qk = quantize_kv(k, k_rotation, k_clip, group_size, backend=backend)
    qv = quantize_kv(v, v_rotation, v_clip, v_group_size, backend=backend)
    hists = [nh for _, nh, _ in parts]
    lcap = max(1, max(hists))
    store = {n: torch.zeros(B, H, lcap, w, dtype=dt, device=dev)
             for n, w, dt in _fields(d, d // group_size, d // v_group_size)}
    srcs = {
        "k_codes": qk.codes, "k_scale": qk.scale, "k_offset": qk.offset,
        "v_codes": qv.codes, "v_scale": qv.scale, "v_offset": qv.offset,
    }
    for b, (ns, nh, _) in enumerate(parts):
        for n, src in srcs.items():
            store[n][b, :, :nh] = src[b, ns : ns + nh].transpose(0, 1)
    cache = Int2KVCache(
        store["k_codes"], store["k_scale"], store["k_offset"],
        store["v_codes"], store["v_scale"], store["v_offset"],
        torch.tensor(hists, dtype=torch.int32, device=dev),
        k16, v16,
        torch.tensor([s + r for s, _, r in parts], dtype=torch.int32, device=dev),
        group_size, v_group_size=v_group_size,
    )
    return cache if page_size is None else to_paged(cache, page_size, generator)


def _fields(d: int, ngk: int, ngv: int):
    return [
        ("k_codes", d // 4, torch.uint8), ("k_scale", ngk, PARAM_DTYPE), ("k_offset", ngk, PARAM_DTYPE),
        ("v_codes", d // 4, torch.uint8), ("v_scale", ngv, PARAM_DTYPE), ("v_offset", ngv, PARAM_DTYPE),
    ]


def to_paged(cache: Int2KVCache, page_size: int, generator: torch.Generator | None = None) -> Int2KVCache:
    """Copy a contiguous cache into the paged layout (pages shuffled with ``generator``)."""
    if cache.paged:
        raise InputError("cache is already paged")
    if not is_power_of_two(page_size):
        raise InputError(f"page size {page_size} is not a power of two")
    hists = cache.hist_lens.tolist()
    npages = [(n + page_size - 1) // page_size for n in hists]
    total = max(1, sum(npages))
    perm = torch.randperm(total, generator=generator) if generator is not None else torch.arange(total)
    B, H = cache.batch, cache.num_kv_heads
    names = ("k_codes", "k_scale", "k_offset", "v_codes", "v_scale", "v_offset")
    pools = {
        n: torch.zeros(total, H, page_size, getattr(cache, n).shape[-1], dtype=getattr(cache, n).dtype,
                       device=cache.k_codes.device)
        for n in names
    }
    table = torch.zeros(B, max(1, max(npages)), dtype=torch.int32)
    nxt = 0
    for b in range(B):
        for j in range(npages[b]):
            page = int(perm[nxt])
            nxt += 1
            table[b, j] = page
            t0, t1 = j * page_size, min(hists[b], (j + 1) * page_size)
            for n in names:
                pools[n][page, :, : t1 - t0] = getattr(cache, n)[b, :, t0:t1]
    return replace(cache, block_table=table.to(cache.k_codes.device), **pools)
