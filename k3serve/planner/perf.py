"""Roofline TPOT / TTFT estimates (planner-data.md §5.5). Assumptions, stated in every report:

- Decode step time per GPU = max(bytes read / (HBM BW x 0.8), FLOPs / (peak x 0.5)) + EP
  all-to-all + TP all-reduce over the scale-up link (half the bidirectional figure per
  direction, 0.7 efficiency; the NIC when TP crosses the domain) + 1 ms fixed per-step overhead.
- Bytes read per step: non-expert weights of the rank; routed experts actually touched, with
  flat routing E x (1 - (1 - k/E)^B) distinct experts per MoE layer for B tokens, spread evenly
  over EP ranks; each request's latent KV (context tokens, replicated over TP) and its KDA
  state read and written once.
- FLOPs per token = 2 x active parameters + MLA attention over the context; experts run at
  FP4 rate on parts with FP4 tensor cores, else FP8; everything else at FP8.
- Prefill (TTFT) for one prompt on an idle server = compute-bound at 0.4 of peak over all
  GPUs of one DP group, plus one pass over the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.cache.sizing import kda_state_bytes_per_request, mla_cache_bytes_per_token
from k3serve.config.model_config import ModelConfig
from k3serve.planner.hardware import GPU
from k3serve.planner.layout import Layout
from k3serve.planner.weights import WeightSplit

BW_EFF, MFU_DECODE, MFU_PREFILL, LINK_EFF, STEP_OVERHEAD = 0.8, 0.5, 0.4, 0.7, 1e-3


def distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    if not num_experts:
        return 0.0
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class Perf:
    tpot_s: float
    ttft_s: float
    tokens_per_s: float  # aggregate decode throughput at the given concurrency
    gpu_hours_per_mtok: float  # GPU-hours per million output tokens
    bound: str  # "memory" | "compute"
    bytes_per_step: float  # per GPU
    experts_per_layer: float

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def estimate(cfg: ModelConfig, gpu: GPU, layout: Layout, w: WeightSplit, concurrency: int, context: int,
             kv_dtype: str = "bfloat16") -> Perf:
    B = max(1, concurrency)
    per_group = -(-B // layout.dp)  # requests on one attention group
    m = cfg.moe
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    touched = distinct_experts(m.num_experts, m.top_k, B)
    expert_bytes = w.expert / max(1, moe_layers * m.num_experts) if m.num_experts else 0
    tp = layout.tp
    non_expert = w.tp_sharded / tp + w.replicated
    kv = per_group * context * mla_cache_bytes_per_token(cfg, kv_dtype)
    state = 2 * per_group * kda_state_bytes_per_request(cfg) / tp
    nbytes = non_expert + moe_layers * touched * expert_bytes / layout.ep + kv + state
    attn_flops = 4 * len(cfg.mla_layers) * cfg.mla.num_heads * context * (cfg.mla.cache_dim + cfg.mla.v_head_dim)
    flops = B * (2 * w.active_params + attn_flops) / layout.num_gpus
    peak = gpu.fp4_flops if gpu.native_fp4 else gpu.fp8_flops
    t_mem, t_comp = nbytes / (gpu.hbm_bw * BW_EFF), flops / (peak * MFU_DECODE)
    link = (gpu.scaleup_bw / 2 if tp <= gpu.scaleup_domain else gpu.nic_bw) * LINK_EFF
    a2a = 2 * moe_layers * B / layout.num_gpus * m.top_k * cfg.hidden_size * 1 if layout.ep > 1 else 0  # FP8 dispatch
    allreduce = 2 * cfg.num_layers * per_group * cfg.hidden_size * 2 * 2 * (tp - 1) / tp if tp > 1 else 0
    tpot = max(t_mem, t_comp) + (a2a + allreduce) / link + STEP_OVERHEAD
    prefill_flops = 2 * w.active_params * context + attn_flops * context / 2
    ttft = prefill_flops / (tp * peak * MFU_PREFILL) + (w.total / layout.num_gpus) / (gpu.hbm_bw * BW_EFF)
    tok_s = B / tpot
    return Perf(tpot, ttft, tok_s, layout.num_gpus / tok_s * 1e6 / 3600, "memory" if t_mem >= t_comp else "compute",
                nbytes, touched)
