"""One decode step's write into a K/V cache: the new token of every sequence, in one launch.

:func:`append_token` stores one token per sequence into a cache whose K and V sit side by side
(the layout of :class:`oscar_calib.runtime.storage.LayerStore`):

==================  ======================================  =================================
tensor              shape                                   written
==================  ======================================  =================================
``window``          ``[B, 2, H, S + R + 1, d]`` 16/32-bit    the rotated row ``x @ R − c``, in its
                                                            window slot (:func:`window_slot`)
``codes``           ``[B, 2, H, cap + 1, d/4]`` uint8        packed INT2 of ``clip(x @ R − c)``, in
``scale``,          ``[B, 2, H, cap + 1, d/G]`` fp16         its history slot
``offset``                                                  (:func:`history_slot`)
``counts``          ``[B]`` int64                           ``+= real``
``lens``            two ``[B]`` int32 (optional)            window and history lengths for the
                                                            decode kernel
==================  ======================================  =================================

Keys and values may use different group sizes: ``group_size=(G_K, G_V)`` with ``scale`` and
``offset`` given as pairs ``(K [B, H, cap + 1, d/G_K], V [B, H, cap + 1, d/G_V])`` (the codes
keep their shape: ``d/4`` bytes whatever the group size).

Token ``t = counts[b]`` goes to window slot ``t`` (``t < S``) or ``S + (t - S) % R``, and to history
slot ``t - S`` (``(t - S) % cap`` for a ring), or to the scratch slots (window ``S + R``, history
``cap``) before the sink ends or when ``real[b]`` is False (a padded row: its count stays). The
caller keeps room in the history (the counts live on the device, so nothing is checked on the host):
a token past ``cap`` without a ring goes to the scratch slot, i.e. is not stored, but nothing is
written out of bounds.
Rotation, clip and INT2 follow :mod:`oscar_calib.numerics.quant`, as in :func:`.quantize_kv`:
the row is first rounded to the window's dtype, so the history holds the codes of the row the
window holds (before its own rounding). ``c`` is the optional centering shift ``center [2H, d]``
(key centering: ``μ @ R_k`` for the K heads, zeros for the V heads; none: ``c = 0``): the window and
the history hold every key with the same shift, so a query's logits all move by the same ``q·μ``.

The Triton kernel does all of it in one launch of ``B x 2H`` programs, reading the count on the
device, so a decode step needs no host sync and can be captured in a CUDA graph. It replaces ~25
small torch launches per layer and the general write kernel's 128-row tile (H200, Qwen3-8B
shapes: ~78 us of the write path per layer and decode step, 24 us of it the write kernel). Its
rotation is one float32 product on the CUDA cores (the reference's arithmetic up to summation
order: a code can differ only at a rounding tie, as in :func:`.quantize_kv`); the clip threshold
is exact (a sort of ``|y|``); codes by IEEE division.

With ``query=`` the K programs also rotate the step's query heads by the ``R_k`` they already hold
and return them (float32), for :func:`~oscar_calib.kernels.decode_attention` with
``k_rotation=None, pdl_input=True``: the decode step then has no query-rotation kernel, and the
decode kernel launches while this one ends (H100, Qwen3-8B shapes, write + decode per layer:
32.6 -> 27.8 us at 32K x 1, 54.3 -> 49.7 us at 128K x 1; ``scripts/bench/bench_append.py``).
"""

from __future__ import annotations

import torch

from ..contract.defaults import group_pair
from ..errors import InputError
from ._common import (
    check_tensor,
    head_dim_problem,
    interpreting,
    load_triton_module,
    next_pow2,
    pdl_capable,
    resolve_backend,
)
from .cache import Int2KVCache
from .decode import rotate_query
from .write import clip_indices, quantize_kv_reference


def window_slot(t: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """Window slot of token index ``t`` (any shape, int64): ``t`` in the sink, else a ring slot of the
    ``recent`` window (the scratch slot ``sink + recent`` when there is none)."""
    ring = sink + torch.remainder(t - sink, recent) if recent else torch.full_like(t, sink + recent)
    return torch.where(t < sink, t, ring)


def history_slot(j: torch.Tensor, cap: int, ring: bool) -> torch.Tensor:
    """History slot of history index ``j = t - sink``: the scratch slot ``cap`` when negative, or
    when ``j >= cap`` without a ring (a full history: the caller must have reserved room)."""
    slot = torch.remainder(j, cap) if ring else torch.where(j < cap, j, cap)
    return torch.where(j >= 0, slot, cap)


def kv_groups(group_size: int | tuple[int, int]) -> tuple[int, int]:
    """``(G_K, G_V)`` from one group size or a pair."""
    if isinstance(group_size, (tuple, list)):
        if len(group_size) != 2:
            raise InputError(f"group_size must be one size or a (K, V) pair, got {group_size!r}")
        return group_pair(*group_size)
    return group_pair(group_size)


def kv_params(t, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views of a parameter tensor ``[B, 2, H, cap + 1, n]``, or a ``(K, V)`` pair as given."""
    if isinstance(t, (tuple, list)):
        if len(t) != 2:
            raise InputError(f"{name} must be a tensor [B, 2, H, cap + 1, d/G] or a (K, V) pair of tensors")
        return t[0], t[1]
    return t[:, 0], t[:, 1]


def decode_view(window: torch.Tensor, codes: torch.Tensor, scale, offset,
                lens: tuple[torch.Tensor, torch.Tensor], group_size: int | tuple[int, int]) -> Int2KVCache:
    """The decode kernel's :class:`~oscar_calib.kernels.cache.Int2KVCache` over the side-by-side K/V
    tensors :func:`append_token` writes (views, no copies); ``lens`` = ``(window, history)``
    lengths; ``scale``/``offset`` and ``group_size`` as :func:`append_token` takes them."""
    gk, gv = kv_groups(group_size)
    (ks, vs), (ko, vo) = kv_params(scale, "scale"), kv_params(offset, "offset")
    return Int2KVCache(codes[:, 0], ks, ko, codes[:, 1], vs, vo, lens[1], window[:, 0], window[:, 1], lens[0], gk,
                       v_group_size=gv)


def rotate_kv(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """``x [..., 2, H, d]`` (K rows, then V) -> float32 ``x @ R`` per head, ``rotation [2H, d, d]``
    (None: identity)."""
    if rotation is None:
        return x.float()
    return torch.einsum("...khd,khde->...khe", x.float(), rotation.view(2, -1, *rotation.shape[-2:]))


def _check(k, v, window, codes, scale, offset, counts, rotation, clip, group_size, sink, recent, real, lens,
           gate=None, center=None):
    b, h, d = k.shape if k.ndim == 3 else (None, None, None)
    if b is None or tuple(v.shape) != tuple(k.shape):
        raise InputError(f"k and v must both be [B, H, d], got {tuple(k.shape)} and {tuple(v.shape)}")
    if tuple(window.shape[:3]) != (b, 2, h) or window.ndim != 5 or window.shape[4] != d \
            or window.shape[3] != sink + recent + 1:
        raise InputError(f"window must be [B, 2, H, sink + recent + 1, d] = {[b, 2, h, sink + recent + 1, d]}, "
                         f"got {list(window.shape)}")
    gk, gv = kv_groups(group_size)
    if d % gk or d % gv or d % 4:
        raise InputError(f"head_dim {d} must be a multiple of 4 and of the group size {group_size}")
    cap = codes.shape[3] - 1 if codes.ndim == 5 else -1
    want = {"codes": (codes, [b, 2, h, cap + 1, d // 4], torch.uint8)}
    if gk == gv and not isinstance(scale, (tuple, list)):
        want.update(scale=(scale, [b, 2, h, cap + 1, d // gk], torch.float16),
                    offset=(offset, [b, 2, h, cap + 1, d // gk], torch.float16))
    else:
        if not isinstance(scale, (tuple, list)) or not isinstance(offset, (tuple, list)):
            raise InputError(f"keys in groups of {gk} and values in groups of {gv}: scale and offset must be "
                             "(K, V) pairs of tensors")
        for name, pair in (("scale", scale), ("offset", offset)):
            kt, vt = kv_params(pair, name)
            want[f"K {name}"] = (kt, [b, h, cap + 1, d // gk], torch.float16)
            want[f"V {name}"] = (vt, [b, h, cap + 1, d // gv], torch.float16)
    for name, (t, shape, dt) in want.items():
        if list(t.shape) != shape or t.dtype != dt or cap < 1:
            raise InputError(f"{name} must be {str(dt).replace('torch.', '')} {shape} (cap >= 1), "
                             f"got {str(t.dtype).replace('torch.', '')} {list(t.shape)}")
    check_tensor("counts", counts, ndim=1, dtypes=(torch.int64,), shape={0: b})
    for name, t in (("real", real), ("gate", gate)):
        if t is not None:
            check_tensor(name, t, ndim=1, dtypes=(torch.bool,), shape={0: b})
    if lens is not None:
        for name, t in zip(("window lengths", "history lengths"), lens):
            check_tensor(name, t, ndim=1, dtypes=(torch.int32,), shape={0: b})
    if rotation is not None:
        check_tensor("rotation", rotation, dtypes=(torch.float32,), shape={0: 2 * h, 1: d, 2: d})
    if clip is not None:
        check_tensor("clip", clip, ndim=1, dtypes=(torch.float32, torch.float64), shape={0: 2 * h})
    if center is not None:
        check_tensor("center", center, ndim=2, dtypes=(torch.float32,), shape={0: 2 * h, 1: d})
    return b, h, d, cap


def append_token(k: torch.Tensor, v: torch.Tensor, window: torch.Tensor, codes: torch.Tensor,
                 scale, offset, counts: torch.Tensor, *, sink: int, recent: int,
                 group_size: int | tuple[int, int], rotation: torch.Tensor | None = None, clip: torch.Tensor | None = None,
                 ring: bool = False, real: torch.Tensor | None = None,
                 lens: tuple[torch.Tensor, torch.Tensor] | None = None, ticket: torch.Tensor | None = None,
                 gate: torch.Tensor | None = None, query: torch.Tensor | None = None,
                 center: torch.Tensor | None = None, backend: str = "auto",
                 config: dict | None = None) -> torch.Tensor | None:
    """Store the new token ``k``/``v`` ``[B, H, d]`` of every sequence (see the module docstring).

    ``query [B, Hq, d]`` (``Hq`` a multiple of ``H``): also return it in the keys' basis, float32
    ``q @ R_k`` per KV head (the query for :func:`~oscar_calib.kernels.decode_attention` with
    ``k_rotation=None``), computed by the K programs from the ``R`` they hold, so a decode step
    needs no query-rotation kernel; the query as given when ``rotation`` is None. Pass
    ``pdl_input=True`` to the decode call that follows directly: it then launches while this kernel
    ends (Hopper and later).

    ``rotation [2H, d, d]`` float32 (K heads, then V; None: identity), ``clip [2H]`` ratios (None:
    no clip), ``center [2H, d]`` float32 subtracted from every rotated row (None: none; key
    centering), ``real [B]`` bool (None: every row stores its token) and ``gate [B]`` bool, a second
    condition (a row stores its token when both hold), ``lens`` the decode kernel's
    ``(window, history)`` lengths to refresh, ``ticket [B]`` int32 zeros the kernel uses and leaves
    zero (allocated per call when None). ``config``: ``num_warps``, ``KB`` (rows of ``R`` per
    step of the product; default ``16384 / d``: all of ``R`` at once for d = 128), for benchmarks.
    ``group_size``: one size, or ``(G_K, G_V)`` with ``scale``/``offset`` as ``(K, V)`` pairs (the
    module docstring). Writes in place; returns the rotated query, or None without ``query``."""
    b, h, d, cap = _check(k, v, window, codes, scale, offset, counts, rotation, clip, group_size,
                          sink, recent, real, lens, gate, center)
    if query is not None:
        check_tensor("query", query, ndim=3, shape={0: b, 2: d})
        if query.shape[1] % h:
            raise InputError(f"query has {query.shape[1]} heads, not a multiple of the {h} KV heads")
    (ks, vs), (ko, vo) = kv_params(scale, "scale"), kv_params(offset, "offset")
    supported = head_dim_problem(d, "write") or (None if window.stride(-1) == 1 and codes.stride(-1) == 1 and all(
        t.stride(-1) == 1 for t in (ks, vs, ko, vo)) and ks.stride() == ko.stride() and vs.stride() == vo.stride()
        else "the cache tensors must be contiguous in their last dimension")
    if resolve_backend(backend, [k, v, window, codes, counts], supported) == "torch":
        return append_token_reference(k, v, window, codes, scale, offset, counts, sink=sink, recent=recent,
                                      group_size=group_size, rotation=rotation, clip=clip, ring=ring, real=real,
                                      lens=lens, gate=gate, query=query, center=center)
    mod = load_triton_module("_append_triton")
    cfg = config or {}
    gk, gv = kv_groups(group_size)
    split = isinstance(scale, (tuple, list))
    if not split:  # the K and V parameters of one tensor [B, 2, H, cap + 1, d/G]
        ks = vs = scale
        ko = vo = offset
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if ticket is None:
        ticket = torch.zeros(b, dtype=torch.int32, device=counts.device)
    kidx = clip_indices(clip, d, k.device)
    r = rotation.contiguous() if rotation is not None else k
    wl, hl = lens if lens is not None else (counts, counts)
    real_u8 = real.view(torch.uint8) if real is not None else counts
    qg = query.shape[1] // h if query is not None and rotation is not None else 0
    if qg:
        if query.stride(-1) != 1:
            query = query.contiguous()
        q_out = torch.empty(b, query.shape[1], d, dtype=torch.float32, device=query.device)
    q_in = query if qg else k
    mod.append_token_kernel[(b, 2 * h)](
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        real_u8, real_u8.stride(0) if real is not None else 0,
        gate.contiguous().view(torch.uint8) if gate is not None else counts,
        counts, ticket, wl, hl,
        window, window.stride(0), window.stride(1), window.stride(2), window.stride(3),
        codes, codes.stride(0), codes.stride(1), codes.stride(2), codes.stride(3),
        ks, ko, ks.stride(0), 0 if split else ks.stride(1), ks.stride(-3), ks.stride(-2),
        vs, vo, vs.stride(0), vs.stride(-3), vs.stride(-2),
        r, kidx, center.contiguous() if center is not None else kidx,
        q_in, q_in.stride(0), q_in.stride(1), q_out if qg else k,
        h, sink, recent, cap,
        D=d, G=gk, W=min(gk, d // 4), KB=min(d, int(cfg.get("KB", max(8, 16384 // d)))),
        ROT=rotation is not None, CLIP=clip is not None, REAL=real is not None, RING=bool(ring),
        LENS=lens is not None, GATE=gate is not None, QG=qg, QG2=next_pow2(max(qg, 1)),
        PDL=bool(qg) and pdl_capable(k.device), SPLIT=split, GV=gv, WV=min(gv, d // 4), INTERP=interpreting(),
        CENTER=center is not None, num_warps=int(cfg.get("num_warps", 4)),
    )
    if query is None:
        return None
    return q_out if qg else query


def append_token_reference(k, v, window, codes, scale, offset, counts, *, sink: int, recent: int, group_size,
                           rotation=None, clip=None, ring: bool = False, real=None, lens=None, gate=None,
                           query=None, center=None) -> torch.Tensor | None:
    """Pure-torch :func:`append_token` (the same slots and values; torch ops only, no host sync)."""
    if gate is not None:
        real = gate if real is None else real & gate
    b, h, d = k.shape
    cap = codes.shape[3] - 1
    rows_b = torch.arange(b, device=counts.device)
    ws, hs = window_slot(counts, sink, recent), history_slot(counts - sink, cap, ring)
    if real is not None:
        ws = torch.where(real, ws, sink + recent)
        hs = torch.where(real, hs, cap)
    rows = torch.stack([k, v], 1).to(window.dtype)                                    # [B, 2, H, d]
    y = rotate_kv(rows, rotation)
    if center is not None:
        y = y - center.view(2, h, d)
    window[rows_b, :, :, ws] = y.to(window.dtype)
    gk, gv = kv_groups(group_size)
    params = (kv_params(scale, "scale"), kv_params(offset, "offset"))
    for kv, g in enumerate((gk, gv)):
        part = slice(kv * h, (kv + 1) * h)
        q = quantize_kv_reference(rows[:, kv], None if rotation is None else rotation[part],
                                  None if clip is None else clip[part], g, None if center is None else center[part])
        codes[rows_b, kv, :, hs] = q.codes
        params[0][kv][rows_b, :, hs] = q.scale
        params[1][kv][rows_b, :, hs] = q.offset
    counts += 1 if real is None else real
    if lens is not None:
        lens[0].copy_(counts.clamp(max=sink + recent))
        lens[1].copy_((counts - sink - recent).clamp(min=0))
    if query is None or rotation is None:
        return query
    return rotate_query(query, rotation[:h], h)
