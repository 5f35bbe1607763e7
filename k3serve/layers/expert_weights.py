"""Routed-expert weights as module state (issue 15: experts used to be plain attributes, so
`model.to(device)` left them on the CPU and `weight_bytes` needed a special case).

One `ExpertWeights` holds one stacked matrix [E, out, in] of a MoE layer, either
  dense:   buffer `weight` [E, out, in] (Kimi-Linear, float; `.to(dtype)` casts it), or
  packed:  buffers `packed` [E, out, in/2] uint8 and `scale` [E, out, in/32] uint8 (E8M0),
           K3's MXFP4 release format (`.to(dtype)` leaves integer buffers alone), or
  nvfp4:   `packed` as above, `scale` [E, out, in/16] uint8 (E4M3 bytes), `global_scale` [E]
           and the per-group factor tables `tables` [E, 256] = e4m3(byte) / global (float32
           always: `_apply` keeps them so through `model.to(dtype)`; weights/nvfp4.py).
Training the demo (QAT) swaps `weight` for a float Parameter read through an MXFP4
straight-through rounding (`train_dense`), instead of swapping the module's class.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from k3serve.weights.mxfp4 import PackedMXFP4
from k3serve.weights.nvfp4 import PackedNVFP4


class ExpertWeights(nn.Module):
    def __init__(self, num_experts: int, out_features: int, in_features: int):
        super().__init__()
        self.shape = (num_experts, out_features, in_features)
        self.register_buffer("weight", torch.zeros(self.shape))
        self.register_buffer("packed", None)
        self.register_buffer("scale", None)
        self.register_buffer("global_scale", None)
        self.register_buffer("tables", None)
        self._read: Callable[[torch.Tensor], torch.Tensor] | None = None  # QAT rounding of `weight`

    @property
    def is_packed(self) -> bool:
        return self.packed is not None

    @property
    def fmt(self) -> str:
        """ "dense", "mxfp4" or "nvfp4"."""
        return "dense" if self.packed is None else "mxfp4" if self.global_scale is None else "nvfp4"

    @property
    def value(self) -> torch.Tensor | PackedMXFP4 | PackedNVFP4:
        """What the expert kernels compute with: the dense [E, out, in] tensor or the packed form."""
        if self.global_scale is not None:
            return PackedNVFP4(self.packed, self.scale, self.global_scale, self.tables)
        if self.packed is not None:
            return PackedMXFP4(self.packed, self.scale)
        return self._read(self.weight) if self._read is not None else self.weight

    @property
    def nbytes(self) -> int:
        held = (self.weight, self.packed, self.scale, self.global_scale)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def load(self, w: torch.Tensor | PackedMXFP4 | PackedNVFP4) -> None:
        """Take a stacked checkpoint matrix (dense in the model's dtype, or packed)."""
        if tuple(w.shape) != self.shape:
            raise ValueError(f"expert weights {tuple(w.shape)}, expected {self.shape}")
        self.global_scale, self.tables = None, None
        if isinstance(w, PackedNVFP4):
            self.weight, self.packed, self.scale = None, w.packed, w.scale
            self.global_scale, self.tables = w.global_scale, w.tables()
        elif isinstance(w, PackedMXFP4):
            self.weight, self.packed, self.scale = None, w.packed, w.scale
        else:
            self.weight, self.packed, self.scale = w, None, None

    def _apply(self, fn, recurse=True):
        """`model.to(bf16)` casts float buffers; NVFP4's global scales and tables stay float32
        (a bf16 table would round every group factor the reference computes in float32)."""
        held = (self.global_scale, self.tables)
        out = super()._apply(fn, recurse)
        if held[0] is not None and self.global_scale.dtype != torch.float32:
            self.global_scale = held[0].to(self.global_scale.device)
            self.tables = held[1].to(self.tables.device)
        return out

    def train_dense(self, read: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Make the weights a trainable FP32 Parameter, seen by the forward through `read`."""
        w = self.value
        w = w.dequantize(torch.float32) if self.is_packed else w.float()
        self.packed, self.scale, self.global_scale, self.tables = None, None, None, None
        self.weight = nn.Parameter(w.clone())
        self._read = read

    def extra_repr(self) -> str:
        return f"{self.fmt} {list(self.shape)}"
