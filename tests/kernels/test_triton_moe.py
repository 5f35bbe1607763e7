"""MoE experts through the Triton grouped GEMM == `experts_reference` (the per-token loop,
dequantize-then-matmul in fp32). MXFP4 experts are packed and dequantized by compressed-tensors'
own codecs (the kernel decodes the bytes in registers); dense fp32 and bf16 experts; SiTU and
SwiGLU; ragged token counts; an expert chosen by many tokens and experts chosen by none; ids
repeated with weight 0 (expert parallelism's masked assignments). Tolerances, relative to the
largest |output|: fp32 1e-5 (another summation order); bf16 3e-2 (a few bf16 roundings of the
GEMM outputs, as the torch path rounds them, ~4e-3 each)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from k3serve.kernels.triton import moe
from k3serve.layers.activation import silu_and_mul, situ_and_mul
from k3serve.layers.experts import experts_reference

E, D, I, K = 8, 64, 96, 3


def ct_mxfp4(w):
    """w [E, out, in] fp32 -> (packed uint8 [E, out, in/2], E8M0 uint8 [E, out, in/32],
    dequantized fp32), all by compressed-tensors."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationArgs, QuantizationType
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    args = QuantizationArgs(num_bits=4, type=QuantizationType.FLOAT, group_size=32, strategy="group")
    packed, scales, deq = [], [], []
    for m in w:
        s = generate_mx_scales(m.abs().reshape(m.shape[0], -1, 32).amax(-1), 4)
        scale = torch.exp2(s.float() - 127)
        qv = quantize(x=m, scale=scale, global_scale=None, zero_point=None, args=args)
        p = pack_fp4_to_uint8(qv)
        packed.append(p)
        scales.append(s.to(torch.uint8))
        values = unpack_fp4_from_uint8(p, m.shape[0], m.shape[1], dtype=torch.float32)
        deq.append(dequantize(values, scale=scale, args=args, dtype=torch.float32))
    return torch.stack(packed), torch.stack(scales), torch.stack(deq)


def routing(N, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E - 2, generator=g)[:K] for _ in range(N)])  # experts 6, 7 never chosen
    ids[: N // 2, 0] = 2  # a popular expert: several blocks of its own
    return ids, torch.rand(N, K, generator=g)


ACTS = {
    "situ": (True, 4.0, 25.0, partial(situ_and_mul, beta=4.0, linear_beta=25.0)),
    "swiglu": (False, 0.0, None, silu_and_mul),
}


@pytest.mark.parametrize("act", ["situ", "swiglu"])
@pytest.mark.parametrize("N", [1, 7, 40])
@pytest.mark.parametrize("packed", [True, False], ids=["mxfp4", "dense"])
def test_grouped_gemm_equals_the_experts_reference(packed, N, act):
    g = torch.Generator().manual_seed(N)
    W = [
        torch.randn(E, I, D, generator=g) * 0.2,
        torch.randn(E, D, I, generator=g) * 0.2,
        torch.randn(E, I, D, generator=g) * 0.2,
    ]
    situ, beta, linear_beta, fn = ACTS[act]
    if packed:
        (p1, s1, d1), (p2, s2, d2), (p3, s3, d3) = (ct_mxfp4(w) for w in W)
        ws, scales, dense = (p1, p2, p3), (s1, s2, s3), (d1, d2, d3)
    else:
        ws, scales, dense = tuple(W), (None,) * 3, tuple(W)
    x = torch.randn(N, D, generator=g)
    ids, weights = routing(N, seed=N)
    want = experts_reference(x, ids, weights, *dense, fn)
    got = moe.moe_experts(x, ids, weights, *ws, *scales, situ, beta, linear_beta)
    assert (got - want).abs().max() / want.abs().max() < 1e-5


def test_bf16_experts_and_masked_repeats():
    g = torch.Generator().manual_seed(5)
    W = [
        torch.randn(E, I, D, generator=g) * 0.2,
        torch.randn(E, D, I, generator=g) * 0.2,
        torch.randn(E, I, D, generator=g) * 0.2,
    ]
    x = torch.randn(9, D, generator=g)
    ids, weights = routing(9, seed=1)
    ids[:, 2], weights[:, 2] = 0, 0.0  # assignments masked to local expert 0 with weight 0
    fn = ACTS["situ"][3]
    want = experts_reference(x, ids, weights, *W, fn)
    got = moe.moe_experts(x.bfloat16(), ids, weights, *(w.bfloat16() for w in W), None, None, None, True, 4.0, 25.0)
    assert (got - want).abs().max() / want.abs().max() < 3e-2
    got32 = moe.moe_experts(x, ids, weights, *W, None, None, None, True, 4.0, 25.0)
    assert (got32 - want).abs().max() / want.abs().max() < 1e-5


def test_align_gives_each_block_one_expert_and_every_assignment_one_row():
    ids, _ = routing(40, seed=2)
    row_token, row_assign, block_expert = moe.align(ids, E)
    assert row_token.shape[0] % moe.BM == 0 and row_token.shape[0] >= ids.numel() + E * (moe.BM - 1)
    one = moe.align(ids[:1], E)[0]  # one token: k groups at most, not E
    assert one.shape[0] == (K + K * (moe.BM - 1) + moe.BM - 1) // moe.BM * moe.BM
    live = row_assign >= 0
    assert sorted(row_assign[live].tolist()) == list(range(ids.numel()))  # each assignment once
    assert torch.equal(row_token[live], row_assign[live] // K)
    block_of_row = torch.arange(row_token.shape[0]) // moe.BM
    assert torch.equal(block_expert[block_of_row[live]], ids.reshape(-1)[row_assign[live]])  # its expert's block
    assert (block_expert[block_of_row[live].max() + 1 :] == -1).all()  # blocks past the last group: skipped
