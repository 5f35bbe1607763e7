"""Launch commands for a planned layout: k3serve, vLLM and SGLang spellings."""

from __future__ import annotations

from k3serve.planner.layout import Layout

TOOLS = "--enable-auto-tool-choice --tool-call-parser kimi_k3 --reasoning-parser kimi_k3"


def launch_commands(
    model: str,
    layout: Layout,
    context: int,
    max_num_seqs: int,
    cache_bytes: int,
    fraction: float,
    sglang_static: float,
    kv_dtype: str,
    scaleup_domain: int = 8,
    redundant_experts: int = 0,
) -> dict[str, str]:
    """One line per engine; a multi-node layout names the node count (vLLM runs it on a Ray
    cluster, SGLang once per node with --node-rank)."""
    fp8 = kv_dtype in ("fp8", "fp8_e4m3")
    nodes = layout.nodes(scaleup_domain)
    k3 = (
        f"k3serve serve {model} --tensor-parallel-size {layout.tp} --max-model-len {context} "
        f"--max-num-seqs {max_num_seqs} --cache-memory {cache_bytes // 2**20}MiB {TOOLS}"
    )
    vllm = f"vllm serve {model} --tensor-parallel-size {layout.tp}"
    if layout.pp > 1:
        vllm += f" --pipeline-parallel-size {layout.pp}"
    if layout.dcp > 1:
        vllm += f" --decode-context-parallel-size {layout.dcp}"
    if layout.dp > 1:
        vllm += f" --data-parallel-size {layout.dp}"
    eplb = ""
    if layout.ep > 1:
        vllm += " --enable-expert-parallel"
        if redundant_experts:
            eplb = f""" --enable-eplb --eplb-config '{{"num_redundant_experts": {redundant_experts}}}'"""
            vllm += eplb
    vllm += (
        f" --gpu-memory-utilization {fraction:.2f} --max-model-len {context} --max-num-seqs {max_num_seqs}"
        f"{' --kv-cache-dtype fp8' if fp8 else ''} --trust-remote-code {TOOLS}"
    )
    sgl = f"python -m sglang.launch_server --model-path {model} --tp {layout.num_gpus // layout.pp}"
    if layout.pp > 1:
        sgl += f" --pp-size {layout.pp}"
    if nodes > 1:
        sgl += f" --nnodes {nodes} --node-rank $NODE_RANK --dist-init-addr $HEAD_IP:5000"
    if layout.dp > 1:
        sgl += f" --dp {layout.dp} --enable-dp-attention"
    if layout.ep > 1:
        sgl += f" --ep-size {layout.ep}"
        if redundant_experts:
            sgl += f" --enable-eplb --ep-num-redundant-experts {redundant_experts}"
    sgl += (
        f" --mem-fraction-static {sglang_static:.2f} --context-length {context}"
        f"{' --kv-cache-dtype fp8_e4m3' if fp8 else ''} --trust-remote-code --tool-call-parser kimi_k3 "
        f"--reasoning-parser kimi_k3"
    )
    if nodes > 1:
        vllm += f" --distributed-executor-backend ray  # on a {nodes}-node Ray cluster"
    if layout.dp > 1:
        k3 += f" --data-parallel-size {layout.dp}"
    if layout.ep > 1:
        k3 += " --enable-expert-parallel" + eplb
    if nodes > 1:
        k3 += f" --nnodes {nodes} --node-rank $NODE_RANK --master-addr $HEAD_IP --master-port 29500"
    if layout.dcp > 1:
        k3 += f" --decode-context-parallel-size {layout.dcp}"
    if layout.pp > 1:
        k3 += f" --pipeline-parallel-size {layout.pp}"
        if layout.dp > 1:
            k3 += "  # DP-attention inside pipeline stages waits for k3serve's lockstep stages: use TP x PP"
    elif nodes > 1 and layout.dp > 1 and layout.ep == 1:
        k3 += "  # plain replicas span one node each: start one server per node behind a load balancer"
    return {"k3serve": k3, "vllm": vllm, "sglang": sgl}
