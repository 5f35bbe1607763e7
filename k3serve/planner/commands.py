"""Launch commands for a planned layout: k3serve, vLLM and SGLang spellings."""

from __future__ import annotations

from k3serve.planner.layout import Layout

TOOLS = "--enable-auto-tool-choice --tool-call-parser kimi_k3 --reasoning-parser kimi_k3"


def launch_commands(model: str, layout: Layout, context: int, max_num_seqs: int, cache_bytes: int,
                    fraction: float, sglang_static: float, kv_dtype: str) -> dict[str, str]:
    fp8 = kv_dtype in ("fp8", "fp8_e4m3")
    k3 = (f"k3serve serve {model} --tensor-parallel-size {layout.tp} --max-model-len {context} "
          f"--max-num-seqs {max_num_seqs} --cache-memory {cache_bytes // 2**20}MiB {TOOLS}")
    vllm = f"vllm serve {model} --tensor-parallel-size {layout.tp}"
    if layout.dp > 1:
        vllm += f" --data-parallel-size {layout.dp}"
    if layout.ep > 1:
        vllm += " --enable-expert-parallel"
    vllm += (f" --gpu-memory-utilization {fraction:.2f} --max-model-len {context} --max-num-seqs {max_num_seqs}"
             f"{' --kv-cache-dtype fp8' if fp8 else ''} --trust-remote-code {TOOLS}")
    sgl = f"python -m sglang.launch_server --model-path {model} --tp {layout.num_gpus}"
    if layout.dp > 1:
        sgl += f" --dp {layout.dp} --enable-dp-attention"
    if layout.ep > 1:
        sgl += f" --ep-size {layout.ep}"
    sgl += (f" --mem-fraction-static {sglang_static:.2f} --context-length {context}"
            f"{' --kv-cache-dtype fp8_e4m3' if fp8 else ''} --trust-remote-code --tool-call-parser kimi_k3 "
            f"--reasoning-parser kimi_k3")
    if layout.num_gpus > 1:
        k3 += "  # multi-GPU runner not built yet: this build serves on one device"
    return {"k3serve": k3, "vllm": vllm, "sglang": sgl}
