"""Engine start-up: device and dtype, model and tokenizer, cache budget and its split, and the
start-up log lines (weights, latent KV capacity, state slots, max concurrency)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from k3serve.config.stages import stage_shares
from k3serve.cache.sizing import (
    CachePlan,
    activation_bytes,
    draft_cache_bytes,
    full_request_bytes,
    parse_bytes,
    plan_cache,
    spec_records_bytes,
)
from k3serve.config.engine_config import EngineConfig
from k3serve.executor.base import ModelInfo
from k3serve.executor.placement import Placement

log = logging.getLogger("k3serve.engine")
KV_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "fp8"}


def _memory(device: torch.device, which: int, meminfo_key: str) -> int:
    """(free, total)[which] bytes of the device: CUDA's mem_get_info, else /proc/meminfo."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[which]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(meminfo_key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"cannot read {meminfo_key} from /proc/meminfo; pass cache_memory explicitly")


def free_memory(device: torch.device) -> int:
    return _memory(device, 0, "MemAvailable")


def total_memory(device: torch.device) -> int:
    return _memory(device, 1, "MemTotal")


def activation_reserve(config: EngineConfig, model: ModelInfo) -> int:
    """What `--gpu-memory-utilization` keeps outside the cache for activations: the planner's
    formula (cache/sizing.py activation_bytes) in the serving dtype."""
    ep = config.tensor_parallel_size if config.enable_expert_parallel else 1
    return activation_bytes(model.cfg, config.max_num_batched_tokens, config.max_num_seqs, ep, model.dtype.itemsize)


def vision_reserve(config: EngineConfig, model: ModelInfo) -> int:
    """The vision tower (loaded on first use, beside the text model) and its encoder cache: what a
    model with a tower keeps outside the cache, as the planner counts it per rank."""
    if model.cfg.vision is None:
        return 0
    from k3serve.weights.schema import model_tensor_specs

    tower = sum(s.params for s in model_tensor_specs(model.cfg) if s.vision) * model.dtype.itemsize
    return tower + parse_bytes(config.mm_encoder_cache)


def cache_budget(config: EngineConfig, device: torch.device, model: ModelInfo | None = None) -> int:
    if config.cache_memory is not None:
        return parse_bytes(config.cache_memory)
    if config.gpu_memory_utilization is not None and model is not None:
        # vLLM's meaning: utilization x TOTAL memory holds weights + activations + cache (+ the
        # vision tower and its encoder cache, for a model with one)
        f = config.gpu_memory_utilization
        total, weights, act = total_memory(device), model.weight_bytes, activation_reserve(config, model)
        vision, records = vision_reserve(config, model), spec_reserve(config, model)
        budget = int(total * f) - weights - act - vision - records
        if budget <= 0:
            raise ValueError(
                f"--gpu-memory-utilization {f}: {f} x {total / 2**30:.1f} GiB leaves no cache after "
                f"{weights / 2**30:.2f} GiB of weights, {act / 2**30:.2f} GiB of activations, "
                f"{vision / 2**30:.2f} GiB for the vision tower and its encoder cache and "
                f"{records / 2**30:.2f} GiB of speculative verify records; raise it"
            )
        free = free_memory(device)
        if budget > free:
            raise ValueError(
                f"--gpu-memory-utilization {f} asks for a {budget / 2**30:.2f} GiB cache, but only "
                f"{free / 2**30:.2f} GiB is free on {device}; lower it or free memory"
            )
        return budget
    frac = config.cache_memory_fraction or (0.9 if device.type == "cuda" else 0.1)
    records = spec_reserve(config, model) if model is not None else 0
    return max(int(free_memory(device) * frac) - records, 0)


def spec_reserve(config: EngineConfig, model: ModelInfo) -> int:
    """Speculative decoding beside the cache: the verify records (cache/sizing.py
    spec_records_bytes) and a `draft_model` drafter's float32 weights and own cache
    (draft_cache_bytes), each by the formula the planner uses."""
    if not config.speculative_config:
        return 0
    from k3serve.config.speculative import SpeculativeConfig

    spec = SpeculativeConfig.from_dict(config.speculative_config)
    records = spec_records_bytes(
        model.cfg, spec.num_speculative_tokens, config.max_num_seqs, config.ssm_dtype, config.tensor_parallel_size
    )
    path = spec.resolve_model(config.model or "").model
    if spec.method != "draft_model" or not path or not Path(path).is_dir():
        return records  # (a draft that is not there fails by name when the drafter loads)
    from k3serve.config.bundled import load_model_config
    from k3serve.weights.schema import loaded_weight_bytes

    draft = load_model_config(path)
    max_model_len = resolve_max_model_len(config, model)
    return records + loaded_weight_bytes(draft) + draft_cache_bytes(draft, config.max_num_seqs, max_model_len)


def check_quantization(config: EngineConfig, model: ModelInfo) -> None:
    """--quantization names a quantized checkpoint's own format (k3serve never requantizes a
    quantized checkpoint), or mxfp4 / nvfp4 for an unquantized one's routed experts, which the
    load quantized (models/registry.py quantized_config): `model` is what was loaded."""
    if config.quantization is None:
        return
    if model.cfg.quant is None:
        raise ValueError(
            f"--quantization {config.quantization}: this checkpoint is not quantized (no "
            f"quantization_config); pass --quantization mxfp4 or nvfp4 to quantize its routed experts "
            f"at load, or convert it first (k3serve convert)"
        )
    scheme = model.cfg.quant.scheme
    if config.quantization in ("mxfp4", "nvfp4") and config.quantization != scheme:
        raise ValueError(
            f"--quantization {config.quantization}: this checkpoint's experts are {scheme} "
            f"({model.cfg.quant.format}); drop the flag or pass --quantization {scheme}"
        )


def resolve_max_model_len(config: EngineConfig, model: ModelInfo) -> int:
    limit = model.cfg.max_position_embeddings
    if config.max_model_len is None:
        return min(limit, 8192)
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {limit}")
    return config.max_model_len


def make_plan(config: EngineConfig, model: ModelInfo, where: Placement, max_model_len: int) -> CachePlan:
    kv_name = KV_NAMES[where.kv_dtype]
    budget = cache_budget(config, where.device, model)
    frac = config.prefix_cache_state_fraction if config.enable_prefix_caching else 0.0
    if config.cache_memory is None and config.gpu_memory_utilization is None:
        # a fraction of free memory never reserves more than max_num_seqs full requests use
        full = full_request_bytes(model.cfg, max_model_len, config.block_size, kv_name, config.ssm_dtype)
        # ... plus the checkpoint share taken off the top, or one slot of max_num_seqs goes missing
        budget = min(budget, math.ceil(config.max_num_seqs * full / (1.0 - frac)))
    share = stage_shares(model.cfg, config.pipeline_parallel_size)  # a stage caches its layers only
    return plan_cache(
        model.cfg,
        budget,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        block_size=config.block_size,
        kv_dtype=kv_name,
        num_slots=config.num_state_slots,
        checkpoint_fraction=frac,
        state_shards=config.tensor_parallel_size,
        kda_share=share.kda,
        mla_share=share.mla,
        latent_shards=config.decode_context_parallel_size,
        state_dtype=config.ssm_dtype,
    )


def seq_limit_note(plan: CachePlan, max_num_seqs: int) -> str | None:
    """Why fewer requests than --max-num-seqs can run at once, or None."""
    if plan.num_slots >= max_num_seqs:
        return None
    return (
        f"--max-num-seqs {max_num_seqs}, but the cache holds {plan.num_slots} KDA state slots "
        f"(each request of max_model_len {plan.max_model_len:,} needs {plan.slot_bytes:,} B of state + its "
        f"latent blocks): at most {plan.num_slots} requests run at once; raise --cache-memory or lower "
        f"--max-model-len"
    )


def startup_lines(
    model_path: str, model: ModelInfo, where: Placement, plan: CachePlan, max_num_seqs: int | None = None
) -> list[str]:
    L = plan.max_model_len
    by_tokens = plan.requests_by_tokens(L)
    note = seq_limit_note(plan, max_num_seqs) if max_num_seqs else None
    return ([note] if note else []) + [
        f"model {model_path} ({model.cfg.architecture}), dtype {str(where.dtype).removeprefix('torch.')}, "
        f"device {where.device}",
        f"weights: {model.weight_bytes:,} B",
        f"cache budget {plan.total_bytes:,} B: latent KV {plan.num_blocks:,} blocks x {plan.block_size} tokens "
        f"= {plan.kv_tokens:,} tokens ({plan.token_bytes:,} B/token), "
        f"KDA state {plan.num_slots} slots x {plan.slot_bytes:,} B"
        + (
            f" + {plan.num_checkpoints} prefix-cache checkpoints ({plan.num_checkpoints * plan.slot_bytes:,} B)"
            if plan.num_checkpoints
            else ""
        ),
        f"max concurrency at max_model_len {L:,}: min({plan.num_slots} slots, {by_tokens} by latent tokens) "
        f"= {plan.max_concurrency(L)}",
    ]
