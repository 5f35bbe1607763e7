"""Matched ablation on the bundled demo model (issue 10): speculative decoding on vs off with
identical chat prompts, sampling parameters (greedy) and output limits, single user, run
alternately in one process, best of --repeats (default 15: this machine's speed moves by 10-40%
between seconds, and the best of alternating runs is the figure least moved by it). Prompt sets: tool-call turns and templated answers
(arithmetic with its think channel). Drafters: the demo's distilled DSpark draft and ngram.
Writes bench/results/demo_spec.json. Target: >= 2x tokens/s.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from k3serve import LLM, SamplingParams
from k3serve.demo import bundled_demo
from k3serve.demo.data import TOOLS, arithmetic, tool_case
from k3serve.chat.render import ChatOptions, ChatRenderer

N = 8


def prompt_sets(llm: LLM) -> dict[str, list[list[int]]]:
    r = ChatRenderer("kimi_k3", llm.get_tokenizer(), llm.engine.model_path)
    rng = random.Random(99)
    tools = [r.render([{"role": "user", "content": tool_case(rng)[0]}], ChatOptions(tools=TOOLS)).token_ids
             for _ in range(N)]
    arith = [r.render([{"role": "user", "content": arithmetic(rng, held_out=True)[0]}], ChatOptions()).token_ids
             for _ in range(N)]
    return {"tool-call": tools, "templated-answer": arith}


def run(llm: LLM, prompts) -> tuple[float, int]:
    sp = SamplingParams(temperature=0, max_tokens=160)
    t, n = time.perf_counter(), 0
    for p in prompts:
        n += len(llm.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids)
    return n / (time.perf_counter() - t), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=15, help="alternating runs per engine and prompt set (best kept)")
    args = ap.parse_args()
    path = bundled_demo()
    if path is None:
        raise SystemExit("no bundled demo model in this install")
    kw = dict(cache_memory="256MiB", max_model_len=2048)
    engines = {"off": LLM(str(path), **kw),
               "dspark": LLM(str(path), speculative_config={"method": "dspark", "model": "dspark",
                                                            "num_speculative_tokens": 4}, **kw),
               "ngram": LLM(str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                           "prompt_lookup_min": 2}, **kw)}
    results = {}
    for name, prompts in prompt_sets(engines["off"]).items():
        speeds = {k: [] for k in engines}
        for e in engines.values():
            if e.engine.spec:
                e.engine.spec.stats.__init__()
        for _ in range(args.repeats):
            for k, e in engines.items():
                speeds[k].append(run(e, prompts)[0])
        best = {k: max(v) for k, v in speeds.items()}
        results[name] = {k: {"tok_per_s": best[k], "ratio_vs_off": best[k] / best["off"],
                             "mean_acceptance_length": e.engine.spec.stats.mean_acceptance_length if e.engine.spec
                             else None} for k, e in engines.items()}
        print(f"{name} ({N} prompts, greedy, single user):")
        for k, r in results[name].items():
            acc = f"  mean acceptance length {r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else ""
            print(f"  {k:7s} {r['tok_per_s']:7.1f} tok/s  x{r['ratio_vs_off']:.2f}{acc}")
    out = Path(__file__).parent / "results" / "demo_spec.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
