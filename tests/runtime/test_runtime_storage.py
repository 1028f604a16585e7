"""Storage of the real cache: what each slot holds, growth without per-step copies, sliding rings,
and the chunked torch attention against the kernels' decode reference (and the Triton kernel)."""

from __future__ import annotations

import pytest
import torch

from oscar_calib.kernels import (
    decode_attention,
    decode_attention_reference,
    quantize_kv,
)
from oscar_calib.kernels.testing import random_rotation
from oscar_calib.runtime import attend
from oscar_calib.runtime.attend import attend_cached
from oscar_calib.runtime.plan import LayerPlan
from oscar_calib.runtime.scheme import SchemeLayer
from oscar_calib.runtime.storage import GROW_MIN, LayerStore, write_step, write_tokens

H, G, D = 2, 2, 64


def make_store(batch=2, sink=2, recent=3, window=None, reserve=0, seed=0, group_size=32, device="cpu",
               v_group_size=None, backend="torch", k_mean=None):
    g = torch.Generator().manual_seed(seed)
    rk, rv = random_rotation(H, D, generator=g), random_rotation(H, D, generator=g)
    layer = SchemeLayer(rk, torch.full((H,), 0.95), rv, torch.full((H,), 0.9),
                        groups=(group_size, v_group_size or group_size), sink=sink, recent=recent,
                        k_mean=k_mean)
    plan = LayerPlan.build(layer, heads=H, d=D, device=device, dtype=torch.float32, sliding_window=window,
                           backend=backend)
    return LayerStore(plan, batch, H, D, device, reserve=reserve), g


@pytest.mark.parametrize("gv", [32, 64, 16])
def test_slots_hold_rotated_window_and_prewritten_int2(gv):
    """Keys in groups of 32, values in groups of ``gv`` (apart when they differ)."""
    st, g = make_store(batch=1, sink=2, recent=3, v_group_size=gv)
    assert st.hist.split == (gv != 32)
    k, v = torch.randn(1, H, 9, D, generator=g), torch.randn(1, H, 9, D, generator=g)
    write_tokens(st, k[:, :, :6], v[:, :, :6], [None])
    for t in range(6, 9):
        write_step(st, k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert st.counts == [9] and st.bf16_lens.tolist() == [5] and st.hist_lens.tolist() == [4]
    kb = k.to(torch.bfloat16)
    rk = st.plan.k_rotation
    want_win = {0: 0, 1: 1, 2: 8, 3: 6, 4: 7}          # slot -> token: sink 0, 1; ring slot 2 + (t - 2) % 3
    for slot, tok in want_win.items():
        rot = torch.einsum("hd,hde->he", kb[0, :, tok].float(), rk).to(torch.bfloat16)
        assert torch.equal(st.window.kv[0, 0, :, slot], rot), slot
    q = quantize_kv(kb[0].transpose(0, 1), rk, st.plan.clip2[:H], 32)                 # [T, H, d/4]
    vb = v.to(torch.bfloat16)
    qv = quantize_kv(vb[0].transpose(0, 1), st.plan.v_rotation, st.plan.clip2[H:], gv)
    (ks, vs), (ko, vo) = (pair if isinstance(pair, tuple) else (pair[:, 0], pair[:, 1])
                          for pair in st.hist.kernel_params())
    assert vs.shape[-1] == D // gv and ks.shape[-1] == D // 32
    for tok in range(2, 9):                             # every token >= sink has its INT2 row at tok - sink
        assert torch.equal(st.hist.codes[0, 0, :, tok - 2], q.codes[tok]), tok
        assert torch.equal(ks[0, :, tok - 2], q.scale[tok]) and torch.equal(ko[0, :, tok - 2], q.offset[tok])
        assert torch.equal(st.hist.codes[0, 1, :, tok - 2], qv.codes[tok]), tok
        assert torch.equal(vs[0, :, tok - 2], qv.scale[tok]) and torch.equal(vo[0, :, tok - 2], qv.offset[tok])
    deq = st.hist.dequantize(0, 7)[0]                   # [2, H, 7, d], rotated basis
    assert torch.equal(deq[0], q.dequantize()[2:9].transpose(0, 1))
    assert torch.equal(deq[1], qv.dequantize()[2:9].transpose(0, 1))
    assert torch.equal(st.window.slot_tokens(st.n)[0], torch.tensor([0, 1, 8, 6, 7]))


def test_history_grows_in_chunks_and_reserve_avoids_copies():
    st, g = make_store(batch=1, sink=2, recent=3)
    write_tokens(st, torch.randn(1, H, 20, D, generator=g), torch.randn(1, H, 20, D, generator=g), [None])
    cap0, ptr0 = st.hist.cap, st.hist.codes.data_ptr()
    assert cap0 >= 20 - 2                               # the prompt (plus the rounding to 256 slots)
    first_row = st.hist.codes[0, :, :, 0].clone()
    moved = 0
    for _ in range(cap0 - 18):
        write_step(st, torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g))
        moved += st.hist.codes.data_ptr() != ptr0
        ptr0 = st.hist.codes.data_ptr()
    assert moved == 0 and st.hist.cap == cap0           # no copy while there is room
    write_step(st, torch.randn(1, H, 1, D, generator=g), torch.randn(1, H, 1, D, generator=g))
    assert st.hist.cap >= cap0 + GROW_MIN                # one growth step, by a chunk
    assert torch.equal(st.hist.codes[0, :, :, 0], first_row)
    big, _ = make_store(batch=1, reserve=5000)
    assert big.hist.cap >= 5000 - 2


@pytest.mark.parametrize("gv", [32, 64])
def test_nothing_but_window_and_history_is_stored(gv):
    st, g = make_store(batch=3, sink=4, recent=8, v_group_size=gv)
    write_tokens(st, torch.randn(3, H, 300, D, generator=g), torch.randn(3, H, 300, D, generator=g), [None] * 3)
    window = 3 * 2 * H * (4 + 8 + 1) * D * 2
    hist_slot = 2 * H * D // 4 + H * 2 * 2 * (D // 32 + D // gv)        # codes, K and V scale + offset
    assert st.nbytes() == window + 3 * (st.hist.cap + 1) * hist_slot


def test_sliding_layer_keeps_a_ring_of_the_window():
    st, g = make_store(batch=1, sink=2, recent=3, window=8)
    k, v = torch.randn(1, H, 30, D, generator=g), torch.randn(1, H, 30, D, generator=g)
    write_tokens(st, k[:, :, :20], v[:, :, :20], [None])
    for t in range(20, 30):
        write_step(st, k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert st.hist.cap == 8                             # never grows
    toks = st.hist.slot_tokens(st.n, 2, 0, 8)[0]
    assert sorted(toks.tolist()) == list(range(22, 30))  # the last W tokens, each in slot (t - S) % W
    assert all(int(t) - 2 == s + 8 * ((int(t) - 2) // 8) for s, t in enumerate(toks))


def test_left_padding_stores_only_real_tokens():
    st, g = make_store(batch=2, sink=2, recent=3)
    k, v = torch.randn(2, H, 7, D, generator=g), torch.randn(2, H, 7, D, generator=g)
    write_tokens(st, k, v, [None, torch.arange(3, 7)])
    assert st.counts == [7, 4]
    assert torch.equal(st.window.kv[1, 0, :, 0],
                       torch.einsum("hd,hde->he", k[1, :, 3].to(torch.bfloat16).float(),
                                    st.plan.k_rotation).to(torch.bfloat16))


def _decode_inputs(batch=2, steps=12, sink=2, recent=3, seed=0, device="cpu", gv=None, backend="torch"):
    st, g = make_store(batch=batch, sink=sink, recent=recent, seed=seed, device=device, v_group_size=gv,
                       backend=backend)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device)

    write_tokens(st, rnd(batch, H, 10, D), rnd(batch, H, 10, D), [None, torch.arange(4, 10, device=device)][:batch])
    for _ in range(steps):
        write_step(st, rnd(batch, H, 1, D), rnd(batch, H, 1, D))
    return st, rnd(batch, H * G, D)


@pytest.mark.parametrize("gv", [None, 64])
def test_chunked_torch_path_equals_decode_reference(monkeypatch, gv):
    st, q = _decode_inputs(gv=gv)
    p = st.plan
    ref = decode_attention_reference(q, st.kernel_view(), k_rotation=p.k_rotation, v_rotation=p.v_rotation,
                                     unrotate=True)
    calls = []
    real = st.hist.dequantize

    def spy(start, length):
        calls.append(length)
        return real(start, length)

    monkeypatch.setattr(st.hist, "dequantize", spy)
    monkeypatch.setattr(attend, "CHUNK_ELEMENTS", 2 * H * G * 4)        # 4 history tokens per block
    monkeypatch.setattr(attend, "MIN_CHUNK", 1)
    got = attend_cached(st, q.unsqueeze(2), None, None, None, st.n.unsqueeze(1) - 1, st.n, D ** -0.5, None)[:, 0]
    assert (got - ref).abs().max() < 1e-5
    assert len(calls) > 2 and max(calls) <= 4                                       # chunks, never all at once
    # only the slots read as INT2 are de-quantised, not those whose tokens are still in the window
    assert sum(calls) == max(st.counts) - p.recent - p.sink < st.history_span()


@pytest.mark.parametrize("gv", [None, 64])
def test_triton_decode_kernel_reads_the_store(gv):
    """The decode kernel (CPU interpreter here, the real compiler on a GPU) on the store's views;
    values in groups of 64 beside keys in groups of 32 too."""
    st, q = _decode_inputs(steps=4, device="cuda" if torch.cuda.is_available() else "cpu", gv=gv)
    p = st.plan
    ref = decode_attention_reference(q, st.kernel_view(), k_rotation=p.k_rotation, v_rotation=p.v_rotation,
                                     unrotate=True)
    got = decode_attention(q, st.kernel_view(), k_rotation=p.k_rotation, v_rotation=p.v_rotation, unrotate=True,
                           backend="triton")
    rel = (got - ref).norm() / ref.norm()
    assert rel < 2e-3                                   # the kernel's stated accuracy (tests/kernels)


def test_masked_decode_step_writes_only_real_rows_and_counts_come_back():
    st, g = make_store(batch=3, sink=2, recent=3)
    k, v = torch.randn(3, H, 12, D, generator=g), torch.randn(3, H, 12, D, generator=g)
    write_tokens(st, k[:, :, :8], v[:, :, :8], [None] * 3)
    ref, _ = make_store(batch=3, sink=2, recent=3)
    write_tokens(ref, k[:, :, :8], v[:, :, :8], [None] * 3)
    real = torch.tensor([True, False, True])
    for t in range(8, 12):
        write_step(st, k[:, :, t:t + 1], v[:, :, t:t + 1], real)
        write_step(ref, k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert st.counts == [12, 12, 12] and st.counts_stale        # an upper bound, no wait for the device
    assert st.n.tolist() == [12, 8, 12] and st.hist_lens.tolist() == [7, 3, 7]
    assert st.exact_counts() == [12, 8, 12] and not st.counts_stale
    scratch_w, scratch_h = st.window.scratch, st.hist.cap
    for b in (0, 2):                                              # real rows: as if written without a mask
        assert torch.equal(st.window.kv[b, :, :, :scratch_w], ref.window.kv[b, :, :, :scratch_w])
        assert torch.equal(st.hist.codes[b, :, :, :10], ref.hist.codes[b, :, :, :10])
    fresh, _ = make_store(batch=3, sink=2, recent=3)
    write_tokens(fresh, k[:, :, :8], v[:, :, :8], [None] * 3)      # row 1: untouched but for scratch slots
    assert torch.equal(st.window.kv[1, :, :, :scratch_w], fresh.window.kv[1, :, :, :scratch_w])
    assert torch.equal(st.hist.codes[1, :, :, :scratch_h], fresh.hist.codes[1, :, :, :scratch_h])
    write_tokens(st, k[:, :, :2], v[:, :, :2], [None] * 3)         # a later write starts from the exact counts
    assert st.counts == [14, 10, 14] and st.n.tolist() == [14, 10, 14]


def test_decode_rows_reads_the_new_tokens_own_entry_without_a_host_copy():
    from oscar_calib.runtime.attention import decode_rows

    assert decode_rows(None, 3) is None
    m = torch.tensor([True, False]).view(2, 1, 1, 1)
    assert decode_rows(m, 2).tolist() == [True, False]
    f = torch.zeros(2, 1, 1, 1)
    f[1] = torch.finfo(f.dtype).min
    assert decode_rows(f, 2).tolist() == [True, False]
    assert decode_rows(torch.ones(1, 1, 1, 1, dtype=torch.bool), 3).tolist() == [True] * 3


def test_triton_writes_fill_a_split_store_as_the_torch_writes_do():
    """Keys in groups of 32, values in groups of 64, written by the Triton kernels (the append
    kernel per step, the write kernel for the prompt; CPU interpreter here) and by their torch
    references: the same slots, codes equal but at rounding ties (random rotations)."""
    from oscar_calib.kernels.testing import code_agreement

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tri, q = _decode_inputs(batch=2, steps=3, device=dev, gv=64, backend="triton")
    ref, _ = _decode_inputs(batch=2, steps=3, device=dev, gv=64)
    assert tri.counts == ref.counts and torch.equal(tri.hist_lens, ref.hist_lens)
    n = tri.history_span()
    from oscar_calib.kernels import QuantizedKV

    for kv, g in ((0, 32), (1, 64)):
        a, b = (QuantizedKV(st.hist.codes[:, kv, :, :n], st.hist.params[2 * kv][:, 0, :, :n],
                            st.hist.params[2 * kv + 1][:, 0, :, :n], g) for st in (tri, ref))
        worst, frac = code_agreement(a, b)
        assert worst <= 1 and frac < 1e-2
    torch.testing.assert_close(tri.window.kv.float(), ref.window.kv.float(), rtol=1e-2, atol=1e-2)


def test_a_scheme_layer_carries_everything_its_plan_is_built_from():
    """``KVScheme.layer(i)`` is one object: layer ``i``'s rotations, its K and V group sizes, the
    windows, the window dtype (None: the model's) and the correction reach the plan unchanged."""
    from oscar_calib.errors import InputError
    from oscar_calib.runtime.scheme import KVScheme

    g = torch.Generator().manual_seed(3)
    rots = [random_rotation(H, D, generator=g) for _ in range(2)]
    sch = KVScheme("x", 2, 32, k_rotation=rots, k_groups=[32, 16], v_groups=[64, 16], sink=2, recent=5,
                   logit_correction=0.5)
    for i, (gk, gv) in enumerate([(32, 64), (16, 16)]):
        layer = sch.layer(i)
        assert layer.k_rotation is rots[i] and layer.v_rotation is None
        plan = LayerPlan.build(layer, heads=H, d=D, device="cpu", dtype=torch.float16)
        assert (plan.groups, plan.sink, plan.recent, plan.logit_correction) == ((gk, gv), 2, 5, 0.5)
        assert plan.window_dtype == torch.bfloat16 and torch.equal(plan.rot2[:H], rots[i])
    lossless = KVScheme("y", 2, 32, window_dtype=None).layer(0)
    assert LayerPlan.build(lossless, heads=H, d=D, device="cpu", dtype=torch.float16).window_dtype == torch.float16
    with pytest.raises(InputError, match="quantises nothing"):
        LayerPlan.build(KVScheme.full_precision(2).layer(0), heads=H, d=D, device="cpu", dtype=torch.float16)
