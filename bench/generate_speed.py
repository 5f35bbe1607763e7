"""Benchmark: engine tokens/s on the default tiny K3 config, fp32 and bf16, batch 1.

Both dtypes are measured alternately in one process; best of 3; writes
bench/results/generate_speed.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from k3serve import LLM, SamplingParams
from k3serve.testing.builder import ensure_default_model

PROMPT = list(range(1, 33))
NEW_TOKENS = 64


def run(llm: LLM) -> float:
    t = time.perf_counter()
    out = llm.generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    )
    return len(out[0].outputs[0].token_ids) / (time.perf_counter() - t)


def main() -> None:
    path = ensure_default_model()
    gens = {name: LLM(str(path), dtype=name, cache_memory="64MiB", max_num_seqs=1) for name in ("float32", "bfloat16")}
    speeds: dict[str, list[float]] = {k: [] for k in gens}
    for _ in range(3):
        for name, gen in gens.items():
            speeds[name].append(run(gen))
    best = {k: max(v) for k, v in speeds.items()}
    for k, v in best.items():
        print(f"{k:9s} batch 1: {v:7.1f} tok/s (prompt {len(PROMPT)}, {NEW_TOKENS} new tokens)")
    print(f"bf16 / fp32 ratio: {best['bfloat16'] / best['float32']:.2f}")
    out = Path(__file__).parent / "results" / "generate_speed.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"model": str(path), "tok_per_s": best, "all": speeds}, indent=2))


if __name__ == "__main__":
    main()
