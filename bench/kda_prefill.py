"""Benchmark: chunked KDA prefill vs token-by-token recurrence at 2,048 tokens.

Runs under `flush_denormals()` as the KDA layer does. Both algorithms run side by side in one process (this machine is noisy), several repeats,
best-of reported; prints the ratio and writes bench/results/kda_prefill.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from k3serve.layers.kda_ops import flush_denormals, kda_chunked, kda_recurrent
from k3serve.layers.norm import l2_normalize

SHAPES = [("tiny K3 (H=4, D=16)", 4, 16), ("H=2, D=128 (K3 head size)", 2, 128), ("H=8, D=64", 8, 64)]


def inputs(T: int, H: int, D: int):
    g = torch.Generator().manual_seed(0)
    q = l2_normalize(torch.randn(T, H, D, generator=g)) * D**-0.5
    k = l2_normalize(torch.randn(T, H, D, generator=g))
    v = torch.randn(T, H, D, generator=g)
    gate = -5.0 * torch.sigmoid(torch.randn(T, H, D, generator=g))
    beta = torch.sigmoid(torch.randn(T, H, generator=g))
    return q, k, v, gate, beta, torch.zeros(H, D, D)


def best_of(fn, args, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return min(times)


def main(T: int = 2048) -> None:
    torch.set_grad_enabled(False)
    rows = []
    for name, H, D in SHAPES:
        args = inputs(T, H, D)
        with flush_denormals():  # as the KDA layer runs both paths; applies to both algorithms
            chunked, recurrent = best_of(kda_chunked, args), best_of(kda_recurrent, args)
        rows.append(
            {"shape": name, "tokens": T, "chunked_s": chunked, "recurrent_s": recurrent, "speedup": recurrent / chunked}
        )
        print(
            f"{name:28s} chunked {chunked * 1e3:8.1f} ms  recurrent {recurrent * 1e3:8.1f} ms  "
            f"speedup {recurrent / chunked:5.2f}x"
        )
    out = Path(__file__).parent / "results" / "kda_prefill.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"threads": torch.get_num_threads(), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
