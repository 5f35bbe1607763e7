"""Check and benchmark: the graph backend's compiled (on CUDA: captured) decode step (issue 46),
and the same step with the Triton kernels in it (kernels "triton", issue 52), against the torch
engine. Two modes, two stages of bench/gpu_check.py:

    python bench/graph_decode.py --check [--only k3-mxfp4,kl-bf16] [--kernels graph,triton] [--buckets 1,4,16,64]
    python bench/graph_decode.py --speed [--only k3-mxfp4,kl-400m] [--kernels torch,graph,triton] [--streams 1,16,64]

--check: at each bucket, the greedy tokens of each compiled engine against the torch engine's and
  against the same backend's static step run eagerly (--enforce-eager: replay equals eager), in
  float32 by default (so that exact equality means on a GPU what it means in the CPU suites);
  the figure per bucket is null (equal) or the first token index where some stream differs;
  exits 1 if any differs.
--speed: decode tok/s at each stream count (vs_llamacpp's counting: prefill left out, median of
  three), bf16 by default, and for compiled backends the host waits a decode step
  (cudaStreamSynchronize / cudaMemcpy* under the profiler over 16 steps, or --new if fewer; the
  one expected: the sampled ids' copy back). Targets on one H100/H200 (issue 46): tiny K3 >=
  1,500 tok/s at one stream; 400 M >= 1,500 at one stream and >= 25,000 at 64.
Checkpoints are vs_llamacpp's (built into its cache folder on first use). `--device cpu` with small
sizes is bench/gpu_check.py's dry run (the figures mean nothing there). The JSON (--json) is
rewritten after each engine, so a run cut short keeps what it measured.
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

PROMPT = 32
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize")
MODES = {  # per-mode defaults of --only, --kernels, --dtype, --new
    "check": dict(only="k3-mxfp4,kl-bf16", kernels="graph,triton", dtype="float32", new=24),
    "speed": dict(only="k3-mxfp4,kl-400m", kernels="torch,graph,triton", dtype="bfloat16", new=96),
}


def engine(args, ckpt: Path, kernels: str, sizes: list[int], eager: bool = False):
    from k3serve import LLM

    return LLM(
        str(ckpt),
        device=args.device,
        dtype=args.dtype,
        kernels=kernels,
        enforce_eager=eager,
        cache_memory="512MiB" if args.device != "cpu" else "64MiB",
        max_num_seqs=max(sizes),
        max_model_len=256,
        block_size=64,
        enable_prefix_caching=False,
        compilation_config={"backend": args.compile_backend, "cudagraph_capture_sizes": sorted(set(sizes))},
    )


def prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + j) % 500 + 1 for j in range(PROMPT)]} for i in range(n)]


def greedy(new: int):
    from k3serve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)


def tokens(llm, n: int, new: int) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(n), greedy(new))]


def first_difference(a: list[list[int]], b: list[list[int]]) -> int | None:
    """None when equal, else the first token index at which some stream differs."""
    return min(
        (
            next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t)))
            for s, t in zip(a, b)
            if s != t
        ),
        default=None,
    )


def tok_s(llm, n: int, new: int) -> float:
    llm.generate(prompts(n), greedy(new))  # warm-up: every bucket this run meets compiles / captures here
    speeds = []
    for _ in range(3):
        outs = llm.generate(prompts(n), greedy(new))
        first = max(o.metrics["first_token_time"] for o in outs)
        last = max(o.metrics["finish_time"] for o in outs)
        speeds.append(sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (last - first))
    return sorted(speeds)[1]


def waits_per_step(llm, steps: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    eng.add_request("profiled", prompts(1)[0], greedy(steps + 4))
    eng.step(), eng.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            eng.step()
    while eng.has_unfinished_requests():
        eng.step()
    return {e.key: e.count / steps for e in prof.key_averages() if e.key.startswith(WAITS)}


def check(args, name: str, ckpt: Path, fig: dict, save) -> bool:
    buckets = [int(s) for s in args.buckets.split(",")]
    ref = engine(args, ckpt, "torch", buckets)
    want = {n: tokens(ref, n, args.new) for n in buckets}
    del ref
    ok = True
    for kernels in args.kernels.split(","):
        compiled = engine(args, ckpt, kernels, buckets)
        got = {n: tokens(compiled, n, args.new) for n in buckets}
        compiles = compiled.engine.executor.graphs.compiles
        del compiled
        eager = engine(args, ckpt, kernels, buckets, eager=True)
        f = fig[kernels] = {
            "vs_torch": {n: first_difference(got[n], want[n]) for n in buckets},
            "vs_eager": {n: first_difference(got[n], tokens(eager, n, args.new)) for n in buckets},
            "compiles": compiles,
        }
        del eager
        ok &= all(v is None for d in (f["vs_torch"], f["vs_eager"]) for v in d.values())
        print(f"{name} [{kernels}]: first difference vs torch {f['vs_torch']}, vs eager {f['vs_eager']}", flush=True)
        save()
    return ok


def speed(args, name: str, ckpt: Path, fig: dict, save) -> bool:
    streams = [int(s) for s in args.streams.split(",")]
    for kernels in args.kernels.split(","):
        llm = engine(args, ckpt, kernels, streams)
        f = fig[kernels] = {"tok_s": {n: tok_s(llm, n, args.new) for n in streams}}
        if kernels != "torch":
            f["waits_per_step"] = waits_per_step(llm, min(16, args.new))
            f["compiles"] = llm.engine.executor.graphs.compiles
        del llm
        print(
            f"{name} [{kernels}]: " + ", ".join(f"{n} streams {v:.0f} tok/s" for n, v in f["tok_s"].items()), flush=True
        )
        save()
    return True


def speed_line(item: tuple[str, dict]) -> str:
    name, fig = item
    return f"{name} " + ", ".join(
        f"{k} " + "/".join(f"{v:.0f}" for v in f["tok_s"].values()) for k, f in fig.items() if k != "seconds"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", dest="mode", action="store_const", const="check")
    mode.add_argument("--speed", dest="mode", action="store_const", const="speed")
    p.add_argument("--only", help=f"checkpoints (default per mode: {MODES})")
    p.add_argument("--kernels", help="backends; --check compares each compiled one against torch")
    p.add_argument("--buckets", default="1,4,16,64", help="--check: batch sizes (each its own captured graph)")
    p.add_argument("--streams", default="1,16,64", help="--speed: concurrent streams")
    p.add_argument("--dtype")
    p.add_argument("--new", type=int, help="greedy tokens a stream")
    p.add_argument("--device", default="auto", help="auto: cuda when available")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--json", type=Path, help="default bench/results/graph_decode_{check,speed}.json")
    args = p.parse_args()
    for k, v in MODES[args.mode].items():
        setattr(args, k, getattr(args, k) or v)
    path = args.json or Path(__file__).parent / "results" / f"graph_decode_{args.mode}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    on_cuda = args.device != "cpu" and torch.cuda.is_available()
    out = {
        "device": torch.cuda.get_device_name(0) if on_cuda else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "results": {},
    }
    ok = True
    for name, ckpt in vs_llamacpp.checkpoints(set(args.only.split(","))).items():
        t0 = time.perf_counter()
        fig = out["results"][name] = {}

        def save() -> None:  # after each engine: a run cut short keeps what it measured
            fig["seconds"] = time.perf_counter() - t0
            path.write_text(json.dumps(out, indent=2))

        ok &= (check if args.mode == "check" else speed)(args, name, ckpt, fig, save)
    if args.mode == "speed":
        print(
            f"tok/s at {args.streams.replace(',', '/')} streams: " + "; ".join(map(speed_line, out["results"].items()))
        )
    else:
        print("check: every compiled engine equals torch and its eager step" if ok else "check: FAILED (see above)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
