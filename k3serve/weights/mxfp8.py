"""OCP-MX MXFP8 (E4M3 elements, one E8M0 scale per 32) for W4A8 expert inputs.

References: OCP Microscaling Formats v1.0; compressed-tensors `generate_mx_scales`
(num_bits=8: emax offset 8, same power-of-two rounding as MXFP4). The K3 model card says
QAT used MXFP8 activations (k3-model-spec.md §1.3), so `fake_quantize_mxfp8` is the
numerically closest serving mode for expert inputs.
"""

from __future__ import annotations

import torch

from k3serve.weights.mxfp4 import GROUP, e8m0_to_float, mx_scale_exponent

E4M3_MAX = 448.0
E4M3_EMAX = 8  # floor(log2(448))


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (E4M3 bytes uint8 [..., K], scales uint8 [..., K/32]); RNE, saturating."""
    if x.shape[-1] % GROUP:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of {GROUP}")
    g = x.float().reshape(*x.shape[:-1], -1, GROUP)
    exp = mx_scale_exponent(g.abs().amax(-1), E4M3_EMAX)
    y = torch.ldexp(g, (127 - exp).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.reshape(x.shape), exp.to(torch.uint8)


def dequantize_mxfp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    vals = codes.view(torch.float8_e4m3fn).float()
    vals = vals.reshape(*vals.shape[:-1], -1, GROUP) * e8m0_to_float(scale).unsqueeze(-1)
    return vals.reshape(codes.shape).to(dtype)


def fake_quantize_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """Round-trip through MXFP8 (the W4A8 activation path), keeping x's dtype."""
    codes, scale = quantize_mxfp8(x)
    return dequantize_mxfp8(codes, scale, x.dtype)
