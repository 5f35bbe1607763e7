"""bf16 GEMMs in FP32 where the CPU lacks bf16 dot instructions (k3serve/layers/gemm.py and its
C++ twin k3k::gemm): the FP32 form is within one bf16 rounding of the exact product, like
torch's bf16 form; the rule picks it only for bf16 inputs past the GEMV sizes; Python and C++
give the same bits; a bad K3SERVE_BF16_GEMM is refused by name."""

from __future__ import annotations

import pytest
import torch

from k3serve import kernels
from k3serve.layers import gemm

K = kernels.get("cpp")


def _case(M: int, Kd: int = 96, N: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, Kd, generator=g).bfloat16(), torch.randn(N, Kd, generator=g).bfloat16()


@pytest.mark.parametrize("mode", ["native", "fp32"])
def test_both_forms_are_within_one_bf16_rounding_of_the_exact_product(mode, monkeypatch):
    monkeypatch.setenv("K3SERVE_BF16_GEMM", mode)
    x, w = _case(33)
    got = gemm.dense(x, w)
    exact = x.double() @ w.double().t()
    assert got.dtype == torch.bfloat16 and got.shape == (33, 40)
    # FP32 sums of exact bf16 products (error ~K * 2^-24 relative), then one bf16 rounding
    bound = exact.abs() * 2**-8 + 1e-5 * exact.abs().max()
    assert ((got.double() - exact).abs() <= bound).all()


def test_the_rule_widens_only_bf16_inputs_past_the_gemv_sizes(monkeypatch):
    monkeypatch.setenv("K3SERVE_BF16_GEMM", "auto")
    big, small = _case(gemm.SMALL_M + 1)[0], _case(gemm.SMALL_M)[0]
    assert gemm.widen_bf16(big) == (not gemm.native_bf16())
    assert not gemm.widen_bf16(small)
    assert not gemm.widen_bf16(big.float())
    monkeypatch.setenv("K3SERVE_BF16_GEMM", "fp32")
    assert gemm.widen_bf16(small) and not gemm.widen_bf16(big.float())
    monkeypatch.setenv("K3SERVE_BF16_GEMM", "native")
    assert not gemm.widen_bf16(big)
    monkeypatch.setenv("K3SERVE_BF16_GEMM", "fast")
    with pytest.raises(ValueError, match="K3SERVE_BF16_GEMM must be auto, native or fp32"):
        gemm.widen_bf16(big)


@pytest.mark.parametrize("mode", ["native", "fp32"])
def test_the_kernels_linear_past_the_gemv_sizes_equals_the_python_rule(mode, monkeypatch):
    monkeypatch.setenv("K3SERVE_BF16_GEMM", mode)
    x, w = _case(50, seed=1)
    assert torch.equal(K.linear(x, w), gemm.dense(x, w))
    if mode == "fp32":  # and it is the FP32 product rounded once
        assert torch.equal(gemm.dense(x, w), (x.float() @ w.float().t()).bfloat16())


def test_a_model_linear_is_the_dense_rule():
    lin = gemm.Linear(96, 40, bias=False).bfloat16()
    x = _case(20)[0]
    with torch.no_grad():
        assert torch.equal(lin(x), gemm.dense(x, lin.weight))
