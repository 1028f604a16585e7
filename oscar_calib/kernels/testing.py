"""Helpers for kernel tests and benchmarks: random inputs with outliers, poisoning, comparisons.

Nothing here is used at run time by the kernels.
"""

from __future__ import annotations

import contextlib

import torch

from ..contract.defaults import group_pair
from .cache import Int2KVCache
from .pack import PARAM_DTYPE, QuantizedKV


def random_rotation(heads: int, d: int, *, generator: torch.Generator | None = None,
                    device: str | torch.device = "cpu") -> torch.Tensor:
    """Random orthogonal ``[heads, d, d]`` float32 (QR of a Gaussian in float64)."""
    a = torch.randn(heads, d, d, dtype=torch.float64, generator=generator)
    qm, r = torch.linalg.qr(a)
    qm = qm * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    return qm.float().contiguous().to(device)


def kv_rows(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16, *,
            generator: torch.Generator | None = None, device: str | torch.device = "cpu",
            outliers: bool = True) -> torch.Tensor:
    """Gaussian rows ``[..., d]`` with a few outlier channels (large scale and offset), like K."""
    x = torch.randn(*shape, generator=generator)
    if outliers:
        d = shape[-1]
        idx = torch.randperm(d, generator=generator)[: max(2, d // 32)]
        x[..., idx] = x[..., idx] * 12.0 + 6.0
    return x.to(dtype).to(device)


def poison_cache(cache: Int2KVCache, *, generator: torch.Generator | None = None) -> None:
    """Fill every slot the lengths mark invalid with NaN (scales, offsets, window) and random
    bytes (codes), in place, so a kernel that reads them produces NaN."""
    hist = cache.hist_lens.tolist()
    win = cache.bf16_lens.tolist()
    for b, n in enumerate(win):
        cache.k_bf16[b, :, n:] = float("nan")
        cache.v_bf16[b, :, n:] = float("nan")
    if cache.paged:
        page = cache.page_size
        used = {}
        tab = cache.block_table.tolist()
        for b, n in enumerate(hist):
            for j in range((n + page - 1) // page):
                used[tab[b][j]] = min(page, n - j * page)
        slots = [(p, used.get(p, 0)) for p in range(cache.k_codes.shape[0])]
        for which in "kv":
            for p, n in slots:
                _poison_rows(cache, which, (p, slice(None), slice(n, None)), generator)
    else:
        for which in "kv":
            for b, n in enumerate(hist):
                _poison_rows(cache, which, (b, slice(None), slice(n, None)), generator)


def _poison_rows(cache, which, idx, generator):
    codes = getattr(cache, f"{which}_codes")
    tgt = codes[idx]
    if tgt.numel():
        codes[idx] = torch.randint(0, 256, tgt.shape, dtype=torch.uint8, generator=generator).to(codes.device)
    getattr(cache, f"{which}_scale")[idx] = float("nan")
    getattr(cache, f"{which}_offset")[idx] = float("nan")


def random_int2_cache(batch: int, heads: int, d: int, group_size: int, hist_len: int, window_len: int, *,
                      window_dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
                      generator: torch.Generator | None = None, v_group_size: int | None = None) -> Int2KVCache:
    """A contiguous cache filled with random codes, plausible scales/offsets and a random window
    (for speed measurements: no quantisation needed). All sequences are full. ``v_group_size``:
    the values' group size (default ``group_size``)."""
    _, gv = group_pair(group_size, v_group_size)

    def codes():
        return torch.randint(0, 256, (batch, heads, max(1, hist_len), d // 4), dtype=torch.uint8,
                             device=device, generator=generator)

    def params(lo, hi, g):
        u = torch.rand(batch, heads, max(1, hist_len), d // g, device=device, generator=generator)
        return (lo + (hi - lo) * u).to(PARAM_DTYPE)

    win = max(1, window_len)
    return Int2KVCache(
        codes(), params(0.05, 0.5, group_size), params(-1.5, -0.1, group_size),
        codes(), params(0.05, 0.5, gv), params(-1.5, -0.1, gv),
        torch.full((batch,), hist_len, dtype=torch.int32, device=device),
        torch.randn(batch, heads, win, d, device=device, generator=generator).to(window_dtype),
        torch.randn(batch, heads, win, d, device=device, generator=generator).to(window_dtype),
        torch.full((batch,), window_len, dtype=torch.int32, device=device),
        group_size, v_group_size=gv,
    )


def code_agreement(a: QuantizedKV, b: QuantizedKV) -> tuple[int, float]:
    """``(largest |level difference|, fraction of codes that differ)`` between two results."""
    ca = a.unpacked_codes().to(torch.int16).cpu()
    cb = b.unpacked_codes().to(torch.int16).cpu()
    diff = (ca - cb).abs()
    return int(diff.max().item()) if diff.numel() else 0, float((diff != 0).float().mean().item()) if diff.numel() else 0.0


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (NaN if ``out`` has a NaN)."""
    o, r = out.double(), ref.double()
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


# the Triton kernels a benchmark or a SASS dump compiles on its own: name -> (module, kernel)
JIT_KERNELS = {"decode": ("_decode_triton", "decode_kernel"), "write": ("_write_triton", "quantize_kv_planes_kernel")}


def jit_kernel(name: str):
    """The ``@triton.jit`` function of the ``decode`` or ``write`` kernel (what
    ``scripts/dev/kernel_sass.py`` compiles for a GPU architecture); needs triton."""
    from ._common import load_triton_module

    if name not in JIT_KERNELS:
        raise KeyError(f"no kernel {name!r}; choose from {', '.join(JIT_KERNELS)}")
    module, kernel = JIT_KERNELS[name]
    return getattr(load_triton_module(module), kernel)


def rotate_query_triton(q: torch.Tensor, k_rotation: torch.Tensor, num_kv_heads: int,
                        config: dict | None = None) -> torch.Tensor:
    """The decode kernel's query rotation alone, ``q [B, Hq, d] @ R_k[h]`` in float32 through its
    Triton kernel with the decode's tuning for this batch (what the decode benchmark times as
    ``rotation_only``); :func:`~oscar_calib.kernels.decode.rotate_query` is its torch reference."""
    from . import decode
    from ._common import load_triton_module

    cfg = decode.tuning(q.shape[0], num_kv_heads, config)
    return decode._rotate_query_triton(load_triton_module("_decode_triton"), q, k_rotation, num_kv_heads, cfg, False)


@contextlib.contextmanager
def merge_left_out():
    """Benchmarks only: decode calls without their merge kernel (its launch a no-op) inside the
    block, to time what the merge adds to a call; the outputs are then not the attention."""
    from ._common import load_triton_module

    mod = load_triton_module("_decode_triton")
    real = mod.decode_merge_kernel

    class _Skip:
        def __getitem__(self, grid):
            return lambda *a, **k: None

    mod.decode_merge_kernel = _Skip()
    try:
        yield
    finally:
        mod.decode_merge_kernel = real
