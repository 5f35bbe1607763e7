"""Speculation on vs off across drafters, concurrency and prompt lengths (issue 61).

Engines in one process, each cell's runs alternated engine by engine (rotating which goes first),
--repeats times (default 5), the median kept: speculation off, the adaptive policy (the
default), and K pinned (`"adaptive": false`, the behaviour before the policy). Greedy outputs
are checked equal to off in every run. Cells:
  demo model x {ngram, DSpark} x {1, 8, 16 concurrent streams} x {chat prompts (the demo's
  tool-call and arithmetic turns), ~2,000-token prompts (a long conversation, then a question)}
  tiny random-weight Kimi-Linear x ngram x {1, 8, 16} (acceptance near zero: the right answer is
  to stop drafting)
A cell's throughput is its output tokens over its wall time, prefill included (what a user of n
streams sees). Writes bench/results/spec_decode.json; the target is on / off >= 1.00 everywhere.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from k3serve import LLM, SamplingParams
from k3serve.chat.render import ChatOptions, ChatRenderer
from k3serve.config.bundled import load_model_config
from k3serve.demo import bundled_demo
from k3serve.demo.data import TOOLS, arithmetic, tool_case

K, PROMPTS, STREAMS = 4, 16, (1, 8, 16)


def demo_prompts(llm: LLM, long_tokens: int) -> dict[str, list[list[int]]]:
    r = ChatRenderer("kimi_k3", llm.get_tokenizer(), llm.engine.model_path)
    rng = random.Random(99)
    chat = [
        r.render([{"role": "user", "content": tool_case(rng)[0]}], ChatOptions(tools=TOOLS)).token_ids for _ in range(8)
    ]
    chat += [
        r.render([{"role": "user", "content": arithmetic(rng, held_out=True)[0]}], ChatOptions()).token_ids
        for _ in range(8)
    ]
    long = []
    for _ in range(PROMPTS):
        turns: list[dict] = []
        while True:  # earlier turns of the conversation until the prompt reaches long_tokens
            q, _, a = arithmetic(rng)
            grown = turns + [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            last = [{"role": "user", "content": arithmetic(rng, held_out=True)[0]}]
            ids = r.render(grown + last, ChatOptions()).token_ids
            if len(ids) > long_tokens:
                long.append(r.render(turns + last, ChatOptions()).token_ids)
                break
            turns = grown
    return {"chat": chat, f"{long_tokens}-token": long}


def random_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]


def timed(llm: LLM, prompts: list[list[int]], streams: int, sp: SamplingParams) -> tuple[float, int, list]:
    """Every prompt, `streams` at a time: (seconds, output tokens, token ids)."""
    out = []
    t = time.perf_counter()
    for i in range(0, len(prompts), streams):
        out += llm.generate([{"prompt_token_ids": p} for p in prompts[i : i + streams]], sp)
    dt = time.perf_counter() - t
    ids = [o.outputs[0].token_ids for o in out]
    return dt, sum(map(len, ids)), ids


def cell(engines: dict[str, LLM], prompts, streams: int, sp: SamplingParams, repeats: int) -> dict:
    names = list(engines)
    rates: dict[str, list[float]] = {n: [] for n in names}
    want = None
    for rep in range(repeats + 1):  # the first round warms every engine up and is not kept
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for n in order:
            dt, tokens, ids = timed(engines[n], prompts, streams, sp)
            want = ids if n == "off" and want is None else want
            if rep:
                rates[n].append(tokens / dt)
            if want is not None and ids != want:
                raise SystemExit(f"{n}: greedy output differs from speculation off")
    med = {n: statistics.median(v) for n, v in rates.items()}
    return {
        n: {"tok_per_s": med[n], "ratio_vs_off": med[n] / med["off"], "runs": [round(x, 1) for x in v]}
        for n, v in rates.items()
    }


def spec_engines(path: str, method: dict, kw: dict) -> dict[str, LLM]:
    base = {"num_speculative_tokens": K, **method}
    return {
        "adaptive": LLM(path, speculative_config=base, **kw),
        "pinned": LLM(path, speculative_config={**base, "adaptive": False}, **kw),
    }


def report(results: dict, key: str, row: dict) -> None:
    results[key] = row
    policy = row.get("adaptive", {})
    print(
        f"{key:44s} off {row['off']['tok_per_s']:8.1f} tok/s | adaptive x{policy.get('ratio_vs_off', 0):.2f}"
        f" | pinned K={K} x{row['pinned']['ratio_vs_off']:.2f}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--long", type=int, default=2000, help="tokens of the long prompts")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--only", choices=["demo", "random"], default=None)
    args = ap.parse_args()
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results: dict = {}
    kw = dict(cache_memory="512MiB", max_model_len=args.long + args.max_tokens + 64, max_num_seqs=16)
    if args.only in (None, "demo"):
        path = str(bundled_demo())
        off = LLM(path, **kw)
        sets = demo_prompts(off, args.long)
        drafters = {
            "ngram": {"method": "ngram", "prompt_lookup_min": 2},
            "dspark": {"method": "dspark", "model": "dspark"},
        }
        for name, method in drafters.items():
            engines = {"off": off, **spec_engines(path, method, kw)}
            for set_name, prompts in sets.items():
                for streams in STREAMS:
                    row = cell(engines, prompts, streams, sp, args.repeats)
                    report(results, f"demo {name} {set_name} x{streams} streams", row)
            for e in list(engines.values())[1:]:
                e.engine.shutdown()
    if args.only in (None, "random"):
        from k3serve.testing.builder import build_tiny_checkpoint

        path = str(build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "kl", kind="kimi_linear", seed=0))
        kw = dict(cache_memory="256MiB", max_model_len=512, max_num_seqs=16)
        engines = {"off": LLM(path, **kw), **spec_engines(path, {"method": "ngram"}, kw)}
        prompts = random_prompts(PROMPTS, 64, load_model_config(path).vocab_size)
        for streams in STREAMS:
            row = cell(
                engines, prompts, streams, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), args.repeats
            )
            report(results, f"random Kimi-Linear ngram x{streams} streams", row)
    lowest = min(r["adaptive"]["ratio_vs_off"] for r in results.values())
    print(f"lowest adaptive / off: {lowest:.3f} (target >= 1.00)")
    out = Path(__file__).parent / "results" / "spec_decode.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"repeats": args.repeats, "k": K, "cells": results, "lowest": lowest}, indent=2))


if __name__ == "__main__":
    main()
