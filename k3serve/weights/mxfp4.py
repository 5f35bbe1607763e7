"""OCP-MX MXFP4: E2M1 elements, one E8M0 scale per 32, in the compressed-tensors byte layout.

References: k3-model-spec.md §8.3 (layout, golden values), OCP Microscaling Formats v1.0
(E2M1 / E8M0), compressed-tensors `mxfp4-pack-quantized` (scale choice and nibble order),
llama.cpp `repack_mxfp4_blocks` (ggml block layout).

Layout of a logical weight W [out, in] (in % 32 == 0):
  weight_packed [out, in/2] uint8: byte j = code(2j) | code(2j+1) << 4  (low nibble = even column)
  weight_scale  [out, in/32] uint8: E8M0 exponent, scale = 2^(s - 127)
ggml `block_mxfp4` (17 B per 32 values): scale byte first, then 16 bytes where byte j holds
element j (low nibble) and element j+16 (high nibble).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32
# E2M1 code -> value; bit 3 is the sign (codes 8..15 are the negatives, 8 = -0.0).
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# Rounding boundaries between consecutive magnitudes; a tie goes to the even code (RNE).
_E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
E2M1_MAX = 6.0
E2M1_EMAX = 2  # floor(log2(6))


def mx_scale_exponent(amax: torch.Tensor, elem_emax: int) -> torch.Tensor:
    """Biased E8M0 exponent per group from the group's max |x| (int32).

    Same rule as compressed-tensors `generate_mx_scales`: round amax to a power of two
    (up when its mantissa is >= 1.75), take log2, subtract the element type's emax.
    An all-zero group gets exponent 0 (scale 2^-127); the codes are all zero anyway.
    """
    mant, exp = torch.frexp(amax.float())  # amax = mant * 2^exp, mant in [0.5, 1)
    log2_floor = exp.to(torch.int32) - 1
    log2_rounded = log2_floor + (mant >= 0.875).to(torch.int32)  # 2*mant >= 1.75
    biased = log2_rounded - elem_emax + 127
    biased = torch.where(amax > 0, biased, torch.zeros_like(biased))
    return biased.clamp(0, 254)


def e8m0_to_float(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 E8M0 -> power of two (0xFF is NaN per OCP); 2^127 needs float32 or wider."""
    s = scale.to(torch.int32)
    out = torch.ldexp(torch.ones_like(s, dtype=dtype), s - 127)
    return torch.where(s == 255, torch.full_like(out, float("nan")), out)


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already divided by their scale) to E2M1 codes, RNE, saturating."""
    mag = y.abs().clamp(max=E2M1_MAX)
    bounds = _E2M1_BOUNDS.to(y.device)
    code = torch.bucketize(mag, bounds, right=False)  # mag == bound -> lower code
    tie_odd = (code < 7) & (mag == bounds[code.clamp(max=6)]) & (code % 2 == 1)
    code = code + tie_odd.to(code.dtype)  # ties to the even code
    sign = (y < 0).to(torch.int64) << 3  # -0.0 in -> +0 code, tiny negatives -> -0 (as compressed-tensors)
    return (code | sign).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    return E2M1_VALUES.to(codes.device)[codes.to(torch.int64)]


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] float -> (codes uint8 [..., K], scales uint8 [..., K/32])."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"last dim {w.shape[-1]} is not a multiple of {GROUP}")
    g = w.float().reshape(*w.shape[:-1], -1, GROUP)  # [..., K/32, 32]
    exp = mx_scale_exponent(g.abs().amax(-1), E2M1_EMAX)  # [..., K/32]
    y = torch.ldexp(g, (127 - exp).unsqueeze(-1))  # exact division by 2^(exp-127)
    return e2m1_encode(y).reshape(w.shape), exp.to(torch.uint8)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., K] (values 0..15) -> [..., K/2]; low nibble = even column."""
    c = codes.reshape(*codes.shape[:-1], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], -1)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference dequant: W[r, c] = fp4(code[r, c]) * 2^(scale[r, c // 32] - 127)."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    vals = e2m1_decode(unpack_nibbles(packed)).to(wide)  # [..., K]
    vals = vals.reshape(*vals.shape[:-1], -1, GROUP) * e8m0_to_float(scale, wide).unsqueeze(-1)
    return vals.reshape(*packed.shape[:-1], -1).to(dtype)


_LUTS: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def decode_tables(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """byte -> (fp4 of low nibble, fp4 of high nibble) [256, 2], and E8M0 byte -> 2^(s-127) [256]."""
    b = torch.arange(256, dtype=torch.uint8)
    return e2m1_decode(unpack_nibbles(b[:, None])).to(dtype).to(device), e8m0_to_float(b).to(dtype).to(device)


def _luts(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_tables`, kept per device and dtype."""
    key = (device, dtype)
    if key not in _LUTS:
        _LUTS[key] = decode_tables(device, dtype)
    return _LUTS[key]


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Fast dequant by two table lookups (byte -> value pair, byte -> scale); same values as
    `dequantize_mxfp4` (the reference) whenever the product is representable in `dtype`."""
    pair, scales = _luts(packed.device, dtype)
    vals = pair[packed.to(torch.int64)]  # [..., K/2, 2]
    vals = vals.view(*packed.shape[:-1], -1, GROUP) * scales[scale.to(torch.int64)].unsqueeze(-1)
    return vals.view(*packed.shape[:-1], -1)


def to_ggml_blocks(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors layout -> ggml block_mxfp4 bytes [..., K/32, 17]."""
    codes = unpack_nibbles(packed).reshape(*packed.shape[:-1], -1, GROUP)  # [..., G, 32]
    qs = codes[..., :16] | (codes[..., 16:] << 4)  # split halves
    return torch.cat((scale.unsqueeze(-1), qs), dim=-1).contiguous()


def from_ggml_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml block_mxfp4 bytes [..., G, 17] -> (packed [..., G*16], scale [..., G])."""
    scale, qs = blocks[..., 0], blocks[..., 1:]
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [..., G, 32]
    packed = pack_nibbles(codes.reshape(*blocks.shape[:-2], -1))
    return packed, scale.contiguous()


@dataclass
class PackedMXFP4:
    """A weight that stays packed in memory (0.53125 B/param) and dequantizes on use.

    packed [..., out, in/2] uint8, scale [..., out, in/32] uint8; leading dims stack experts.
    """

    packed: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.packed.dtype != torch.uint8 or self.scale.dtype != torch.uint8:
            raise TypeError("PackedMXFP4 needs uint8 packed codes and uint8 scales")
        if self.packed.shape[:-1] != self.scale.shape[:-1] or self.packed.shape[-1] * 2 != self.scale.shape[-1] * GROUP:
            raise ValueError(
                f"packed {tuple(self.packed.shape)} and scale "
                f"{tuple(self.scale.shape)} do not describe one MXFP4 matrix"
            )

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "PackedMXFP4":
        codes, scale = quantize_mxfp4(w)
        return cls(pack_nibbles(codes), scale)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale.numel()

    @property
    def numel(self) -> int:
        return self.packed.numel() * 2

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mxfp4(self.packed, self.scale, dtype)

    def select(self, index: torch.Tensor | int) -> "PackedMXFP4":
        """Rows of the leading (expert) dim, still packed."""
        return PackedMXFP4(self.packed[index], self.scale[index])

    def to(self, device: torch.device | str) -> "PackedMXFP4":
        return PackedMXFP4(self.packed.to(device), self.scale.to(device))
