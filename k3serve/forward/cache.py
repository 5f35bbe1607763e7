"""CacheTensors: where a rank's cache state lives, indexed by layer (None for the other kind).

  KDA layer l:  recurrent[l][slot] [H, D, D] fp32 (or bf16: --mamba-ssm-cache-dtype),  conv[l][slot] [K-1, 3P] fp32
  MLA layer l:  latent[l][row] [kv_lora + rope], row = block_id * block_size + offset

Sizes come from the pure-Python `CachePlan` (cache/sizing.py); checkpoint slots for prefix
caching follow the live slots in the same state tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3serve.config.model_config import LayerKind, ModelConfig


@dataclass
class CacheTensors:
    """Device tensors for both cache kinds; indexed by layer (None for the other kind)."""

    recurrent: list[torch.Tensor | None]
    conv: list[torch.Tensor | None]
    latent: list[torch.Tensor | None]
    block_size: int
    # the graph backend's padding rows write here (one state slot and one latent block past the
    # plan's, never handed to a request); None when allocated without them
    scratch_slot: int | None = None
    scratch_block: int | None = None

    @property
    def device(self) -> torch.device:
        return next(t for t in (*self.recurrent, *self.latent) if t is not None).device

    @classmethod
    def allocate(
        cls,
        cfg: ModelConfig,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tp_size: int = 1,
        scratch: bool = False,
        state_dtype: torch.dtype = torch.float32,
    ) -> "CacheTensors":
        """`tp_size`: a tensor-parallel rank holds the KDA state of its H/N heads; the latent is whole.
        `scratch`: one more slot and block for the static step's padding rows."""
        k, m = cfg.kda, cfg.mla
        num_slots, num_blocks = num_slots + scratch, num_blocks + scratch
        heads = k.num_heads // tp_size
        rec, conv, lat = [], [], []
        for kind in cfg.layer_kinds:
            if kind is LayerKind.KDA:
                rec.append(torch.zeros(num_slots, heads, k.head_dim, k.head_dim, dtype=state_dtype, device=device))
                conv.append(torch.zeros(num_slots, k.conv_kernel - 1, 3 * heads * k.head_dim, device=device))
                lat.append(None)
            else:
                rec.append(None)
                conv.append(None)
                lat.append(torch.zeros(num_blocks * block_size, m.cache_dim, dtype=kv_dtype, device=device))
        if scratch:
            return cls(rec, conv, lat, block_size, num_slots - 1, num_blocks - 1)
        return cls(rec, conv, lat, block_size)
