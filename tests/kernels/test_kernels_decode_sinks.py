"""Attention sinks in the decode kernel (gpt-oss: a learned logit per query head that joins the
softmax as a key of value zero), against the pure-torch reference and against the rule itself."""

import pytest
import torch
from factories import grid

from oscar_calib.errors import InputError
from oscar_calib.kernels import (
    build_cache,
    decode_attention,
    decode_attention_reference,
)
from oscar_calib.kernels.decode import _history, rotate_query
from oscar_calib.kernels.testing import kv_rows, random_rotation, relative_error

SMALL = {"BLOCK_N": 16, "BLOCK16": 16}


def _case(*, batch, tokens, heads, qg, d, g, lengths=None, sink=4, recent=8, page=None, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    k = kv_rows((batch, tokens, heads, d), torch.bfloat16, generator=gen)
    v = kv_rows((batch, tokens, heads, d), torch.bfloat16, generator=gen, outliers=False)
    q = kv_rows((batch, heads * qg, d), torch.float32, generator=gen)
    rk, rv = random_rotation(heads, d, generator=gen), random_rotation(heads, d, generator=gen)
    cache = build_cache(k, v, lengths=lengths, k_rotation=rk, v_rotation=rv, k_clip=0.96, v_clip=0.92, group_size=g,
                        sink=sink, recent=recent, page_size=page,
                        generator=torch.Generator().manual_seed(seed + 1) if page else None, backend="torch")
    for name in ("k_codes", "k_scale", "k_offset", "v_codes", "v_scale", "v_offset", "hist_lens", "k_bf16", "v_bf16",
                 "bf16_lens", "block_table"):
        if getattr(cache, name) is not None:
            setattr(cache, name, getattr(cache, name).to(device))
    q, rk, rv = q.to(device), rk.to(device), rv.to(device)
    # sink logits near each query head's log-sum-exp of scores, so the sink takes a real share of its rows
    sinks = (_log_z(q, cache, rk).mean(0) + torch.randn(heads * qg, generator=gen).to(device)).contiguous()
    return q, cache, rk, rv, sinks


def _log_z(q, cache, rk):
    """``log Z`` ``[B, Hq]``, ``Z`` the sum of a query head's exponentiated scores over the keys the
    reference reads (the 16-bit window, then the dequantised INT2 history)."""
    h, d = cache.num_kv_heads, q.shape[-1]
    qr = rotate_query(q, rk, h).view(q.shape[0], h, -1, d)
    out = []
    for b in range(q.shape[0]):
        n = int(cache.bf16_lens[b])
        keys = torch.cat([cache.k_bf16[b, :, :n].float(), _history(cache, b, "k")], dim=1)
        out.append(torch.logsumexp(torch.einsum("hgd,htd->hgt", qr[b], keys) * d ** -0.5, -1).reshape(-1))
    return torch.stack(out)


CASES = {
    "d64_gqa": dict(batch=2, tokens=45, heads=2, qg=4, d=64, g=32, lengths=[45, 20]),
    "d128_paged": dict(batch=2, tokens=56, heads=2, qg=2, d=128, g=64, lengths=[56, 33], page=8),
    "window_only": dict(batch=1, tokens=10, heads=1, qg=4, d=64, g=64),
}


@pytest.mark.parametrize("name,two_pass", grid([(n, t) for n in CASES for t in (False, True)],
                                               [("d64_gqa", False), ("d128_paged", True), ("window_only", False)]))
def test_decode_sinks_match_reference(name, two_pass, device):
    """The merge adds ``exp(sink - m)`` to the denominator (one pass or two over the partials);
    without sinks the kernel's result is the one it always gave, bit for bit."""
    q, cache, rk, rv, sinks = _case(**CASES[name], seed=len(name), device=device)
    cfg = {**SMALL, "merge_two_pass": two_pass}
    got = decode_attention(q, cache, k_rotation=rk, v_rotation=rv, unrotate=True, backend="triton", config=cfg,
                           sinks=sinks, out_dtype=torch.float32)
    ref = decode_attention_reference(q, cache, k_rotation=rk, v_rotation=rv, unrotate=True, sinks=sinks,
                                     out_dtype=torch.float32)
    plain = decode_attention_reference(q, cache, k_rotation=rk, v_rotation=rv, unrotate=True, out_dtype=torch.float32)
    assert relative_error(ref, plain) > 0.05                       # the sinks take a real share
    assert torch.isfinite(got).all()
    assert relative_error(got, ref) < 2e-3, relative_error(got, ref)
    off = decode_attention(q, cache, k_rotation=rk, backend="triton", config=cfg)
    assert relative_error(off.float(), decode_attention_reference(q, cache, k_rotation=rk, out_dtype=torch.float32)) \
        < 2e-3


def test_reference_sink_is_a_key_of_value_zero():
    """The reference's rule, written out: a sink logit ``s_j`` scales query head ``j``'s output by
    ``Z / (Z + exp(s_j))``, ``Z`` the sum of its keys' exponentiated scores (gpt-oss's eager
    attention: concatenate, softmax, drop the sink column)."""
    q, cache, rk, rv, sinks = _case(**CASES["d64_gqa"], seed=3)
    plain = decode_attention_reference(q, cache, k_rotation=rk, out_dtype=torch.float32)
    got = decode_attention_reference(q, cache, k_rotation=rk, sinks=sinks, out_dtype=torch.float32)
    share = torch.sigmoid(_log_z(q, cache, rk) - sinks)                 # Z / (Z + e^s), without overflow
    assert relative_error(got, plain * share.unsqueeze(-1)) < 1e-4
    assert share.min() < 0.8                                            # a real share
    far = decode_attention_reference(q, cache, k_rotation=rk, sinks=torch.full_like(sinks, -1e4),
                                     out_dtype=torch.float32)
    assert torch.equal(far, plain)


def test_sinks_refused_in_one_line(device):
    q, cache, rk, _, sinks = _case(**CASES["window_only"], device=device)
    with pytest.raises(InputError, match="sinks"):
        decode_attention(q, cache, k_rotation=rk, sinks=sinks[:2])
    with pytest.raises(InputError, match="sinks"):
        decode_attention(q, cache, k_rotation=rk, sinks=sinks.view(2, 2))
