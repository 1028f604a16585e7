"""Where triton is not installed (pyproject requires it on Linux only: it has no wheels elsewhere): the
kernels package imports, ``backend="auto"`` runs the pure-torch references and gives their results,
``backend="triton"`` and ``oscar verify --backend triton`` are refused in one line.

Here triton is hidden in-process (``sys.modules["triton"] = None``, the kernels package imported
afresh); ``make test-no-triton`` runs this file in a virtual environment where it is really absent."""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

import oscar_calib
from oscar_calib.errors import InputError


@pytest.fixture
def kernels(monkeypatch):
    """``oscar_calib.kernels`` imported afresh while ``import triton`` fails (the modules as they
    were come back after the test)."""
    monkeypatch.setitem(sys.modules, "triton", None)
    for name in [m for m in sys.modules if m == "oscar_calib.kernels" or m.startswith("oscar_calib.kernels.")]:
        monkeypatch.delitem(sys.modules, name)
    if hasattr(oscar_calib, "kernels"):
        monkeypatch.setattr(oscar_calib, "kernels", oscar_calib.kernels)
    mod = importlib.import_module("oscar_calib.kernels")
    assert not mod.triton_available()
    return mod


def triton_modules() -> list[str]:
    return sorted(m for m in sys.modules if m.startswith("oscar_calib.kernels._") and m.endswith("_triton"))


def orthogonal(h: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))[0].float()


def test_auto_runs_the_references(kernels, device):
    """Write, cache and decode through ``backend="auto"`` equal the references bit for bit, on the
    GPU too (there the kernels would otherwise run), and no Triton module is loaded."""
    g = torch.Generator().manual_seed(0)
    b, t, h, qg, d, gs = 2, 40, 2, 4, 64, 32
    k = torch.randn(b, t, h, d, generator=g).to(device, torch.bfloat16)
    v = torch.randn(b, t, h, d, generator=g).to(device, torch.bfloat16)
    rk, rv = orthogonal(h, d, 1).to(device), orthogonal(h, d, 2).to(device)
    clip = torch.tensor([0.9, 0.95], device=device)

    got = kernels.quantize_kv(k, rk, clip, gs)
    ref = kernels.quantize_kv_reference(k, rk, clip, gs)
    assert torch.equal(got.codes, ref.codes) and torch.equal(got.scale, ref.scale)
    assert torch.equal(got.offset, ref.offset)
    assert got.codes.shape == (b, t, h, d // 4) and int(got.codes.max()) > 0   # really quantised

    cache = kernels.build_cache(k, v, lengths=[t, t - 7], k_rotation=rk, v_rotation=rv, k_clip=clip, v_clip=clip,
                                group_size=gs, sink=4, recent=8)
    q = torch.randn(b, h * qg, d, generator=g).to(device, torch.bfloat16)
    kw = dict(k_rotation=rk, v_rotation=rv, unrotate=True)
    out = kernels.decode_attention(q, cache, **kw)
    assert torch.equal(out, kernels.decode_attention_reference(q, cache, **kw))
    assert out.isfinite().all() and out.abs().max() > 0
    assert kernels.decode.decode_backend(q, cache) == "torch"
    assert triton_modules() == [] and sys.modules["triton"] is None


def test_append_token_auto_runs_the_reference(kernels, device):
    g = torch.Generator().manual_seed(3)
    b, h, d, gs, sink, recent, cap = 3, 2, 64, 32, 2, 4, 8

    def store():
        return (torch.zeros(b, 2, h, sink + recent + 1, d, dtype=torch.bfloat16, device=device),
                torch.zeros(b, 2, h, cap + 1, d // 4, dtype=torch.uint8, device=device),
                torch.zeros(b, 2, h, cap + 1, d // gs, dtype=torch.float16, device=device),
                torch.zeros(b, 2, h, cap + 1, d // gs, dtype=torch.float16, device=device),
                torch.tensor([0, 5, 9], device=device))

    rot = orthogonal(2 * h, d, 4).to(device)
    clip = torch.full((2 * h,), 0.9, device=device)
    auto, ref = store(), store()
    for _ in range(3):
        k = torch.randn(b, h, d, generator=g).to(device, torch.bfloat16)
        v = torch.randn(b, h, d, generator=g).to(device, torch.bfloat16)
        kw = dict(sink=sink, recent=recent, group_size=gs, rotation=rot, clip=clip)
        kernels.append_token(k, v, *auto, **kw)
        kernels.append_token_reference(k, v, *ref, **kw)
    assert all(torch.equal(a, r) for a, r in zip(auto, ref))
    assert auto[4].tolist() == [3, 8, 12] and int(auto[1].max()) > 0
    assert triton_modules() == []


def test_dispatch_falls_back_without_triton(kernels, monkeypatch):
    """On CUDA tensors ``auto`` would take the kernels when triton imports; without it the
    references. An explicit ``triton`` (argument or ``OSCAR_KERNELS``) is refused in one line."""
    common = sys.modules["oscar_calib.kernels._common"]
    on_gpu = [SimpleNamespace(is_cuda=True)]
    assert common.resolve_backend("auto", on_gpu) == "torch"
    for request in (lambda: common.resolve_backend("triton", on_gpu),
                    lambda: (monkeypatch.setenv("OSCAR_KERNELS", "triton"), common.resolve_backend("auto", on_gpu))):
        with pytest.raises(InputError, match="needs the triton package, which is not installed") as e:
            request()
        assert "\n" not in str(e.value)
    monkeypatch.delenv("OSCAR_KERNELS")
    monkeypatch.setattr(common, "triton_available", lambda: True)       # the same call where triton imports
    assert common.resolve_backend("auto", on_gpu) == "triton"


def test_verify_refuses_the_triton_backend_before_loading_anything(kernels, tmp_path):
    """``oscar verify --backend triton`` without triton: one InputError before the artifact or the
    model is read (tmp_path holds no artifact, so any later check would fail differently)."""
    from oscar_calib.eval.verify import verify_artifact

    with pytest.raises(InputError, match="--backend triton needs the triton package.*use --backend auto or torch"):
        verify_artifact(tmp_path, model="no-such-model", backend="triton")
    with pytest.raises(InputError, match="unknown backend 'cuda'"):
        verify_artifact(tmp_path, backend="cuda")
