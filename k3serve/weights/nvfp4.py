"""NVFP4: E2M1 elements, one FP8-E4M3 scale per 16, one FP32 global scale per matrix, in the
compressed-tensors `nvfp4-pack-quantized` byte layout (what SGLang's and vLLM's NVFP4 K3 rows
serve; NVIDIA's Blackwell format).

Layout of a logical weight W [out, in] (in % 16 == 0), per checkpoint module:
  weight_packed       [out, in/2]  uint8: byte j = code(2j) | code(2j+1) << 4 (as MXFP4)
  weight_scale        [out, in/16] float8_e4m3fn
  weight_global_scale [1]          float32
  W[r, c] = e2m1(code[r, c]) * (e4m3(scale[r, c // 16]) / global)
compressed-tensors dequantizes in exactly that order (scale / global first, in float32,
`forward_helpers._dequantize`); the reference below does too, and every fast path reads the
per-group factor from a table `e4m3(byte) / global` [..., 256] built once per matrix (one
division per table entry, the reference's own rounding), so packed kernels and the reference
agree bit for bit before the dot. The engine keeps scales as their uint8 bytes (a float8
buffer would be cast by `model.to(dtype)`), and the global scale in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3serve.weights.mxfp4 import E2M1_MAX, _luts, e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles

GROUP = 16
E4M3_MAX = 448.0
E4M3_EPS = 0.125  # torch.finfo(float8_e4m3fn).eps: the library's stand-in for an all-zero group's scale


def e4m3_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """byte -> float32 value of that FP8-E4M3 (fn) byte [256]; 0x7F and 0xFF are NaN."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().to(device)


def scale_tables(global_scale: torch.Tensor) -> torch.Tensor:
    """global [...] float32 -> per-group factor by scale byte, e4m3(b) / global [..., 256] float32."""
    g = global_scale.float()
    return e4m3_values(g.device) / g.unsqueeze(-1)


def global_scale_of(w: torch.Tensor) -> torch.Tensor:
    """compressed-tensors `generate_gparam`: 448 * 6 / max|W| per matrix (float32, [] ), 1 if W is 0."""
    g = E4M3_MAX * E2M1_MAX / w.float().abs().amax((-2, -1))
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0)


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None):
    """w [..., out, in] -> (codes uint8 [..., out, in], scale bytes uint8 [..., out, in/16],
    global float32 [...]), compressed-tensors' rules: group scale = global * amax / 6 rounded to
    E4M3 (an all-zero group's 0 becomes E4M3's eps), elements rounded to E2M1 (RNE, saturating)
    after dividing by e4m3(scale) / global."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"last dim {w.shape[-1]} is not a multiple of {GROUP}")
    g = global_scale_of(w) if global_scale is None else global_scale.float().reshape(w.shape[:-2])
    grouped = w.float().reshape(*w.shape[:-1], -1, GROUP)  # [..., out, in/16, 16]
    gg = g.reshape(*g.shape, 1, 1)
    s = (gg * (grouped.abs().amax(-1) / E2M1_MAX)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    s = torch.where(s.float() == 0, torch.tensor(E4M3_EPS).to(torch.float8_e4m3fn), s)
    factor = s.float() / gg  # [..., out, in/16]
    codes = e2m1_encode(grouped / factor.unsqueeze(-1))
    return codes.reshape(w.shape), s.view(torch.uint8), g


def dequantize_nvfp4(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Reference: W[..., r, c] = e2m1(code) * (e4m3(scale[..., r, c // 16]) / global[...]) in float32."""
    vals = e2m1_decode(unpack_nibbles(packed)).float()  # [..., out, in]
    factor = scale.view(torch.float8_e4m3fn).float() / global_scale.float().reshape(*global_scale.shape, 1, 1)
    vals = vals.reshape(*vals.shape[:-1], -1, GROUP) * factor.unsqueeze(-1)
    return vals.reshape(*packed.shape[:-1], -1).to(dtype)


def decode_nvfp4(packed: torch.Tensor, scale: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Fast dequant of [M, out, in/2] codes with [M, out, in/16] scale bytes through the matrices'
    tables [M, 256] (`scale_tables`): float32 products, then `dtype` (the reference's values)."""
    pair, _ = _luts(packed.device, torch.float32)  # byte -> (low, high) E2M1 values, cached (mxfp4.py)
    vals = pair[packed.to(torch.int64)]  # [M, out, in/2, 2]
    M = packed.shape[0]
    factor = tables.gather(1, scale.reshape(M, -1).to(torch.int64)).view(scale.shape)  # [M, out, in/16]
    return (vals.view(*packed.shape[:-1], -1, GROUP) * factor.unsqueeze(-1)).view(*packed.shape[:-1], -1).to(dtype)


@dataclass
class PackedNVFP4:
    """A weight that stays packed in memory (0.5625 B/param) and dequantizes on use.

    packed [..., out, in/2] uint8, scale [..., out, in/16] uint8 (E4M3 bytes), global_scale
    [...] float32; leading dims stack experts.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    table: torch.Tensor | None = None  # `tables()` precomputed [..., 256] (ExpertWeights holds it)

    fmt = "nvfp4"
    group = GROUP

    def __post_init__(self) -> None:
        if self.scale.dtype == torch.float8_e4m3fn:
            self.scale = self.scale.view(torch.uint8)
        if self.packed.dtype != torch.uint8 or self.scale.dtype != torch.uint8:
            raise TypeError("PackedNVFP4 needs uint8 packed codes and E4M3 (or uint8) scales")
        if self.packed.shape[:-1] != self.scale.shape[:-1] or self.packed.shape[-1] * 2 != self.scale.shape[-1] * GROUP:
            raise ValueError(
                f"packed {tuple(self.packed.shape)} and scale {tuple(self.scale.shape)} do not describe one NVFP4 matrix"
            )
        self.global_scale = self.global_scale.float().reshape(self.packed.shape[:-2])

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "PackedNVFP4":
        codes, scale, g = quantize_nvfp4(w)
        return cls(pack_nibbles(codes), scale, g)

    @classmethod
    def stack(cls, mats: list["PackedNVFP4"]) -> "PackedNVFP4":
        return cls(*(torch.stack([getattr(m, f) for m in mats]) for f in ("packed", "scale", "global_scale")))

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale.numel() + 4 * self.global_scale.numel()

    @property
    def numel(self) -> int:
        return self.packed.numel() * 2

    def tables(self) -> torch.Tensor:
        return self.table if self.table is not None else scale_tables(self.global_scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_nvfp4(self.packed, self.scale, self.global_scale, dtype)

    def select(self, index: torch.Tensor | int) -> "PackedNVFP4":
        """Rows of the leading (expert) dim, still packed."""
        table = self.table[index] if self.table is not None else None
        return PackedNVFP4(self.packed[index], self.scale[index], self.global_scale[index], table)

    def narrow(self, dim: int, start: int, length: int) -> "PackedNVFP4":
        """Logical rows (dim 0) or input columns (dim 1, whole 16-value groups) of one matrix."""
        if dim == 0:
            return PackedNVFP4(
                self.packed.narrow(0, start, length), self.scale.narrow(0, start, length), self.global_scale
            )
        if start % GROUP or length % GROUP:
            raise ValueError(f"NVFP4 columns split by whole groups of {GROUP}: {start}+{length}")
        return PackedNVFP4(
            self.packed.narrow(1, start // 2, length // 2),
            self.scale.narrow(1, start // GROUP, length // GROUP),
            self.global_scale,
        )

    def to(self, device: torch.device | str) -> "PackedNVFP4":
        return PackedNVFP4(self.packed.to(device), self.scale.to(device), self.global_scale.to(device))
