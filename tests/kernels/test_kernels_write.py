"""Write kernel (rotate, clip, INT2, pack) against its pure-torch reference."""

import pytest
import torch
import triton
import triton.language as tl
from factories import grid

from oscar_calib.errors import InputError
from oscar_calib.kernels import QuantizedKV, quantize_kv, quantize_kv_reference
from oscar_calib.kernels import write as write_mod
from oscar_calib.kernels._common import load_triton_module
from oscar_calib.kernels.testing import code_agreement, kv_rows, random_rotation

# kernel variants: the general kernel and the plane-wise one (one product per plane, or one
# [BT, d] product split into planes; clip selection by rounds or by a tournament); "planes" only applies where d == 4 * min(G, d/4)
KERNELS = {
    "general": {"planes": False},
    "planes": {"planes": True, "split": False, "select": "rounds"},
    "planes_split": {"planes": True, "split": True, "select": "rounds"},
    # the clip threshold by a tournament over each column's sorted plane values (the default,
    # except for unrotated 16-bit input, which always takes rounds over integer keys)
    "planes_sorted": {"planes": True, "split": True, "select": "sorted"},
    # with a 16-bit rotation the default is a persistent grid whose programs load the rotation
    # once and loop over row blocks (under the interpreter: two programs per head, so each takes
    # several blocks); this is one program per row block
    "planes_per_block": {"planes": True, "split": True, "select": "sorted", "programs_per_sm": 0},
    # codes by division instead of by the three exact thresholds per group
    "planes_divide": {"planes": True, "split": True, "select": "sorted", "quantize": "divide"},
    # "planes_sorted" takes the defaults: codes by thresholds of the unclipped values (the clip
    # enters through the group extremes), a tournament over each column's four values, thresholds
    # not re-checked by division, compares as signs of differences;
    # "planes_early": clip first, four values per column, thresholds re-checked, compares and
    # selects
    "planes_early": {"planes": True, "split": True, "select": "sorted", "late_clip": False, "select_top3": False,
                     "check_thresholds": True, "sign_bits": False},
    # the tournament over each column's three largest values only
    "planes_top3": {"planes": True, "split": True, "select": "sorted", "select_top3": True},
}

# At most this fraction of codes may differ, by one level, where the kernel's rotation (another
# summation order) moves y/s + z + 0.5 across an integer: a rounding tie. Seen: 0.
TIE_FRACTION = 1e-3


def _poisoned(lead, h, d, g, device, fill):
    ng = d // g
    return QuantizedKV(
        torch.full(lead + (h, d // 4), fill, dtype=torch.uint8, device=device),
        torch.full(lead + (h, ng), float("nan"), dtype=torch.float16, device=device),
        torch.full(lead + (h, ng), float("nan"), dtype=torch.float16, device=device),
        g,
    )


def _check_close(res: QuantizedKV, ref: QuantizedKV, exact: bool = False):
    assert torch.isfinite(res.scale.float()).all() and torch.isfinite(res.offset.float()).all()
    if exact:
        assert torch.equal(res.codes.cpu(), ref.codes.cpu())
        assert torch.equal(res.scale.cpu(), ref.scale.cpu())
        assert torch.equal(res.offset.cpu(), ref.offset.cpu())
        return
    worst, frac = code_agreement(res, ref)
    assert worst <= 1 and frac <= TIE_FRACTION, (worst, frac)
    s_ref = ref.scale.float().cpu()
    torch.testing.assert_close(res.scale.float().cpu(), s_ref, rtol=2e-3, atol=0.0)
    torch.testing.assert_close(res.offset.float().cpu(), ref.offset.float().cpu(), rtol=2e-3, atol=1e-6)
    # dequantised values: within one level where a code moved, ~fp16 rounding elsewhere
    g = res.group_size
    step = s_ref.repeat_interleave(g, dim=-1)
    dev = (res.dequantize().cpu() - ref.dequantize().cpu()).abs()
    assert (dev <= 1.01 * step + 1e-5).all()
    assert dev.mean() <= 2e-3 * step.mean()


SHAPES = [  # dtype, head_dim, group size, tokens, KV heads
    (torch.bfloat16, 64, 32, 37, 2),
    (torch.float16, 128, 128, 50, 1),
    (torch.bfloat16, 128, 64, 9, 3),
    (torch.float32, 256, 32, 20, 2),
    (torch.bfloat16, 256, 128, 33, 1),
]


# every kernel on every shape; under the interpreter every kernel once and every shape at least
# once (kernel i on shape i mod 5)
@pytest.mark.parametrize("kernel,dtype,d,g,tokens,heads",
                         grid([(k, *s) for s in SHAPES for k in KERNELS],
                              [(k, *SHAPES[i % len(SHAPES)]) for i, k in enumerate(KERNELS)]))
def test_write_kernel_matches_reference(dtype, d, g, tokens, heads, kernel, device):
    gen = torch.Generator().manual_seed(d * 7 + g + tokens)
    x = kv_rows((tokens, heads, d), dtype, generator=gen, device=device)
    rot = random_rotation(heads, d, generator=gen, device=device)
    # 0.3 takes the kernel's min-removal branch, 1.0 the no-op clip
    clip = torch.tensor([0.96, 0.3, 1.0][:heads], device=device)
    ref = quantize_kv_reference(x.cpu(), rot.cpu(), clip.cpu(), g)
    results = []
    for fill in (0x00, 0xFF):  # two poisons: every code byte must be written
        out = _poisoned((tokens,), heads, d, g, device, fill)
        res = quantize_kv(x, rot, clip, g, backend="triton", out=out, config={"BT": 16, **KERNELS[kernel]})
        assert res is out
        _check_close(res, ref)
        results.append(res.codes.cpu())
    assert torch.equal(results[0], results[1])


# (under the interpreter: the general kernel and the default plane-wise one; every variant is
# compared with the reference above, and the tournaments on degenerate groups below)
@pytest.mark.slow
@pytest.mark.parametrize("kernel", grid(["general", "planes", "planes_sorted", "planes_divide", "planes_early",
                                         "planes_top3"], ["general", "planes_sorted"]))
def test_write_kernel_identical_arithmetic_with_ties(kernel, device):
    """Without a rotation the kernel's arithmetic is the reference's: bit-identical output,
    even on a grid of values full of clip ties and rounding ties."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randint(-6, 7, (33, 2, 64), generator=gen).float() * 0.25).to(device)
    clip = torch.tensor([0.9, 0.5], device=device)
    cfg = {"BT": 16, **KERNELS[kernel]}
    for g in (16, 64):
        res = quantize_kv(x, None, clip, g, backend="triton", config=cfg)
        _check_close(res, quantize_kv_reference(x.cpu(), None, clip.cpu(), g), exact=True)
    res = quantize_kv(x.half(), None, None, 32, backend="triton", config=cfg)
    _check_close(res, quantize_kv_reference(x.half().cpu(), None, None, 32), exact=True)
    # 16-bit input without a rotation takes the integer-key clip selection (both branches)
    for dt in (torch.bfloat16, torch.float16):
        xb = (x * 1.37).to(dt)
        for g in (16, 64):
            res = quantize_kv(xb, None, clip, g, backend="triton", config=cfg)
            _check_close(res, quantize_kv_reference(xb.cpu(), None, clip.cpu(), g), exact=True)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", grid(["planes_sorted", "planes_early", "planes_top3"], ["planes_sorted", "planes_top3"]))
def test_write_kernel_degenerate_groups(kernel, device):
    """Groups whose values are all equal, or differ by a few ulps around a large offset, after the
    clip: codes by thresholds of unclipped values cannot stand in for the clipped ones there (the
    kernel checks each group and divides the clipped values instead); exact either way."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(40, 2, 64, generator=gen)
    x[:8] = 3.0  # constant rows: every group degenerate
    x[8:16] = 1000.0 + torch.randint(-3, 4, (8, 2, 64), generator=gen).float() * 6.1e-5
    x[16:20] = 0.0
    x[18:20, :, ::2] = -0.0  # negative zeros: a threshold at +0 must take them as +0
    x[20:32] = 3.0  # equal values with a few beyond the clip on either side: clipped, all equal
    x[20:24, :, :5] = 50.0
    x[24:28, :, 3:6] = -50.0
    x[28:32] *= -1
    x[28:32, :, 60:] = 40.0
    x[32:36, :, [2, 18, 34, 50]] = torch.tensor([30.0, 31.0, 32.0, 33.0])  # one column holds the top 4
    # two columns hold the top 8
    x[36:40, :, [2, 18, 34, 50, 10, 26, 42, 58]] = torch.arange(30.0, 38.0)
    cfg = {"BT": 16, **KERNELS[kernel]}
    clip = torch.tensor([0.9, 0.5], device=device)
    for dt in (torch.float32, torch.bfloat16):
        xd = x.to(dt)
        for g in (16, 64):
            res = quantize_kv(xd.to(device), None, clip, g, backend="triton", config=cfg)
            _check_close(res, quantize_kv_reference(xd, None, clip.cpu(), g), exact=True)


def test_write_kernel_leading_dims_and_scalar_clip(device):
    gen = torch.Generator().manual_seed(11)
    x = kv_rows((2, 5, 2, 64), torch.bfloat16, generator=gen, device=device)
    rot = random_rotation(2, 64, generator=gen, device=device)
    res = quantize_kv(x, rot, 0.92, None, backend="triton")
    assert res.codes.shape == (2, 5, 2, 16) and res.scale.shape == (2, 5, 2, 1)
    _check_close(res, quantize_kv_reference(x.cpu(), rot.cpu(), 0.92, None))


def test_write_kernel_into_head_major_cache(device):
    """``out`` may be a strided view, e.g. one sequence of a [H, L, ...] head-major buffer."""
    gen = torch.Generator().manual_seed(5)
    h, d, g, t = 2, 128, 32, 24
    x = kv_rows((t, h, d), torch.float16, generator=gen, device=device)
    rot = random_rotation(h, d, generator=gen, device=device)
    codes = torch.full((h, 40, d // 4), 0xAB, dtype=torch.uint8, device=device)
    scale = torch.full((h, 40, d // g), float("nan"), dtype=torch.float16, device=device)
    offset = scale.clone()
    view = QuantizedKV(codes[:, 8:32].transpose(0, 1), scale[:, 8:32].transpose(0, 1),
                       offset[:, 8:32].transpose(0, 1), g)
    quantize_kv(x, rot, 0.95, g, backend="triton", out=view)
    _check_close(view, quantize_kv_reference(x.cpu(), rot.cpu(), 0.95, g))
    assert (codes[:, :8] == 0xAB).all() and (codes[:, 32:] == 0xAB).all()
    assert torch.isnan(scale[:, :8].float()).all() and torch.isnan(scale[:, 32:].float()).all()


def test_fast_division_differs_only_at_ties(device):
    """``fast_div`` (y * (1/s) instead of y / s) may move a code by one level at a rounding tie."""
    gen = torch.Generator().manual_seed(4)
    x = kv_rows((48, 2, 128), torch.bfloat16, generator=gen, device=device)
    rot = random_rotation(2, 128, generator=gen, device=device)
    res = quantize_kv(x, rot, 0.96, 64, backend="triton", config={"fast_div": True})
    _check_close(res, quantize_kv_reference(x.cpu(), rot.cpu(), 0.96, 64))


def test_fast_rotation_is_close(device):
    gen = torch.Generator().manual_seed(9)
    x = kv_rows((64, 2, 128), torch.bfloat16, generator=gen, device=device)
    rot = random_rotation(2, 128, generator=gen, device=device)
    res = quantize_kv(x, rot, 0.96, 128, backend="triton", fast_rotation=True)
    worst, frac = code_agreement(res, quantize_kv_reference(x.cpu(), rot.cpu(), 0.96, 128))
    assert worst <= 1 and frac < 0.01


def test_write_input_errors(device):
    x = torch.randn(4, 2, 64, device=device)
    rot = torch.eye(64, device=device).expand(2, 64, 64).contiguous()
    with pytest.raises(InputError, match="dtype"):
        quantize_kv(x.to(torch.int32), rot, 1.0, 32, backend="triton")
    with pytest.raises(InputError, match="kv_heads, head_dim"):
        quantize_kv(x[0, 0], rot, 1.0, 32, backend="triton")
    with pytest.raises(InputError, match="rotation must be"):
        quantize_kv(x, rot[:1], 1.0, 32, backend="triton")
    with pytest.raises(InputError, match="dtype"):
        quantize_kv(x, rot.half(), 1.0, 32, backend="triton")
    with pytest.raises(InputError, match="not a power of two dividing head_dim"):
        quantize_kv(torch.randn(4, 2, 96, device=device), None, 1.0, 64, backend="triton")
    with pytest.raises(InputError, match="not a power of two"):
        quantize_kv(torch.randn(4, 2, 96, device=device), None, 1.0, 48, backend="triton")
    with pytest.raises(InputError, match=r"clip ratio must be in \(0, 1\]"):
        quantize_kv(x, rot, 1.5, 32, backend="triton")
    with pytest.raises(InputError, match="clip must be"):
        quantize_kv(x, rot, torch.ones(3, device=device), 32, backend="triton")
    with pytest.raises(InputError, match="unknown kernel backend"):
        quantize_kv(x, rot, 1.0, 32, backend="cuda")
    with pytest.raises(InputError, match="head_dim 96"):
        quantize_kv(torch.randn(4, 2, 96, device=device), None, 1.0, 32, backend="triton")
    with pytest.raises(InputError, match="config select must be"):
        quantize_kv(x, rot, 0.9, 32, backend="triton", config={"select": "fast"})


def test_backend_selection(monkeypatch, device):
    x = torch.randn(4, 2, 64)

    def boom(*a, **k):
        raise AssertionError("Triton path taken")

    monkeypatch.setattr(write_mod, "_quantize_kv_triton", boom)
    ref = quantize_kv_reference(x, None, None, 32)
    # auto on CPU tensors -> torch
    assert torch.equal(quantize_kv(x, None, None, 32).codes, ref.codes)
    # the environment variable forces the reference even when triton is asked for
    monkeypatch.setenv("OSCAR_KERNELS", "torch")
    assert torch.equal(quantize_kv(x, None, None, 32, backend="triton").codes, ref.codes)
    monkeypatch.setenv("OSCAR_KERNELS", "fast")
    with pytest.raises(InputError, match="OSCAR_KERNELS"):
        quantize_kv(x, None, None, 32)
    monkeypatch.delenv("OSCAR_KERNELS")
    with pytest.raises(AssertionError, match="Triton path"):  # CPU tensors run interpreted
        quantize_kv(x.to(device), None, None, 32, backend="triton")
    if device == "cuda":
        with pytest.raises(AssertionError, match="Triton path"):  # auto picks triton on CUDA
            quantize_kv(x.to(device), None, None, 32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InputError, match="needs CUDA tensors"):
        quantize_kv(x, None, None, 32, backend="triton")


# the write kernel's threshold helper, set on first use (a kernel resolves it as a global)
_THRESHOLDS = None


@triton.jit
def _thresholds_kernel(s_ptr, z_ptr, t_ptr, ok_ptr, N, BLOCK: tl.constexpr, CHECK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < N
    s = tl.load(s_ptr + i, mask=m, other=1.0)
    z = tl.load(z_ptr + i, mask=m, other=0.0)
    t1, t2, t3, ok = _THRESHOLDS(s, z, CHECK)
    tl.store(t_ptr + i * 3, t1, mask=m)
    tl.store(t_ptr + i * 3 + 1, t2, mask=m)
    tl.store(t_ptr + i * 3 + 2, t3, mask=m)
    tl.store(ok_ptr + i, ok.to(tl.int32), mask=m)


def _level_np(y, s, z):
    """The reference's ``floor(fl(fl(y / s) + z) + 0.5)`` in float32 (numpy rounds each step)."""
    import numpy as np

    f = np.float32
    return np.floor(f(f(f(y) / f(s)) + f(z)) + f(0.5))


@pytest.mark.parametrize("check", [True, False])
def test_level_thresholds_are_exact(check, device):
    """The write kernel's codes by thresholds: for every group ``T_k`` is the smallest float32 whose
    level (the reference's arithmetic) reaches ``k``; with ``check`` the kernel's own verification
    agrees, without it the derivation alone gets every finite case right (and refuses NaN)."""
    import numpy as np

    global _THRESHOLDS
    mod = load_triton_module("_write_triton")
    _THRESHOLDS = mod._thresholds
    # U_k: the smallest float32 u with fl(u + 0.5) >= k, as the kernel assumes
    f32 = np.float32
    for k, u in ((1, mod.U1.value), (2, 1.5), (3, 2.5)):
        u = f32(u)
        assert f32(u + f32(0.5)) >= k > f32(np.nextafter(u, f32(-1)) + f32(0.5))

    gen = torch.Generator().manual_seed(8)
    n = 4096
    s = torch.exp(torch.empty(n).uniform_(-18.4, 7.0, generator=gen))  # 1e-8 .. 1e3
    z = torch.cat([torch.empty(n // 4).uniform_(0, 3, generator=gen),
                   torch.empty(n // 8).uniform_(-40, 40, generator=gen),
                   torch.randn(n // 8, generator=gen) * 1e6,
                   # where float64's m - z is inexact: |z| >= 2^26, or tiny
                   torch.randn(n // 4, generator=gen) * 2.0 ** torch.empty(n // 4).uniform_(26, 60, generator=gen),
                   torch.randn(n // 4, generator=gen) * 2.0 ** torch.empty(n // 4).uniform_(-90, -20, generator=gen)])
    s[:8] = torch.tensor([1.0, 1e-8, 3.0, 0.5, 1.0, 2.0 ** -20, 1.0, 1e-8])  # exact halves: ties
    z[:8] = torch.tensor([0.0, 0.0, 1.5, 1.0, 0.5, 3.0, 2.5, -5e8])
    z[8:12] = torch.tensor([-0.0, 2.0 ** -149, -(2.0 ** -149), 2.0 ** 27 + 8])
    s[12], z[13] = float("nan"), float("nan")
    t = torch.empty(n, 3, device=device)
    ok = torch.empty(n, dtype=torch.int32, device=device)
    _thresholds_kernel[(1,)](s.to(device), z.to(device), t, ok, n, BLOCK=n, CHECK=check)
    ok = ok.cpu().bool().numpy()
    zn = z.numpy()
    assert not ok[12] and not ok[13]  # NaN
    usual = np.abs(zn) < 2.0 ** 50  # (a group's z = -min/s exceeds that only if its values are huge and nearly equal)
    usual[12:14] = False
    assert ok[usual].all()
    assert ok.sum() > n // 2
    # wherever the kernel trusts its thresholds they are exact (elsewhere its block divides)
    t, sn, zn = t.cpu().numpy()[ok], s.numpy()[ok], zn[ok]
    with np.errstate(over="ignore", invalid="ignore"):
        for k in (1, 2, 3):
            tk = t[:, k - 1]
            assert (_level_np(tk, sn, zn) >= k).all()
            assert (_level_np(np.nextafter(tk, f32(-np.inf)), sn, zn) < k).all()
