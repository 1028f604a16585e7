"""Public API of oscar_calib.kernels: light import, cache builder layout."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oscar_calib.errors import InputError
from oscar_calib.kernels import build_cache, quantize_kv_reference, split_lengths
from oscar_calib.kernels.testing import kv_rows, random_rotation

ROOT = Path(__file__).resolve().parents[2]


def test_import_loads_neither_triton_nor_cuda():
    code = (
        "import sys, oscar_calib.kernels, torch;"
        "assert 'triton' not in sys.modules, 'triton imported';"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised';"
        "print('ok')"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_split_lengths():
    assert split_lengths(1000) == (64, 680, 256)
    assert split_lengths(320) == (64, 0, 256)
    assert split_lengths(100) == (64, 0, 36)
    assert split_lengths(30) == (30, 0, 0)
    assert split_lengths(50, sink=0, recent=0) == (0, 50, 0)


def test_build_cache_layout():
    gen = torch.Generator().manual_seed(1)
    b, t, h, d, g = 2, 30, 2, 64, 32
    k = kv_rows((b, t, h, d), torch.bfloat16, generator=gen)
    v = kv_rows((b, t, h, d), torch.bfloat16, generator=gen)
    rk = random_rotation(h, d, generator=gen)
    cache = build_cache(k, v, lengths=[30, 11], k_rotation=rk, k_clip=0.9, group_size=g,
                        sink=4, recent=8, backend="torch")
    assert cache.hist_lens.tolist() == [18, 0] and cache.bf16_lens.tolist() == [12, 11]
    assert cache.k_codes.shape == (2, 2, 18, 16) and cache.k_scale.shape == (2, 2, 18, 2)
    ref = quantize_kv_reference(k[0, 4:22], rk, 0.9, g)  # the history of sequence 0
    assert torch.equal(cache.k_codes[0, :, :18], ref.codes.transpose(0, 1))
    assert torch.equal(cache.k_offset[0, :, :18], ref.offset.transpose(0, 1))
    # window: the sink then the recent tokens, rotated, bf16
    win = torch.einsum("thd,hde->the", k[0, [0, 1, 2, 3, 22, 23, 24, 25, 26, 27, 28, 29]].float(), rk)
    assert torch.equal(cache.k_bf16[0, :, :12], win.transpose(0, 1).bfloat16())
    # values: no rotation given -> stored as they are
    assert torch.equal(cache.v_bf16[1, :, :11], v[1, :11].transpose(0, 1))
    paged = build_cache(k, v, lengths=[30, 11], k_rotation=rk, group_size=g, sink=4, recent=8,
                        page_size=4, generator=torch.Generator().manual_seed(0), backend="torch")
    assert paged.paged and paged.page_size == 4 and paged.history_capacity == 20
    assert sorted(paged.block_table[0].tolist()) == [0, 1, 2, 3, 4]


def test_interpreter_problem_names_the_versions(monkeypatch):
    # Triton < 3.7 with NumPy >= 2.4: the interpreter fails on our kernels; one clear line instead
    import numpy
    import triton

    from oscar_calib.kernels import _common

    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.1")
    why = _common.interpreter_problem()
    assert why and "3.6.0" in why and "2.4.1" in why and "numpy<2.4" in why
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(InputError, match="CPU interpreter cannot run"):
        _common.load_triton_module("_write_triton")
    monkeypatch.setattr(numpy, "__version__", "2.3.5")
    assert _common.interpreter_problem() is None
    monkeypatch.setattr(triton, "__version__", "3.7.0+git1234")
    monkeypatch.setattr(numpy, "__version__", "2.4.6")
    assert _common.interpreter_problem() is None


def test_a_head_dim_outside_the_kernels_is_refused_by_backend_triton_and_served_by_auto():
    """The Triton kernels take head_dim per call: powers of two 16..256 for the writes (the decode-step
    append too), 64..256 for the decode kernel. Gemma 4's 512-wide global layers: ``backend="triton"``
    refuses them in one line before anything runs, ``"auto"`` serves them with the torch references."""
    from oscar_calib.kernels import append_token, quantize_kv
    from oscar_calib.kernels._common import head_dim_problem

    assert head_dim_problem(256, "write") is head_dim_problem(64, "decode") is None
    assert head_dim_problem(512, "decode") == "head_dim 512 (the decode kernel needs a power of two in 64..256)"
    assert head_dim_problem(32, "decode") and head_dim_problem(96, "write") and not head_dim_problem(16, "write")
    x = kv_rows((2, 1, 512), generator=torch.Generator().manual_seed(1))
    with pytest.raises(InputError, match=r"does not support this input: head_dim 512 \(the write kernel"):
        quantize_kv(x, None, None, 128, backend="triton")
    assert torch.equal(quantize_kv(x, None, None, 128, backend="auto").codes,
                       quantize_kv_reference(x, None, None, 128).codes)
    b, h, d, cap = 1, 1, 512, 4
    window = torch.zeros(b, 2, h, 4, d, dtype=torch.bfloat16)
    codes = torch.zeros(b, 2, h, cap + 1, d // 4, dtype=torch.uint8)
    params = [torch.zeros(b, 2, h, cap + 1, d // 128, dtype=torch.float16) for _ in range(2)]
    k = torch.randn(b, h, d, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="head_dim 512 \\(the write kernel"):
        append_token(k, k, window, codes, *params, torch.zeros(b, dtype=torch.int64), sink=1, recent=2,
                     group_size=128, backend="triton")
