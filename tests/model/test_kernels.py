"""Compiled CPU kernels (k3serve.kernels) against their plain torch references, on random
shapes with ragged edges; bad shapes are refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from k3serve import kernels
from k3serve.layers.activation import situ_and_mul
from k3serve.layers.experts import experts_forward, experts_reference
from k3serve.weights.mxfp4 import PackedMXFP4

K = kernels.get("cpp")  # must build on this machine kind: a silent fallback would hide a broken kernel


def grouped_reference(x, offsets, w: PackedMXFP4):
    """Dequantize in float64, then one matmul per expert group."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    for e in range(w.shape[0]):
        a, b = int(offsets[e]), int(offsets[e + 1])
        out[a:b] = x[a:b].double() @ w.select(e).dequantize(torch.float64).t()
    return out


@pytest.mark.parametrize("seed", range(6))
def test_grouped_mxfp4_matmul_equals_dequantize_then_matmul(seed):
    g = torch.Generator().manual_seed(seed)
    E = int(torch.randint(1, 9, (1,), generator=g))
    O = int(torch.randint(1, 70, (1,), generator=g))  # rows not a multiple of any tile
    Kd = 32 * int(torch.randint(1, 9, (1,), generator=g))
    counts = torch.randint(0, 5, (E,), generator=g)  # some experts get no tokens
    offsets = torch.zeros(E + 1, dtype=torch.long)
    offsets[1:] = counts.cumsum(0)
    w = PackedMXFP4.quantize(torch.randn(E, O, Kd, generator=g) * 3)
    x = torch.randn(int(offsets[-1]), Kd, generator=g)
    got = K.mxfp4_grouped_matmul(x, offsets, w.packed, w.scale)
    ref = grouped_reference(x, offsets, w)
    assert got.shape == ref.shape and got.dtype == torch.float32
    err = (got.double() - ref).norm() / ref.norm().clamp_min(1e-30)
    assert err < 1e-6, float(err)  # FP32 accumulation of exact products


def test_grouped_mxfp4_rows_do_not_depend_on_batch_mates():
    g = torch.Generator().manual_seed(7)
    w = PackedMXFP4.quantize(torch.randn(4, 40, 96, generator=g))
    x = torch.randn(9, 96, generator=g)
    offsets = torch.tensor([0, 3, 3, 8, 9])
    full = K.mxfp4_grouped_matmul(x, offsets, w.packed, w.scale)
    alone = K.mxfp4_grouped_matmul(x[4:5], torch.tensor([0, 0, 0, 1, 1]), w.packed, w.scale)
    assert torch.equal(full[4], alone[0])  # bitwise: fixed summation order per row


def test_bad_shapes_are_refused_by_name():
    w = PackedMXFP4.quantize(torch.randn(2, 8, 64))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        K.mxfp4_grouped_matmul(torch.randn(3, 48), torch.tensor([0, 1, 3]), w.packed[..., :24], w.scale[..., :1])
    with pytest.raises(RuntimeError, match="offsets"):
        K.mxfp4_grouped_matmul(torch.randn(3, 64), torch.tensor([0, 1, 2]), w.packed, w.scale)
    with pytest.raises(RuntimeError, match="float32"):
        K.mxfp4_grouped_matmul(torch.randn(3, 64).bfloat16(), torch.tensor([0, 1, 3]), w.packed, w.scale)


@pytest.mark.parametrize("a8", [False, True])
def test_moe_through_the_kernel_equals_the_reference_loop(a8):
    g = torch.Generator().manual_seed(3)
    E, h, inter, T, k = 8, 64, 96, 13, 3
    w1, w3 = (PackedMXFP4.quantize(torch.randn(E, inter, h, generator=g) / 8) for _ in range(2))
    w2 = PackedMXFP4.quantize(torch.randn(E, h, inter, generator=g) / 6)
    x = torch.randn(T, h, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    fast = experts_forward(x, ids, weights, w1, w2, w3, situ_and_mul, a8, kernels=K)
    ref = experts_reference(x, ids, weights, w1, w2, w3, situ_and_mul, a8)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


def test_torch_mode_means_no_kernels_and_unknown_modes_are_refused():
    assert kernels.get("torch") is None
    with pytest.raises(ValueError, match="kernels must be one of"):
        kernels.get("fast")


def test_a_native_build_takes_the_widest_vector_route_the_cpu_has():
    """A native build on a CPU with AVX2 + FMA must not fall back to the scalar loops (they ran
    the tiny and 400 M models 2-4x slower on an AVX2-only EPYC); with AVX-512 F/BW/VL it takes
    the AVX-512 route, with AVX512-BF16 the vdpbf16ps one."""
    import os
    from pathlib import Path

    arch = os.environ.get("K3SERVE_KERNEL_ARCH", "native")
    cpuinfo = Path("/proc/cpuinfo")
    if arch != "native" or not cpuinfo.exists():
        pytest.skip("the expectation holds for native builds on Linux")
    flags = set(
        next((ln.split(":", 1)[1].split() for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")), [])
    )
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        want = "avx512-bf16" if "avx512_bf16" in flags else "avx512"
    elif {"avx2", "fma"} <= flags:
        want = "avx2"
    else:
        want = "scalar"
    assert K.simd() == want
    assert K.has_bf16_dot() == (want == "avx512-bf16")
