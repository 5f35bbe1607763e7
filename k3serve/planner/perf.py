"""Roofline TPOT / TTFT estimates (planner-data.md §5.5). Assumptions, stated in every report:

- Decode step time per GPU = max(bytes read / (HBM BW x 0.8), FLOPs / (peak x 0.5)) + EP
  all-to-all + TP all-reduce + PP send, each timed on the link it crosses (`Layout.links`):
  the scale-up link at half its bidirectional figure per direction inside one domain, the
  per-GPU NIC once the group spans domains (all-to-all: the share of peers outside the
  domain goes over the NIC), both at 0.7 efficiency; + 1 ms fixed per forward.
- Bytes read per step: non-expert weights of the rank; routed experts actually touched, with
  flat routing E x (1 - (1 - k/E)^B) distinct experts per MoE layer for B tokens, spread evenly
  over EP ranks; each request's latent KV (context tokens, replicated over TP) and its KDA
  state read and written once.
- Pipeline parallel: the batch runs as PP micro-batches; a token's interval (TPOT) is PP
  stage steps on one micro-batch each (the busiest stage, layers split contiguously);
  embeddings and the LM head are counted in the layer share.
- FLOPs per token = 2 x active parameters + MLA attention over the context; experts run at
  FP4 rate on parts with FP4 tensor cores, else FP8; everything else at FP8.
- Prefill (TTFT) for one prompt on an idle server = compute-bound at 0.4 of peak over the TP
  GPUs of one DP group (stages run one after another), plus one pass over the weights.
- Cost = GPU-hours per million output tokens at the stated concurrency x the GPU's hourly
  price (illustrative list prices in `planner/hardware.py`; `--price GPU=USD` overrides).
"""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.cache.sizing import kda_state_bytes_per_request, mla_cache_bytes_per_token
from k3serve.config.model_config import ModelConfig
from k3serve.planner.hardware import GPU
from k3serve.config.stages import stage_shares
from k3serve.planner.layout import NIC, NVLINK, Layout
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
    tokens_per_s: float  # aggregate decode throughput at `concurrency`
    gpu_hours_per_mtok: float  # GPU-hours per million output tokens
    usd_per_mtok: float
    bound: str  # "memory" | "compute"
    bytes_per_step: float  # per GPU, one stage step
    experts_per_layer: float
    concurrency: int  # the batch these figures are for
    comm_s: dict[str, float]  # per-token seconds of each collective, by name

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def link_bw(gpu: GPU, link: str) -> float:
    return (gpu.scaleup_bw / 2 if link == NVLINK else gpu.nic_bw) * LINK_EFF


def alltoall_s(gpu: GPU, nbytes: float, ep: int) -> float:
    """Dispatch + combine of `nbytes` per GPU over EP peers: the share of peers inside the
    scale-up domain on its link, the rest over the NIC."""
    inside = min(ep, gpu.scaleup_domain) / ep
    return nbytes * inside / link_bw(gpu, NVLINK) + nbytes * (1 - inside) / link_bw(gpu, NIC)


def estimate(
    cfg: ModelConfig,
    gpu: GPU,
    layout: Layout,
    w: WeightSplit,
    concurrency: int,
    context: int,
    kv_dtype: str = "bfloat16",
    state_dtype: str = "float32",
) -> Perf:
    B = max(1, concurrency)
    pp, tp, dp = layout.pp, layout.tp, layout.dp
    micro = -(-B // pp)  # requests in one micro-batch
    per_group = -(-micro // dp)  # of those, on one attention group
    share = stage_shares(cfg, pp)
    kda_share, mla_share, moe_share, layer_share = share.kda, share.mla, share.moe, share.layers
    m = cfg.moe
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    stage_moe = round(moe_layers * moe_share)
    touched = distinct_experts(m.num_experts, m.top_k, micro)
    expert_bytes = w.expert / max(1, moe_layers * m.num_experts) if m.num_experts else 0
    non_expert = (w.tp_sharded / tp + w.replicated) * layer_share
    kv = per_group * context * mla_cache_bytes_per_token(cfg, kv_dtype) * mla_share
    state = 2 * per_group * kda_state_bytes_per_request(cfg, state_dtype) * kda_share / tp
    nbytes = non_expert + stage_moe * touched * expert_bytes / layout.ep + kv + state
    attn_flops = 4 * len(cfg.mla_layers) * cfg.mla.num_heads * context * (cfg.mla.cache_dim + cfg.mla.v_head_dim)
    flops = micro * (2 * w.active_params + attn_flops) * layer_share / layout.stage_gpus
    peak = gpu.fp4_flops if gpu.native_fp4 else gpu.fp8_flops
    t_mem, t_comp = nbytes / (gpu.hbm_bw * BW_EFF), flops / (peak * MFU_DECODE)
    links = layout.links(gpu.scaleup_domain)
    comm = {}
    if "ep_alltoall" in links:  # FP8 dispatch + BF16-free combine: 1 B/element each way
        comm["ep_alltoall"] = alltoall_s(
            gpu, 2 * stage_moe * micro / layout.stage_gpus * m.top_k * cfg.hidden_size, layout.ep
        )
    if "tp_allreduce" in links:  # ring all-reduce of BF16 hidden states, 2 per layer
        stage_layers_n = round(cfg.num_layers * layer_share)
        nb = 2 * stage_layers_n * per_group * cfg.hidden_size * 2 * 2 * (tp - 1) / tp
        comm["tp_allreduce"] = nb / link_bw(gpu, links["tp_allreduce"])
    if "pp_send" in links:  # BF16 hidden states of the micro-batch to the next stage
        comm["pp_send"] = micro * cfg.hidden_size * 2 / dp / link_bw(gpu, links["pp_send"])
    t_stage = max(t_mem, t_comp) + sum(comm.values()) + STEP_OVERHEAD
    tpot = pp * t_stage
    prefill_flops = 2 * w.active_params * context + attn_flops * context / 2
    ttft = prefill_flops / (tp * peak * MFU_PREFILL) + w.per_rank(tp, layout.ep) / (gpu.hbm_bw * BW_EFF)
    tok_s = B / tpot
    gpu_h = layout.num_gpus / tok_s * 1e6 / 3600
    return Perf(
        tpot,
        ttft,
        tok_s,
        gpu_h,
        gpu_h * gpu.usd_per_hour,
        "memory" if t_mem >= t_comp else "compute",
        nbytes,
        touched,
        B,
        {k: pp * v for k, v in comm.items()},
    )
