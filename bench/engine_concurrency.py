"""Benchmark: aggregate decode throughput of 16 concurrent requests vs the same 16 run one
after another, on the default tiny K3 through the engine (continuous batching).

Both modes run alternately in one process (this machine is noisy); best of 3 each.
Also prints the engine start-up lines for a 1 GiB cache. Writes bench/results/engine_concurrency.json.
Target (issue 4): concurrent / sequential >= 5x.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from k3serve import LLM, SamplingParams
from k3serve.testing.builder import ensure_default_model

NUM_REQUESTS, PROMPT_LEN, NEW_TOKENS = 16, 16, 64


def prompts() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {"prompt_token_ids": torch.randint(1, 500, (PROMPT_LEN,), generator=g).tolist()} for _ in range(NUM_REQUESTS)
    ]


def tok_per_s(llm: LLM, concurrent: bool) -> float:
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ps = prompts()
    t = time.perf_counter()
    outs = llm.generate(ps, sp) if concurrent else [o for p in ps for o in llm.generate([p], sp)]
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n / (time.perf_counter() - t)


def main() -> None:
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())
    logging.getLogger("k3serve.engine").addHandler(handler)
    logging.getLogger("k3serve.engine").setLevel(logging.INFO)
    llm = LLM(str(ensure_default_model()), cache_memory="1GiB", max_num_seqs=NUM_REQUESTS)
    print("start-up (tiny K3, 1 GiB cache):")
    for line in lines:
        print("  " + line)
    tok_per_s(llm, True)  # warm-up
    runs: dict[str, list[float]] = {"concurrent": [], "sequential": []}
    for _ in range(3):
        runs["concurrent"].append(tok_per_s(llm, True))
        runs["sequential"].append(tok_per_s(llm, False))
    best = {k: max(v) for k, v in runs.items()}
    ratio = best["concurrent"] / best["sequential"]
    print(f"{NUM_REQUESTS} requests x {NEW_TOKENS} new tokens (prompt {PROMPT_LEN}):")
    print(f"  concurrent : {best['concurrent']:8.1f} tok/s")
    print(f"  sequential : {best['sequential']:8.1f} tok/s")
    print(f"  ratio      : {ratio:8.2f}x (target >= 5x)")
    out = Path(__file__).parent / "results" / "engine_concurrency.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "model": str(ensure_default_model()),
                "startup_log": lines,
                "tok_per_s": best,
                "ratio": ratio,
                "all": runs,
                "num_requests": NUM_REQUESTS,
                "prompt_len": PROMPT_LEN,
                "new_tokens": NEW_TOKENS,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
