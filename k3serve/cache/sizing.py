"""Bytes per latent-cache token and per KDA state slot; shared by the engine and the planner.

k3-model-spec.md §3.2/§3.5/§4.3/§10: an MLA layer caches kv_lora_rank + qk_rope_head_dim
values per token (576 for K3: 1,152 B in BF16); a KDA layer holds a recurrent state
H x D x D (FP32) and a conv window of (K-1) pre-conv vectors for each of q, k, v.
K3: 27,648 B/token (BF16, 24 layers); 464,633,856 B/request (FP32 state and conv, 69 layers).
Pure Python on purpose: the scheduler and planner must not import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3serve.config.model_config import ModelConfig

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "float8_e4m3fn": 1,
}


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


def kda_state_bytes_per_request(cfg: ModelConfig, state_dtype: str = "float32", conv_dtype: str = "float32") -> int:
    """One state slot: recurrent + conv state of every KDA layer."""
    per_layer = kda_recurrent_bytes_per_layer(cfg, state_dtype) + kda_conv_bytes_per_layer(cfg, conv_dtype)
    return len(cfg.kda_layers) * per_layer


# ---- splitting a cache budget between the two pools ------------------------------------

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | int) -> int:
    """'1GiB', '512MiB', '2GB', '1073741824' -> bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    if not num or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a memory size; write e.g. 1GiB, 512MiB or 2GB")
    return int(float(num) * _UNITS[unit])


@dataclass(frozen=True)
class CachePlan:
    """How a cache budget is split: latent blocks for MLA, state slots for KDA."""

    block_size: int
    num_blocks: int
    num_slots: int
    block_bytes: int  # one block across all MLA layers
    slot_bytes: int  # one request's recurrent + conv state across all KDA layers
    token_bytes: int  # one token's latent rows across all MLA layers
    max_model_len: int
    num_checkpoints: int = 0  # extra state slots holding prefix-cache KDA checkpoints
    state_dtype: str = "float32"  # the KDA recurrent state's (--mamba-ssm-cache-dtype); conv state stays fp32

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes + (self.num_slots + self.num_checkpoints) * self.slot_bytes

    def requests_by_tokens(self, context_len: int) -> int:
        """Requests of `context_len` tokens the latent blocks alone could hold."""
        return self.num_blocks // max(1, -(-context_len // self.block_size))

    def max_concurrency(self, context_len: int) -> int:
        """Requests of `context_len` tokens that fit at once = min(slots, latent tokens / len)."""
        return min(self.num_slots, self.requests_by_tokens(context_len))


def spec_records_bytes(
    cfg: ModelConfig,
    spec_tokens: int,
    max_num_seqs: int,
    state_dtype: str = "float32",
    shards: int = 1,
    share: float = 1.0,
) -> int:
    """What speculative decoding holds beside the cache: a verify pass records the KDA state after
    each of its 1 + k positions (spec_decode/rollback.py) for every running sequence, at most
    max_num_seqs; one rank's heads (`shards`), its stage's layers (`share`). The engine takes it
    out of a budget it derives from device memory (engine/startup.py cache_budget) and the planner
    out of the same arithmetic (planner/memory.py), so their figures agree; an explicit
    --cache-memory is the cache's alone."""
    if not spec_tokens:
        return 0
    slot = -(-_share(kda_state_bytes_per_request(cfg, state_dtype), share) // shards)
    return (1 + spec_tokens) * slot * max_num_seqs


DRAFT_BLOCK = 16  # the draft model's own cache blocks (spec_decode/draft_model.py)


def activation_bytes(cfg: ModelConfig, tokens: int, seqs: int, ep: int = 1, elem_bytes: int = 2) -> int:
    """What a step's activations take outside the cache, the one formula of the engine's
    `--gpu-memory-utilization` reserve and the planner's: a prefill chunk of `tokens` rows holds
    ~12 [tokens, hidden] buffers live plus AttnRes's block snapshots, its routed experts'
    [tokens x top_k, intermediate] gate and up rows (this rank's 1/ep of them), in the serving
    dtype (`elem_bytes`); and the fp32 logits of `seqs` sampled rows."""
    d = cfg.hidden_size
    snapshots = cfg.num_layers // cfg.attn_res_block_size + 1 if cfg.use_attnres else 0
    moe = cfg.moe
    experts = tokens * moe.top_k * moe.expert_intermediate_size * 2 * elem_bytes // ep if moe.num_experts else 0
    return tokens * d * elem_bytes * (12 + snapshots) + experts + seqs * cfg.vocab_size * 4


def draft_cache_shape(max_num_seqs: int, max_model_len: int) -> tuple[int, int]:
    """The `draft_model` drafter's own cache: (state slots, latent blocks), a slot and
    max_model_len + 16 rows of blocks per running sequence (spec_decode/draft_model.py allocates
    exactly this)."""
    per_request = -(-(max_model_len + 16) // DRAFT_BLOCK)
    return max_num_seqs, per_request * max_num_seqs


def draft_cache_bytes(draft: ModelConfig, max_num_seqs: int, max_model_len: int, dtype: str = "float32") -> int:
    """Bytes of that cache: its state slots (float32) and latent blocks in the draft's dtype (the
    engine loads drafts in float32). The engine takes them out of a budget it derives, and the
    planner out of the same arithmetic (--draft-model), as spec_records_bytes."""
    slots, blocks = draft_cache_shape(max_num_seqs, max_model_len)
    return slots * kda_state_bytes_per_request(draft) + blocks * latent_block_bytes(draft, DRAFT_BLOCK, dtype)


def full_request_bytes(
    cfg: ModelConfig, max_model_len: int, block_size: int = 16, kv_dtype: str = "bfloat16", state_dtype: str = "float32"
) -> int:
    """Cache bytes of one request at max_model_len: its state slot plus whole latent blocks."""
    blocks = -(-max_model_len // block_size)
    return kda_state_bytes_per_request(cfg, state_dtype) + blocks * latent_block_bytes(cfg, block_size, kv_dtype)


def _share(nbytes: int, share: float) -> int:
    return nbytes if share == 1.0 else math.ceil(nbytes * share)


def plan_cache(
    cfg: ModelConfig,
    cache_bytes: int,
    *,
    max_model_len: int,
    max_num_seqs: int,
    block_size: int = 16,
    kv_dtype: str = "bfloat16",
    num_slots: int | None = None,
    checkpoint_fraction: float = 0.0,
    state_shards: int = 1,
    kda_share: float = 1.0,
    mla_share: float = 1.0,
    latent_shards: int = 1,
    state_dtype: str = "float32",
) -> CachePlan:
    """Split `cache_bytes` by the expected request shape.

    Default: as many slots as requests of `max_model_len` tokens fit whole (slot + latent
    blocks), capped at `max_num_seqs`; every remaining byte becomes latent blocks, so short
    requests can share them. `num_slots` fixes the slot count instead (operators whose
    requests are much shorter than max_model_len). Either way one request of max_model_len
    must fit, or this raises with the numbers. With prefix caching, `checkpoint_fraction` of the
    budget is set aside first for KDA checkpoint slots (at least one). `state_shards` is the
    tensor-parallel degree of the attention: KDA state is split by heads across it, while the
    MLA latent (one latent "head") is replicated on every rank (planner-data.md §5.2).
    `kda_share` / `mla_share` are the fractions of those layers on this rank (a pipeline
    stage holds only its own layers' caches). `latent_shards` N: decode context parallelism,
    each rank holding 1/N of every block's latent rows (parallel/dcp.py).
    """
    token_bytes = _share(mla_cache_bytes_per_token(cfg, kv_dtype), mla_share / latent_shards)
    block_bytes = block_size * token_bytes
    slot_bytes = -(-_share(kda_state_bytes_per_request(cfg, state_dtype), kda_share) // state_shards)
    blocks_per_req = -(-max_model_len // block_size)
    per_request = slot_bytes + blocks_per_req * block_bytes
    num_ckpt = 0
    if checkpoint_fraction > 0:
        num_ckpt = max(1, int(cache_bytes * checkpoint_fraction) // slot_bytes) if slot_bytes else 0
        cache_bytes -= num_ckpt * slot_bytes
    if per_request > cache_bytes:
        raise ValueError(
            f"cache memory {cache_bytes:,} B cannot hold one request of max_model_len {max_model_len:,}: "
            f"it needs {per_request:,} B (KDA state {slot_bytes:,} B + latent KV {blocks_per_req * block_bytes:,} B); "
            f"lower --max-model-len or raise --cache-memory"
        )
    if num_slots is None:
        num_slots = max(1, min(max_num_seqs, cache_bytes // per_request))
    elif num_slots < 1 or num_slots * slot_bytes + blocks_per_req * block_bytes > cache_bytes:
        raise ValueError(
            f"{num_slots} state slots ({num_slots * slot_bytes:,} B) leave no room for one "
            f"request of max_model_len {max_model_len:,} in {cache_bytes:,} B"
        )
    rest = cache_bytes - num_slots * slot_bytes
    # Without MLA layers blocks cost nothing; keep enough for every slot at max_model_len.
    num_blocks = rest // block_bytes if block_bytes else num_slots * blocks_per_req
    return CachePlan(
        block_size, num_blocks, num_slots, block_bytes, slot_bytes, token_bytes, max_model_len, num_ckpt, state_dtype
    )
