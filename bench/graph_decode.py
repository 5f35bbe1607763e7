"""Benchmark and check: the graph backend's compiled (on CUDA: captured) decode step (issue 46),
and the same step with the Triton kernels in it (`--kernels graph,triton`, issue 52).

    python bench/graph_decode.py [--only k3-mxfp4,kl-400m] [--streams 1,16,64] [--compile-backend inductor]
                                 [--kernels graph,triton]

Per checkpoint (tiny K3, the 400 M Kimi-Linear; built into vs_llamacpp's cache folder on first
use), side by side in one run:
  1. replay equals eager: greedy tokens of the compiled / captured engine equal the same
     backend's static step run eagerly (--enforce-eager), at each stream count (buckets 1, 4, 16, 64);
  2. decode tok/s at 1, 16, 64 streams: the torch reference (today's GPU path) against each
     compiled backend asked for (vs_llamacpp's counting: prefill left out, median of three);
  3. host waits a decode step: cudaStreamSynchronize / cudaMemcpy* events per step under the
     profiler (the one expected: the sampled ids' copy back).
Targets on one H100/H200 (issue 46): tiny K3 >= 1,500 tok/s at one stream; 400 M >= 1,500 at one
stream and >= 25,000 at 64. Runs on a CPU too (small, for the script's own check; the figures mean
nothing there). Writes bench/results/graph_decode.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import vs_llamacpp  # noqa: E402  (bench/ is not a package)

PROMPT, NEW = 32, 96
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize")


def engine(ckpt: Path, streams: list[int], kernels: str, compile_backend: str, eager: bool = False):
    from k3serve import LLM

    return LLM(
        str(ckpt),
        dtype="bfloat16",
        kernels=kernels,
        enforce_eager=eager,
        cache_memory="512MiB",
        max_num_seqs=max(streams),
        max_model_len=256,
        block_size=64,
        enable_prefix_caching=False,
        compilation_config={"backend": compile_backend, "cudagraph_capture_sizes": sorted(set(streams))},
    )


def prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + j) % 500 + 1 for j in range(PROMPT)]} for i in range(n)]


def tok_s(llm, n: int) -> float:
    from k3serve import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    llm.generate(prompts(n), greedy)  # warm-up: every bucket this run meets compiles / captures here
    speeds = []
    for _ in range(3):
        outs = llm.generate(prompts(n), greedy)
        first = max(o.metrics["first_token_time"] for o in outs)
        last = max(o.metrics["finish_time"] for o in outs)
        speeds.append(sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (last - first))
    return sorted(speeds)[1]


def waits_per_step(llm) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    from k3serve import SamplingParams

    eng = llm.engine
    eng.add_request("profiled", prompts(1)[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    eng.step(), eng.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(16):
            eng.step()
    while eng.has_unfinished_requests():
        eng.step()
    return {e.key: e.count / 16 for e in prof.key_averages() if e.key.startswith(WAITS)}


def main() -> None:
    from k3serve import SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("--only", default="k3-mxfp4,kl-400m")
    p.add_argument("--streams", default="1,16,64")
    p.add_argument("--check-buckets", default="1,4,16,64")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--kernels", default="graph", help="compiled backends to measure: graph, triton or both")
    args = p.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    buckets = [int(s) for s in args.check_buckets.split(",")]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    out = {"device": device, "torch": torch.__version__, "results": {}}
    for name, ckpt in vs_llamacpp.checkpoints(set(args.only.split(","))).items():
        t0 = time.perf_counter()
        ref = engine(ckpt, streams, "torch", args.compile_backend)
        fig = {"torch_tok_s": {n: tok_s(ref, n) for n in streams}}
        del ref
        for kernels in args.kernels.split(","):
            graph = engine(ckpt, streams + buckets, kernels, args.compile_backend)
            eager = engine(ckpt, streams + buckets, kernels, args.compile_backend, eager=True)
            greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            same = {
                n: [o.outputs[0].token_ids for o in graph.generate(prompts(n), greedy)]
                == [o.outputs[0].token_ids for o in eager.generate(prompts(n), greedy)]
                for n in buckets
            }
            del eager
            f = {
                "replay_equals_eager": same,
                "tok_s": {n: tok_s(graph, n) for n in streams},
                "waits_per_step": waits_per_step(graph),
                "compiles": graph.engine.executor.rank.graphs.compiles,
            }
            del graph
            f["speedup_vs_torch"] = {n: f["tok_s"][n] / fig["torch_tok_s"][n] for n in streams}
            fig[kernels] = f
            print(
                f"{name} [{kernels}]: replay == eager {same}; "
                + ", ".join(
                    f"{n} streams {f['tok_s'][n]:.0f} tok/s vs {fig['torch_tok_s'][n]:.0f} torch "
                    f"({f['speedup_vs_torch'][n]:.1f}x)"
                    for n in streams
                )
                + f"; waits a step {f['waits_per_step']}; "
                f"{f['compiles']} compiles",
                flush=True,
            )
        fig["seconds"] = time.perf_counter() - t0
        out["results"][name] = fig
    path = Path(__file__).parent / "results" / "graph_decode.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
