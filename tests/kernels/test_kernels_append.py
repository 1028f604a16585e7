"""The one-launch decode-step write (``kernels.append_token``) against its pure-torch reference:
slots, codes, parameters, counts and lengths, on random inputs (CPU interpreter in CI, the real
compiler on a GPU)."""

from __future__ import annotations

import pytest
import torch
from factories import grid

from oscar_calib.errors import InputError
from oscar_calib.kernels.append import (
    append_token,
    append_token_reference,
    decode_view,
    history_slot,
    window_slot,
)
from oscar_calib.kernels.testing import random_rotation


def signed_permutations(heads: int, d: int, g: torch.Generator) -> torch.Tensor:
    """Rotations whose products are exact in float32 (one signed entry per column)."""
    r = torch.zeros(heads, d, d)
    for i in range(heads):
        p = torch.randperm(d, generator=g)
        sign = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0)
        r[i, torch.arange(d), p] = sign
    return r


class Store:
    """A cache as :func:`append_token` writes it; ``g_size`` a pair ``(G_K, G_V)`` of different sizes
    keeps K and V parameters apart (``scale``/``offset`` are ``(K, V)`` pairs)."""

    def __init__(self, b, h, d, g_size, sink, recent, cap, dtype, device, counts):
        self.window = torch.zeros(b, 2, h, sink + recent + 1, d, dtype=dtype, device=device)
        self.codes = torch.zeros(b, 2, h, cap + 1, d // 4, dtype=torch.uint8, device=device)
        if isinstance(g_size, tuple) and g_size[0] != g_size[1]:
            self.scale = tuple(torch.zeros(b, h, cap + 1, d // g, dtype=torch.float16, device=device) for g in g_size)
            self.offset = tuple(torch.zeros_like(t) for t in self.scale)
        else:
            g = g_size[0] if isinstance(g_size, tuple) else g_size
            self.scale = torch.zeros(b, 2, h, cap + 1, d // g, dtype=torch.float16, device=device)
            self.offset = torch.zeros_like(self.scale)
        self.counts = torch.tensor(counts, device=device)
        self.lens = (torch.full((b,), -1, dtype=torch.int32, device=device),
                     torch.full((b,), -1, dtype=torch.int32, device=device))
        self.ticket = torch.zeros(b, dtype=torch.int32, device=device)

    def tensors(self):
        return self.window, self.codes, self.scale, self.offset, self.counts

    def all(self):
        flat = [t for x in self.tensors() for t in (x if isinstance(x, tuple) else (x,))]
        return tuple(flat) + self.lens


def run_steps(device, *, d=128, group_size=128, sink=3, recent=5, cap=24, ring=False, dtype=torch.bfloat16,
              rotation="perm", clip=True, real=None, steps=4, counts=(0, 4, 9), seed=0, heads=2, gate=None,
              center=False):
    g = torch.Generator().manual_seed(seed)
    b, h = len(counts), heads
    if rotation == "perm":
        rot = signed_permutations(2 * h, d, g)
    elif rotation == "random":
        rot = random_rotation(2 * h, d, generator=g)
    else:
        rot = None
    rot = None if rot is None else rot.float()
    clips = torch.rand(2 * h, generator=g).mul(0.2).add(0.8) if clip else None
    if clip:
        clips[0] = 1.0                                  # a head without clip beside clipped ones
    # key centering: a shift per K head (the mean key in the rotated basis), zeros for the V heads
    shift = torch.cat([torch.randn(h, d, generator=torch.Generator().manual_seed(seed + 1)) * 3,
                       torch.zeros(h, d)]) if center else None
    ref = Store(b, h, d, group_size, sink, recent, cap, dtype, "cpu", list(counts))   # torch on CUDA divides by 3
    tri = Store(b, h, d, group_size, sink, recent, cap, dtype, device, list(counts))  # as a product: CPU reference
    for step in range(steps):
        k = (torch.randn(b, h, 1, d, generator=g) * 2).to(torch.bfloat16)[:, :, 0]
        v = torch.randn(b, h, 1, d, generator=g).to(torch.bfloat16)[:, :, 0]
        if step == 1:
            k[0, 0, :] = 0.5                            # a constant row: every group degenerate
        kw = dict(sink=sink, recent=recent, group_size=group_size, rotation=rot, clip=clips, ring=ring,
                  real=None if real is None else torch.tensor(real), gate=None if gate is None else torch.tensor(gate),
                  center=shift)
        append_token_reference(k, v, *ref.tensors(), lens=ref.lens, **kw)
        kw = {a: x.to(device) if isinstance(x, torch.Tensor) else x for a, x in kw.items()}
        append_token(k.to(device), v.to(device), *tri.tensors(), lens=tri.lens, ticket=tri.ticket, backend="triton", **kw)
    tri.__dict__.update({a: (x.cpu() if isinstance(x, torch.Tensor) else tuple(t.cpu() for t in x))
                         for a, x in tri.__dict__.items()})
    return ref, tri


@pytest.mark.parametrize("group_size,d,dtype", grid([
    (128, 128, torch.bfloat16), (128, 128, torch.float16), (128, 128, torch.float32),
    (64, 128, torch.bfloat16), (32, 128, torch.bfloat16), (16, 64, torch.float16), (256, 256, torch.bfloat16),
    ((32, 128), 128, torch.bfloat16), ((32, 256), 256, torch.bfloat16), ((64, 16), 64, torch.float16)],
    # under the interpreter: each input dtype, groups of 16 to 256, one and two byte blocks, K and V apart
    [(128, 128, torch.float32), (16, 64, torch.float16), (256, 256, torch.bfloat16), ((64, 16), 64, torch.float16)]))
def test_append_token_equals_the_reference_bit_for_bit(device, group_size, d, dtype):
    """Exact rotations (signed permutations): every slot, code, parameter, count and length is the
    reference's, across the sink, the ring of the recent window and the history."""
    ref, tri = run_steps(device, d=d, group_size=group_size, dtype=dtype, steps=5)
    for a, b in zip(ref.all(), tri.all()):
        assert torch.equal(a, b)
    assert tri.counts.tolist() == [5, 9, 14] and tri.lens[1].tolist() == [0, 1, 6]
    assert tri.ticket.tolist() == [0, 0, 0]               # left zero for the next call
    assert tri.codes.any()


@pytest.mark.slow
def test_append_token_masked_rows_and_history_ring(device):
    """Rows whose token is not real write scratch slots only and keep their count; a ring history
    wraps (sliding layers)."""
    ref, tri = run_steps(device, real=[True, False, True], ring=True, cap=4, steps=6, counts=(0, 6, 30), heads=4)
    for a, b in zip(ref.all(), tri.all()):
        assert torch.equal(a, b)
    assert tri.counts.tolist() == [6, 6, 36]
    fresh = Store(3, 4, 128, 128, 3, 5, 4, torch.bfloat16, "cpu", [0, 6, 30])
    for got, untouched in zip(tri.tensors()[:4], fresh.tensors()[:4]):  # row 1: scratch slots only
        assert torch.equal(got[1, :, :, :-1], untouched[1, :, :, :-1])
        assert not torch.equal(got[1, :, :, -1], untouched[1, :, :, -1])


@pytest.mark.parametrize("real", grid([None, [True, True, False]], [[True, True, False]]))
def test_append_token_gate_is_a_second_condition(device, real):
    """``gate``: a row stores its token only when it is real and its gate is set."""
    ref, tri = run_steps(device, real=real, gate=[False, True, True], steps=3)
    for a, b in zip(ref.all(), tri.all()):
        assert torch.equal(a, b)
    assert tri.counts.tolist() == [0, 7, 12 if real is None else 9]


@pytest.mark.slow
def test_append_token_random_rotation_agrees_up_to_rounding_ties(device):
    """Random rotations (float32 sums in another order): the window within one 16-bit rounding step
    of the reference, codes equal but at rounding ties (a code that differs moves by one level, its parameters agree to 1e-3)."""
    ref, tri = run_steps(device, rotation="random", steps=8, heads=4, counts=(0, 30, 100), cap=128)
    w_ref, w_tri = ref.window.float(), tri.window.float()
    ulp = w_ref.abs() * 2.0 ** -7                      # a bf16 step; 1e-5: cancellation near zero
    assert ((w_ref - w_tri).abs() <= ulp + 1e-5).all() and (w_ref != w_tri).float().mean() < 1e-2
    from oscar_calib.kernels import unpack_codes

    cr, ct = unpack_codes(ref.codes, 128), unpack_codes(tri.codes, 128)
    assert (cr.int() - ct.int()).abs().max() <= 1 and (cr != ct).float().mean() < 1e-3
    assert torch.allclose(ref.scale.float(), tri.scale.float(), rtol=1e-3, atol=1e-6)
    assert torch.equal(ref.counts, tri.counts) and all(torch.equal(a, b) for a, b in zip(ref.lens, tri.lens))


def test_append_token_without_rotation_or_clip(device):
    ref, tri = run_steps(device, rotation=None, clip=False, steps=3)
    for a, b in zip(ref.all(), tri.all()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rotation,group_size", grid([("perm", 128), ("perm", (32, 128)), (None, 64)],
                                                     [("perm", (32, 128)), (None, 64)]))
def test_append_token_centers_the_keys_in_the_window_and_the_history(device, rotation, group_size):
    """Key centering: every K row is stored as ``x @ R − c`` in the window and in the history (the same
    shift), the V rows as they were; bit for bit the reference's."""
    ref, tri = run_steps(device, rotation=rotation, group_size=group_size, center=True, steps=5)
    for a, b in zip(ref.all(), tri.all()):
        assert torch.equal(a, b)
    plain, _ = run_steps(device, rotation=rotation, group_size=group_size, steps=5)  # the reference runs on the CPU
    assert not torch.equal(plain.window[:, 0], ref.window[:, 0])       # the keys moved ...
    assert torch.equal(plain.window[:, 1], ref.window[:, 1])           # ... the values did not
    assert not torch.equal(plain.codes[:, 0], ref.codes[:, 0])


def test_slot_rules():
    t = torch.arange(12)
    assert window_slot(t, 3, 4).tolist() == [0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 6, 3]
    assert window_slot(t, 3, 0).tolist() == [0, 1, 2] + [3] * 9           # no recent window: scratch
    assert history_slot(t - 3, 100, False).tolist() == [100, 100, 100] + list(range(9))
    assert history_slot(t - 3, 4, True).tolist() == [4, 4, 4, 0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert history_slot(t - 3, 6, False).tolist() == [6, 6, 6, 0, 1, 2, 3, 4, 5, 6, 6, 6]  # full: scratch


def test_append_token_past_a_full_history_writes_nothing_out_of_bounds(device):
    """Counts beyond the history's capacity (no reservation) land in the scratch slot, in the kernel
    as in the reference, and the slots before it keep their tokens."""
    ref, tri = run_steps(device, cap=6, counts=(8, 9, 40), steps=3)
    for a, b in zip(ref.all(), tri.all()):
        assert torch.equal(a, b)
    assert tri.codes[0, :, :, 5].any() and tri.codes[2, :, :, :6].eq(0).all()     # row 2: only scratch
    assert tri.codes[2, :, :, 6].any()


def test_append_token_refuses_bad_input(device):
    st = Store(2, 2, 128, 128, 3, 5, 8, torch.bfloat16, device, [0, 0])
    k = torch.zeros(2, 2, 128, dtype=torch.bfloat16, device=device)
    kw = dict(sink=3, recent=5, group_size=128)
    with pytest.raises(InputError, match="k and v"):
        append_token(k, k[:, :1], *st.tensors(), **kw)
    with pytest.raises(InputError, match="window"):
        append_token(k, k, *st.tensors(), sink=4, recent=5, group_size=128)
    with pytest.raises(InputError, match="scale"):
        append_token(k, k, st.window, st.codes, st.scale[..., :0], st.offset, st.counts, **kw)
    with pytest.raises(InputError, match="counts"):
        append_token(k, k, *st.tensors()[:4], st.counts.int(), **kw)
    with pytest.raises(InputError, match="rotation"):
        append_token(k, k, *st.tensors(), rotation=torch.zeros(2, 128, 128, device=device), **kw)
    with pytest.raises(InputError, match="real"):
        append_token(k, k, *st.tensors(), real=torch.ones(2, device=device), **kw)
    with pytest.raises(InputError, match="not a multiple"):
        append_token(k, k, *st.tensors(), query=torch.zeros(2, 3, 128, device=device), **kw)


@pytest.mark.parametrize("qg,d,kb", grid([(4, 128, None), (3, 64, None), (1, 128, 32), (8, 256, None)],
                                          [(3, 64, None), (1, 128, 32)]))
def test_append_token_rotates_the_query_with_the_keys_rotation(device, qg, d, kb):
    """``query=``: the K programs return ``q @ R_k`` per KV head (float32, the decode kernel's
    query) from the ``R`` they hold; the cache writes are unchanged by it. A strided query view
    (the model's ``[B, Hq, 1, d]`` slice) and head counts that are not powers of two."""
    g = torch.Generator().manual_seed(7)
    b, h = 3, 2
    rot = random_rotation(2 * h, d, generator=g).float().to(device)
    clip = torch.full((2 * h,), 0.9, device=device)
    k = torch.randn(b, h, d, generator=g).to(torch.bfloat16).to(device)
    v = torch.randn(b, h, d, generator=g).to(torch.bfloat16).to(device)
    q = torch.randn(b, h * qg, 2, d, generator=g).to(torch.bfloat16).to(device)[:, :, 1]   # strided
    kw = dict(sink=3, recent=5, group_size=min(d, 128), rotation=rot, clip=clip,
              config=None if kb is None else {"KB": kb}, backend="triton")
    with_q = Store(b, h, d, min(d, 128), 3, 5, 8, torch.bfloat16, device, [0, 6, 20])
    without = Store(b, h, d, min(d, 128), 3, 5, 8, torch.bfloat16, device, [0, 6, 20])
    qr = append_token(k, v, *with_q.tensors(), lens=with_q.lens, query=q, **kw)
    assert append_token(k, v, *without.tensors(), lens=without.lens, **kw) is None
    for a, c in zip(with_q.all(), without.all()):
        assert torch.equal(a, c)
    want = torch.einsum("bhgd,hde->bhge", q.float().cpu().view(b, h, qg, d), rot[:h].cpu()).reshape(b, h * qg, d)
    assert qr.dtype == torch.float32 and qr.shape == (b, h * qg, d)
    assert torch.allclose(qr.cpu(), want, rtol=1e-5, atol=1e-5)
    ref_kw = {a: x for a, x in kw.items() if a not in ("config", "backend", "rotation", "clip")}
    ref = append_token_reference(k.cpu(), v.cpu(), *Store(b, h, d, min(d, 128), 3, 5, 8, torch.bfloat16, "cpu",
                                                          [0, 6, 20]).tensors(),
                                 rotation=rot.cpu(), clip=clip.cpu(), query=q.cpu(), **ref_kw)
    assert torch.allclose(ref, want, rtol=1e-5, atol=1e-5)
    kw.pop("rotation")
    assert append_token(k, v, *without.tensors(), query=q, **kw) is q          # no rotation: the query as is


def test_decode_after_append_reads_the_new_lengths(device):
    """A decode step as the runtime runs it: ``append_token(query=)`` then ``decode_attention(qr,
    k_rotation=None, pdl_input=True)``, the decode kernel launched while the write ends (on a
    Hopper GPU). The token that leaves the window this step joins the history: the decode must read
    the lengths the write left (equal to the reference over the cache after the write), for rows in
    the sink, at the window's edge and well past it."""
    from oscar_calib.kernels import decode_attention, decode_attention_reference

    g = torch.Generator().manual_seed(3)
    b, h, qg, d, sink, recent, cap = 3, 2, 4, 128, 4, 8, 160
    counts = [2, sink + recent, 150]
    rot = random_rotation(2 * h, d, generator=g).float().to(device)
    st = Store(b, h, d, 128, sink, recent, cap, torch.bfloat16, device, counts)
    for i in range(max(counts)):                      # fill the cache token by token, up to each row's count
        k = torch.randn(b, h, d, generator=g).to(torch.bfloat16).to(device)
        real = torch.tensor([i < c for c in counts], device=device)
        append_token(k, k * 0.5, *st.tensors(), sink=sink, recent=recent, group_size=128, rotation=rot,
                     real=real, lens=st.lens, ticket=st.ticket)
        st.counts.copy_(torch.tensor([min(i + 1, c) for c in counts]))
    view = decode_view(st.window, st.codes, st.scale, st.offset, st.lens, 128)
    for step in range(3):
        k = torch.randn(b, h, d, generator=g).to(torch.bfloat16).to(device)
        q = torch.randn(b, h * qg, d, generator=g).to(torch.bfloat16).to(device)
        qr = append_token(k, -k, *st.tensors(), sink=sink, recent=recent, group_size=128, rotation=rot,
                          lens=st.lens, ticket=st.ticket, query=q)
        got = decode_attention(qr, view, k_rotation=None, pdl_input=True, check_lengths=False,
                               out_dtype=torch.float32)
        want = decode_attention_reference(q.float(), view, k_rotation=rot[:h], out_dtype=torch.float32)
        assert torch.allclose(got, want, rtol=2e-3, atol=2e-3), (got - want).abs().max()
    assert st.lens[1].tolist() == [0, 3, 141]
