"""Benchmark: the compiled grouped-MXFP4 MoE kernels vs the torch reference path, side by side.

The default tiny K3 (MXFP4 routed experts), bf16, prefix caching off: decode of 1 and of 16
concurrent requests (64 new tokens each) and a 512-token prefill, `--kernels auto` and
`--kernels torch` engines alternated in one process, best of 3. Writes
bench/results/moe_kernels.json. (The llama.cpp comparison of issue 15 is a separate script.)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from k3serve import LLM, SamplingParams
from k3serve.testing.builder import ensure_default_model

DECODE = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def decode(llm: LLM, n: int) -> float:
    prompts = [{"prompt_token_ids": list(range(1 + i, 33 + i))} for i in range(n)]
    t = time.perf_counter()
    out = llm.generate(prompts, DECODE)
    return sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - t)


def prefill(llm: LLM) -> float:
    t = time.perf_counter()
    llm.generate({"prompt_token_ids": list(range(1, 513))}, ONE)
    return 512 / (time.perf_counter() - t)


def main() -> None:
    path = ensure_default_model()
    llms = {
        mode: LLM(
            str(path),
            dtype="bfloat16",
            cache_memory="64MiB",
            max_num_seqs=16,
            kernels=mode,
            enable_prefix_caching=False,
        )
        for mode in ("torch", "cpp")
    }
    cases = {"decode_1": lambda l: decode(l, 1), "decode_16": lambda l: decode(l, 16), "prefill_512": prefill}
    result = {}
    for name, fn in cases.items():
        runs = {mode: [] for mode in llms}
        for _ in range(3):
            for mode, llm in llms.items():
                runs[mode].append(fn(llm))
        best = {mode: max(v) for mode, v in runs.items()}
        result[name] = {"tok_per_s": best, "ratio_cpp_over_torch": best["cpp"] / best["torch"], "all": runs}
        print(
            f"{name:12s} torch {best['torch']:8.1f} tok/s   kernels {best['cpp']:8.1f} tok/s   "
            f"x{best['cpp'] / best['torch']:.2f}"
        )
    out = Path(__file__).parent / "results" / "moe_kernels.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"model": str(path), **result}, indent=2))


if __name__ == "__main__":
    main()
