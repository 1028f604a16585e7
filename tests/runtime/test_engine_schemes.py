"""Other engines' quantisers (numerics/engines.py) against their code's definitions, and the
``vllm`` / ``llamacpp`` evaluation schemes that read through them."""

from __future__ import annotations

import pytest
import torch
from factories import tiny_model

from oscar_calib.contract.artifact import Artifact, LayerRotations
from oscar_calib.errors import InputError
from oscar_calib.eval.methods import build_schemes, parse_methods
from oscar_calib.numerics.engines import (
    Q2_0_LEVELS,
    fake_quant_q2_0,
    fake_quant_q8_0,
    fake_quant_vllm,
    q2_0_read,
    q2_0_write,
)
from oscar_calib.runtime.scheme import KVScheme
from oscar_calib.runtime.simulate import SimulatedKV


def test_vllm_quantiser_one_group_per_vector_with_fp16_parameters():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, 64, generator=g) * 3 + 1
    y = fake_quant_vllm(x)
    lo = x.amin(-1, keepdim=True)
    s = ((x.amax(-1, keepdim=True) - lo) / 3).half().float()
    z = lo.half().float()
    levels = z + s * torch.arange(4.0)                               # four levels per head vector
    assert torch.allclose((y.unsqueeze(-1) - levels.unsqueeze(-2)).abs().amin(-1), torch.zeros_like(y), atol=1e-6)
    assert torch.equal(y.amin(-1, keepdim=True), z)                  # the minimum comes back as its fp16 value
    assert ((y - x).abs() <= s / 2 + (x - lo).abs() * 2e-3 + 1e-3).all()
    assert torch.equal(fake_quant_vllm(torch.full((2, 8), 0.5)), torch.full((2, 8), 0.5))   # flat rows: floor


def test_q2_0_restores_the_chunk_mean_when_heads_align_with_chunks():
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(20, 256, generator=g) + 5.0                   # one head of 256 (Gemma-3): 2 chunks of 128
    codes, sigma, mean = q2_0_write(rows, None)
    assert codes.shape == rows.shape and sigma.shape == mean.shape == (20, 8)
    assert torch.equal(mean[:, 1:4], torch.zeros(20, 3)) and (mean[:, 0] > 4).all()   # mean in the chunk's first block
    y = q2_0_read(codes, sigma, mean, 256)
    blocks = (y - mean[:, [0, 0, 0, 0, 4, 4, 4, 4]].repeat_interleave(32, 1)).reshape(20, 8, 32) / \
        sigma.unsqueeze(-1)
    assert torch.allclose(blocks.abs().unsqueeze(-1).sub(torch.tensor(Q2_0_LEVELS).abs()).abs().amin(-1),
                          torch.zeros(20, 8, 32), atol=1e-4)         # every value is a Lloyd-Max level times σ
    assert (y - rows).abs().mean() < 0.6 * rows.std()


def test_q2_0_loses_the_mean_where_read_groups_do_not_match_write_chunks():
    """head_dim 64 with three KV heads (SmolLM2): the row is written in 128-value chunks across heads
    but read per head in 32-value groups, so 3 of every 4 blocks read their mean as 0 (the fork's
    arithmetic, reproduced)."""
    rows = torch.full((1, 192), 5.0) + torch.linspace(-0.1, 0.1, 192)
    y = fake_quant_q2_0(rows, 64, None)
    block_mean = y.reshape(6, 32).mean(-1)
    assert (block_mean[[0, 4]] > 4.5).all()                           # chunk leaders (head 0 block 0, head 2 block 0)
    assert (block_mean[[1, 2, 3, 5]].abs() < 0.2).all()               # the others lost the +5
    aligned = fake_quant_q2_0(rows[:, :128], 128, None)               # head_dim 128: read groups = write chunks
    assert (aligned.reshape(4, 32).mean(-1) > 4.5).all()


def test_q2_0_clip_applies_to_the_mean_subtracted_chunk():
    x = torch.zeros(1, 128)
    x[0, :8] = torch.tensor([10.0, -10, 1, -1, 1, -1, 1, -1])
    clipped = fake_quant_q2_0(x, 128, 0.9)
    plain = fake_quant_q2_0(x, 128, None)
    assert clipped.abs().max() < plain.abs().max()
    with pytest.raises(ValueError, match="multiple of 32"):
        q2_0_write(torch.zeros(1, 48), None)


def test_q8_0_rounds_half_away_from_zero_with_an_fp16_scale():
    x = torch.tensor([[127.0, 63.5, -63.5, 0.25] + [0.0] * 28])
    y = fake_quant_q8_0(x)
    assert y[0, :4].tolist() == [127.0, 64.0, -64.0, 0.0]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(10, 64, generator=g)
    delta = x.reshape(10, 2, 32).abs().amax(-1, keepdim=True) / 127
    assert ((fake_quant_q8_0(x) - x).reshape(10, 2, 32).abs() <= delta * 0.51 + 1e-3).all()


def tiny_artifact(layers: int, kv: int, d: int) -> Artifact:
    g = torch.Generator().manual_seed(4)
    rows = []
    for _ in range(layers):
        r = [torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0].float() for _ in range(2)]
        eig = torch.linspace(1, 0, d).expand(kv, d).clone()
        rows.append(LayerRotations(r[0].expand(kv, d, d).clone(), r[1].expand(kv, d, d).clone(), torch.full((kv,), 0.95),
                                   torch.full((kv,), 0.9), eig, eig.clone()))
    md = {"num_layers": str(layers), "num_attention_heads": str(2 * kv), "num_kv_heads": str(kv), "head_dim": str(d),
          "group_size": str(d), "granularity": "layer", "sink_tokens": "4", "recent_tokens": "4",
          "fork_k_clip": "0.95", "fork_v_clip": "0.9"}
    return Artifact(layers=rows, metadata=md)


def test_engine_schemes_and_methods():
    art = tiny_artifact(4, 2, 32)
    assert parse_methods("oscar,vllm,llamacpp") == ["oscar", "vllm", "llamacpp"]
    from oscar_calib.model.geometry import Geometry

    geo = Geometry("llama", 4, 4, 2, 32, ("full_attention",) * 4, None)
    s = build_schemes(["vllm", "llamacpp"], geo, artifact=art)
    assert s["vllm"].quantizer == "vllm" and s["vllm"].native_layers == (0, 1, 2, 3)    # L = 4: 2 + 2 native
    assert s["llamacpp"].window_dtype == torch.float16 and (s["llamacpp"].sink, s["llamacpp"].recent) == (4, 4)
    assert float(s["llamacpp"].v_clip[0][0]) == pytest.approx(0.95)   # ONE ratio: K's, for V too
    assert s["llamacpp"].bits_per_element == 3.0
    with pytest.raises(InputError, match="only in the perplexity simulation"):
        build_schemes(["vllm"], geo, artifact=art, real_cache=True)
    with pytest.raises(InputError, match="head_dim 16 is not a whole number of q2_0 blocks"):
        KVScheme.engine_from_artifact(tiny_artifact(2, 2, 16), "llamacpp")


def test_simulated_engines_on_a_tiny_model():
    model = tiny_model("llama", layers=2, head_dim=32)                # q2_0 needs whole 32-value blocks per head
    art = tiny_artifact(2, 2, 32)
    ids = torch.randint(1, 120, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        with SimulatedKV(model, KVScheme.full_precision(2, window_dtype=torch.bfloat16)):
            ref = model(ids).logits
        with SimulatedKV(model, KVScheme.engine_from_artifact(art, "vllm")):
            native = model(ids).logits                                # L = 2: both layers native
        vllm = KVScheme.engine_from_artifact(art, "vllm")
        vllm.native_layers = ()
        with SimulatedKV(model, vllm):
            quant = model(ids).logits
        with SimulatedKV(model, KVScheme.engine_from_artifact(art, "llamacpp")):
            lc = model(ids).logits
        wide = KVScheme.engine_from_artifact(art, "llamacpp", sink=64, recent=64)
        with SimulatedKV(model, wide):
            lc_wide = model(ids).logits                               # every token in the F16 window
    assert torch.allclose(native, ref, atol=1e-5)
    assert not torch.allclose(quant, ref, atol=1e-3) and torch.isfinite(quant).all()
    assert not torch.allclose(lc, ref, atol=1e-3) and torch.isfinite(lc).all()
    assert torch.allclose(lc_wide, ref, atol=5e-2)                     # F16 window, rotations exact
