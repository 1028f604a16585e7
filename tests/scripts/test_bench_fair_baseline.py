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


def test_flashinfer_baseline_says_why_it_is_not_timed_on_the_cpu():
    fair = _module()
    model = _model("cpu")
    got = fair.flashinfer_baseline(model)
    assert set(got) == {"skipped"} and "\n" not in got["skipped"] and "FlashInfer" in got["skipped"]
    with pytest.raises(RuntimeError, match="FlashInfer"):
        fair.PrefixCache(model.config, "flashinfer_cuda_cores", 1, 64, "cpu")


def test_paged_layer_stores_each_token_in_its_row_s_shuffled_page():
    """The FlashInfer form's pool: a decode step's token lands at its row's page and offset, and
    ``dense`` reads the rows back in token order (no FlashInfer needed for the plumbing)."""
    import types

    import torch
    from kernels_flashinfer import page_table

    fair = _module()
    indptr, indices, _, pages = page_table([40, 40], 16, "cpu", generator=torch.Generator().manual_seed(1))
    paged = types.SimpleNamespace(indptr=indptr, indices=indices, page=16, pages=pages)
    layer = fair.PrefixLayer("flashinfer_cuda_cores", 2, 3, 8, 40, "cpu", torch.float32, paged)
    layer.fill(33)
    before_k, _ = layer.dense(33)
    k, v = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8)
    layer.update(k, v)
    got_k, got_v = layer.dense(34)
    assert torch.equal(got_k[:, :, :33], before_k)
    assert torch.equal(got_k[:, :, 33], k[:, :, 0]) and torch.equal(got_v[:, :, 33], v[:, :, 0])
    assert layer.lengths.tolist() == [34, 34] and layer.seen == 34


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
@pytest.mark.parametrize("mode", ["sdpa", "flash", "flashinfer_cuda_cores", "flashinfer_tensor_cores"])
def test_baselines_follow_dynamic_cache_and_time_on_the_gpu(mode):
    if mode.startswith("flashinfer"):
        pytest.importorskip("flashinfer", reason="FlashInfer is timed where it is installed (scripts/dev/flashinfer_bundle.py)")
    fair = _module()
    model = _model("cuda")
    assert fair.agrees_with_dynamic(model, mode, batch=2, tokens=300) < 2e-2      # bf16 model
    assert fair.replay_ms(model, mode, 2, 300, replays=3) > 0
    if mode == "flash":
        assert fair.loop(model, 2, 300, 4)["tok_s"] > 0


@pytest.mark.gpu
def test_the_step_profile_counts_each_kernel_a_step_launches():
    import torch

    x = torch.ones(1024, device="cuda")
    got = _module().profile_step(lambda: (x + 1) * 2, steps=3)
    assert got["launches"] == 2 and got["kernels_ms"] > 0
    assert sum(got["by_category_ms"].values()) == pytest.approx(got["kernels_ms"])
