"""Other engines' KV quantisers, in pure torch, as their code defines them (read, cited, not copied):
the references ``oscar eval --methods vllm,llamacpp`` simulates and the tests check.

vLLM, pull request #46774 (``vllm-project/vllm``; ``triton_oscar_store.py: _store_int2_vec`` at
5660ce4a99, ``triton_oscar_decode.py`` at 5eee9be311, ``oscar/config.py: get_boundary_skip_layers``
at 9195dd08f3):

=================  ==========================================================================
step               definition (per token, per KV head: one group of ``d = head_dim`` values)
=================  ==========================================================================
clip               ours (:func:`~oscar_calib.numerics.quant.clip_rows`): the sorted-index rule, one
                   K and one V ratio for the model
parameters         ``s = max((max-min)/3, 1e-8)``, both ``s`` and ``zero = min`` rounded to fp16 (a
                   flat row's floor rounds to 0: it reads back as its minimum)
codes              ``q = clamp(floor((x - zero)/s + 0.5), 0, 3)`` against the rounded pair
read back          ``q·s + zero`` (float32)
native layers      the first and last ``min(2, L // 2)`` layers keep the model's dtype
=================  ==========================================================================

llama.cpp, OSCAR's branch ``zhongzhu/llamacpp`` (FutureMLS-Lab/OSCAR at 4570ea609;
``ggml/src/ggml-quants.c: quantize_row_q2_0_ref / dequantize_row_q2_0``,
``ggml/src/ggml-cpu/quants.c: ggml_vec_dot_q2_0_q8_0_generic``), with ``LLAMA_KV_NO_HADAMARD=1``:

=================  ==========================================================================
step               definition
=================  ==========================================================================
write (``q2_0``)   a token's whole K (or V) row, all KV heads concatenated (``n = H·d`` values),
                   in chunks of 128 (32 when ``n < 128``; the last chunk may be shorter): subtract
                   the chunk mean; clip to ``±sorted(|x|)[min(floor(c·m), m-1)]`` over the chunk's
                   ``m`` values (``0 < c < 1``, ONE ratio for K and V); per block of 32:
                   ``σ = sqrt(mean(x²))``, codes by ``x/σ`` against ``-0.6745, 0, 0.6745``;
                   stored: ``fp16(σ)`` per block, ``fp16(mean)`` in the chunk's first block and
                   0 in the others
read               per head vector (``d`` values): in groups of 4 blocks when ``d >= 128``, else of
                   1 block; value = ``level[q]·σ + m`` with ``m`` the group's FIRST block's stored
                   mean and levels ``(-0.9816, -0.4528, 0.4528, 0.9816)``. When a head is not a whole
                   number of 128-value write chunks (``d < 128``) the read groups do not match the
                   write chunks and the means of all but the chunk's first block read as 0: the
                   fork's arithmetic, reproduced as it is
query (CPU)        scored against ``q2_0`` keys as ``q8_0``: per 32 values ``δ = max|x|/127``,
                   ``round(x/δ)`` (half away from zero), ``fp16(δ)``; against the F16 window as F16
window             ``LLAMA_KV_HP_SINK`` / ``LLAMA_KV_HP_RECENT`` tokens in F16 (not BF16)
=================  ==========================================================================
"""

from __future__ import annotations

import torch

from .quant import SCALE_FLOOR, clip_rows

VLLM_BOUNDARY_LAYERS = 2
VLLM_PARAM_BITS = 32                  # fp16 scale + fp16 zero per head vector
Q2_0_BLOCK = 32
Q2_0_CHUNK = 128                      # Q2_0_HAD_SIZE: the write side's mean/clip chunk
Q2_0_BITS = 12 * 8 / Q2_0_BLOCK       # block_q2_0: fp16 d, fp16 m, 8 code bytes per 32 values = 3 bits
Q2_0_LEVELS = (-0.9816, -0.4528, 0.4528, 0.9816)
Q2_0_THRESHOLD = 0.6745
Q8_0_BLOCK = 32


def boundary_layers(num_layers: int, n: int = VLLM_BOUNDARY_LAYERS, *, hybrid: bool = False) -> list[int]:
    """The layers vLLM's OSCAR backend keeps in the model's dtype: the first and last ``min(n, L // 2)``,
    none on a hybrid model (``OscarConfig.get_boundary_skip_layers`` at 9195dd08f3 returns none when
    ``model_config.is_hybrid``: too few attention layers to spare)."""
    if hybrid:
        return []
    n = min(n, num_layers // 2)
    return sorted(set(range(n)) | set(range(num_layers - n, num_layers))) if n > 0 else []


def fake_quant_vllm(x: torch.Tensor) -> torch.Tensor:
    """vLLM's INT2 store and read of rows ``[..., d]`` (already rotated and clipped), float32."""
    xf = x.float()
    lo = xf.amin(-1, keepdim=True)
    s = torch.clamp((xf.amax(-1, keepdim=True) - lo) / 3, min=SCALE_FLOOR).half().float()
    z = lo.half().float()
    q = torch.nan_to_num(torch.floor((xf - z) / s + 0.5), nan=0.0, posinf=3.0, neginf=0.0).clamp(0, 3)
    return q * s + z          # a flat row: s rounds to 0 in fp16, the row reads back as its fp16 minimum


def q2_0_write(rows: torch.Tensor, clip: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q2_0`` storage of rows ``[..., n]`` (a token's K or V, KV heads concatenated; ``n`` a
    multiple of 32): codes ``uint8 [..., n]``, per-block ``fp16(σ)`` and stored mean ``[..., n/32]``
    (float32 holding fp16 values)."""
    x = rows.float()
    n = x.shape[-1]
    if n % Q2_0_BLOCK:
        raise ValueError(f"q2_0 rows need a multiple of {Q2_0_BLOCK} values, got {n}")
    chunk = Q2_0_CHUNK if n >= Q2_0_CHUNK else Q2_0_BLOCK
    codes, sigmas, means = [], [], []
    for start in range(0, n, chunk):
        c = x[..., start:start + chunk]
        mean = c.mean(-1, keepdim=True)
        c = c - mean
        if clip is not None and 0 < clip < 1:
            c = clip_rows(c, clip)
        b = c.reshape(*c.shape[:-1], -1, Q2_0_BLOCK)
        sigma = torch.sqrt((b * b).mean(-1, keepdim=True))
        inv = torch.where(sigma > 1e-8, 1 / sigma, torch.zeros_like(sigma))
        vs = b * inv
        q = (vs >= -Q2_0_THRESHOLD).to(torch.uint8) + (vs >= 0).to(torch.uint8) + (vs >= Q2_0_THRESHOLD).to(torch.uint8)
        m = torch.zeros(*b.shape[:-1], dtype=torch.float32)
        m[..., 0] = mean[..., 0]
        codes.append(q.reshape(c.shape))
        sigmas.append(sigma[..., 0].half().float())
        means.append(m.half().float())
    return torch.cat(codes, -1), torch.cat(sigmas, -1), torch.cat(means, -1)


def q2_0_read(codes: torch.Tensor, sigma: torch.Tensor, mean: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The values llama.cpp reads back from :func:`q2_0_write`'s storage, one head vector
    (``head_dim`` values, a multiple of 32: its views of a ``q2_0`` cache are whole blocks) at a
    time (module docstring): ``[..., n]`` float32."""
    if head_dim % Q2_0_BLOCK:
        raise ValueError(f"q2_0 reads head vectors of whole {Q2_0_BLOCK}-value blocks, head_dim is {head_dim}")
    n = codes.shape[-1]
    nb = head_dim // Q2_0_BLOCK
    group = Q2_0_CHUNK // Q2_0_BLOCK if head_dim >= Q2_0_CHUNK else 1
    levels = torch.tensor(Q2_0_LEVELS, dtype=torch.float32)
    vals = levels[codes.long()].reshape(*codes.shape[:-1], n // Q2_0_BLOCK, Q2_0_BLOCK) * sigma.unsqueeze(-1)
    first = torch.arange(n // Q2_0_BLOCK)
    first = (first // nb) * nb + ((first % nb) // group) * group          # each block's read-group leader
    return (vals + mean[..., first].unsqueeze(-1)).reshape(codes.shape)


def fake_quant_q2_0(rows: torch.Tensor, head_dim: int, clip: float | None) -> torch.Tensor:
    """Store rows ``[..., n]`` as ``q2_0`` and read them back per head (float32)."""
    return q2_0_read(*q2_0_write(rows, clip), head_dim)


def fake_quant_q8_0(x: torch.Tensor) -> torch.Tensor:
    """``q8_0`` of rows ``[..., d]`` (``d`` a multiple of 32), read back as float32: the query
    llama.cpp's CPU path scores ``q2_0`` keys with."""
    b = x.float().reshape(*x.shape[:-1], -1, Q8_0_BLOCK)
    delta = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(delta > 0, 1 / delta, torch.zeros_like(delta))
    y = b * inv
    q = torch.sign(y) * torch.floor(y.abs() + 0.5)
    return (q * delta.half().float()).reshape(x.shape)
