"""Benchmark: routed experts read packed, NVFP4 against MXFP4 (issue 50), on the CPU.

    python bench/nvfp4_experts.py [--experts 32] [--hidden 1024] [--inter 512] [--top-k 4] [--repeats 20]

One MoE layer's routed experts (the 400 M Kimi-Linear's shapes by default) quantized both ways
from the same float weights, then, for 1, 4 and 16 tokens, side by side in one run: the C++
grouped kernels on the packed bytes (kernels/cpu mxfp4_grouped.cpp / nvfp4_grouped.cpp) and
the torch path that decodes the selected experts (layers/experts.py), each checked against
`experts_reference`. Prints microseconds per call, the bytes of the experts touched and the
GB/s that implies, and NVFP4's time over MXFP4's; writes bench/results/nvfp4_experts.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from k3serve import kernels
from k3serve.layers.activation import situ_and_mul
from k3serve.layers.experts import experts_forward, experts_reference
from k3serve.weights.mxfp4 import PackedMXFP4
from k3serve.weights.nvfp4 import PackedNVFP4


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    E, D, I, k = args.experts, args.hidden, args.inter, args.top_k
    g = torch.Generator().manual_seed(0)
    dense = [torch.randn(E, I, D, generator=g) / D**0.5, torch.randn(E, D, I, generator=g) / I**0.5]
    dense.append(torch.randn(E, I, D, generator=g) / D**0.5)
    formats = {"mxfp4": [PackedMXFP4.quantize(w) for w in dense], "nvfp4": [PackedNVFP4.quantize(w) for w in dense]}
    act = partial(situ_and_mul, beta=4.0, linear_beta=25.0)
    K = kernels.get("cpp")
    rows = []
    for n in (1, 4, 16):
        x = torch.randn(n, D, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
        weights = torch.rand(n, k, generator=g)
        touched = ids.unique().numel()
        for fmt, (w1, w2, w3) in formats.items():
            want = experts_reference(x, ids, weights, w1, w2, w3, act)
            nbytes = touched * sum(w.nbytes // E for w in (w1, w2, w3))
            for path, kern in (("cpp", K), ("torch", None)):
                got = experts_forward(x, ids, weights, w1, w2, w3, act, kernels=kern)
                err = ((got - want).abs().max() / want.abs().max()).item()
                assert err < 1e-5, (fmt, path, err)
                s = timed(lambda: experts_forward(x, ids, weights, w1, w2, w3, act, kernels=kern), args.repeats)
                rows.append(dict(tokens=n, format=fmt, path=path, us=s * 1e6, bytes=nbytes, GBps=nbytes / s / 1e9))
    print(f"experts {E} x ({I} x {D}) x 3, top-{k}; median of {args.repeats}; threads {torch.get_num_threads()}")
    print(f"{'tokens':>6} {'path':>6} {'mxfp4 us':>10} {'nvfp4 us':>10} {'nv/mx':>6} {'mx GB/s':>8} {'nv GB/s':>8}")
    ratios = {}
    for n in (1, 4, 16):
        for path in ("cpp", "torch"):
            mx, nv = (next(r for r in rows if (r["tokens"], r["format"], r["path"]) == (n, f, path)) for f in formats)
            ratios[f"{path}@{n}"] = nv["us"] / mx["us"]
            print(
                f"{n:>6} {path:>6} {mx['us']:>10.0f} {nv['us']:>10.0f} {nv['us'] / mx['us']:>6.2f} "
                f"{mx['GBps']:>8.2f} {nv['GBps']:>8.2f}"
            )
    out = dict(shape=dict(experts=E, hidden=D, inter=I, top_k=k), rows=rows, nvfp4_over_mxfp4_time=ratios)
    path = Path(__file__).parent / "results" / "nvfp4_experts.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
