import pytest
import torch

from oscar_calib.calibration.stats import LayerStats


def _batch(gen, b=2, t=16, hq=6, hkv=2, d=8):
    q = torch.randn(b, hq, t, d, generator=gen)
    k = torch.randn(b, hkv, t, d, generator=gen) * torch.linspace(0.1, 3, d)
    v = torch.randn(b, hkv, t, d, generator=gen)
    o = torch.randn(b, t, hq, d, generator=gen)
    return q, k, v, o


def _one_shot(batches, hkv=2, g=3, d=8, pilot_n=None):
    q = torch.cat([b[0].transpose(1, 2).reshape(-1, hkv * g, d) for b in batches]).double()
    k = torch.cat([b[1].transpose(1, 2).reshape(-1, hkv, d) for b in batches]).double()
    v = torch.cat([b[2].transpose(1, 2).reshape(-1, hkv, d) for b in batches]).double()
    o = torch.cat([b[3].reshape(-1, hkv * g, d) for b in batches]).double()
    n = k.shape[0]
    out = {}
    for name, x, per in (("q", q, g), ("s", o, g), ("k", k, 1), ("v", v, 1)):
        x = x.reshape(n, hkv, per, d).permute(1, 0, 2, 3).reshape(hkv, n * per, d)
        out[name] = x.transpose(1, 2) @ x / (n * per)
    pn = pilot_n or n
    qp = q[:pn].reshape(pn, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, pn * g, d)
    cq = qp.transpose(1, 2) @ qp / (pn * g)
    kk = k.permute(1, 0, 2)
    vv = v.permute(1, 0, 2)
    w = torch.einsum("hnd,hde,hne->hn", kk, cq, kk)
    out["s_approx"] = (vv * w.unsqueeze(-1)).transpose(1, 2) @ vv / w.sum(-1).view(-1, 1, 1)
    return out


def test_streaming_equals_one_shot():
    gen = torch.Generator().manual_seed(0)
    batches = [_batch(gen) for _ in range(5)]
    st = LayerStats(2, 3, 8, pilot_tokens=10_000)        # pilot covers everything: exact two-pass C_Q
    for b in batches:
        st.update(*b)
    ref = _one_shot(batches)
    for name in ("q", "s", "k", "v", "s_approx"):
        got = st.covariance(name)
        rel = float((got - ref[name]).norm() / ref[name].norm())
        assert rel <= 1e-10, (name, rel)


def test_pilot_freezes_query_covariance_from_first_tokens():
    gen = torch.Generator().manual_seed(1)
    batches = [_batch(gen) for _ in range(4)]
    st = LayerStats(2, 3, 8, pilot_tokens=32)            # exactly the first batch (2 x 16 tokens)
    for b in batches:
        st.update(*b)
    ref = _one_shot(batches, pilot_n=32)
    rel = float((st.covariance("s_approx") - ref["s_approx"]).norm() / ref["s_approx"].norm())
    assert rel <= 1e-10
    assert not st._pilot_k                                # buffer released


def test_memory_does_not_grow_with_tokens():
    gen = torch.Generator().manual_seed(2)
    st = LayerStats(2, 3, 8, pilot_tokens=16)

    def numel():
        sd = st.state_dict()
        n = sum(t.numel() for t in sd["sums"].values()) + sd["w_sum"].numel()
        return n + sum(t.numel() for t in sd["pilot_k"] + sd["pilot_v"])

    fixed = 5 * 2 * 8 * 8 + 2 * 8 + 2                    # five [2, 8, 8] sums, the [2, 8] key sum, w_sum
    st.update(*_batch(gen))                               # 32 tokens >= pilot: buffer folded in
    assert numel() == fixed
    for _ in range(20):
        st.update(*_batch(gen))
    assert numel() == fixed and st.tokens == 21 * 32


def test_state_dict_round_trip_is_exact():
    gen = torch.Generator().manual_seed(3)
    a, b = LayerStats(2, 3, 8, 40), LayerStats(2, 3, 8, 40)
    batches = [_batch(gen) for _ in range(4)]
    for x in batches[:1]:
        a.update(*x)
    b.load_state_dict(a.state_dict())
    for x in batches[1:]:
        a.update(*x)
        b.update(*x)
    for name in ("q", "s", "s_approx", "k", "v"):
        assert torch.equal(a.covariance(name), b.covariance(name))
    assert torch.equal(a.key_mean(), b.key_mean())


def test_key_mean_and_centered_key_covariance():
    """The mean key per KV head and the covariance of the centered keys, streamed (float64, exact
    and half-precision paths, padding dropped) against a one-shot computation."""
    gen = torch.Generator().manual_seed(5)
    batches = [_batch(gen) for _ in range(3)]
    shift = torch.randn(2, 8, generator=gen) * 5                      # keys far from zero, as RoPE'd keys are
    batches = [(q, k + shift[None, :, None, :], v, o) for q, k, v, o in batches]
    st = LayerStats(2, 3, 8, pilot_tokens=1000)
    for x in batches:
        st.update(*x)
    rows = torch.cat([b[1].transpose(1, 2).reshape(-1, 2, 8) for b in batches]).double()        # [n, h, d]
    mean = rows.mean(0)
    centered = (rows - mean).permute(1, 0, 2)
    assert torch.allclose(st.key_mean(), mean, rtol=0, atol=1e-12)
    ref = centered.transpose(1, 2) @ centered / rows.shape[0]
    assert float((st.covariance("k", centered=True) - ref).norm() / ref.norm()) <= 1e-10
    assert float((st.covariance("k") - ref).norm() / ref.norm()) > 0.1          # the raw one is another matrix
    half = LayerStats(2, 3, 8, 1000, approx=False)
    for x in batches:
        half.update(*(t.to(torch.bfloat16) for t in x))                         # bf16 activations: the fast path
    bf = torch.cat([b[1].to(torch.bfloat16).transpose(1, 2).reshape(-1, 2, 8) for b in batches]).double().mean(0)
    assert torch.allclose(half.key_mean(), bf, rtol=0, atol=1e-12)
    valid = torch.zeros(2, 16, dtype=torch.bool)
    valid[:, :5] = True
    masked = LayerStats(2, 3, 8, 1000)
    masked.update(*batches[0], valid)
    assert torch.allclose(masked.key_mean(), batches[0][1][:, :, :5].transpose(1, 2).reshape(-1, 2, 8).double().mean(0))
    with pytest.raises(ValueError, match="only the key accumulator"):
        st.covariance("v", centered=True)


def test_valid_mask_drops_padding():
    gen = torch.Generator().manual_seed(4)
    q, k, v, o = _batch(gen, b=1, t=10)
    valid = torch.zeros(1, 10, dtype=torch.bool)
    valid[0, :6] = True
    a, b = LayerStats(2, 3, 8, 1000), LayerStats(2, 3, 8, 1000)
    a.update(q, k, v, o, valid)
    b.update(q[:, :, :6], k[:, :, :6], v[:, :, :6], o[:, :6])
    assert a.tokens == 6
    assert torch.allclose(a.covariance("q"), b.covariance("q"))
