"""What the draft-length policy costs a step (issue 61: under 2% of a decode step at 16 streams).

The demo model's chat prompts, 16 streams (--streams), greedy: each engine's steps timed whole, and inside
them the policy's own work (should_draft / choose / shadow scoring / resting, and the step-cost
sample after the step), by wrapping those calls. Speculation engines: ngram and DSpark, adaptive.
Writes bench/results/spec_policy_cost.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from k3serve import LLM, SamplingParams
from k3serve.demo import bundled_demo
from k3serve.spec_decode import adaptive, decoder

sys.path.insert(0, str(Path(__file__).parent))
from spec_decode import demo_prompts  # noqa: E402

POLICY = [
    (adaptive.DraftPolicy, "resting"),
    (adaptive.DraftPolicy, "should_draft"),
    (adaptive.DraftPolicy, "choose"),
    (adaptive.DraftPolicy, "score_shadows"),
    (decoder.SpecDecoder, "step_done"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=16, help="requests at once (1: one user, the shortest steps)")
    args = ap.parse_args()
    spent: Counter = Counter()
    for cls, name in POLICY:
        f = getattr(cls, name)

        def timed(*a, _f=f, _n=name, **k):
            t = time.perf_counter()
            out = _f(*a, **k)
            spent[_n] += time.perf_counter() - t
            return out

        setattr(cls, name, timed)
    path = str(bundled_demo())
    kw = dict(cache_memory="256MiB", max_model_len=2048, max_num_seqs=16)
    sp = SamplingParams(temperature=0, max_tokens=160)
    results = {}
    for name, method in (
        ("ngram", {"method": "ngram", "prompt_lookup_min": 2}),
        ("dspark", {"method": "dspark", "model": "dspark"}),
    ):
        llm = LLM(path, speculative_config={"num_speculative_tokens": 4, **method}, **kw)
        prompts = [{"prompt_token_ids": p} for p in demo_prompts(llm, 2000)["chat"]]

        def run():
            for i in range(0, len(prompts), args.streams):
                llm.generate(prompts[i : i + args.streams], sp)

        run()
        spent.clear()
        steps0 = llm.engine.spec._steps
        t = time.perf_counter()
        for _ in range(5):
            run()
        total = time.perf_counter() - t
        steps = llm.engine.spec._steps - steps0
        policy = sum(spent.values())
        results[name] = {
            "steps": steps,
            "step_us": total / steps * 1e6,
            "policy_us_per_step": policy / steps * 1e6,
            "share": policy / total,
            "by_call_us_per_step": {k: v / steps * 1e6 for k, v in spent.items()},
        }
        r = results[name]
        print(
            f"{name}: {r['step_us']:.0f} us a step, the policy {r['policy_us_per_step']:.1f} us "
            f"({100 * r['share']:.2f}%): " + ", ".join(f"{k} {v:.1f}" for k, v in r["by_call_us_per_step"].items())
        )
    name = "spec_policy_cost.json" if args.streams == 16 else f"spec_policy_cost_{args.streams}.json"
    out = Path(__file__).parent / "results" / name
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
