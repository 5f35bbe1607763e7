"""MXFP4/MXFP8 codecs vs compressed-tensors (packing, scale choice) and ml_dtypes (decoding)."""

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3serve.weights.mxfp4 import (
    PackedMXFP4,
    dequantize_mxfp4,
    from_ggml_blocks,
    pack_nibbles,
    quantize_mxfp4,
    to_ggml_blocks,
    unpack_nibbles,
)
from k3serve.weights.mxfp8 import dequantize_mxfp8, quantize_mxfp8


def _random_weights(seed, rows=16, cols=256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    # spread magnitudes over many binades, and plant exact ties / zeros / negative zeros
    x = x * torch.exp2(torch.randint(-20, 20, (rows, cols // 32, 1), generator=g).float()).repeat_interleave(
        32, -1
    ).reshape(rows, cols)
    x[0, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[1, :4] = torch.tensor([-0.0, 0.0, -1e-30, 1e-30])
    return x


@pytest.mark.parametrize("seed", range(4))
def test_quantize_and_pack_bit_exact_vs_compressed_tensors(seed):
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization import QuantizationArgs, QuantizationType
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    x = _random_weights(seed)
    amax = x.abs().reshape(16, -1, 32).amax(-1)
    keep = amax > 0  # the library's scale of an all-zero group is -inf; ours is 0 (codes are 0)
    ct_scale = generate_mx_scales(amax, 4)
    args = QuantizationArgs(num_bits=4, type=QuantizationType.FLOAT, group_size=32, strategy="group")
    ct_q = quantize(x=x, scale=torch.exp2(ct_scale - 127), global_scale=None, zero_point=None, args=args)
    ct_packed = pack_fp4_to_uint8(ct_q)

    codes, scale = quantize_mxfp4(x)
    assert torch.equal(scale[keep].int(), ct_scale[keep].int())
    assert torch.equal(pack_nibbles(codes), ct_packed)


def test_decode_matches_ml_dtypes_fp4_and_e8m0():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2, 2)  # [2, 32]
    scales = torch.tensor([[0], [254]], dtype=torch.uint8)
    scales = torch.tensor([[100], [130]], dtype=torch.uint8)
    ours = dequantize_mxfp4(pack_nibbles(codes), scales)
    fp4 = codes.numpy().view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    e8 = scales.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(ours.numpy(), fp4 * e8)
    assert np.array_equal(np.signbit(ours.numpy()), np.signbit(fp4))  # code 8 is -0.0


def test_e8m0_full_range_matches_ml_dtypes():
    s = torch.arange(255, dtype=torch.uint8).reshape(255, 1)
    ours = dequantize_mxfp4(torch.full((255, 16), 0x22, dtype=torch.uint8), s)[:, 0]  # code 2 = 1.0
    ref = s.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)[:, 0]
    np.testing.assert_array_equal(ours.numpy(), ref)


def test_nibble_order_low_is_even_column():
    codes = torch.tensor([[1, 2] * 16], dtype=torch.uint8)
    assert pack_nibbles(codes)[0, 0].item() == 0x21
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.floats(-30, 30), st.integers(0, 2**31 - 1))
def test_quantize_is_idempotent_and_bounded(rows, groups, log_scale, seed):
    x = torch.randn(rows, groups * 32, generator=torch.Generator().manual_seed(seed)) * 2.0**log_scale
    p = PackedMXFP4.quantize(x)
    deq = p.dequantize()
    again = PackedMXFP4.quantize(deq)
    # same scales and values (a -0 code re-encodes as +0, as compressed-tensors does)
    assert torch.equal(again.scale, p.scale) and torch.equal(again.dequantize(), deq)
    # error bound: half the largest E2M1 step (2.0 at the top binade) times the group scale
    step = torch.exp2(p.scale.float() - 127).repeat_interleave(32, -1)
    assert torch.all((x - deq).abs() <= step * 1.0 + 1e-30)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=16, max_size=16), st.integers(0, 254))
def test_ggml_repack_is_lossless(byte_list, scale):
    packed = torch.tensor([byte_list * 2], dtype=torch.uint8)  # [1, 32] -> 64 values, 2 groups
    sc = torch.tensor([[scale, 254 - scale]], dtype=torch.uint8)
    blocks = to_ggml_blocks(packed, sc)
    assert blocks.shape == (1, 2, 17)
    p2, s2 = from_ggml_blocks(blocks)
    assert torch.equal(p2, packed) and torch.equal(s2, sc)
    # independent ggml decode: doubled-integer LUT and half scale 2^(e-128), split halves
    lut = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float64)
    qs = blocks[..., 1:].long()
    vals = torch.cat((lut[qs & 15], lut[qs >> 4]), -1) * torch.exp2(blocks[..., :1].double() - 128)
    assert torch.equal(vals.reshape(1, 64), dequantize_mxfp4(packed, sc, torch.float64))


def test_mxfp8_matches_ml_dtypes_e4m3():
    x = _random_weights(7)
    codes, scale = quantize_mxfp8(x)
    s = np.exp2(scale.numpy().astype(np.float64) - 127).repeat(32, -1)
    y = np.clip(x.numpy().astype(np.float64) / s, -448, 448).astype(np.float32)
    ref_codes = y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(codes.numpy(), ref_codes)
    deq = dequantize_mxfp8(codes, scale)
    ref = ref_codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * s.astype(np.float32)
    np.testing.assert_array_equal(deq.numpy(), ref)
    rel = ((deq - x).abs() / x.abs().clamp_min(1e-30))[x.abs() > x.abs().amax() * 1e-6]
    assert rel.median() < 0.04


def test_packed_experts_take_at_most_054_bytes_per_param():
    p = PackedMXFP4.quantize(torch.randn(3072, 3584))
    assert p.nbytes / p.numel == 0.53125 <= 0.54
    assert p.packed.dtype == torch.uint8 and p.shape == (3072, 3584)


def test_lut_decode_equals_reference_dequant_on_every_byte():
    """Fast two-lookup decode == reference dequant, bit for bit in fp32, over all code bytes and
    every finite E8M0 scale (0..254, which includes fp32-subnormal 2^-127..2^-127+22)."""
    from k3serve.weights.mxfp4 import decode_mxfp4, dequantize_mxfp4

    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (255, 64), generator=g, dtype=torch.int64).to(torch.uint8)
    packed[0, :] = torch.arange(64, dtype=torch.uint8) * 4  # cover low/high nibble combinations
    scale = torch.arange(255, dtype=torch.uint8)[:, None].repeat(1, 4)  # [255, 128/32]
    fast, ref = decode_mxfp4(packed, scale, torch.float32), dequantize_mxfp4(packed, scale)
    assert torch.equal(fast.view(torch.int32), ref.view(torch.int32))
    bf = decode_mxfp4(packed, scale, torch.bfloat16).float()
    normal = ref.abs() >= 2.0**-126
    assert torch.equal(bf[normal], ref[normal])  # products of a power of two and an fp4 value are exact
