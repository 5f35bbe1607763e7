"""Benchmark: what an fp8 MLA latent cache costs against the model-dtype cache over long
generation, unit scale against calibrated per-layer scales (--calculate-kv-scales), on the
bundled demo model (trained, K3's layout) and on tiny K3 and tiny Kimi-Linear with random weights
(issue 50).

    python bench/kv_fp8_drift.py [--tokens 4096] [--prompt 64]

Per model, side by side in one run: greedy generation of `--tokens` tokens (free running) with
the model-dtype cache, fp8 at unit scale and fp8 with calibrated scales; for each fp8 run the
first position where its tokens leave the reference's and the share of positions equal, and the
calibrated scales' range. Writes bench/results/kv_fp8_drift.json; docs/features.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from k3serve import LLM, SamplingParams
from k3serve.testing.builder import build_tiny_checkpoint


def generate(path, n, prompt, kv, calibrate):
    llm = LLM(
        str(path),
        cache_memory="64MiB",
        max_model_len=len(prompt) + n + 16,
        kv_cache_dtype=kv,
        calculate_kv_scales=calibrate,
        enable_prefix_caching=False,
    )
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    scales = llm.engine.executor.cache.latent_scale
    return out[0].outputs[0].token_ids, None if scales is None else [s.item() for s in scales.values()]


def agreement(a: list[int], b: list[int]) -> dict:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return {"first_difference": first, "equal_share": sum(x == y for x, y in zip(a, b)) / len(a)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--prompt", type=int, default=64)
    args = p.parse_args()
    from k3serve.demo import bundled_demo

    work = Path(tempfile.mkdtemp(prefix="k3serve-fp8-"))
    models = {
        "demo": bundled_demo(),
        "tiny-k3": build_tiny_checkpoint(work / "k3", kind="k3", seed=0),
        "tiny-kimi-linear": build_tiny_checkpoint(work / "kl", kind="kimi_linear", seed=0),
    }
    prompt = torch.randint(1, 500, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {"tokens": args.tokens, "prompt": args.prompt, "models": {}}
    for name, path in models.items():
        t0 = time.perf_counter()
        ref, _ = generate(path, args.tokens, prompt, "auto", False)
        unit, _ = generate(path, args.tokens, prompt, "fp8", False)
        cal, scales = generate(path, args.tokens, prompt, "fp8", True)
        row = {
            "fp8_unit_scale": agreement(unit, ref),
            "fp8_calibrated": agreement(cal, ref),
            "calibrated_scales": [min(scales), max(scales)],
            "seconds": time.perf_counter() - t0,
        }
        out["models"][name] = row
        print(
            f"{name:<17} fp8 unit: first diff {row['fp8_unit_scale']['first_difference']:>5}, "
            f"equal {row['fp8_unit_scale']['equal_share']:.1%} | calibrated: first diff "
            f"{row['fp8_calibrated']['first_difference']:>5}, equal {row['fp8_calibrated']['equal_share']:.1%} "
            f"(scales {min(scales):.3g}..{max(scales):.3g})  [{row['seconds']:.0f} s]"
        )
    path = Path(__file__).parent / "results" / "kv_fp8_drift.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
