"""bf16 GEMMs where the CPU has no bf16 dot instructions (issue 15).

torch's bf16 matmul on a CPU without AVX512-BF16 or AMX-BF16 runs at ~17 GFLOP/s on two AVX2
cores (measured on an AMD EPYC, 512 x 1024 @ 1024 x 2048), against 85-120 GFLOP/s for the same
product in FP32 with both operands widened per call: 96% of a 400 M model's 512-token prefill
was that matmul. Both forms sum the exact bf16 products in FP32 and round the output to bf16
once, so they differ only in summation order. `dense` takes the FP32 form for bf16 inputs of
more than `SMALL_M` rows on such CPUs (smaller ones are GEMV-shaped: the decode kernels' or
torch's own); the kernels' C++ side (kernels/cpu/core/common.h `k3k::gemm`) applies the same rule.

K3SERVE_BF16_GEMM=native|fp32 forces one form (tests run both on any machine); default auto.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

# kernels/cpu/core/common.h kSmallM: up to it, rows run in GEMV loops (one constant with the short
# prefill chunks that run position by position, forward/batch.py)
from k3serve.forward.batch import SHORT_PREFILL as SMALL_M


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16), as torch detects it."""
    caps = torch._C._cpu._get_cpu_capability()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def widen_bf16(x: torch.Tensor) -> bool:
    """Whether a bf16 GEMM of x's rows takes the FP32 form here."""
    mode = os.environ.get("K3SERVE_BF16_GEMM", "auto")
    if mode not in ("auto", "native", "fp32"):
        raise ValueError(f"K3SERVE_BF16_GEMM must be auto, native or fp32, got {mode!r}")
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or mode == "native":
        return False
    return mode == "fp32" or (x.numel() > SMALL_M * x.shape[-1] and not native_bf16())


def dense(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ w [out, in]^T in x's dtype."""
    if widen_bf16(x) and w.dtype == torch.bfloat16:
        return F.linear(x.float(), w.float()).to(torch.bfloat16)
    return F.linear(x, w)


class Linear(nn.Linear):
    """Bias-free nn.Linear (weight [out, in] as in the checkpoint) whose product is `dense`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight)
