"""Storage of one decoder layer of the real cache (:class:`~oscar_calib.runtime.cache.OscarCache`).

Everything is kept in the kernels' layout (:mod:`oscar_calib.kernels.cache`, head-major,
contiguous), with K and V side by side in one buffer so a decode step writes everything with one
launch (:func:`oscar_calib.kernels.append_token`); ``buf[:, 0]`` is K and ``buf[:, 1]`` is V, views the decode kernel reads
directly (:meth:`LayerStore.kernel_view`).

==================  =============================================  ===================================
part                shape                                          content
==================  =============================================  ===================================
window ``kv``       ``[B, 2, H, S + R + 1, d]`` bf16/fp16           sink slots ``[0, S)`` and a ring of
                                                                   ``R`` recent slots, rotated
                                                                   (``x @ R − c``); the last slot is
                                                                   scratch
history ``codes``   ``[B, 2, H, cap + 1, d/4]`` uint8               packed INT2 codes of
                                                                   ``clip(x @ R − c)``
history ``scale``,  ``[B, 2, H, cap + 1, d/G]`` fp16                per-group scale and offset
``offset``
counts ``n``        ``[B]`` int64 (device) and a host list          valid tokens stored per sequence
==================  =============================================  ===================================

``c`` is the layer's centering shift (:attr:`~oscar_calib.runtime.plan.LayerPlan.center2`: ``μ @ R_k``
for the keys of an artifact with key centering, zeros otherwise): window and history hold every key
with the same shift.

A layer whose keys and values use different group sizes ``G_K != G_V`` keeps their parameters
apart: ``[B, 1, H, cap + 1, d/G_K]`` for K and ``[B, 1, H, cap + 1, d/G_V]`` for V (scale and
offset each), every other part as above.

The host list is exact except after a decode step whose rows carried a mask or a gate (rows that
finished generating, :class:`~oscar_calib.runtime.graph.DecodeGraph`): such a step writes each row
only when its token is real and its gate is set (decided on the device, so the step never waits
for the GPU and can be captured in a CUDA graph) and adds one to every host count, an upper bound, until
:meth:`LayerStore.exact_counts` reads the device counts back (writes of several tokens, crop,
batch reorders and ``memory()`` do).

Token ``t`` of a sequence (``t`` counts its *valid* tokens, so left padding takes no room) goes to
window slot ``t`` when ``t < S``, else to ring slot ``S + (t - S) % R``; every token ``t >= S`` is
also quantised **once, when it arrives**, into history slot ``t - S`` (full-attention layers:
the history grows with the context) or ``(t - S) % W`` (sliding layers: a ring of the window
size ``W``). A token leaving the recent ring therefore needs no work: the kernel reads history
slots ``[0, n - S - R)`` and window slots ``[0, min(n, S + R))``, both prefixes, in any order
(attention does not depend on the order of keys). Quantising from the token as the model
computed it (rounded to the window dtype) gives the same codes as the simulation, which
quantises the token when it leaves the window.

Growth: the history is preallocated (:meth:`LayerStore.reserve`, or the prompt length plus
:data:`GROW_MIN` at the first write) and grows by ``max(GROW_MIN, cap / 4)`` tokens when full:
one copy of the history every so often, never per step. Nothing else grows with the context.
"""

from __future__ import annotations

import torch

from ..kernels import Int2KVCache, dequantize_packed
from ..kernels.append import append_token, decode_view, history_slot, window_slot
from ..kernels.pack import PARAM_DTYPE

GROW_MIN = 1024          # tokens added to the history at least when it grows
WRITE_CHUNK = 16384      # tokens quantised per call in a long write (bounds the temporaries)


def _round_up(n: int, m: int = 256) -> int:
    return -(-n // m) * m


def held_slots(n: int, sink: int, recent: int, ring: int | None) -> tuple[int, int, int]:
    """For a sequence of ``n`` tokens in one layer: ``(window slots, history slots, tokens)`` that
    hold tokens, and the tokens a 16-bit cache would hold for it. Every token from the sink on has
    a history slot from its arrival (the recent window's tokens are held twice); a sliding layer's
    history is a ring of ``ring`` slots, so it holds the sink and the last ``ring`` tokens."""
    kept = n if ring is None else min(n, ring + sink)
    return min(n, sink + recent), max(0, kept - sink), kept


def context_bits(scheme, windows: list, tokens: int, window_bits: int | None = None) -> float:
    """Bits per K/V element :class:`~oscar_calib.runtime.cache.OscarCache` holds for a sequence of
    ``tokens`` tokens stored with ``scheme`` in a model whose layers have ``windows`` (per layer
    :func:`~oscar_calib.runtime.compat.layer_windows`'s ``(window, chunk)``, or the window alone;
    None: full attention, else a history ring of the window's size): its window slots
    in the window dtype (``window_bits``, default the scheme's window dtype), its history slots at
    ``scheme.layer_bits`` (codes and fp16 parameters), over the elements a 16-bit cache would hold
    for the same tokens (:func:`held_slots`; ``16 / compression`` of :meth:`OscarCache.memory`).
    Windows included, so it falls towards the history's bits as the context grows."""
    if not scheme.quantized:
        return scheme.bits_per_element
    wb = window_bits or (torch.finfo(scheme.window_dtype).bits if scheme.window_dtype else 16)
    held = elements = 0.0
    for i, win in enumerate(windows):
        ring = win[0] if isinstance(win, tuple) else win
        w, h, kept = held_slots(tokens, scheme.sink, scheme.recent, ring)
        held += w * wb + h * scheme.layer_bits(i)
        elements += kept
    return held / elements if elements else float(wb)


class Window:
    """The 16-bit window of one layer: ``S`` sink slots, a ring of ``R`` recent slots, one scratch
    slot, all rotated (see the module docstring)."""

    def __init__(self, batch: int, heads: int, d: int, sink: int, recent: int, dtype, device):
        self.sink, self.recent = sink, recent
        self.kv = torch.zeros(batch, 2, heads, sink + recent + 1, d, dtype=dtype, device=device)

    @property
    def scratch(self) -> int:
        return self.sink + self.recent

    def slots(self, t: torch.Tensor) -> torch.Tensor:
        """Window slot of token index ``t`` (any shape; int64)."""
        return window_slot(t, self.sink, self.recent)

    def slot_tokens(self, n: torch.Tensor) -> torch.Tensor:
        """``[B, S + R]``: the token index each slot holds for sequences of ``n`` tokens (-1: none)."""
        s, r = self.sink, self.recent
        slot = torch.arange(s + r, device=n.device).unsqueeze(0)
        last = n.unsqueeze(1) - 1 - slot                         # sink: t = slot if slot < n
        if r:
            ring = n.unsqueeze(1) - 1 - slot                      # ring slot S + j holds S + j + R*k
            ring = torch.where(ring >= 0, slot + r * torch.div(ring, r, rounding_mode="floor"), -1)
        else:
            ring = torch.full_like(last, -1)
        return torch.where(slot < s, torch.where(last >= 0, slot, -1), ring)


class Int2Store:
    """Packed INT2 history of one layer (K and V), ``cap`` slots plus one scratch slot; with
    ``ring=True`` token ``j`` (counted from the first history token) lives in slot ``j % cap``.
    ``groups = (G_K, G_V)``: the keys' and the values' group sizes."""

    def __init__(self, batch: int, heads: int, d: int, groups: tuple[int, int], cap: int, ring: bool, device):
        self.groups, self.ring = tuple(groups), ring
        self.codes = torch.zeros(batch, 2, heads, cap + 1, d // 4, dtype=torch.uint8, device=device)
        # one [B, 2, H, ·] tensor per parameter when K and V share a group size; else K's and V's apart
        caches = ((2, self.groups[0]),) if not self.split else ((1, self.groups[0]), (1, self.groups[1]))
        self.params = [torch.zeros(batch, n, heads, cap + 1, d // g, dtype=PARAM_DTYPE, device=device)
                       for n, g in caches for _ in ("scale", "offset")]

    @property
    def split(self) -> bool:
        return self.groups[0] != self.groups[1]

    @property
    def cap(self) -> int:
        return self.codes.shape[3] - 1

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Codes, then the parameters (scale, offset; K's then V's when they are apart)."""
        return (self.codes, *self.params)

    def set_tensors(self, ts) -> None:
        self.codes, *params = ts
        self.params = list(params)

    def kernel_params(self) -> tuple:
        """``(scale, offset)`` as :func:`~oscar_calib.kernels.append.append_token` and
        :func:`~oscar_calib.kernels.append.decode_view` take them: the ``[B, 2, H, cap + 1, d/G]``
        tensors, or ``(K, V)`` pairs of ``[B, H, cap + 1, d/G_·]`` views."""
        if not self.split:
            return self.params[0], self.params[1]
        ks, ko, vs, vo = self.params
        return (ks[:, 0], vs[:, 0]), (ko[:, 0], vo[:, 0])

    def grow(self, need: int) -> bool:
        """Make room for ``need`` history tokens per sequence; True when the buffers moved."""
        old_cap = self.cap
        if self.ring or need <= old_cap:
            return False
        new = _round_up(max(need, old_cap + max(GROW_MIN, old_cap // 4)))
        old = self.tensors()
        self.set_tensors([torch.zeros(*t.shape[:3], new + 1, t.shape[4], dtype=t.dtype, device=t.device)
                          for t in old])
        for dst, src in zip(self.tensors(), old):
            dst[:, :, :, :old_cap] = src[:, :, :, :old_cap]
        return True

    def slots(self, j: torch.Tensor) -> torch.Tensor:
        """History slot of history index ``j = t - S`` (negative: the scratch slot)."""
        return history_slot(j, self.cap, self.ring)

    def slot_tokens(self, n: torch.Tensor, sink: int, start: int, length: int) -> torch.Tensor:
        """``[B, length]``: token index held by slots ``start ..`` for sequences of ``n`` tokens."""
        h = torch.arange(start, start + length, device=n.device).unsqueeze(0)
        last = n.unsqueeze(1) - 1 - sink - h
        if self.ring:
            t = sink + h + self.cap * torch.div(last, self.cap, rounding_mode="floor")
        else:
            t = (sink + h).expand_as(last)
        return torch.where(last >= 0, t, -1)

    def dequantize(self, start: int, length: int) -> torch.Tensor:
        """Slots ``[start, start + length)`` as float32 ``[B, 2, H, length, d]`` (rotated basis)."""
        sl = slice(start, start + length)
        if not self.split:
            return dequantize_packed(self.codes[:, :, :, sl], self.params[0][:, :, :, sl],
                                     self.params[1][:, :, :, sl], self.groups[0])
        return torch.cat([dequantize_packed(self.codes[:, kv:kv + 1, :, sl], self.params[2 * kv][:, :, :, sl],
                                            self.params[2 * kv + 1][:, :, :, sl], self.groups[kv])
                          for kv in (0, 1)], dim=1)

    def key_scales(self, start: int, length: int) -> torch.Tensor:
        """The keys' group scales of slots ``[start, start + length)``, float32 ``[B, H, length, d/G_K]``."""
        return self.params[0][:, 0, :, start:start + length].float()

    def store(self, b: int, slots: torch.Tensor, parts: list, heads: int) -> None:
        """Write :meth:`LayerPlan.quantize`'s result for tokens ``[N, 2H, ·]`` of sequence ``b`` into
        history slots ``slots [N]``."""
        n = slots.shape[0]
        codes = torch.cat([q.codes for q in parts], dim=1)                                   # [N, 2H, d/4]
        self.codes[b].index_copy_(2, slots, codes.view(n, 2, heads, -1).permute(1, 2, 0, 3))
        for i, q in enumerate(parts):             # one part of 2H heads, or K's and V's
            for dst, src in zip(self.params[2 * i:2 * i + 2], (q.scale, q.offset)):
                dst[b].index_copy_(2, slots, src.view(n, dst.shape[1], heads, -1).permute(1, 2, 0, 3))


class LayerStore:
    """Window + INT2 history + token counts of one layer, and the decode kernel's view of them.
    ``plan`` is the layer's :class:`~oscar_calib.runtime.plan.LayerPlan` (already on the device);
    :func:`write_step` and :func:`write_tokens` fill it."""

    def __init__(self, plan, batch: int, heads: int, d: int, device, reserve: int = 0):
        self.plan, self.batch, self.heads, self.d = plan, batch, heads, d
        s, r = plan.sink, plan.recent
        self.window = Window(batch, heads, d, s, r, plan.window_dtype, device)
        ring = plan.sliding_window is not None
        cap = plan.sliding_window if ring else _round_up(max(reserve - s, 1))
        self.hist = Int2Store(batch, heads, d, plan.groups, cap, ring, device)
        self.n = torch.zeros(batch, dtype=torch.int64, device=device)
        self.counts = [0] * batch
        self.counts_stale = False            # counts may exceed n (see the module docstring)
        self.full_span = False               # the torch decode path reads every history slot (graphs)
        self.ticket = torch.zeros(batch, dtype=torch.int32, device=device)    # the write kernel's, kept zero
        self.bf16_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.hist_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self._view = None

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` tokens per sequence in the history (grows it if needed)."""
        if self.hist.grow(tokens - self.plan.sink):
            self._view = None

    def set_counts(self, counts: list[int]) -> None:
        self.counts = list(counts)
        self.counts_stale = False
        self.n.copy_(torch.tensor(self.counts, dtype=torch.int64))
        self.sync_lens()

    def sync_lens(self) -> None:
        """The kernel's lengths from the counts (device ops only)."""
        p = self.plan
        self.bf16_lens.copy_(self.n.clamp(max=p.sink + p.recent))
        self.hist_lens.copy_((self.n - p.sink - p.recent).clamp(min=0))

    def kernel_view(self) -> Int2KVCache:
        """The layer as the decode kernel's contiguous :class:`Int2KVCache` (views, no copies)."""
        if self._view is None:
            self._view = decode_view(self.window.kv, self.hist.codes, *self.hist.kernel_params(),
                                     (self.bf16_lens, self.hist_lens), self.plan.groups)
        return self._view

    def exact_counts(self) -> list[int]:
        """The host counts, read back from the device first when a masked decode step may have
        left them above it (one wait for the GPU)."""
        if self.counts_stale:
            self.counts = self.n.tolist()
            self.counts_stale = False
        return self.counts

    def history_span(self) -> int:
        """History slots that may hold a token (host bound over the batch; an upper bound). Every
        slot while ``full_span`` is set: a step recorded in a CUDA graph must read what later replays
        will have written (the masks, from the device counts, leave out the slots not yet filled)."""
        if self.full_span:
            return self.hist.cap
        return max(0, min(self.hist.cap, max(self.counts) - self.plan.sink))

    def exact_after_removing(self) -> bool:
        """Whether the last tokens can be dropped exactly: no stored token has left the window yet."""
        return max(self.exact_counts()) <= self.plan.sink + self.plan.recent

    def map_batch(self, fn, index: list[int]) -> None:
        """Apply ``fn`` to every per-sequence tensor (beam reorder, repeat, select); ``index``
        says which old sequence each new one comes from."""
        self.window.kv = fn(self.window.kv)
        self.hist.set_tensors([fn(t) for t in self.hist.tensors()])
        counts = self.exact_counts()
        self.n, self.bf16_lens, self.hist_lens = fn(self.n), fn(self.bf16_lens), fn(self.hist_lens)
        self.counts = [counts[i] for i in index]
        self.batch = len(index)
        self.ticket = torch.zeros(self.batch, dtype=torch.int32, device=self.n.device)
        self._view = None

    def nbytes(self) -> int:
        ts = (self.window.kv,) + self.hist.tensors()
        return sum(t.numel() * t.element_size() for t in ts)


def write_step(st: LayerStore, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None = None,
               gate: torch.Tensor | None = None, query: torch.Tensor | None = None) -> torch.Tensor | None:
    """One new token per sequence: ``k``/``v`` ``[B, H, 1, d]``; ``real`` and ``gate`` (device bool
    ``[B]``, None: all) say which rows store theirs, both must hold (the others write to the scratch
    slots and keep their count). One launch of :func:`~oscar_calib.kernels.append.append_token` on CUDA (slots from the
    device counts: no host sync, graph-safe while the history has room, :meth:`reserve`).
    ``query [B, Hq, d]``: also returned in the keys' basis (float32), rotated in the same launch."""
    p = st.plan
    if max(st.counts) + 1 - p.sink > st.hist.cap:
        st.reserve(max(st.counts) + 1)
    scale, offset = st.hist.kernel_params()
    qr = append_token(k[:, :, 0], v[:, :, 0], st.window.kv, st.hist.codes, scale, offset, st.n, sink=p.sink,
                      recent=p.recent, group_size=p.groups, rotation=p.rot2, clip=p.clip2, ring=st.hist.ring,
                      real=real, lens=(st.bf16_lens, st.hist_lens), ticket=st.ticket, gate=gate, query=query,
                      center=p.center2, backend=p.backend)
    if real is not None or gate is not None:
        st.counts_stale = True
    st.counts = [c + 1 for c in st.counts]
    return qr


def write_tokens(st: LayerStore, k: torch.Tensor, v: torch.Tensor, valid: list[torch.Tensor | None]) -> None:
    """New tokens ``k``/``v`` ``[B, H, T, d]``; ``valid[b]`` indexes the real ones of row ``b``
    (None: all ``T``). Only the tokens that end in the window are rotated into it; every token
    from the sink on is quantised into its history slot, :data:`WRITE_CHUNK` at a time."""
    p, s = st.plan, st.plan.sink
    longest = max(c + (k.shape[2] if sel is None else len(sel)) for c, sel in zip(st.exact_counts(), valid))
    if longest - s > st.hist.cap:                      # no reservation covers it: room for GROW_MIN more
        st.reserve(longest + GROW_MIN)
    counts = list(st.counts)
    for b, sel in enumerate(valid):
        rows = torch.stack([k[b], v[b]])                                               # [2, H, T, d]
        rows = (rows if sel is None else rows.index_select(2, sel)).to(p.window_dtype)
        n0, m = counts[b], rows.shape[2]
        t = torch.arange(n0, n0 + m, device=rows.device)
        pos = ((t < s) | (t >= n0 + m - p.recent)).nonzero().squeeze(1)
        rot = p.rotate(rows[:, :, pos].permute(2, 0, 1, 3)).permute(1, 2, 0, 3)        # [2, H, m', d]
        st.window.kv[b].index_copy_(2, st.window.slots(t[pos]), rot.to(p.window_dtype))
        for a in range(max(0, s - n0, m - st.hist.cap if st.hist.ring else 0), m, WRITE_CHUNK):
            part = rows[:, :, a:a + WRITE_CHUNK]
            q = p.quantize(part.permute(2, 0, 1, 3).reshape(part.shape[2], 2 * st.heads, st.d))
            st.hist.store(b, st.hist.slots(t[a:a + WRITE_CHUNK] - s), q, st.heads)
        counts[b] = n0 + m
    st.set_counts(counts)
