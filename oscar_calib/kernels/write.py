"""KV-cache write path: rotate, clip, quantise to INT2 and pack (Triton kernel + torch reference).

``quantize_kv(x, rotation, clip, group_size)`` takes K or V rows ``[..., kv_heads, d]``
(bf16/fp16/fp32), rotations ``[kv_heads, d, d]`` (fp32, or None), clip ratios ``[kv_heads]``
(or a float, or None = no clip), and returns a :class:`~oscar_calib.kernels.pack.QuantizedKV`
with ``codes uint8 [..., kv_heads, d/4]``, ``scale``/``offset`` float16 ``[..., kv_heads, d/G]``.

Per row (token, KV head), exactly the conventions of :mod:`oscar_calib.numerics.quant`:

1. rotate ``y = x @ R[h]`` (float32 result), then subtract ``center[h]`` when given (key centering:
   ``center = μ @ R``, so ``y = (x − μ) @ R``; one ``[kv_heads, d]`` float32 operand, a load and
   a subtraction per row, cheaper than centering before the product);
2. clip: ``t = sorted(|y|)[min(floor(c*d), d-1)]``, ``y = max(min(y, t), -t)``;
3. per group of G channels: ``s = max((max-min)/3, 1e-8)``, ``z = -min/s``,
   ``q = clamp(floor(y/s + z + 0.5), 0, 3)``;
4. store ``fp16(s)``, ``fp16(-z*s)`` and the packed codes (:mod:`.pack`).

The Triton kernel reproduces the reference's arithmetic: the clip threshold is selected
exactly (ties included) and ``floor(y/s + z + 0.5)`` is evaluated with IEEE division (``div_rn``)
or, equivalently, by thresholds derived from it exactly, so codes agree bit for bit when the
rotated values agree. The rotation is the one place the arithmetic differs: for 16-bit inputs the kernel splits ``R``
into a 16-bit high part and a 16-bit residual and runs two tensor-core products with fp32
accumulation (``x @ R_hi + x @ R_lo``, about 1e-6 relative error, against the reference's fp32
matmul); for fp32 inputs it runs one fp32 ("ieee") product. Different summation orders move
``y`` by an ulp or so, which flips a code by one level only where ``y/s + z + 0.5`` lies within
that distance of an integer (a rounding tie): in practice about one per million codes.
``fast_rotation=True`` uses the high part only (one product, ~1e-3 relative error in ``y``;
about 0.1% of codes move by one level), and ``config={"fast_div": True}`` (general kernel)
multiplies by ``1/s`` instead of dividing (codes may move at rounding ties).

Two Triton kernels (:mod:`._write_triton`): the general one, and a plane-wise one for rows of a
single byte block (``d == 4 * min(G, d/4)``, e.g. d = 128 with any G >= 32) that holds the row as
four ``[rows, d/4]`` tensors (one per bit plane), so the clip selection, the group statistics and
the packing need no data movement between threads. ``config={"planes": ...}`` picks one; by
default the plane-wise kernel runs wherever it applies. With a rotation it takes one ``[rows, d]``
product split into the planes (``"split": True``; four narrow products, ``False``, are slower).
Its clip threshold comes from a tournament (``"select": "sorted"``): each column's four plane
values are sorted once, and a round pops the row's largest column head. That is one compare, four
selects and one row reduction per column per round, instead of a compare, a select and a maximum
per value; a row needs ``m = d - floor(c*d)`` rounds (2-20 for the bundled zoo's clip ratios), so
the clip's cost grows with ``m``. It is exact: a count check (exactly ``m`` values at least the
answer) and a tie-aware fallback. ``"select_top3"`` keeps each column's three largest values only;
the count check catches a column that held four of the top ``m``, which is common for large
``m``, so it is off. Unrotated 16-bit input
always takes rounds over its unique integer keys (a tournament there measured slower: it needs
255 registers).

Codes come from three thresholds per group instead of a division per value (exact; see
:mod:`._write_triton`), ``config={"quantize": "divide"}`` divides. The thresholds are exact by
their derivation (``_write_triton._thresholds``); ``config={"check_thresholds": True}`` re-checks
each with the reference arithmetic (two divisions). With ``"late_clip"`` (default) the codes come
from the unclipped values and the clip enters only through each group's extremes (clipping is
monotone), checked per group: a block with a group that is degenerate after the clip clips and
divides. ``"sign_bits"`` (default) takes ``y >= T`` as the sign of ``pred(T) - y``: a subtraction
on the FMA pipe instead of a compare and a select on the ALU pipe, which bounds this kernel.
With a 16-bit rotation at d <= 128 the grid is persistent: each program keeps R's two
parts in shared memory and loops over row blocks (``programs_per_sm``, default 2; 0 for one
program per 64-row block). ``maxnreg`` caps the registers per thread.

Kernel cost (H100, 128K tokens x 8 heads, d = 128, bf16 in, 3.0 TB/s copy;
``scripts/bench/bench_kernels.py``; see docs/design/kernels.md): rotate + clip + quantise + pack at
the bundled zoo's clip ratios (0.88-0.95 over the heads: 7-16 tournament rounds) 441 us (695 GB/s,
23% of copy); at clip ratio 0.96 (6 rounds) 332 us (31%). Dividing instead of thresholds took 36%
longer, one program per row block instead of the persistent grid 11% longer. Rotate without clip
223 us (46%).
Without rotation: with clip 218 us (47%), neither 143 us (71%; Nsight Compute: memory-bound, 76%
of DRAM peak). With rotation and clip Nsight Compute finds 132 M warp instructions for 1 M rows at
42% issue, the ALU pipe (compares, min/max, selects) 61% busy and 94% without the rotation: the
clip selection, the codes and the two 16-bit rotation products stand between it and 60%.
"""

from __future__ import annotations

import math

import torch

from ..contract.defaults import default_group_size
from ..errors import InputError
from ..numerics import quant
from ._common import (
    check_group,
    check_tensor,
    derived,
    head_dim_problem,
    interpreting,
    load_triton_module,
    resolve_backend,
    same_device,
    sm_count,
)
from .pack import PARAM_DTYPE, QuantizedKV, pack_codes, to_param

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _validate(x, rotation, clip, group_size, center=None) -> tuple[int, int, int, torch.Tensor | None]:
    check_tensor("x", x, dtypes=X_DTYPES)
    if x.ndim < 2:
        raise InputError(f"x must be [..., kv_heads, head_dim], got shape {tuple(x.shape)}")
    kvh, d = x.shape[-2], x.shape[-1]
    if group_size is None:
        group_size = default_group_size(d)
    check_group(d, group_size)
    if rotation is not None:
        check_tensor("rotation", rotation, ndim=3, dtypes=(torch.float32, torch.float64))
        if tuple(rotation.shape) != (kvh, d, d):
            raise InputError(
                f"rotation must be [kv_heads, d, d] = {[kvh, d, d]}, got {list(rotation.shape)}"
            )
        same_device(("x", x), ("rotation", rotation))
    clip_t = None
    if clip is not None:
        if isinstance(clip, (int, float)) and not isinstance(clip, bool):
            if not 0 < float(clip) <= 1:
                raise InputError(f"clip ratio must be in (0, 1], got {clip}")
            clip_t = None if float(clip) == 1.0 else torch.full((kvh,), float(clip), device=x.device)
        else:
            check_tensor("clip", clip, dtypes=(torch.float32, torch.float64))
            if clip.ndim == 0:
                clip = clip.expand(kvh)
            if tuple(clip.shape) != (kvh,):
                raise InputError(f"clip must be a float or [kv_heads] = [{kvh}], got {list(clip.shape)}")
            same_device(("x", x), ("clip", clip))
            clip_t = clip
    if center is not None:
        check_tensor("center", center, ndim=2, dtypes=(torch.float32,), shape={0: kvh, 1: d})
        same_device(("x", x), ("center", center))
    return kvh, d, group_size, clip_t


def quantize_kv_reference(
    x: torch.Tensor,
    rotation: torch.Tensor | None,
    clip: torch.Tensor | float | None,
    group_size: int | None = None,
    center: torch.Tensor | None = None,
) -> QuantizedKV:
    """Pure-torch reference of :func:`quantize_kv` (built from :mod:`oscar_calib.numerics.quant`)."""
    kvh, d, group_size, clip_t = _validate(x, rotation, clip, group_size, center)
    y = x.float()
    if rotation is not None:
        y = torch.einsum("...hd,hde->...he", y, rotation.float())
    if center is not None:
        y = y - center
    if clip_t is not None:
        y = quant.clip_rows(y, clip_t.to(torch.float64))
    codes, scale, zero = quant.quantize_int2(y, group_size)
    offset = -(zero * scale)
    return QuantizedKV(pack_codes(codes, group_size), to_param(scale), to_param(offset), group_size)


def _triton_support(d: int, group_size: int) -> str | None:
    return head_dim_problem(d, "write")


def quantize_kv(
    x: torch.Tensor,
    rotation: torch.Tensor | None,
    clip: torch.Tensor | float | None,
    group_size: int | None = None,
    *,
    center: torch.Tensor | None = None,
    backend: str = "auto",
    out: QuantizedKV | None = None,
    fast_rotation: bool = False,
    config: dict | None = None,
) -> QuantizedKV:
    """Rotate, clip, INT2-quantise and pack K or V rows.

    Args:
        x: ``[..., kv_heads, d]`` bf16/fp16/fp32 rows (one per token and KV head).
        rotation: ``[kv_heads, d, d]`` float32 (``x @ R``), or None for no rotation.
        clip: clip ratio per KV head ``[kv_heads]``, a float for all heads, or None (no clip).
        group_size: channels per quantisation group (power of two dividing d);
            default ``min(128, d)``.
        center: ``[kv_heads, d]`` float32 subtracted from every rotated row (key centering:
            ``μ @ R``), or None.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"`` (see :mod:`._common`).
        out: optional preallocated :class:`QuantizedKV` (e.g. a slice of a cache) whose
            tensors have the leading shape of ``x``; written in place and returned.
        fast_rotation: Triton only: one 16-bit product for the rotation instead of two
            (see the module docstring).
        config: Triton tuning overrides (``BT``, ``num_warps``, ``KB``, ``planes``: True,
            False or "auto", ``split``, ``select``: "sorted", "rounds" or "auto",
            ``fast_div``, ``programs_per_sm``: a persistent grid whose programs load the
            rotation once, 0 for one program per row block, ``quantize``: "thresholds" or
            "divide", ``num_stages``); for benchmarks.

    Returns:
        :class:`QuantizedKV` with codes ``uint8 [..., kv_heads, d/4]`` and fp16 scale/offset
        ``[..., kv_heads, d/G]``.
    """
    kvh, d, group_size, clip_t = _validate(x, rotation, clip, group_size, center)
    lead = tuple(x.shape[:-2])
    if out is not None:
        if not isinstance(out, QuantizedKV):
            raise InputError("out must be a QuantizedKV")
        if tuple(out.codes.shape) != lead + (kvh, d // 4) or out.group_size != group_size:
            raise InputError(
                f"out.codes has shape {tuple(out.codes.shape)} (group size {out.group_size}), "
                f"expected {lead + (kvh, d // 4)} (group size {group_size})"
            )
    which = resolve_backend(backend, [x], _triton_support(d, group_size))
    if which == "torch":
        res = quantize_kv_reference(x, rotation, clip_t, group_size, center)
        if out is None:
            return res
        out.codes.copy_(res.codes)
        out.scale.copy_(res.scale)
        out.offset.copy_(res.offset)
        return out
    return _quantize_kv_triton(x, rotation, clip_t, group_size, out, fast_rotation, config or {}, center)


def _flat(t: torch.Tensor, name: str, kvh: int) -> torch.Tensor:
    try:
        v = t.view(-1, kvh, t.shape[-1])
    except RuntimeError as e:
        raise InputError(f"{name} cannot be viewed as [tokens, kv_heads, n]: {e}") from None
    if v.stride(-1) != 1:
        raise InputError(f"{name} must be contiguous in its last dimension")
    return v


# the compiled kernel of the latest Triton launch (register/spill reports for benchmarks)
LAST_LAUNCH: dict = {}
# Tuning defaults of the write kernels (H100, 128K tokens x 8 heads, d = 128, rotation and clip unless
# said; the measurements and the variants not adopted: see docs/design/kernels.md). The plane-wise
# kernel runs wherever it applies (without rotation or clip 147 against 223 us for the general one); its
# clip threshold comes from the tournament ("select": "sorted": 428 against 480 us for rounds), except
# for unrotated 16-bit input, whose rounds over integer keys beat a tournament (289 against 356 us).
# the rotation as one [BT, d] product split into the four planes (four narrow products: 565 against 428 us)
DEFAULT_SPLIT = True
# programs per SM of the persistent grid with a resident rotation (0: one program per row block):
# 2 (two stages) 428 us against 456 us per block and 972 us for 1 per SM
DEFAULT_PROGRAMS_PER_SM = 2
RESIDENT_BYTES = 64 * 1024
# tile of the persistent grid (rows per block, warps, pipeline stages): 128 rows over 8 warps with
# 3 stages 397-412 us against 427-431 us for 64 rows, 4 warps, 2 stages; other tiles were slower
RESIDENT_TILE = {"BT": 128, "num_warps": 8, "num_stages": 3}
# plane-wise kernel: codes by three exact thresholds per group ("thresholds") or by division
DEFAULT_QUANTIZE = "thresholds"
# codes by thresholds from the unclipped values, the clip entering only through each group's
# extremes (exact: a per-group check sends a block to the clipped division otherwise)
DEFAULT_LATE_CLIP = True
# tournament columns keep their three largest values (the count check refuses a miss): off. It pays
# only where a head's clip needs few rounds (m = d - floor(clip * d)); at the bundled zoo's ratios
# (0.85-0.99, median m = 11) a column often holds four of a row's top m and the block selects again:
# the zoo's spread of ratios 599.9 against 430.5 us (H200)
DEFAULT_SELECT_TOP3 = False
# each group's thresholds re-checked by the reference arithmetic (two divisions per threshold);
# without, the derivation's exactness rests on its proof (``_write_triton._thresholds``), and only
# non-finite values or |z| >= 2^50 (groups of huge, nearly equal values) send a block to the division
DEFAULT_CHECK_THRESHOLDS = False
# compares as the sign bit of a difference (``y >= T`` as ``pred(T) - y < 0``) in the codes and the
# tie check: a subtraction on the FMA pipe and a shift instead of a compare and a select on the
# busier ALU pipe (clip ratio 0.96: 332 against 353 us)
DEFAULT_SIGN_BITS = True


def clip_indices(clip: torch.Tensor | None, d: int, device) -> torch.Tensor:
    """Per head, the index ``min(floor(c * d), d - 1)`` of the clip threshold in the sorted ``|row|``
    (int32, cached per clip tensor; one unused zero when there is no clip)."""
    if clip is None:
        return torch.zeros(1, dtype=torch.int32, device=device)
    return derived(clip, ("kidx", d), lambda: torch.clamp(
        torch.floor(clip.to(torch.float64) * d), max=d - 1).to(torch.int32).contiguous())


def _split_rotation(rotation: torch.Tensor, dtype: torch.dtype, rot_mode: int):
    rf = rotation.float()
    if rot_mode == 2:
        r = rf.contiguous()
        return r, r
    hi = rf.to(dtype).contiguous()
    if rot_mode == 3:
        return hi, hi
    return hi, (rf - hi.float()).to(dtype).contiguous()


def _quantize_kv_triton(x, rotation, clip_t, group_size, out, fast_rotation, config, center=None) -> QuantizedKV:
    mod = load_triton_module("_write_triton")
    kvh, d = x.shape[-2], x.shape[-1]
    lead = tuple(x.shape[:-2])
    ng = d // group_size
    if out is None:
        out = QuantizedKV(
            torch.empty(lead + (kvh, d // 4), dtype=torch.uint8, device=x.device),
            torch.empty(lead + (kvh, ng), dtype=PARAM_DTYPE, device=x.device),
            torch.empty(lead + (kvh, ng), dtype=PARAM_DTYPE, device=x.device),
            group_size,
        )
    x3 = x.reshape(-1, kvh, d)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    codes3 = _flat(out.codes, "out.codes", kvh)
    scale3 = _flat(out.scale, "out.scale", kvh)
    off3 = _flat(out.offset, "out.offset", kvh)
    if scale3.stride() != off3.stride():
        raise InputError("out.scale and out.offset must have the same strides")
    n_tok = x3.shape[0]
    if n_tok == 0:
        return out
    if rotation is None:
        rot_mode, r1, r2 = 0, x3, x3
    else:
        rot_mode = 2 if x3.dtype == torch.float32 else (3 if fast_rotation else 1)
        r1, r2 = derived(rotation, ("rot", x3.dtype, rot_mode), lambda: _split_rotation(rotation, x3.dtype, rot_mode))
    kidx = clip_indices(clip_t, d, x.device)
    kb = min(d, int(config.get("KB", 64)))
    w = min(group_size, d // 4)
    planes = config.get("planes", "auto")
    if planes == "auto":  # measured faster everywhere it applies, given the split product
        planes = rot_mode == 0 or bool(config.get("split", DEFAULT_SPLIT))
    planes = bool(planes) and d == 4 * w
    kern = mod.quantize_kv_planes_kernel if planes else mod.quantize_kv_kernel
    # (centered rows are no longer 16-bit values: the unique integer keys need the inputs as they are)
    keyed = rot_mode == 0 and center is None and x3.dtype in (torch.bfloat16, torch.float16) and d <= 256
    select = config.get("select", "auto")
    if select not in ("auto", "sorted", "rounds"):
        raise InputError(f"config select must be 'auto', 'sorted' or 'rounds', got {select!r}")
    tile = {"BT": 64 if d <= 128 else 32, "num_warps": 4 if d <= 128 else 8, "num_stages": 3}
    if planes:
        split = bool(config.get("split", DEFAULT_SPLIT))
        quantize = config.get("quantize", DEFAULT_QUANTIZE)
        if quantize not in ("thresholds", "divide"):
            raise InputError(f"config quantize must be 'thresholds' or 'divide', got {quantize!r}")
        extra = {"SPLIT": split, "SORTED": select != "rounds", "THRESH": quantize == "thresholds",
                 "LATE": bool(config.get("late_clip", DEFAULT_LATE_CLIP)),
                 "TOP3": bool(config.get("select_top3", DEFAULT_SELECT_TOP3)),
                 "CHECKT": bool(config.get("check_thresholds", DEFAULT_CHECK_THRESHOLDS)),
                 "SIGNS": bool(config.get("sign_bits", DEFAULT_SIGN_BITS))}
        # resident rotation: a persistent grid of programs that load R once (16-bit rotations
        # whose parts fit 64 KB of shared memory, i.e. d <= 128)
        per_sm = int(config.get("programs_per_sm", DEFAULT_PROGRAMS_PER_SM))
        r_bytes = d * d * 2 * (2 if rot_mode == 1 else 1)
        if split and rot_mode in (1, 3) and per_sm > 0 and r_bytes <= RESIDENT_BYTES:
            extra["RES"] = True
            tile = dict(RESIDENT_TILE)
    else:
        extra = {"FAST_DIV": bool(config.get("fast_div", False))}
    tile.update({k: int(config[k]) for k in tile if k in config})
    bt = tile["BT"]
    # register cap per thread (0 or absent: none), e.g. 128 with one stage lets two 8-warp programs
    # share an SM
    launch = {"maxnreg": int(config["maxnreg"])} if int(config.get("maxnreg", 0) or 0) > 0 and not interpreting() else {}
    grid = (math.ceil(n_tok / bt), kvh)
    if extra.get("RES"):  # (the interpreter: two programs per head, so that each one loops)
        per_head = 2 if interpreting() or not x3.is_cuda else -(-per_sm * sm_count(x3.device) // kvh)
        grid = (max(1, min(grid[0], per_head)), kvh)
    LAST_LAUNCH["write"] = kern[grid](
        x3, x3.stride(0), x3.stride(1),
        r1, r2, kidx, center.contiguous() if center is not None else kidx,
        codes3, codes3.stride(0), codes3.stride(1),
        scale3, off3, scale3.stride(0), scale3.stride(1),
        n_tok,
        D=d, G=group_size, W=w, BT=bt, KB=kb,
        ROT=rot_mode, CLIP=clip_t is not None, INTERP=interpreting(),
        KEYED=keyed, CENTER=center is not None,
        num_warps=tile["num_warps"], num_stages=tile["num_stages"], **extra, **launch,
    )
    return out
