"""Benchmark: k3serve on a CUDA device, the k3serve side of bench/vs_llamacpp.py's cells.

    python bench/gpu_decode.py [--only kl-400m,kl-400m-mxfp4,k3-mxfp4]

The same checkpoints (built into vs_llamacpp's cache folder on first use) and the same figures
as vs_llamacpp.k3serve_numbers: prefill 512, decode 1 stream, 8 and 16 concurrent streams
(aggregate tok/s, the prompts' prefill left out), bf16. The engine picks cuda by itself
(EngineConfig.device "auto"); on cuda every layer runs its torch path (the C++ kernels are
CPU-only) and MXFP4 experts are dequantized per step. Writes bench/results/gpu_decode.json (the
GPU check's speed stage, bench/graph_decode.py --speed, measures the torch engine beside the
compiled ones instead). There is no llama.cpp side: the device has no CUDA llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import vs_llamacpp  # noqa: E402  (bench/ is not a package)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="kl-400m,kl-400m-mxfp4,k3-mxfp4")
    args = p.parse_args()
    assert torch.cuda.is_available(), "no CUDA device visible to torch"
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": {}}
    for name, ckpt in vs_llamacpp.checkpoints(set(args.only.split(","))).items():
        t = time.perf_counter()
        figures = vs_llamacpp.k3serve_numbers(ckpt, (8, 16))
        out["results"][name] = figures
        print(
            f"{name:14s} "
            + "  ".join(f"{k} {v:8.1f} tok/s" for k, v in figures.items())
            + f"  ({time.perf_counter() - t:.0f} s)",
            flush=True,
        )
    path = Path(__file__).parent / "results" / "gpu_decode.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
