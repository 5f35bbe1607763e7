"""Benchmark: checkpoint load time, safetensors' mmap reader against fastsafetensors (issue 50).

    python bench/load_formats.py [--size 400m|tiny] [--shards 8] [--repeats 3]

Builds a multi-shard checkpoint with k3serve's builder (the 400 M Kimi-Linear by default, into
a temporary folder), then loads it with `load_weights` both ways, alternating, median of
`--repeats` (the page cache is warm after the first read: these are warm-cache figures, what a
restart on the same host sees), and checks every tensor equal. Writes
bench/results/load_formats.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from k3serve.config.bundled import load_model_config
from k3serve.testing.builder import build_tiny_checkpoint
from k3serve.testing.tiny_configs import kimi_linear_400m_config
from k3serve.weights.loader import load_weights
from k3serve.weights.mxfp4 import PackedMXFP4


def same(a, b) -> bool:
    if isinstance(a, PackedMXFP4):
        return torch.equal(a.packed, b.packed) and torch.equal(a.scale, b.scale)
    return torch.equal(a, b)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", choices=("400m", "tiny"), default="400m")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="k3serve-load-"))
    try:
        config = kimi_linear_400m_config() if args.size == "400m" else None
        kind = "kimi_linear" if args.size == "400m" else "k3"
        ckpt = build_tiny_checkpoint(work / args.size, kind=kind, seed=0, config=config, num_shards=args.shards)
        cfg = load_model_config(ckpt)
        nbytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        times = {"safetensors": [], "fastsafetensors": []}
        ref = load_weights(ckpt, cfg, progress=False)  # warms the page cache
        for _ in range(args.repeats):
            for fmt in times:
                t0 = time.perf_counter()
                got = load_weights(ckpt, cfg, load_format=fmt, progress=False)
                times[fmt].append(time.perf_counter() - t0)
                assert got.keys() == ref.keys() and all(same(got[k], ref[k]) for k in ref), fmt
                del got
        med = {k: statistics.median(v) for k, v in times.items()}
        out = {
            "checkpoint": args.size,
            "shards": len(list(ckpt.glob("*.safetensors"))),
            "bytes": nbytes,
            "seconds": med,
            "GBps": {k: nbytes / v / 1e9 for k, v in med.items()},
            "fastsafetensors_over_mmap": med["safetensors"] / med["fastsafetensors"],
        }
        print(
            f"{args.size}: {nbytes / 1e9:.2f} GB in {out['shards']} shards; mmap {med['safetensors']:.2f} s "
            f"({out['GBps']['safetensors']:.2f} GB/s), fastsafetensors {med['fastsafetensors']:.2f} s "
            f"({out['GBps']['fastsafetensors']:.2f} GB/s): {out['fastsafetensors_over_mmap']:.2f}x; tensors equal"
        )
        path = Path(__file__).parent / "results" / "load_formats.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(out, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
