"""Benchmark: how much of a decode run each pipeline stage spends waiting for the other.

    .venv/bin/python bench/pp_overlap.py [--streams 16] [--tokens 48] [--size tiny|400m] [--kernels graph]

PP2 (two worker ranks, one stage each) beside one process on the same checkpoint and prompts:
decode tok/s of both, the greedy tokens (must match), and for each stage the fraction of the
PP2 run's wall time it sat in a receive (parallel/pipe.py StagePipe.waited_s): stage 0 (the
driver's rank) waits for the last stage's logits, stage 1 for stage 0's hidden state. With one
batch in flight the stages take turns, so their waits add up to about the run (less what both
spend outside the forward: scheduling, sampling). With two steps in flight (the default
without speculation: engine/llm_engine.py `_overlapped_step`, each step half the running
requests) stage 0 runs the next step while stage 1 finishes the last; the run is measured both
ways, the overlap off first. `--kernels graph`: every run takes the graph backend (each stage its
own compiled static step; the warm-up runs every prompt, so the buckets the run meets are built
before it is timed). Writes bench/results/pp_overlap.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from k3serve import LLM, SamplingParams
from k3serve.runner.compile_thread import wait_for_compiles
from k3serve.testing.builder import build_tiny_checkpoint
from k3serve.testing.tiny_configs import kimi_linear_400m_config

CACHE = Path.home() / ".cache" / "k3serve" / "bench-pp"
KW = dict(cache_memory="256MiB", max_model_len=512, max_num_batched_tokens=512, seed=0)


def checkpoint(size: str) -> Path:
    d = CACHE / size
    if not (d / "config.json").exists():
        if size == "400m":
            build_tiny_checkpoint(d, config=kimi_linear_400m_config())
        else:
            build_tiny_checkpoint(d, kind="k3", seed=0)
    return d


def run(path: Path, streams: int, tokens: int, pp: int, overlap: bool = True, kernels: str = "auto") -> dict:
    llm = LLM(str(path), pipeline_parallel_size=pp, max_num_seqs=streams, kernels=kernels, **KW)
    llm.engine.core.overlap = overlap
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [f"stream {i}: the quick brown fox jumps over" for i in range(streams)]
    try:
        llm.generate(prompts, params)  # warm-up: the same run first (the graph backend builds its buckets)
        if wait_for_compiles(600):  # one process compiles them on a thread of its own: done, then used
            llm.generate(prompts, params)
        waits0 = dict(llm.engine.executor.pipe_stats()) if pp > 1 else {}
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        waits = {}
        if pp > 1:
            for stage, waited in llm.engine.executor.pipe_stats():
                waits[stage] = round((waited - waits0.get(stage, 0.0)) / wall, 3)
        return {
            "tok_s": round(streams * tokens / wall, 1),
            "wall_s": round(wall, 3),
            "tokens": [o.outputs[0].token_ids for o in outs],
            "wait_fraction": waits,
        }
    finally:
        llm.engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--size", choices=("tiny", "400m"), default="tiny")
    ap.add_argument("--kernels", default="auto", help="auto (the CPU kernels), torch or graph")
    args = ap.parse_args()
    path = checkpoint(args.size)
    one = run(path, args.streams, args.tokens, 1, kernels=args.kernels)
    serial = run(path, args.streams, args.tokens, 2, overlap=False, kernels=args.kernels)
    two = run(path, args.streams, args.tokens, 2, kernels=args.kernels)
    same = one["tokens"] == two["tokens"] == serial["tokens"]
    print(f"{args.size}, {args.streams} streams x {args.tokens} tokens, --kernels {args.kernels}")
    print(f"  one process:          {one['tok_s']} tok/s")
    for name, r in (("PP2, one step at once", serial), ("PP2, two in flight", two)):
        print(f"  {name}: {r['tok_s']} tok/s ({r['tok_s'] / one['tok_s']:.2f}x of one process)")
        for stage, f in sorted(r["wait_fraction"].items()):
            print(f"    stage {stage} waited {f:.0%} of the run for the other stage")
    print(f"  two in flight / one at once: {two['tok_s'] / serial['tok_s']:.2f}x; tokens equal: {same}")
    out = Path(__file__).parent / "results" / "pp_overlap.json"
    out.parent.mkdir(exist_ok=True)
    runs = (("pp1", one), ("pp2_serial", serial), ("pp2", two))
    result = {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in runs}
    out.write_text(json.dumps({**vars(args), **result, "tokens_equal": same}, indent=2))


if __name__ == "__main__":
    main()
