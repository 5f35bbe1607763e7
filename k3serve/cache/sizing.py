"""Bytes per latent-cache token and per KDA state slot; shared by the engine and the planner.

k3-model-spec.md §3.2/§3.5/§4.3/§10: an MLA layer caches kv_lora_rank + qk_rope_head_dim
values per token (576 for K3: 1,152 B in BF16); a KDA layer holds a recurrent state
H x D x D (FP32) and a conv window of (K-1) pre-conv vectors for each of q, k, v.
K3: 27,648 B/token (BF16, 24 layers); 464,633,856 B/request (FP32 state and conv, 69 layers).
Pure Python on purpose: the scheduler and planner must not import torch.
"""

from __future__ import annotations

from k3serve.config.model_config import ModelConfig

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "fp8": 1, "fp8_e4m3": 1, "float8_e4m3fn": 1}


def dtype_bytes(name: str) -> int:
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown cache dtype {name!r}; choose one of {sorted(DTYPE_BYTES)}") from None


def mla_bytes_per_token_per_layer(cfg: ModelConfig, kv_dtype: str = "bfloat16") -> int:
    return cfg.mla.cache_dim * dtype_bytes(kv_dtype)


def mla_cache_bytes_per_token(cfg: ModelConfig, kv_dtype: str = "bfloat16") -> int:
    """Latent KV bytes one token occupies across all MLA layers."""
    return len(cfg.mla_layers) * mla_bytes_per_token_per_layer(cfg, kv_dtype)


def latent_block_bytes(cfg: ModelConfig, block_size: int, kv_dtype: str = "bfloat16") -> int:
    return block_size * mla_cache_bytes_per_token(cfg, kv_dtype)


def kda_recurrent_bytes_per_layer(cfg: ModelConfig, state_dtype: str = "float32") -> int:
    k = cfg.kda
    return k.num_heads * k.head_dim * k.head_dim * dtype_bytes(state_dtype)


def kda_conv_bytes_per_layer(cfg: ModelConfig, conv_dtype: str = "float32") -> int:
    k = cfg.kda
    return (k.conv_kernel - 1) * 3 * k.proj_dim * dtype_bytes(conv_dtype)


def kda_state_bytes_per_request(cfg: ModelConfig, state_dtype: str = "float32",
                                conv_dtype: str = "float32") -> int:
    """One state slot: recurrent + conv state of every KDA layer."""
    per_layer = kda_recurrent_bytes_per_layer(cfg, state_dtype) + kda_conv_bytes_per_layer(cfg, conv_dtype)
    return len(cfg.kda_layers) * per_layer
