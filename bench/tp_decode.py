"""Benchmark: tensor / expert parallel decode against one process, same checkpoint, same run.

    .venv/bin/python bench/tp_decode.py [--streams 1 8] [--tokens 64] [--size tiny|400m]

For tiny Kimi-Linear (TP2, channels split) and tiny K3 (TP2 + expert parallel; its 32 MXFP4
expert channels cannot split by whole groups), alternately TP1 and TP2, best of 3: decode
tok/s, the greedy tokens (must match), and from rank 0's CommStats the collectives per decode
step, their wall time and payload bytes per token, beside the planner's model of the same
traffic (`planner/perf.py`: 2 bf16 hidden-state all-reduces per layer; an EP all-to-all of
top_k x hidden FP8 each way per MoE layer, which k3serve's TP-group EP does not send: tokens are
replicated over the group, so dispatch is a mask and the combine rides the all-reduce).
On 2 cores, TP2 runs 2 processes of 1 thread each against 1 process of 2 threads: slower is
expected (the issue asks for the figure). Writes bench/results/tp_decode.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from k3serve import LLM, SamplingParams
from k3serve.config.bundled import load_model_config
from k3serve.testing.builder import build_tiny_checkpoint
from k3serve.testing.tiny_configs import kimi_linear_400m_config

CACHE = Path.home() / ".cache" / "k3serve" / "bench-tp"
PROMPT = list(range(1, 33))


def checkpoints(size: str) -> dict[str, tuple[Path, bool]]:
    """name -> (dir, expert parallel)."""
    if size == "400m":
        d = CACHE / "kl-400m"
        if not (d / "config.json").exists():
            build_tiny_checkpoint(d, config=kimi_linear_400m_config())
        return {"kl-400m": (d, False)}
    out = {}
    for kind, ep in (("kimi_linear", False), ("k3", True)):
        d = CACHE / f"tiny-{kind}"
        if not (d / "config.json").exists():
            build_tiny_checkpoint(d, kind=kind)
        out[f"tiny-{kind}"] = (d, ep)
    return out


def run(llm: LLM, streams: int, tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": PROMPT[i:] + PROMPT[:i]} for i in range(streams)], params)
    return streams * tokens / (time.perf_counter() - t), [o.outputs[0].token_ids for o in outs]


def planner_bytes_per_token(path: Path, tp: int) -> dict[str, float]:
    cfg = load_model_config(path)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    return {
        "tp_allreduce_bf16": 2 * cfg.num_layers * cfg.hidden_size * 2 * 2 * (tp - 1) / tp,
        "ep_alltoall_fp8": 2 * moe_layers * cfg.moe.top_k * cfg.hidden_size / tp,
    }


def measure(name: str, path: Path, ep: bool, streams: list[int], tokens: int) -> dict:
    kw = dict(cache_memory="256MiB", max_model_len=512, max_num_seqs=max(streams), seed=0)
    one = LLM(str(path), **kw)
    two = LLM(str(path), tensor_parallel_size=2, enable_expert_parallel=ep, **kw)
    stats = two.engine.model.tp.stats
    res: dict = {"expert_parallel": ep, "streams": {}}
    try:
        for n in streams:
            run(one, n, 4), run(two, n, 4)  # warm
            best1, best2, same, comm, comm_wall = 0.0, 0.0, True, None, 1.0
            for _ in range(3):
                s1, t1 = run(one, n, tokens)
                before = (dict(stats.calls), dict(stats.bytes), dict(stats.seconds))
                began = time.perf_counter()
                s2, t2 = run(two, n, tokens)
                wall = time.perf_counter() - began
                same &= t1 == t2
                if s2 > best2:
                    comm = {
                        k: (
                            stats.calls[k] - before[0].get(k, 0),
                            stats.bytes[k] - before[1].get(k, 0),
                            stats.seconds[k] - before[2].get(k, 0.0),
                        )
                        for k in stats.calls
                    }
                    comm_wall = wall
                best1, best2 = max(best1, s1), max(best2, s2)
            steps = tokens  # one decode step per generated token (prefill steps counted in too)
            row = {
                "tp1_tok_s": best1,
                "tp2_tok_s": best2,
                "ratio": best2 / best1,
                "greedy_identical": same,
                "collectives_per_step": {k: c / steps for k, (c, _, _) in comm.items()},
                "collective_share_of_wall": sum(s for _, _, s in comm.values()) / comm_wall,
                "allreduce_us_per_step": comm["all_reduce"][2] / steps * 1e6,
                "payload_bytes_per_token": {k: b / (steps * n) for k, (_, b, _) in comm.items()},
            }
            res["streams"][n] = row
            print(
                f"{name:18s} {n:2d} streams: TP1 {best1:7.1f} tok/s  TP2{'+EP' if ep else '   '} {best2:7.1f} tok/s"
                f"  ({best2 / best1:.2f}x)  greedy identical: {same}  all-reduce "
                f"{row['allreduce_us_per_step']:.0f} us/step ({row['collective_share_of_wall']:.0%} of wall), "
                f"{row['collectives_per_step'].get('all_reduce', 0):.1f} per step, "
                f"{row['payload_bytes_per_token'].get('all_reduce', 0):,.0f} B/token (fp32)"
            )
        res["planner_bytes_per_token"] = planner_bytes_per_token(path, 2)
        print(f"{'':18s} planner's model per token: {res['planner_bytes_per_token']}")
    finally:
        two.engine.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--size", choices=("tiny", "400m"), default="tiny")
    args = ap.parse_args()
    results = {
        name: measure(name, path, ep, args.streams, args.tokens) for name, (path, ep) in checkpoints(args.size).items()
    }
    out = Path(__file__).parent / "results" / f"tp_decode_{args.size}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
