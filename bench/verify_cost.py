"""Benchmark: what a speculative verify pass of 1 + k tokens costs beside a decode step (issue 15).

One sequence after a 64-token prefill, on the model's own forward (no scheduler, no sampler):
a decode step (1 row) vs a verify step (1 + k rows with per-position KDA states recorded),
k = 1..8, kernels on, best of 20 each, alternated. Default: the tiny K3 (MXFP4 experts) and the
400 M Kimi-Linear when `--400m` (built on first use). Writes bench/results/verify_cost.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from k3serve.models.registry import load_model
from k3serve.forward import CacheTensors, ForwardBatch

BS, PROMPT = 16, 64


def step_ms(model, cache, ids: torch.Tensor, ctx: int, verify: bool, reps: int = 20) -> float:
    table = list(range(16))
    best = float("inf")
    for _ in range(reps):
        fb = ForwardBatch(ids, [len(ids)], [ctx], [0], [table], BS, verify=[0] if verify else [])
        t = time.perf_counter()
        model.compute_logits(model(fb, cache).hidden)
        best = min(best, time.perf_counter() - t)
    return best * 1000


def measure(path: Path, ks=(1, 2, 4, 8)) -> dict:
    model = load_model(path, dtype=torch.bfloat16, progress=False)
    model.use_kernels("auto")
    cache = CacheTensors.allocate(model.cfg, 2, 16, BS, kv_dtype=model.dtype)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 500, (PROMPT,), generator=g)
    with torch.inference_mode():
        model.compute_logits(model(ForwardBatch(prompt, [PROMPT], [0], [0], [list(range(16))], BS), cache).hidden)
        # state slot 0 now holds the prompt; every timed step rewrites the same next positions
        decode = step_ms(model, cache, prompt[:1], PROMPT, False)
        verify = {k: step_ms(model, cache, prompt[: 1 + k], PROMPT, True) for k in ks}
    return {"decode_ms": decode, "verify_ms": verify, "verify_over_decode": {k: v / decode for k, v in verify.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--400m", dest="big", action="store_true", help="also the 400 M Kimi-Linear")
    args = ap.parse_args()
    from k3serve.testing.builder import build_tiny_checkpoint, ensure_default_model

    models = {"tiny-k3-mxfp4": ensure_default_model()}
    if args.big:
        from k3serve.testing.tiny_configs import kimi_linear_400m_config

        d = Path.home() / ".cache" / "k3serve" / "llamacpp" / "ckpt-kimi-linear-400m"
        if not (d / "config.json").exists():
            build_tiny_checkpoint(d, kind="kimi_linear", seed=0, config=kimi_linear_400m_config())
        models["kl-400m"] = d
    result = {}
    for name, path in models.items():
        r = result[name] = measure(Path(path))
        print(
            f"{name}: decode {r['decode_ms']:.2f} ms; verify 1+k: "
            + ", ".join(f"k={k} {v:.2f} ms ({r['verify_over_decode'][k]:.2f}x)" for k, v in r["verify_ms"].items())
        )
    out = Path(__file__).parent / "results" / "verify_cost.json"
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
