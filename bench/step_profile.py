"""Profile of single-stream decode steps: what one step dispatches, where its time goes, and
how often it waits for the device (issues 15 and 46).

    python bench/step_profile.py [--model DIR|kl-bf16] [--kernels torch,auto,graph] [--dtype bfloat16] [--steps 8]

For each backend named (k3serve/backends): the aten (and k3serve::) ops one decode step
dispatches, in all, a layer, and split by the module that issued them (KDA, MLA, MoE, ...); the
top ops by self time (device time on cuda); the host/device waits (cudaStreamSynchronize,
cudaMemcpy*, cudaDeviceSynchronize). The graph backend is counted with its static step run
eagerly (--enforce-eager: what compilation starts from; issue 46's budget is 40 a layer) and
timed compiled (--compile-backend, inductor by default), both side by side with the others.
Writes --json (default bench/results/step_profile.json; one entry a backend) and a Chrome trace
per backend beside it; prints last the host waits a step of each backend.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from k3serve import LLM, SamplingParams

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
    eng.add_request(
        "profiled",
        {"prompt_token_ids": list(range(1, 33))},
        SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True),
    )
    eng.step(), eng.step()
    yield
    for _ in range(steps):
        eng.step()
    while eng.has_unfinished_requests():
        eng.step()


def model(args) -> str:
    """--model: a checkpoint directory, or one of vs_llamacpp's names (the tiny K3 by default)."""
    if Path(args.model).is_dir():
        return args.model
    sys.path.insert(0, str(Path(__file__).parent))
    import vs_llamacpp  # bench/ is not a package

    return str(vs_llamacpp.checkpoints({args.model})[args.model])


def profile_backend(args, kernels: str, **engine) -> dict:
    llm = LLM(
        model(args),
        device=args.device,
        dtype=args.dtype,
        kernels=kernels,
        cache_memory="64MiB",
        max_num_seqs=1,
        enable_prefix_caching=False,
        **engine,
    )
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
    prof.export_chrome_trace(str(args.json.parent / f"step_profile_trace_{kernels}.json"))
    events = prof.key_averages()
    on_device = device.type == "cuda"
    key = (lambda e: e.self_device_time_total) if on_device else (lambda e: e.self_cpu_time_total)
    top = sorted((e for e in events if e.key.startswith(("aten::", "k3serve::"))), key=key, reverse=True)[:20]
    waits = {e.key: e.count for e in events if e.key.startswith(SYNCS)}
    n, layers = args.steps, llm.engine.model.cfg.num_layers
    ops = sum(counter.counts.values()) / n
    return {
        "device": str(device),
        "dtype": args.dtype,
        "kernels": kernels,
        "backend": llm.engine.model.model.backend.name,
        "ms_per_step_profiled": wall / n * 1e3,
        "ops_per_step": ops,
        # the layers' own (what the budget counts): all but the engine's (inputs, sampling, bookkeeping)
        "ops_per_layer": (ops - counter.counts["engine"] / n) / layers,
        "ops_per_step_by_module": {k: v / n for k, v in counter.counts.most_common()},
        "waits_per_step": {k: v / n for k, v in waits.items()},
        "top_ops": [{"op": e.key, "calls_per_step": e.count / n, "us_per_step": key(e) / n} for e in top],
    }


def time_compiled(args) -> float:
    """ms a decode step of the graph backend compiled (the first steps compile; not timed)."""
    llm = LLM(
        model(args),
        device=args.device,
        dtype=args.dtype,
        kernels="graph",
        cache_memory="64MiB",
        max_num_seqs=1,
        enable_prefix_caching=False,
        compilation_config={"backend": args.compile_backend, "cudagraph_capture_sizes": [1]},
    )
    llm.generate([{"prompt_token_ids": list(range(1, 33))}], SamplingParams(temperature=0, max_tokens=40))
    run = decode_steps(llm, args.steps)
    next(run)
    t = time.perf_counter()
    next(run, None)
    return (time.perf_counter() - t) / args.steps * 1e3


def waits(r: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in r["waits_per_step"].items()) or "none"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="k3-mxfp4", help="checkpoint directory or vs_llamacpp name (kl-bf16, ...)")
    ap.add_argument("--device", default="auto", help="auto: cuda when available")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kernels", default="torch,auto,graph", help="backends, comma-separated (torch, auto, cpp, graph)")
    ap.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend the graph backend is timed with"
    )
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "step_profile.json")
    args = ap.parse_args()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    results = {}
    for kernels in args.kernels.split(","):
        r = results[kernels] = profile_backend(args, kernels, **({"enforce_eager": True} if kernels == "graph" else {}))
        if kernels == "graph":
            r["ms_per_step_compiled"] = time_compiled(args)
        print(
            f"{r['device']} {args.dtype} --kernels {kernels} ({r['backend']}): "
            f"{r['ms_per_step_profiled']:.2f} ms a step under the profiler, {r['ops_per_step']:.0f} ops a step, "
            f"{r['ops_per_layer']:.1f} a layer in the model"
            + (
                f"; compiled ({args.compile_backend}) {r['ms_per_step_compiled']:.2f} ms a step"
                if kernels == "graph"
                else ""
            )
        )
        print("  ops a step by module: " + ", ".join(f"{k} {v:.0f}" for k, v in r["ops_per_step_by_module"].items()))
        print(f"  host/device waits a step: {waits(r)}")
        for row in r["top_ops"][:8]:
            print(f"    {row['op']:32s} {row['calls_per_step']:6.1f} calls  {row['us_per_step']:8.1f} us a step")
        args.json.write_text(json.dumps(results, indent=2))  # after each backend: a run cut short keeps it
    if "torch" in results and "graph" in results:
        print(
            f"ops a layer: torch {results['torch']['ops_per_layer']:.0f}, graph {results['graph']['ops_per_layer']:.0f} "
            f"({results['torch']['ops_per_layer'] / results['graph']['ops_per_layer']:.1f}x fewer)"
        )
    print("host/device waits a step: " + "; ".join(f"{k} {waits(r)}" for k, r in results.items()))


if __name__ == "__main__":
    main()
