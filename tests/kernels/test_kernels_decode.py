"""Decode attention kernel against its pure-torch reference, and the reference against plain
attention over quant.py's fake-quantised keys and values."""

import math

import pytest
import torch
from factories import grid

from oscar_calib.errors import InputError
from oscar_calib.kernels import (
    build_cache,
    decode_attention,
    decode_attention_reference,
    split_lengths,
    to_paged,
)
from oscar_calib.kernels import decode as decode_mod
from oscar_calib.kernels.testing import (
    kv_rows,
    poison_cache,
    random_rotation,
    relative_error,
)
from oscar_calib.numerics import quant

SMALL = {"BLOCK_N": 16, "BLOCK16": 16}
# (code mode, KV heads per program) variants of the INT2 kernel (see _decode_triton); the
# inline-PTX mode 1 exists only on the GPU. Under the interpreter: 4 heads per program over 2 KV
# heads (slots past the end); 1 head runs in the library-tuning test (every regime's default), 2 in
# the prefetch test.
DECODE_VARIANTS = grid([(0, 1), (0, 2), (0, 4), (1, 1), (1, 2), (1, 4)], [(0, 4)])


def _window_fake(x, r):
    """Window tokens as the cache holds them (rotated, bf16), mapped back to the unrotated basis."""
    rot = torch.einsum("thd,hde->the", x.float(), r).bfloat16().float()
    return torch.einsum("the,hde->thd", rot, r)


def _case(*, batch, tokens, heads, qg, d, g, gv=None, lengths=None, sink=4, recent=8, page=None,
          window_dtype=torch.bfloat16, q_dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    k = kv_rows((batch, tokens, heads, d), torch.bfloat16, generator=gen)
    v = kv_rows((batch, tokens, heads, d), torch.bfloat16, generator=gen, outliers=False)
    q = kv_rows((batch, heads * qg, d), torch.float32, generator=gen).to(q_dtype)
    rk = random_rotation(heads, d, generator=gen)
    rv = random_rotation(heads, d, generator=gen)
    cache = build_cache(
        k, v, lengths=lengths, k_rotation=rk, v_rotation=rv,
        k_clip=torch.tensor([0.96, 0.9, 0.97, 0.93][:heads]), v_clip=0.92, group_size=g, v_group_size=gv,
        sink=sink, recent=recent, window_dtype=window_dtype, page_size=page,
        generator=torch.Generator().manual_seed(seed + 1) if page else None, backend="torch",
    )
    poison_cache(cache, generator=gen)
    to = dict(device=device)
    for name in ("k_codes", "k_scale", "k_offset", "v_codes", "v_scale", "v_offset", "hist_lens",
                 "k_bf16", "v_bf16", "bf16_lens", "block_table"):
        t = getattr(cache, name)
        if t is not None:
            setattr(cache, name, t.to(**to))
    return q.to(device), cache, rk.to(device), rv.to(device), (k, v)


def _run(q, cache, rk, rv, *, unrotate=False, config=SMALL, tol=None):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    res = decode_attention(q, cache, k_rotation=rk, v_rotation=rv, unrotate=unrotate,
                           backend="triton", out=out, config=config)
    assert res is out
    ref = decode_attention_reference(q, cache, k_rotation=rk, v_rotation=rv, unrotate=unrotate,
                                     out_dtype=torch.float32)
    assert torch.isfinite(ref).all()
    assert torch.isfinite(res.float()).all(), "unwritten output or a read of a poisoned slot"
    err = relative_error(res.float(), ref)
    if tol is None:
        tol = 2e-3 if q.dtype == torch.float32 else 8e-3
    assert err < tol, err
    return res, ref


CASES = {
    # name: case kwargs (lengths not multiples of the 16-token tiles; some sequences all-16-bit)
    "d64_mixed_lengths": dict(batch=3, tokens=61, heads=2, qg=4, d=64, g=32, lengths=[61, 10, 12]),
    "d128_one_kv_head": dict(batch=2, tokens=45, heads=1, qg=8, d=128, g=128, lengths=[45, 29]),
    "d256_g64": dict(batch=1, tokens=40, heads=2, qg=2, d=256, g=64),
    "d256_g32_two_blocks": dict(batch=2, tokens=40, heads=1, qg=4, d=256, g=32, lengths=[40, 23]),
    "paged_page8_shuffled": dict(batch=3, tokens=56, heads=2, qg=2, d=128, g=32, lengths=[56, 33, 9], page=8),
    "paged_page32": dict(batch=2, tokens=90, heads=1, qg=4, d=64, g=64, lengths=[90, 41], page=32),
    "history_zero": dict(batch=2, tokens=12, heads=2, qg=2, d=64, g=64, lengths=[12, 7]),
    "int2_only": dict(batch=2, tokens=37, heads=2, qg=4, d=128, g=64, sink=0, recent=0, lengths=[37, 20]),
    # SmolLM2-like: 3 KV heads (two per program: one program has a missing head), 3 query heads each
    "d64_three_heads_qg3": dict(batch=2, tokens=50, heads=3, qg=3, d=64, g=64, lengths=[50, 41]),
    # keys and values in groups of different sizes (the value loop takes its own groups, plane
    # width and parameter strides): K 32 / V 128 (one byte block each), Gemma-like d = 256 with
    # K 32 (two byte blocks) / V 256 (one), the reverse, and a paged split cache
    "split_d128_k32_v128": dict(batch=2, tokens=45, heads=2, qg=4, d=128, g=32, gv=128, lengths=[45, 30]),
    # (histories of several 16-token steps, so the running maximum moves and every accumulator of
    # the value loop is rescaled)
    "split_d256_k32_v256": dict(batch=1, tokens=90, heads=1, qg=4, d=256, g=32, gv=256),
    "split_d256_k256_v32": dict(batch=1, tokens=90, heads=1, qg=4, d=256, g=256, gv=32),
    "split_paged_d64_k32_v64": dict(batch=2, tokens=56, heads=3, qg=3, d=64, g=32, gv=64, lengths=[56, 33],
                                    page=8),
}


# under the interpreter: one case per regime (the two left out have their own tests below: two
# byte blocks with G = 32, and pages of 32 tokens)
@pytest.mark.parametrize("name", grid(CASES, ["d64_mixed_lengths", "d128_one_kv_head", "d256_g64",
                                              "paged_page8_shuffled", "history_zero", "int2_only",
                                              "d64_three_heads_qg3"]))
def test_decode_matches_reference(name, device):
    q, cache, rk, rv, _ = _case(**CASES[name], seed=len(name), device=device)
    _run(q, cache, rk, rv)


@pytest.mark.parametrize("name", ["split_d256_k32_v256", "split_d256_k256_v32"])
def test_decode_split_groups_over_several_steps_per_program(name, device):
    """Programs of several 16-token steps (one 64-token chunk each), so that running maxima move
    inside a program and the value loop's accumulators of both byte blocks are rescaled."""
    q, cache, rk, rv, _ = _case(**CASES[name], seed=5, device=device)
    _run(q, cache, rk, rv, config={**SMALL, "split_tokens": 64})


@pytest.mark.parametrize("mode,hp", DECODE_VARIANTS)
def test_decode_kernel_variants(mode, hp, device):
    # (hp=4 with 2 KV heads: two head slots of the program are past the end)
    q, cache, rk, rv, _ = _case(batch=2, tokens=44, heads=2, qg=4, d=128, g=64, lengths=[44, 31],
                                seed=mode + 3 * hp, device=device)
    _run(q, cache, rk, rv, config={**SMALL, "mode": mode, "heads_per_program": hp})


@pytest.mark.parametrize("hp,page", grid([(1, None), (2, None), (1, 16), (2, 16)], [(2, 16)]))
def test_decode_prefetch_register_cap_pdl(hp, page, device):
    # software prefetch of the next step's offsets and parameters (paged: the block-table
    # entries too), a register cap and programmatic dependent launch (the last two act on the
    # GPU only); lengths leave partial last steps and one empty split
    q, cache, rk, rv, _ = _case(batch=3, tokens=150, heads=2, qg=4, d=128, g=128, lengths=[150, 97, 40],
                                page=page, seed=40 + hp, device=device)
    cfg = {**SMALL, "prefetch": True, "maxnreg": 128, "pdl": True, "heads_per_program": hp, "split_tokens": 48}
    _run(q, cache, rk, rv, config=cfg)
    _run(q, cache, rk, rv, unrotate=True, config=cfg)
    # without a query rotation the decode kernel is launched without PDL
    qr = decode_mod.rotate_query(q, rk, 2)
    a = decode_attention(qr, cache, backend="triton", config=cfg)
    b = decode_attention_reference(qr, cache, out_dtype=torch.float32)
    assert relative_error(a.float(), b) < 2e-3


@pytest.mark.parametrize("hp", grid([2, 4], [4]))
def test_decode_heads_per_program_with_missing_heads(hp, device):
    # 3 KV heads: the last program's head slots past the end are computed on a clamped head
    # and never stored; paged layout for the per-token page lookups
    q, cache, rk, rv, _ = _case(batch=2, tokens=48, heads=3, qg=3, d=64, g=32, lengths=[48, 37],
                                page=16, seed=30 + hp, device=device)
    _run(q, cache, rk, rv, config={**SMALL, "heads_per_program": hp})


@pytest.mark.parametrize("pairs,d,page", grid([(True, 128, None), (False, 128, None), (True, 256, 16),
                                                (False, 256, 16)], [(True, 128, None), (False, 256, 16)]))
def test_decode_value_codes_as_pairs_or_words(pairs, d, page, device):
    # value codes loaded as 16-bit pairs (default) or 32-bit words: the same attention, with two
    # byte blocks per row (d=256), paged, and partial last steps
    q, cache, rk, rv, _ = _case(batch=2, tokens=80, heads=2, qg=4, d=d, g=64, lengths=[80, 53], page=page,
                                seed=50 + d + bool(page), device=device)
    _run(q, cache, rk, rv, config={**SMALL, "value_pairs": pairs, "BLOCK_N": 32})


@pytest.mark.parametrize("page,block_n,off32", grid([(16, 16, True), (16, 16, False), (8, 16, True), (32, 16, False)],
                                                   [(8, 16, True), (32, 16, False)]))
def test_decode_paged_step_entries_and_offsets(page, block_n, off32, device):
    # a step inside one page takes one block-table entry (page % BLOCK_N == 0), otherwise one per
    # token; offsets 32- or 64-bit; prefetched steps, a partial last step and an empty split
    q, cache, rk, rv, _ = _case(batch=2, tokens=120, heads=2, qg=4, d=128, g=128, lengths=[120, 45], page=page,
                                seed=70 + page + off32, device=device)
    assert decode_mod._offsets32(cache, {"offsets32": off32}) == off32
    _run(q, cache, rk, rv, config={**SMALL, "BLOCK_N": block_n, "prefetch": True, "offsets32": off32,
                                   "split_tokens": 48})


def test_decode_two_blocks_odd_group(device):
    # two byte blocks (d=256, G=32: eight groups) and 3 query heads per KV head
    q, cache, rk, rv, _ = _case(batch=2, tokens=44, heads=1, qg=3, d=256, g=32, lengths=[44, 27],
                                seed=21, device=device)
    _run(q, cache, rk, rv, config={**SMALL, "BLOCK_N": 32})


def test_decode_many_splits_mha_and_default_tiles(device):
    # QG = 1 (plain multi-head attention), 16-token splits: many partials, several empty
    q, cache, rk, rv, _ = _case(batch=2, tokens=72, heads=2, qg=1, d=64, g=32, lengths=[72, 25],
                                seed=4, device=device)
    one, _ = _run(q, cache, rk, rv, config={**SMALL, "split_tokens": 16, "split_tokens16": 16})
    two, _ = _run(q, cache, rk, rv, config={**SMALL, "split_tokens": 16, "split_tokens16": 16, "merge_two_pass": True})
    assert relative_error(one.float(), two.float()) < 1e-6  # the merge's one- and two-pass forms agree
    _run(q, cache, rk, rv, config={})  # production tile sizes


def test_l2_warm_up_covers_short_chunks_only():
    # whole chunks of at most l2_prefetch tokens, one prefetch per 128-byte line, only under PDL
    warm = decode_mod._l2_warm_args
    cfg = {"l2_prefetch": 192}
    assert warm(cfg, 160, 128, 128, 1, False, True) == {"L2T": 256, "L2CS": 4, "L2PS": 64}
    assert warm(cfg, 64, 64, 32, 1, False, True) == {"L2T": 64, "L2CS": 8, "L2PS": 32}
    assert warm(cfg, 64, 256, 64, 16, True, True) == {"L2T": 64, "L2CS": 2, "L2PS": 16}  # page-capped
    assert warm(cfg, 256, 128, 128, 1, False, True) == {}
    assert warm(cfg, 64, 128, 128, 1, False, False) == {}
    assert warm({"l2_prefetch": 0}, 64, 128, 128, 1, False, True) == {}


def test_l2_warm_up_of_a_longer_chunk_takes_its_head_only():
    # l2_head: chunks past l2_prefetch prefetch their first l2_head tokens (a power of two), under PDL only
    warm = decode_mod._l2_warm_args
    cfg = {"l2_prefetch": 192, "l2_head": 100}
    assert warm(cfg, 1024, 128, 128, 1, False, True) == {"L2T": 128, "L2CS": 4, "L2PS": 64}
    assert warm(cfg, 160, 128, 128, 1, False, True) == {"L2T": 256, "L2CS": 4, "L2PS": 64}  # short: whole
    assert warm({"l2_prefetch": 0, "l2_head": 512}, 320, 128, 128, 1, False, True)["L2T"] == 512  # the chunk, rounded up
    assert warm(cfg, 1024, 128, 128, 1, False, False) == {}
    assert warm({"l2_prefetch": 192, "l2_head": 0}, 1024, 128, 128, 1, False, True) == {}


def test_window_stages_auto_follows_history_share():
    # "auto": one window stage once the INT2 history holds 8x the window's bytes (Qwen3-8B shapes:
    # 72 history bytes per token against 512 per bf16 window token)
    from types import SimpleNamespace

    def cache(history, window=320):
        return SimpleNamespace(history_capacity=history, window_capacity=window, head_dim=128, group_size=128,
                               v_group_size=128, k_bf16=torch.empty(0, dtype=torch.bfloat16))

    stages = decode_mod._window_stages
    assert stages({"window_stages": "auto"}, cache(7872)) == 2       # 8K context: 3.5x
    assert stages({"window_stages": "auto"}, cache(32448)) == 1      # 32K: 14x
    assert stages({"window_stages": "auto"}, cache(18205)) == 1      # just over 8x
    assert stages({"window_stages": "auto"}, cache(18204)) == 2
    assert stages({"window_stages": 2}, cache(10**6)) == 2


@pytest.mark.parametrize("stages", [1, 2])
def test_decode_window_loop_stages(stages, device):
    # the window loop with and without its software pipeline (several 16-token steps per program)
    q, cache, rk, rv, _ = _case(batch=2, tokens=90, heads=2, qg=4, d=128, g=128, lengths=[90, 51], recent=40,
                                seed=31, device=device)
    _run(q, cache, rk, rv, config={**SMALL, "window_stages": stages, "split_tokens16": 32})


@pytest.mark.parametrize("page", [None, 16])
def test_decode_library_tuning_of_every_regime(page, device, monkeypatch):
    # the defaults of every regime ("small", "large": one head per program, 32-token tiles,
    # register caps, PDL; their "_paged" forms), selected at a small size by moving the threshold
    q, cache, rk, rv, _ = _case(batch=2, tokens=70, heads=2, qg=4, d=128, g=128, lengths=[70, 45],
                                page=page, seed=23, device=device)
    for threshold in (1, 10**6):
        monkeypatch.setattr(decode_mod, "SMALL_BATCH_HEADS", threshold)
        regime = decode_mod.tuning(2, 2, paged=page is not None)
        want = ("small" if threshold > 4 else "large") + ("_paged" if page else "")
        assert regime == decode_mod.TUNING[want]
        _run(q, cache, rk, rv, config={"split_tokens": 32})
        if threshold > 4:  # programs of at least long_chunk tokens take a third pipeline stage
            _run(q, cache, rk, rv, config={"split_tokens": 32, "long_chunk": 32})


def test_history_stages_follow_the_chunk():
    small = decode_mod.TUNING["small"]
    assert decode_mod._history_stages(small, 256) == 2
    assert decode_mod._history_stages(small, 512) == 3
    assert decode_mod._history_stages({**small, "num_stages_long": 0}, 4096) == 2
    assert decode_mod._history_stages(decode_mod.TUNING["large"], 4096) == 2


def test_decode_rotation_prepared_once(device):
    # a non-contiguous rotation is made contiguous once per tensor, not per call
    from oscar_calib.kernels import _common

    q, cache, rk, rv, _ = _case(batch=1, tokens=30, heads=2, qg=2, d=64, g=64, seed=24, device=device)
    rt = rk.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, column-major
    assert not rt.is_contiguous()
    _run(q, cache, rt, rv)

    def live():
        # (entries of tensors that died keep their key until the cache is pruned; a new tensor can
        # reuse such an id, so only live entries of rt count)
        return [v for k, v in _common._DERIVED.items() if k[0] == id(rt) and v[0]() is rt]

    hit = live()
    assert len(hit) == 1 and hit[0][2].is_contiguous()
    first = hit[0][2]
    _run(q, cache, rt, rv)
    assert live()[0][2] is first
    rt.mul_(1.0)  # an in-place change invalidates the cached copy
    _run(q, cache, rt, rv)
    assert live()[0][2] is not first


def test_decode_unrotate_bf16_query_fp16_window(device):
    q, cache, rk, rv, _ = _case(batch=2, tokens=40, heads=2, qg=2, d=64, g=32, lengths=[40, 30],
                                window_dtype=torch.float16, q_dtype=torch.bfloat16, seed=8, device=device)
    res, _ = _run(q, cache, rk, rv, unrotate=True)
    assert res.dtype == torch.bfloat16


def test_decode_prerotated_query_equals_rotation(device):
    q, cache, rk, rv, _ = _case(batch=1, tokens=30, heads=2, qg=2, d=64, g=64, seed=9, device=device)
    a = decode_attention(q, cache, k_rotation=rk, backend="triton", config=SMALL)
    qr = decode_mod.rotate_query(q, rk, 2)
    b = decode_attention(qr, cache, backend="triton", config=SMALL)
    assert relative_error(a, b) < 1e-3


@pytest.mark.parametrize("batch,qg,grouped", grid([(b, qg, grouped) for grouped in (True, False)
                                                   for b, qg in ((9, 4), (5, 3), (3, 8), (2, 32))],
                                                  [(9, 4, True), (5, 3, True), (2, 32, False)]))
def test_query_rotation_kernel_groups_sequences(batch, qg, grouped, device):
    """The rotation kernel, with sequences grouped into the 16 rows of its product (a partial last
    group; 3 query heads padded to 4; 32 heads taking 32 rows) or one sequence per program, equals
    q @ R[h] in float64 for every sequence and head."""
    from oscar_calib.kernels._common import load_triton_module

    gen = torch.Generator().manual_seed(batch * 100 + qg)
    h, d = 2, 64
    q = torch.randn(batch, h * qg, d, generator=gen).to(device)
    r = random_rotation(h, d, generator=gen).float().to(device)
    got = decode_mod._rotate_query_triton(load_triton_module("_decode_triton"), q, r, h,
                                          {"rotate_batched": grouped}, pdl=False)
    want = torch.einsum("bhmd,hde->bhme", q.double().view(batch, h, qg, d), r.double()).reshape(batch, h * qg, d)
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("gv", [32, 64, 16])
def test_reference_is_attention_over_fake_quantised_kv(gv):
    """The reference equals softmax attention in the unrotated basis over quant.py's simulated
    keys/values (history) and 16-bit-rounded rotated window tokens; keys in groups of 32 and values
    in groups of ``gv``."""
    tokens, heads, qg, d, g, sink, recent = 40, 2, 2, 64, 32, 4, 8
    q, cache, rk, rv, (k, v) = _case(batch=2, tokens=tokens, heads=heads, qg=qg, d=d, g=g, gv=gv,
                                     lengths=[40, 25], seed=12)
    assert cache.split == (gv != g) and cache.v_scale.shape[-1] == d // gv
    got = decode_attention_reference(q, cache, k_rotation=rk, v_rotation=rv, unrotate=True)
    kclip = torch.tensor([0.96, 0.9])
    want = torch.empty_like(got)
    for b, n in enumerate([40, 25]):
        ns, nh, nr = split_lengths(n, sink, recent)
        kq = quant.simulate_kv_quant(k[b, :n], rk, kclip, g, unrotate=True)
        vq = quant.simulate_kv_quant(v[b, :n], rv, 0.92, gv, unrotate=True)
        win = torch.cat([torch.arange(ns), torch.arange(ns + nh, n)])
        kq[win] = _window_fake(k[b, win], rk)
        vq[win] = _window_fake(v[b, win], rv)
        for hq in range(heads * qg):
            h = hq // qg
            s = kq[:, h] @ q[b, hq] / math.sqrt(d)
            want[b, hq] = torch.softmax(s, 0) @ vq[:, h]
    # fp16 storage of scale/offset: ~2e-3 relative here (moving one token between the window
    # and the history gives ~3e-2)
    assert relative_error(got, want) < 4e-3


def test_paged_reference_equals_contiguous():
    q, cache, rk, rv, _ = _case(batch=3, tokens=50, heads=2, qg=2, d=64, g=32, lengths=[50, 21, 30], seed=13)
    paged = to_paged(cache, 8, torch.Generator().manual_seed(2))
    assert paged.paged and paged.block_table.shape == (3, 5)
    a = decode_attention_reference(q, cache, k_rotation=rk)
    b = decode_attention_reference(q, paged, k_rotation=rk)
    assert torch.equal(a, b)


def test_decode_input_errors(device):
    q, cache, rk, rv, _ = _case(batch=2, tokens=30, heads=2, qg=2, d=64, g=32, seed=14, device=device)
    with pytest.raises(InputError, match="q must have 3 dimensions"):
        decode_attention(q[0], cache, backend="triton")
    with pytest.raises(InputError, match="not a multiple of 2 KV heads"):
        decode_attention(q[:, :3], cache, backend="triton")
    with pytest.raises(InputError, match="q must have dtype"):
        decode_attention(q.to(torch.int32), cache, backend="triton")
    with pytest.raises(InputError, match="batch"):
        decode_attention(q[:1], cache, backend="triton")
    with pytest.raises(InputError, match="k_rotation must be"):
        decode_attention(q, cache, k_rotation=rk[:1], backend="triton")
    with pytest.raises(InputError, match="unrotate=True needs v_rotation"):
        decode_attention(q, cache, unrotate=True, backend="triton")
    with pytest.raises(InputError, match="unknown kernel backend"):
        decode_attention(q, cache, backend="gpu")
    bad = decode_mod.Int2KVCache(**{**cache.__dict__, "k_scale": cache.k_scale.float()})
    with pytest.raises(InputError, match="cache.k_scale must have dtype float16"):
        decode_attention(q, bad, backend="triton")
    bad = decode_mod.Int2KVCache(**{**cache.__dict__, "hist_lens": cache.hist_lens + 1000})
    with pytest.raises(InputError, match="hist_lens must be in"):
        decode_attention(q, bad, backend="triton")
    bad = decode_mod.Int2KVCache(**{**cache.__dict__, "group_size": 48})
    with pytest.raises(InputError, match="not a power of two"):
        decode_attention(q, bad, backend="triton")
    bad = decode_mod.Int2KVCache(**{**cache.__dict__, "group_size": 128})
    with pytest.raises(InputError, match="not a power of two dividing head_dim"):
        decode_attention(q, bad, backend="triton")
    # group size 8 is valid storage but below the kernel's 32-channel groups
    _, c8, _, _, _ = _case(batch=1, tokens=20, heads=2, qg=1, d=64, g=8, seed=15, device=device)
    with pytest.raises(InputError, match="does not support"):
        decode_attention(q[:1, :2], c8, backend="triton")
    with pytest.raises(InputError, match="page size 12"):
        to_paged(cache, 12)
    with pytest.raises(InputError, match="lengths must be"):
        build_cache(torch.randn(1, 5, 1, 64), torch.randn(1, 5, 1, 64), lengths=[6])


# logit-noise correction: a gain that moves the output by 10-30% on these cases (more would leave
# the history almost unweighted, and the kernel would agree with the reference trivially)
GAIN = 0.25
CORR_CASES = {
    # name: (case kwargs, config overrides); every case differs from the uncorrected output
    # two key groups, two KV heads per program
    "d64_g32_hp2": (dict(batch=2, tokens=45, heads=2, qg=4, d=64, g=32, lengths=[45, 30]),
                    {"heads_per_program": 2}),
    # eight key groups over two byte blocks (cn0 .. cn7), 3 query heads
    "d256_g32": (dict(batch=2, tokens=40, heads=1, qg=3, d=256, g=32, lengths=[40, 23]), {"BLOCK_N": 32}),
    # one group per row: prefetched parameters (PF) over a paged cache, two heads per program
    "paged_prefetch_d128_g128": (dict(batch=3, tokens=150, heads=2, qg=4, d=128, g=128, lengths=[150, 97, 40],
                                      page=16), {"prefetch": True, "heads_per_program": 2, "split_tokens": 48}),
    "prefetch_d128_g128": (dict(batch=2, tokens=120, heads=2, qg=4, d=128, g=128, lengths=[120, 45]),
                           {"prefetch": True, "split_tokens": 48}),
    # K and V groups of different sizes: the correction reads the keys' scales
    "split_d128_k32_v128": (dict(batch=2, tokens=45, heads=2, qg=4, d=128, g=32, gv=128, lengths=[45, 30]), {}),
    "split_paged_d64_k32_v64": (dict(batch=2, tokens=56, heads=3, qg=3, d=64, g=32, gv=64, lengths=[56, 33],
                                     page=8), {"heads_per_program": 2}),
    "split_d256_k256_v32": (dict(batch=1, tokens=90, heads=1, qg=4, d=256, g=256, gv=32), {"split_tokens": 64}),
}


@pytest.mark.parametrize("name,mode", grid([(n, m) for n in CORR_CASES for m in (0, 1)],
                                           [(n, 0) for n in CORR_CASES if n != "split_d256_k256_v32"]))
def test_decode_logit_correction_matches_reference(name, mode, device):
    """With a gain ``a > 0`` the kernel equals the reference, whose output the correction moves;
    ``a = 0`` is the uncorrected kernel, bit for bit."""
    kwargs, cfg = CORR_CASES[name]
    q, cache, rk, rv, _ = _case(**kwargs, seed=60 + len(name), device=device)
    cfg = {**SMALL, "mode": mode, **cfg}
    got = decode_attention(q, cache, k_rotation=rk, backend="triton", config=cfg, logit_correction=GAIN)
    ref = decode_attention_reference(q, cache, k_rotation=rk, out_dtype=torch.float32, logit_correction=GAIN)
    plain = decode_attention_reference(q, cache, k_rotation=rk, out_dtype=torch.float32)
    assert relative_error(ref, plain) > 0.05
    assert torch.isfinite(got).all()
    assert relative_error(got.float(), ref) < 2e-3, relative_error(got.float(), ref)
    off = decode_attention(q, cache, k_rotation=rk, backend="triton", config=cfg, logit_correction=0.0)
    assert torch.equal(off, decode_attention(q, cache, k_rotation=rk, backend="triton", config=cfg))
    assert relative_error(off.float(), plain) < 2e-3


def test_decode_logit_correction_torch_backend_and_prerotated_query(device):
    """The torch backend runs the reference with the correction; a query already in the keys'
    basis gets the same correction as one rotated by the call."""
    q, cache, rk, rv, _ = _case(batch=2, tokens=40, heads=2, qg=2, d=64, g=32, lengths=[40, 30], seed=66,
                                device=device)
    ref = decode_attention_reference(q, cache, k_rotation=rk, v_rotation=rv, unrotate=True, logit_correction=GAIN)
    torch_out = decode_attention(q, cache, k_rotation=rk, v_rotation=rv, unrotate=True, backend="torch",
                                 logit_correction=GAIN)
    assert torch.equal(torch_out, ref)
    qr = decode_mod.rotate_query(q, rk, 2)
    got = decode_attention(qr, cache, v_rotation=rv, unrotate=True, backend="triton", config=SMALL,
                           logit_correction=GAIN)
    assert relative_error(got, ref) < 2e-3


@pytest.mark.parametrize("page", [None, 8])
def test_reference_logit_correction_is_the_formula(page):
    """The reference with a gain equals softmax attention computed here from the cache's own
    tensors: each INT2 history token's logit less ``a/2 * sm_scale^2 * sum_g |q_rot[g]|^2 *
    s_g^2 / 12`` over the key groups, window tokens as they are."""
    from oscar_calib.kernels.pack import dequantize_packed

    a, sm, g, d = 0.7, 0.3, 32, 64
    q, cache, rk, _, _ = _case(batch=2, tokens=30, heads=2, qg=2, d=d, g=g, gv=64, lengths=[30, 19], seed=67)
    got = decode_attention_reference(q, to_paged(cache, page, torch.Generator().manual_seed(3)) if page else cache,
                                     k_rotation=rk, sm_scale=sm, logit_correction=a)
    for b in range(2):
        nw, n = int(cache.bf16_lens[b]), int(cache.hist_lens[b])
        for hq in range(4):
            h = hq // 2
            qr = q[b, hq].double() @ rk[h].double()
            ks = cache.k_scale[b, h, :n].double()                                    # [n, 2]
            khist = dequantize_packed(cache.k_codes[b, h, :n], cache.k_scale[b, h, :n],
                                      cache.k_offset[b, h, :n], g).double()
            vhist = dequantize_packed(cache.v_codes[b, h, :n], cache.v_scale[b, h, :n],
                                      cache.v_offset[b, h, :n], 64).double()
            noise = sum(qr[j * g:(j + 1) * g].pow(2).sum() * ks[:, j] ** 2 / 12 for j in range(d // g))
            logits = torch.cat([sm * cache.k_bf16[b, h, :nw].double() @ qr,
                                sm * khist @ qr - a / 2 * sm * sm * noise])
            vals = torch.cat([cache.v_bf16[b, h, :nw].double(), vhist])
            want = torch.softmax(logits, 0) @ vals
            torch.testing.assert_close(got[b, hq].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [-0.1, 4.5, float("nan"), float("inf"), "1", True, None])
def test_decode_logit_correction_refused(bad, device):
    q, cache, rk, _, _ = _case(batch=1, tokens=20, heads=2, qg=2, d=64, g=32, seed=68, device=device)
    for fn, backend in ((decode_attention, {"backend": "triton"}), (decode_attention, {"backend": "torch"}),
                        (decode_attention_reference, {})):
        with pytest.raises(InputError, match=r"^logit_correction must be a number in \[0, 4\]"):
            fn(q, cache, k_rotation=rk, logit_correction=bad, **backend)
