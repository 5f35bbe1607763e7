"""Check and benchmark: the multi-rank engine on a machine with several GPUs (issue 60 item 6),
the multi-GPU stage of bench/gpu_check.py (run only where torch sees 2 or more GPUs).

    python bench/multi_gpu.py [--only k3-mxfp4,kl-400m] [--tp 2,4,8] [--streams 1,16,64] [--kernels auto]

Per checkpoint (vs_llamacpp's: tiny K3, the 400 M Kimi-Linear) and per TP size that fits the
GPUs present (tiny K3 with expert parallelism: its MXFP4 experts cannot split by channel), side
by side with one GPU in the same run:
  1. greedy tokens of the TP engine equal one GPU's (null, or the first index that differs);
  2. decode tok/s at each stream count (vs_llamacpp's counting: prefill left out, median of three);
  3. weight bytes per rank as loaded, against `k3serve plan`'s per-rank figure (bf16 as stored).
`--device cpu` with small sizes is bench/gpu_check.py's dry run: TP2 over gloo on the CPU (the
figures mean nothing there). The JSON (--json) is rewritten after each engine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import graph_decode  # noqa: E402  (bench/ is not a package)
import vs_llamacpp  # noqa: E402


def engine(args, ckpt: Path, tp: int):
    from k3serve import LLM
    from k3serve.config.bundled import load_model_config

    packed = load_model_config(ckpt).quant is not None  # MXFP4 experts: split by expert, not by channel

    return LLM(
        str(ckpt),
        device=args.device,
        dtype="bfloat16",
        kernels=args.kernels,
        tensor_parallel_size=tp,
        enable_expert_parallel=tp > 1 and packed,
        cache_memory="512MiB" if args.device != "cpu" else "64MiB",
        max_num_seqs=max(args.streams),
        max_model_len=256,
        enable_prefix_caching=False,
        compilation_config={"backend": args.compile_backend, "cudagraph_capture_sizes": sorted(set(args.streams))},
    )


def planned_bytes(ckpt: Path, tp: int, ep: int) -> int:
    """`k3serve plan`'s weights per rank for the layout, the vision tower aside (loaded beside)."""
    from k3serve.config.bundled import load_model_config
    from k3serve.planner.weights import weight_split
    from k3serve.weights.schema import model_tensor_specs

    cfg = load_model_config(ckpt)
    return weight_split(cfg, ckpt).per_rank(tp=tp, ep=ep) - sum(s.nbytes for s in model_tensor_specs(cfg) if s.vision)


def run(args, name: str, ckpt: Path, fig: dict, save) -> bool:
    n = max(args.streams)
    one = engine(args, ckpt, 1)
    want = graph_decode.tokens(one, n, args.new)
    fig["tp1"] = {"tok_s": {s: graph_decode.tok_s(one, s, args.new) for s in args.streams}}
    one.engine.shutdown()
    del one
    ok = True
    for tp in args.tp:
        llm = engine(args, ckpt, tp)
        try:
            f = fig[f"tp{tp}"] = {
                "vs_one_gpu": graph_decode.first_difference(graph_decode.tokens(llm, n, args.new), want),
                "weights_per_rank": llm.engine.executor.rank_weight_bytes(),
                "planned_per_rank": planned_bytes(ckpt, tp, tp),  # channel-split experts: 1/tp of each
                "startup": llm.engine.startup_log[-3:],
            }
            f["tok_s"] = {s: graph_decode.tok_s(llm, s, args.new) for s in args.streams}
        finally:
            llm.engine.shutdown()
        ok &= f["vs_one_gpu"] is None
        print(
            f"{name} TP{tp}: tokens == one GPU: {f['vs_one_gpu'] is None}; weights per rank "
            f"{f['weights_per_rank']} (plan {f['planned_per_rank']:,}); tok/s "
            + ", ".join(f"{s}: {v:.0f} vs {fig['tp1']['tok_s'][s]:.0f}" for s, v in f["tok_s"].items()),
            flush=True,
        )
        save()
    return ok


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="k3-mxfp4,kl-400m")
    p.add_argument("--tp", default=None, help="TP sizes (default: 2, 4, 8 up to the GPUs present)")
    p.add_argument("--streams", default="1,16,64")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--kernels", default="auto")
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    gpus = torch.cuda.device_count() if args.device == "cuda" else 2
    args.tp = [int(t) for t in args.tp.split(",")] if args.tp else [t for t in (2, 4, 8) if t <= gpus]
    args.streams = [int(s) for s in args.streams.split(",")]
    out = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "gpus": gpus, "results": {}}
    path = Path(args.json) if args.json else Path(__file__).parent / "results" / "multi_gpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        path.write_text(json.dumps(out, indent=2))

    ok = True
    for name, ckpt in vs_llamacpp.checkpoints(set(args.only.split(","))).items():
        ok &= run(args, name, ckpt, out["results"].setdefault(name, {}), save)
    save()
    print(f"multi-gpu: TP {args.tp} {'equal to one GPU' if ok else 'DIFFER from one GPU'}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
