"""CacheTensors: where a rank's cache state lives, indexed by layer (None for the other kind).

  KDA layer l:  recurrent[l][slot] [H, D, D] fp32 (or bf16: --mamba-ssm-cache-dtype),  conv[l][slot] [K-1, 3P] fp32
  MLA layer l:  latent[l][row] [kv_lora + rope], row = block_id * block_size + offset (under
                decode context parallelism a rank's share of each block: parallel/dcp.py)
  FP8 latent with scales: latent_scale[l] a 0-d fp32 tensor s on the cache's device; a row holds
                fp8(latent / s) and reads back as fp8 * s (layers/mla.py to_cache / from_cache).
                From the checkpoint's `self_attn.k_scale`, or calibrated on the first rows a
                layer writes (--calculate-kv-scales: s = max|latent| / K_SCALE_RANGE); None:
                unit scale, as before scales existed.

Sizes come from the pure-Python `CachePlan` (cache/sizing.py); checkpoint slots for prefix
caching follow the live slots in the same state tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3serve.config.model_config import LayerKind, ModelConfig


# vLLM's K_SCALE_CONSTANT: a calibrated scale maps the first rows' max |latent| to 200 of fp8's
# 448, headroom for larger values later (they saturate at 448 * s, never NaN)
K_SCALE_RANGE = 200.0
MIN_SCALE = 1e-8  # an all-zero first write would otherwise give s = 0 and divide by it


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
    # slot-per-draft rollback's spare state slots (cache/draft_slots.py), after the scratch slot
    first_spare: int | None = None
    num_spare: int = 0
    latent_scale: dict[int, torch.Tensor] | None = None  # MLA layer -> 0-d fp32 s (fp8 with scales)
    calibrating: set[int] = field(default_factory=set)  # layers whose s the first written rows set

    def kv_scale(self, layer: int) -> torch.Tensor | None:
        return self.latent_scale[layer] if self.latent_scale is not None else None

    def observe(self, layer: int, latent: torch.Tensor) -> torch.Tensor | None:
        """Layer's scale for rows about to be written, latent [N, c + r]; a calibrating layer
        takes s = max|latent| / K_SCALE_RANGE from them first (in place: compiled steps that
        read s see the new value; no host sync)."""
        if layer in self.calibrating and latent.numel():
            amax = latent.detach().abs().amax().float()
            self.latent_scale[layer].copy_((amax / K_SCALE_RANGE).clamp(min=MIN_SCALE))
            self.calibrating.discard(layer)
        return self.kv_scale(layer)

    def use_scales(self, scales: dict[int, float], calibrate: bool) -> None:
        """Give every MLA layer a scale (`scales` where given, else 1.0); `calibrate`: all of them
        set by their first written rows instead."""
        layers = [i for i, t in enumerate(self.latent) if t is not None]
        self.latent_scale = {
            i: torch.tensor(float(scales.get(i, 1.0)), dtype=torch.float32, device=self.latent[i].device)
            for i in layers
        }
        self.calibrating = set(layers) if calibrate else set()

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
        spare: int = 0,
        layers: range | None = None,
        latent_shards: int = 1,
    ) -> "CacheTensors":
        """`tp_size`: a tensor-parallel rank holds the KDA state of its H/N heads; the latent is whole.
        `scratch`: one more slot and block for the static step's padding rows. `spare`: state
        slots after those for slot-per-draft rollback (cache/draft_slots.py). `layers`: a
        pipeline stage's (the others None here), None: all. `latent_shards` N: decode context
        parallelism, each block's rows split by token over N ranks (parallel/dcp.py): this
        rank's block_size / N rows of each."""
        k, m = cfg.kda, cfg.mla
        live, num_blocks = num_slots + scratch, num_blocks + scratch
        num_slots = live + spare
        heads = k.num_heads // tp_size
        rec, conv, lat = [], [], []
        for i, kind in enumerate(cfg.layer_kinds):
            if layers is not None and i not in layers:
                rec.append(None)
                conv.append(None)
                lat.append(None)
            elif kind is LayerKind.KDA:
                rec.append(torch.zeros(num_slots, heads, k.head_dim, k.head_dim, dtype=state_dtype, device=device))
                conv.append(torch.zeros(num_slots, k.conv_kernel - 1, 3 * heads * k.head_dim, device=device))
                lat.append(None)
            else:
                rec.append(None)
                conv.append(None)
                rows = num_blocks * (block_size // latent_shards)
                lat.append(torch.zeros(rows, m.cache_dim, dtype=kv_dtype, device=device))
        spares = dict(first_spare=live, num_spare=spare) if spare else {}
        if scratch:
            return cls(rec, conv, lat, block_size, live - 1, num_blocks - 1, **spares)
        return cls(rec, conv, lat, block_size, **spares)


# ---- the latent rows' encoding (fp8 with a scale, or the cache dtype) ----------------------------
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value: beyond it a cast gives NaN, so clamp


def to_cache(latent: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Latent rows [N, c + r] in the cache dtype; fp8 divided by the layer's scale (0-d fp32;
    None: unit scale, vLLM's default k_scale), saturating instead of overflowing to NaN."""
    if dtype == torch.float8_e4m3fn:
        latent = latent.float() if scale is None else latent.float() / scale
        latent = latent.clamp(-FP8_MAX, FP8_MAX)
    return latent.to(dtype)


def write_rows(store: torch.Tensor, rows: torch.Tensor, latent: torch.Tensor, scale: torch.Tensor | None = None):
    """store[rows] = to_cache(latent) as one index_copy_ (graph-safe); fp8 through a uint8 view
    of both (index_copy_ has no fp8 kernel on the CPU)."""
    new = to_cache(latent, store.dtype, scale)
    if store.dtype == torch.float8_e4m3fn:
        store.view(torch.uint8).index_copy_(0, rows, new.view(torch.uint8))
    else:
        store.index_copy_(0, rows, new)


def from_cache(rows: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Cached rows [..., c + r] -> fp32 values (times the layer's scale where there is one)."""
    return rows.float() if scale is None else rows.float() * scale
