"""Profile of single-stream decode steps: what one step dispatches, where its time goes, and
how often it waits for the device (issue 15).

    python bench/step_profile.py [--model DIR] [--kernels torch|auto] [--dtype bfloat16] [--steps 8]

On a CUDA machine (bench/gpu_check.sh) the engine runs on the GPU, where every layer takes its
torch path: the first H200 run decoded at ~20 ms a step, about what the same path costs on this
2-core CPU, which pointed at per-op dispatch and host/device waits rather than GPU arithmetic.
This prints, per decode step: the aten ops dispatched, split by the module that issued them
(KDA, MLA, MoE, ...); the top ops by self time (device time on cuda); and the host/device waits
(cudaStreamSynchronize, cudaMemcpy*, cudaDeviceSynchronize). Writes
bench/results/step_profile.json and a Chrome trace (step_profile_trace.json).
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from k3serve import LLM, SamplingParams
from k3serve.testing.builder import ensure_default_model

OUT = Path(__file__).parent / "results"
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync", "cudaEventSynchronize")


class OpsByModule(TorchDispatchMode):
    """Counts dispatched aten ops by the innermost module of interest that issued them."""

    KINDS = ("KimiDeltaAttention", "GatedMLA", "SparseMoE", "GluMLP", "RMSNorm", "KimiModel")

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.stack, self.counts = ["engine"], collections.Counter()
        self.hooks = []
        for m in model.modules():
            if type(m).__name__ in self.KINDS:
                self.hooks.append(m.register_forward_pre_hook(self._enter))
                self.hooks.append(m.register_forward_hook(self._leave))

    def _enter(self, module, args) -> None:
        self.stack.append(type(module).__name__)

    def _leave(self, module, args, out) -> None:
        self.stack.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.stack[-1]] += 1
        return func(*args, **(kwargs or {}))

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def decode_steps(llm: LLM, steps: int) -> Iterator[None]:
    """One request: its prefill and first decode step, (a pause), then `steps` decode steps."""
    eng = llm.engine
    eng.add_request("profiled", {"prompt_token_ids": list(range(1, 33))},
                    SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    eng.step(), eng.step()
    yield
    for _ in range(steps):
        eng.step()
    while eng.has_unfinished_requests():
        eng.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the tiny K3)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kernels", default="auto", help="auto: the CPU kernels on a CPU; torch: the reference path")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    llm = LLM(str(args.model or ensure_default_model()), dtype=args.dtype, kernels=args.kernels,
              cache_memory="64MiB", max_num_seqs=1, enable_prefix_caching=False)
    device = llm.engine.runner.device
    llm.generate([{"prompt_token_ids": list(range(1, 33))}], SamplingParams(temperature=0, max_tokens=8))  # warm-up

    counter = OpsByModule(llm.engine.model)  # 1) ops per step, by module
    run = decode_steps(llm, args.steps)
    next(run)
    with counter:
        next(run, None)
    counter.remove()

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    run = decode_steps(llm, args.steps)  # 2) time, by op, and the host/device waits
    next(run)
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        next(run, None)
        wall = time.perf_counter() - t
    OUT.mkdir(exist_ok=True)
    prof.export_chrome_trace(str(OUT / "step_profile_trace.json"))
    events = prof.key_averages()
    on_device = device.type == "cuda"
    key = (lambda e: e.self_device_time_total) if on_device else (lambda e: e.self_cpu_time_total)
    top = sorted((e for e in events if e.key.startswith("aten::")), key=key, reverse=True)[:20]
    waits = {e.key: e.count for e in events if e.key.startswith(SYNCS)}
    n = args.steps
    result = {
        "device": str(device), "dtype": args.dtype, "kernels": llm.engine.kernels is not None,
        "ms_per_step_profiled": wall / n * 1e3,
        "ops_per_step": sum(counter.counts.values()) / n,
        "ops_per_step_by_module": {k: v / n for k, v in counter.counts.most_common()},
        "waits_per_step": {k: v / n for k, v in waits.items()},
        "top_ops": [{"op": e.key, "calls_per_step": e.count / n, "us_per_step": key(e) / n} for e in top],
    }
    print(f"{device} {args.dtype} kernels={'on' if result['kernels'] else 'off'}: "
          f"{result['ms_per_step_profiled']:.2f} ms a step under the profiler, {result['ops_per_step']:.0f} ops a step")
    print("ops a step by module: " + ", ".join(f"{k} {v:.0f}" for k, v in result["ops_per_step_by_module"].items()))
    print("host/device waits a step: " + (", ".join(f"{k} {v:.1f}" for k, v in waits.items()) or "none"))
    for row in result["top_ops"]:
        print(f"  {row['op']:32s} {row['calls_per_step']:6.1f} calls  {row['us_per_step']:8.1f} us a step")
    (OUT / "step_profile.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
