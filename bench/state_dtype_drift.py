"""Benchmark: what a bfloat16 KDA state (--mamba-ssm-cache-dtype bfloat16) costs against float32
over long generation, on the bundled demo model (trained, K3's layout) and on tiny K3 and tiny
Kimi-Linear with random weights (issue 50).

    python bench/state_dtype_drift.py [--tokens 4096] [--prompt 64]

Per model, side by side in one run:
  token agreement   greedy generation of `--tokens` tokens by the engine with each state dtype
                    (free running): the first position where they differ, and the share of
                    positions equal;
  state error       the float32 run's tokens decoded one at a time through the model twice, a
                    float32 and a bfloat16 state pool (teacher forced, so both see the same
                    inputs): the largest |bf16 - fp32| of the recurrent state over all KDA
                    layers, relative to the largest |fp32|, sampled every 256 tokens, and the
                    largest top-1 disagreement of the logits along the way.
Writes bench/results/state_dtype_drift.json; docs/features.md quotes the figures.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from k3serve import LLM, SamplingParams
from k3serve.forward import CacheTensors, ForwardBatch
from k3serve.testing.builder import build_tiny_checkpoint


def generate(path, n, prompt, state):
    llm = LLM(
        str(path),
        kernels="torch",
        cache_memory="64MiB",
        max_model_len=len(prompt) + n + 16,
        mamba_ssm_cache_dtype=state,
        enable_prefix_caching=False,
    )
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return out[0].outputs[0].token_ids, llm.engine.model


def teacher_forced(model, prompt, tokens, every=256):
    """Max relative state error and top-1 disagreements along the fp32 tokens."""
    bs, total = 16, len(prompt) + len(tokens)
    blocks = list(range(-(-total // bs)))
    caches = {
        d: CacheTensors.allocate(model.cfg, 1, len(blocks), bs, state_dtype=d) for d in (torch.float32, torch.bfloat16)
    }
    worst, disagree, trace = 0.0, 0, []
    with torch.inference_mode():
        logits = {}
        for d, c in caches.items():
            out = model(ForwardBatch(torch.tensor(prompt), [len(prompt)], [0], [0], [blocks], bs), c)
            logits[d] = model.compute_logits(out.hidden[-1:])
        for i, t in enumerate(tokens):
            disagree += int(logits[torch.float32].argmax() != logits[torch.bfloat16].argmax())
            for d, c in caches.items():
                out = model(ForwardBatch(torch.tensor([t]), [1], [len(prompt) + i], [0], [blocks], bs), c)
                logits[d] = model.compute_logits(out.hidden)
            if (i + 1) % every == 0 or i + 1 == len(tokens):
                a = [x[0].float() for x in caches[torch.float32].recurrent if x is not None]
                b = [x[0].float() for x in caches[torch.bfloat16].recurrent if x is not None]
                err = max((x - y).abs().max().item() / max(x.abs().max().item(), 1e-30) for x, y in zip(a, b))
                worst = max(worst, err)
                trace.append((i + 1, err))
    return worst, disagree, trace


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--prompt", type=int, default=64)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="k3serve-drift-"))
    prompt = torch.randint(1, 500, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {"tokens": args.tokens, "results": {}}
    from k3serve.demo import default_model

    for kind in ("demo", "k3", "kimi_linear"):  # the trained demo (K3 layout), then random tiny weights
        t0 = time.perf_counter()
        path = default_model() if kind == "demo" else build_tiny_checkpoint(work / kind, kind=kind, seed=0)
        from k3serve.config.bundled import load_model_config

        n = min(args.tokens, load_model_config(path).max_position_embeddings - len(prompt) - 16)
        ref, model = generate(path, n, prompt, "float32")
        bf16, _ = generate(path, n, prompt, "bfloat16")
        first = next((i for i, (a, b) in enumerate(zip(ref, bf16)) if a != b), len(ref))
        agree = sum(a == b for a, b in zip(ref, bf16)) / len(ref)
        worst, disagree, trace = teacher_forced(model, prompt, ref)
        out["results"][kind] = {
            "first_divergence": first,
            "token_agreement": agree,
            "max_state_rel_error": worst,
            "teacher_forced_top1_disagreements": disagree,
            "state_error_trace": trace,
            "seconds": time.perf_counter() - t0,
        }
        print(
            f"{kind}: free-running tokens equal up to {first} of {len(ref)} ({agree:.1%} of positions equal); "
            f"teacher forced: max state error {worst:.2e} (relative), top-1 differs at {disagree} of "
            f"{len(ref)} positions",
            flush=True,
        )
    path = Path(__file__).parent / "results" / "state_dtype_drift.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
