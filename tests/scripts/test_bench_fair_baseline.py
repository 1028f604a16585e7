"""The fair BF16 decode baseline of scripts/bench/bench_generate.py computes the model's own
attention: its logits follow transformers' DynamicCache holding the same K/V (CPU: the ``sdpa``
form; the GPU machine also checks the flash form and the graph timings' plumbing)."""

from __future__ import annotations

import pytest
from factories import load_script

pytestmark = pytest.mark.script


def _module():
    return load_script("bench/bench_generate_fair.py")


def _model(device):
    return load_script("bench/bench_generate_runs.py").build_model(True, device)


def test_sdpa_baseline_follows_dynamic_cache_on_cpu():
    fair = _module()
    model = _model("cpu")
    assert fair.agrees_with_dynamic(model, "sdpa", batch=2, tokens=40) < 1e-5


def test_weight_bytes_reads_the_embedding_table_only_at_the_batch_rows():
    fair = _module()
    model = _model("cpu")
    emb = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert fair.weight_bytes(model, 3) == total - emb.numel() * emb.element_size() + 3 * emb.shape[1] * emb.element_size()
    assert fair.categorise("void cutlass::Kernel<sm90_gemm>") == "GEMV/GEMM (weights)"
    assert fair.categorise("decode_kernel") == "INT2 decode + merge"
    assert fair.categorise("triton_poi_fused_add_mul_0") == "norms, RoPE, small ops"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["sdpa", "flash"])
def test_baselines_follow_dynamic_cache_and_time_on_the_gpu(mode):
    fair = _module()
    model = _model("cuda")
    assert fair.agrees_with_dynamic(model, mode, batch=2, tokens=300) < 2e-2      # bf16 model
    assert fair.replay_ms(model, mode, 2, 300, replays=3) > 0
    if mode == "flash":
        assert fair.loop(model, 2, 300, 4)["tok_s"] > 0
