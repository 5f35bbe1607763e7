"""Matched ablation for speculative decoding (issue 7, the answer to seed 004).

Identical tokenized prompts, sampling parameters and output lengths, spec on vs off, run
alternately in one process, single user (one request at a time, the seed's setting), best of
2, on the default tiny K3 (random weights, CPU). Two prompt sets:
  low-entropy   repeated 6-token segments; outputs restricted by a logit bias to 4 tokens
                (stands in for code / boilerplate: the next tokens are predictable)
  high-entropy  random prompts, temperature 1.0, no bias
Drafters: ngram (k=4), dspark untrained (random init) and dspark distilled from the target
(`k3serve train-dspark`), k=4, greedy drafting, standard verification.
Writes bench/results/spec_decode.json.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from k3serve import LLM, SamplingParams
from k3serve.config.bundled import load_model_config
from k3serve.spec_decode.dspark import DSparkConfig, DSparkModel, save_dspark
from k3serve.spec_decode.train_dspark import distill_dspark
from k3serve.testing.builder import ensure_default_model

K, N_PROMPTS, NEW = 4, 6, 48
KW = dict(cache_memory="64MiB", max_model_len=1024)


def prompt_sets() -> dict[str, tuple[list[dict], SamplingParams]]:
    g = torch.Generator().manual_seed(0)
    low = [{"prompt_token_ids": torch.randint(1, 500, (6,), generator=g).tolist() * 5} for _ in range(N_PROMPTS)]
    high = [{"prompt_token_ids": torch.randint(1, 500, (30,), generator=g).tolist()} for _ in range(N_PROMPTS)]
    return {
        "low-entropy": (
            low,
            SamplingParams(
                temperature=0, max_tokens=NEW, ignore_eos=True, logit_bias={11: 6.0, 22: 6.0, 33: 6.0, 44: 6.0}
            ),
        ),
        "high-entropy": (high, SamplingParams(temperature=1.0, seed=0, max_tokens=NEW, ignore_eos=True)),
    }


def run(llm: LLM, prompts, sp) -> float:
    t = time.perf_counter()
    n = sum(len(llm.generate([p], sp)[0].outputs[0].token_ids) for p in prompts)
    return n / (time.perf_counter() - t)


def main() -> None:
    path = str(ensure_default_model())
    tmp = Path(tempfile.mkdtemp())
    cfg = load_model_config(path)
    torch.manual_seed(0)
    untrained = save_dspark(
        DSparkModel(DSparkConfig((1, 4, 6), K, cfg.pad_token_id, cfg.vocab_size, cfg.hidden_size, markov_rank=16)),
        tmp / "untrained",
    )
    distilled = distill_dspark(path, str(tmp / "distilled"), block_size=K, steps=300, num_seqs=96, seq_len=64)["out"]
    engines = {
        "off": LLM(path, **KW),
        "ngram": LLM(
            path, speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2}, **KW
        ),
        "dspark-untrained": LLM(
            path, speculative_config={"method": "dspark", "model": str(untrained), "num_speculative_tokens": K}, **KW
        ),
        "dspark-distilled": LLM(
            path, speculative_config={"method": "dspark", "model": distilled, "num_speculative_tokens": K}, **KW
        ),
    }
    results = {}
    for set_name, (prompts, sp) in prompt_sets().items():
        speeds = {k: [] for k in engines}
        for name, llm in engines.items():
            if llm.engine.spec:
                llm.engine.spec.stats.__init__()
        for _ in range(2):
            for name, llm in engines.items():
                speeds[name].append(run(llm, prompts, sp))
        best = {k: max(v) for k, v in speeds.items()}
        row = {}
        for name, llm in engines.items():
            st = llm.engine.spec.stats if llm.engine.spec else None
            row[name] = {
                "tok_per_s": best[name],
                "ratio_vs_off": best[name] / best["off"],
                "mean_acceptance_length": st.mean_acceptance_length if st else None,
                "accepted_per_position": st.accepted_per_position if st else None,
            }
        results[set_name] = row
        print(f"{set_name} ({N_PROMPTS} prompts x {NEW} tokens, single user):")
        for name, r in row.items():
            acc = f"  mean acceptance length {r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else ""
            print(f"  {name:17s} {r['tok_per_s']:7.1f} tok/s  x{r['ratio_vs_off']:.2f} vs off{acc}")
    out = Path(__file__).parent / "results" / "spec_decode.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"k": K, "new_tokens": NEW, "results": results}, indent=2))


if __name__ == "__main__":
    main()
