"""Storage format: packing order, round trips, bits, and the reference against quant.py."""

import pytest
import torch

from oscar_calib.errors import InputError
from oscar_calib.kernels import (
    QuantizedKV,
    bits_per_element,
    pack_codes,
    quantize_kv_reference,
    unpack_codes,
)
from oscar_calib.kernels.testing import kv_rows, random_rotation
from oscar_calib.numerics import quant


def test_packing_order_matches_docstring():
    # d=128, G=128: W=32, one block; byte j holds channels j, j+32, j+64, j+96 (bits 1:0 .. 7:6)
    codes = torch.zeros(1, 128, dtype=torch.uint8)
    codes[0, 5], codes[0, 32 + 5], codes[0, 64 + 5] = 1, 2, 3
    codes[0, 96 + 7] = 1
    packed = pack_codes(codes, 128)[0]
    assert packed.shape == (32,)
    assert int(packed[5]) == 1 | (2 << 2) | (3 << 4)
    assert int(packed[7]) == 1 << 6
    assert int(packed.sum()) == int(packed[5]) + int(packed[7])
    # d=256, G=32: W=32, two blocks of 128 channels; channel 128 + 32 + 3 -> byte 32 + 3, bits 3:2
    codes = torch.zeros(256, dtype=torch.uint8)
    codes[128 + 32 + 3] = 3
    packed = pack_codes(codes, 32)
    assert int(packed[35]) == 3 << 2 and int(packed.sum()) == 3 << 2


@pytest.mark.parametrize("d,g", [(64, 16), (64, 64), (128, 32), (128, 128), (256, 32), (96, 32), (16, 4)])
def test_pack_round_trip(d, g):
    gen = torch.Generator().manual_seed(d + g)
    codes = torch.randint(0, 4, (3, 5, d), dtype=torch.uint8, generator=gen)
    packed = pack_codes(codes, g)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, d // 4)
    assert torch.equal(unpack_codes(packed, g), codes)


def test_bits_per_element():
    assert bits_per_element(128) == 2.25
    assert bits_per_element(64) == 2.5
    assert bits_per_element(32) == 3.0


@pytest.mark.parametrize("d,g", [(64, 32), (128, 128), (256, 64)])
def test_reference_matches_quant_primitives(d, g):
    gen = torch.Generator().manual_seed(7)
    x = kv_rows((40, 2, d), torch.bfloat16, generator=gen)
    rot = random_rotation(2, d, generator=gen)
    clip = torch.tensor([0.96, 0.9])
    res = quantize_kv_reference(x, rot, clip, g)
    # codes: exactly quant.quantize_int2 after rotate + clip
    y = quant.clip_rows(torch.einsum("thd,hde->the", x.float(), rot), clip.double())
    codes, scale, zero = quant.quantize_int2(y, g)
    assert torch.equal(res.unpacked_codes(), codes)
    # dequantised values: quant.simulate_kv_quant up to the fp16 storage of scale and offset
    sim = quant.simulate_kv_quant(x, rot, clip, g)
    tol = (4e-3 * scale.repeat_interleave(g, dim=-1)) + 1e-6
    assert ((res.dequantize() - sim).abs() <= tol).all()
    assert res.scale.dtype == torch.float16 and res.offset.dtype == torch.float16


def test_constant_group_reconstructs_without_nan():
    x = torch.randn(4, 1, 64)
    x[1, 0, :32] = 5.0  # a constant group: scale floors at 1e-8 (0 in fp16)
    res = quantize_kv_reference(x, None, None, 32)
    deq = res.dequantize()
    assert torch.isfinite(deq).all()
    assert torch.allclose(deq[1, 0, :32], torch.full((32,), 5.0))


def test_quantized_kv_rejects_bad_fields():
    codes = torch.zeros(3, 2, 32, dtype=torch.uint8)
    good = torch.zeros(3, 2, 1, dtype=torch.float16)
    QuantizedKV(codes, good, good, 128)
    with pytest.raises(InputError, match="float16"):
        QuantizedKV(codes, good.float(), good, 128)
    with pytest.raises(InputError, match="shape"):
        QuantizedKV(codes, torch.zeros(3, 2, 2, dtype=torch.float16), good, 128)
    with pytest.raises(InputError, match="power of two"):
        QuantizedKV(codes, good, good, 96)
