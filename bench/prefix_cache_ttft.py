"""Benchmark: TTFT of a request whose 2,048-token prompt shares 90% with an earlier one, prefix
caching on vs off, on the default tiny K3 (issue 6 target: >= 5x lower).

Three engines run side by side in one process, alternating, best of 3:
  off          --no-enable-prefix-caching
  interval256  caching with a KDA checkpoint every 256 prompt tokens: the first request that
               shares 90% resumes at 1,792 tokens
  default      caching with checkpoints at prompt ends and junctions only: the first sharer
               computes everything and leaves a checkpoint at the junction (1,840); the
               second sharer resumes there
Reports TTFT (ms) and ratios, bytes per KDA checkpoint (tiny K3 and bundled K3), and writes
bench/results/prefix_cache_ttft.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from k3serve import LLM, SamplingParams
from k3serve.cache.sizing import kda_state_bytes_per_request
from k3serve.config.bundled import load_model_config
from k3serve.testing.builder import ensure_default_model

PROMPT, SHARED = 2048, int(2048 * 0.9)
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ttft(llm: LLM, prompt: list[int]) -> float:
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], ONE)
    return time.perf_counter() - t


def main() -> None:
    path = str(ensure_default_model())
    kw = dict(cache_memory="512MiB", max_model_len=4096, max_num_batched_tokens=4096)
    engines = {
        "off": LLM(path, enable_prefix_caching=False, **kw),
        "interval256": LLM(path, prefix_cache_state_interval=256, **kw),
        "default": LLM(path, **kw),
    }
    times: dict[str, list[float]] = {k: [] for k in engines}
    for rep in range(3):
        base = tokens(PROMPT, seed=rep)
        sharers = [base[:SHARED] + tokens(PROMPT - SHARED, seed=100 + 10 * rep + i) for i in range(2)]
        for name, llm in engines.items():
            llm.engine.reset_prefix_cache()
            ttft(llm, base)  # the earlier request
            first = ttft(llm, sharers[0])
            second = ttft(llm, sharers[1])
            times[name].append(second if name == "default" else first)
    best = {k: min(v) * 1000 for k, v in times.items()}
    tiny_ckpt = engines["default"].engine.plan.slot_bytes
    k3_ckpt = kda_state_bytes_per_request(load_model_config("moonshotai/Kimi-K3"))
    print(f"TTFT, 2,048-token prompt sharing {SHARED} tokens with an earlier request (best of 3):")
    for k, v in best.items():
        print(f"  {k:12s} {v:8.1f} ms   ratio off/{k}: {best['off'] / v:5.2f}x")
    print(f"bytes per KDA checkpoint: tiny K3 {tiny_ckpt:,} B; bundled Kimi-K3 {k3_ckpt:,} B")
    hit = {k: e.engine.cache.checkpoints.stats.hit_tokens for k, e in engines.items()}
    print(f"hit tokens over the run: {hit}")
    out = Path(__file__).parent / "results" / "prefix_cache_ttft.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "ttft_ms": best,
                "all_s": times,
                "ratio_interval256": best["off"] / best["interval256"],
                "ratio_default_second_sharer": best["off"] / best["default"],
                "checkpoint_bytes": {"tiny_k3": tiny_ckpt, "kimi_k3": k3_ckpt},
                "hit_tokens": hit,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
