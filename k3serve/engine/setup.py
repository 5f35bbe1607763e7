"""Engine start-up: device and dtype, model and tokenizer, cache budget and its split, and the
start-up log lines (weights, latent KV capacity, state slots, max concurrency)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from k3serve.cache.sizing import CachePlan, full_request_bytes, parse_bytes, plan_cache
from k3serve.config.engine_config import EngineConfig
from k3serve.models.kimi import KimiForCausalLM
from k3serve.runner.model_runner import weight_bytes

log = logging.getLogger("k3serve.engine")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype


def placement(config: EngineConfig) -> Placement:
    dev = config.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev)
    name = config.dtype if config.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    kv = config.kv_cache_dtype if config.kv_cache_dtype != "auto" else name
    return Placement(device, TORCH_DTYPES[name], TORCH_DTYPES[kv])


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass cache_memory explicitly")


def cache_budget(config: EngineConfig, device: torch.device) -> int:
    if config.cache_memory is not None:
        return parse_bytes(config.cache_memory)
    frac = config.cache_memory_fraction or (0.9 if device.type == "cuda" else 0.1)
    return int(free_memory(device) * frac)


def resolve_max_model_len(config: EngineConfig, model: KimiForCausalLM) -> int:
    limit = model.cfg.max_position_embeddings
    if config.max_model_len is None:
        return min(limit, 8192)
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                         f"max_position_embeddings {limit}")
    return config.max_model_len


def make_plan(config: EngineConfig, model: KimiForCausalLM, where: Placement, max_model_len: int) -> CachePlan:
    kv_name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[where.kv_dtype]
    budget = cache_budget(config, where.device)
    frac = config.prefix_cache_state_fraction if config.enable_prefix_caching else 0.0
    if config.cache_memory is None:  # a fraction never reserves more than max_num_seqs full requests use
        full = full_request_bytes(model.cfg, max_model_len, config.block_size, kv_name)
        # ... plus the checkpoint share taken off the top, or one slot of max_num_seqs goes missing
        budget = min(budget, math.ceil(config.max_num_seqs * full / (1.0 - frac)))
    return plan_cache(model.cfg, budget, max_model_len=max_model_len,
                      max_num_seqs=config.max_num_seqs, block_size=config.block_size, kv_dtype=kv_name,
                      num_slots=config.num_state_slots,
                      checkpoint_fraction=frac)


def seq_limit_note(plan: CachePlan, max_num_seqs: int) -> str | None:
    """Why fewer requests than --max-num-seqs can run at once, or None."""
    if plan.num_slots >= max_num_seqs:
        return None
    return (f"--max-num-seqs {max_num_seqs}, but the cache holds {plan.num_slots} KDA state slots "
            f"(each request of max_model_len {plan.max_model_len:,} needs {plan.slot_bytes:,} B of state + its "
            f"latent blocks): at most {plan.num_slots} requests run at once; raise --cache-memory or lower "
            f"--max-model-len")


def startup_lines(model_path: str, model: KimiForCausalLM, where: Placement, plan: CachePlan,
                  max_num_seqs: int | None = None) -> list[str]:
    L = plan.max_model_len
    by_tokens = plan.requests_by_tokens(L)
    note = seq_limit_note(plan, max_num_seqs) if max_num_seqs else None
    return ([note] if note else []) + [
        f"model {model_path} ({model.cfg.architecture}), dtype {str(where.dtype).removeprefix('torch.')}, "
        f"device {where.device}",
        f"weights: {weight_bytes(model):,} B",
        f"cache budget {plan.total_bytes:,} B: latent KV {plan.num_blocks:,} blocks x {plan.block_size} tokens "
        f"= {plan.kv_tokens:,} tokens ({plan.token_bytes:,} B/token), "
        f"KDA state {plan.num_slots} slots x {plan.slot_bytes:,} B"
        + (f" + {plan.num_checkpoints} prefix-cache checkpoints ({plan.num_checkpoints * plan.slot_bytes:,} B)"
           if plan.num_checkpoints else ""),
        f"max concurrency at max_model_len {L:,}: min({plan.num_slots} slots, {by_tokens} by latent tokens) "
        f"= {plan.max_concurrency(L)}",
    ]
