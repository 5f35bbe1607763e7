"""`k3serve plan`: argument handling (the four workload questions are flags)."""

from __future__ import annotations

import argparse
from pathlib import Path

from k3serve.cache.sizing import parse_bytes
from k3serve.planner.hardware import GPUS, get_gpu, load_gpu_file, with_prices
from k3serve.planner.memory import GiB, Workload


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="moonshotai/Kimi-K3", help="bundled name, config.json or checkpoint dir")
    p.add_argument("--gpu", action="append", help=f"GPU type, repeatable, or 'all' ({', '.join(GPUS)})")
    p.add_argument("--gpu-file", help="custom GPU as JSON/TOML")
    p.add_argument("--num-gpus", type=int, help="plan exactly this many GPUs (default: search counts)")
    p.add_argument("--tp", type=int)
    p.add_argument("--dp", type=int, help="attention data parallel (DP-attention) groups")
    p.add_argument("--ep", type=int)
    p.add_argument("--pp", type=int, help="pipeline-parallel stages (default: search 1, 2, 4, 8)")
    p.add_argument(
        "--decode-context-parallel-size",
        "--dcp",
        type=int,
        dest="dcp",
        help="shard the MLA latent cache by token over this many TP ranks (layouts it divides; "
        "the report shows the concurrency gained)",
    )
    p.add_argument(
        "--cpu",
        metavar="HOST",
        help="plan a CPU host instead of GPUs: fit in RAM, decode tok/s from memory bandwidth, the launch "
        "line (hosts: epyc-9654-2s, epyc-9755-2s, xeon-8480-2s, threadripper-7980x, ryzen-9950x, "
        "desktop-64g; or custom with the three figures below)",
    )
    p.add_argument("--ram-gib", type=float, help="--cpu: the host's RAM")
    p.add_argument("--mem-bw-gbs", type=float, help="--cpu: measured sustained memory bandwidth, GB/s")
    p.add_argument("--cpu-cores", type=int, help="--cpu: physical cores")
    # The four workload questions. Unasked ones are assumed, and every format says so.
    p.add_argument("--context", type=int, help=f"tokens per request, max_model_len (default {DEFAULTS['context']:,})")
    p.add_argument("--concurrency", type=int, help="requests the deployment must hold at once (default 1)")
    p.add_argument(
        "--latency-sensitive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="rank layouts by TPOT (default: no)",
    )
    p.add_argument("--optimize", choices=("min-hardware", "cost"), help="what to minimise (default min-hardware)")
    p.add_argument(
        "--price",
        action="append",
        default=[],
        metavar="GPU=USD",
        help="USD per GPU-hour for the cost column, repeatable (illustrative defaults otherwise)",
    )
    p.add_argument(
        "--experts",
        choices=("checkpoint", "mxfp4", "nvfp4", "bf16"),
        default="checkpoint",
        help="routed experts as the model ships them (default), or packed MXFP4 / NVFP4, or bf16 "
        "(e.g. nvidia's NVFP4 release of a model whose config says MXFP4)",
    )
    p.add_argument("--kv-cache-dtype", choices=("bfloat16", "fp8"), default="bfloat16")
    p.add_argument(
        "--mamba-ssm-cache-dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="the KDA recurrent state's dtype (auto: float32)",
    )
    p.add_argument(
        "--num-redundant-experts",
        type=int,
        default=0,
        help="EPLB's extra expert slots over an expert-parallel layout's ranks: their bytes are counted "
        "and the launch lines turn on --enable-eplb",
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--memory-fraction", type=float, default=0.92, help="of total HBM (vLLM semantics)")
    p.add_argument("--overhead-gib", type=float, default=3.0, help="non-torch reserve per rank")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--spec-tokens",
        type=int,
        default=0,
        help="speculative tokens k: each running request's 1 + k verify-record KDA states, reserved as the engine does",
    )
    p.add_argument("--draft-params", type=float, default=0.0, help="draft model parameters (BF16, per rank)")
    p.add_argument(
        "--draft-model",
        help="a draft_model drafter's checkpoint dir or config: its float32 weights and its own cache "
        "(a slot and max-model-len rows per sequence), reserved as the engine reserves them",
    )
    p.add_argument("--cache-memory", help="cache bytes per rank; skips the GPU arithmetic (engine check)")
    p.add_argument("--mm-encoder-cache", default="256MiB", help="vision encoder cache per rank (models with a tower)")
    p.add_argument(
        "--pd",
        metavar="P:D",
        help="also the best layout disaggregated: P prefill + D decode instances, "
        "with each request's hand-off (latent rows + KDA state) and its time",
    )
    p.add_argument(
        "--pd-cached-tokens",
        type=int,
        default=0,
        help="prompt tokens the decode side already holds (prefix-aware hand-off sends only the rest)",
    )
    p.add_argument(
        "--kv-offloading-size",
        type=float,
        default=0.0,
        help="GiB of host memory for prefix-cache tiers: how many conversations it holds",
    )
    p.add_argument("--kv-offloading-dir-size", type=float, default=0.0, help="GiB of the directory tier, likewise")
    p.add_argument("--turns", type=int, default=4, help="KDA checkpoints a conversation keeps in the tiers")
    p.add_argument("--top", type=int, default=10, help="layouts to show")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--markdown", action="store_true")
    fmt.add_argument("--html", metavar="FILE")


DEFAULTS = {"context": 32768, "concurrency": 1, "latency_sensitive": False, "optimize": "min-hardware"}
ASSUMED = {
    "context": "context not given: assuming {:,} tokens per request",
    "concurrency": "concurrency not given: assuming {} request at a time",
    "latency_sensitive": "latency sensitivity not given: assuming throughput-oriented (rank by GPU count)",
    "optimize": "optimisation goal not given: assuming {} (fewest GPUs)",
}


def workload_questions(args: argparse.Namespace) -> list[str]:
    """Fill the unasked workload questions with defaults; return what was assumed."""
    assumed = []
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
            assumed.append(ASSUMED[key].format(default))
    return assumed


def experts_as(cfg, fmt: str):
    """The config with its routed experts in `fmt` ("checkpoint": as they are)."""
    import dataclasses

    from k3serve.config.quant_config import nvfp4_quantization_config, parse_quant_config

    if fmt == "checkpoint":
        return cfg
    if fmt == "bf16":
        return dataclasses.replace(cfg, quant=None)
    if fmt == "nvfp4":
        return dataclasses.replace(cfg, quant=parse_quant_config(nvfp4_quantization_config()))
    from k3serve.config.bundled import load_model_config

    k3 = load_model_config("moonshotai/Kimi-K3")  # K3's own MXFP4 config
    return dataclasses.replace(cfg, quant=k3.quant)


def _draft(args: argparse.Namespace) -> dict:
    """The draft's weights and own cache per rank: --draft-model by the engine's formulas
    (weights/schema.py loaded_weight_bytes, cache/sizing.py draft_cache_bytes), else the BF16
    weights of --draft-params."""
    if not args.draft_model:
        return dict(draft_bytes=int(args.draft_params * 2))
    from k3serve.cache.sizing import draft_cache_bytes
    from k3serve.weights.hub import load_config
    from k3serve.weights.schema import loaded_weight_bytes

    draft = load_config(args.draft_model)
    return dict(
        draft_bytes=loaded_weight_bytes(draft),
        draft_cache_bytes=draft_cache_bytes(draft, args.max_num_seqs, args.context),
    )


def run_plan(args: argparse.Namespace) -> int:
    from k3serve.planner.html import to_html
    from k3serve.planner.report import print_table, to_json, to_markdown
    from k3serve.planner.search import plan
    from k3serve.planner.weights import weight_split
    from k3serve.weights.hub import load_config

    assumed = workload_questions(args)
    cfg = experts_as(load_config(args.model), args.experts)
    is_dir = Path(args.model).is_dir() and any(Path(args.model).glob("*.safetensors"))
    if is_dir and args.experts != "checkpoint":
        raise SystemExit("plan: --experts re-packs a config's experts; a checkpoint's headers already say its format")
    if args.cpu:
        from k3serve.planner.cpu import format_cpu_plan, host, plan_cpu

        h = host(args.cpu, args.ram_gib, args.mem_bw_gbs, args.cpu_cores)
        w = weight_split(cfg, args.model if is_dir else None)
        seqs = args.concurrency or 1
        p = plan_cpu(cfg, args.model, w, h, args.context, seqs, args.kv_cache_dtype, args.experts)
        print(format_cpu_plan(p, args.model, args.experts, args.context, seqs))
        for line in assumed:  # context and concurrency (the others rank GPU layouts)
            if line.startswith(("context", "concurrency")):
                print(f"  {line}")
        return 0 if p.fits else 1
    gpus = [load_gpu_file(args.gpu_file)] if args.gpu_file else []
    names = args.gpu or ([] if gpus else ["all"])
    gpus += list(GPUS.values()) if "all" in names else [get_gpu(n) for n in names]
    gpus = with_prices(gpus, args.price)
    w = Workload(
        context=args.context,
        concurrency=args.concurrency,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_dtype=args.kv_cache_dtype,
        memory_fraction=args.memory_fraction,
        overhead_bytes=int(args.overhead_gib * GiB),
        prefix_cache_fraction=0.0 if args.no_prefix_caching else 0.1,
        spec_tokens=args.spec_tokens,
        **_draft(args),
        encoder_cache_bytes=parse_bytes(args.mm_encoder_cache),
        state_dtype="float32" if args.mamba_ssm_cache_dtype == "auto" else args.mamba_ssm_cache_dtype,
        redundant_experts=args.num_redundant_experts,
    )
    report = plan(
        cfg,
        args.model,
        "checkpoint headers" if is_dir else "config + tensor schema",
        gpus,
        weight_split(cfg, args.model if is_dir else None),
        w,
        num_gpus=args.num_gpus,
        tp=args.tp,
        dp=args.dp,
        ep=args.ep,
        pp=args.pp,
        dcp=args.dcp,
        optimize=args.optimize,
        latency_sensitive=args.latency_sensitive,
        cache_bytes=parse_bytes(args.cache_memory) if args.cache_memory else None,
        assumed=assumed,
    )
    if args.pd and report.best():
        from k3serve.planner.disagg import parse_pd, pd_layout

        best = report.best()
        report.pd = pd_layout(
            cfg,
            best.gpu,
            best.layout.num_gpus,
            *parse_pd(args.pd),
            args.context,
            args.kv_cache_dtype,
            args.pd_cached_tokens,
        )
    if args.kv_offloading_size or args.kv_offloading_dir_size:
        from k3serve.planner.tiers import tier_capacity

        token_bytes = report.token_bytes_fp8 if args.kv_cache_dtype == "fp8" else report.token_bytes
        report.tiers = tier_capacity(
            token_bytes,
            report.state_bytes,
            args.context,
            args.turns,
            args.kv_offloading_size,
            args.kv_offloading_dir_size,
        )
    if args.json:
        print(to_json(report, args.top))
    elif args.markdown:
        print(to_markdown(report, args.top))
    elif args.html:
        Path(args.html).write_text(to_html(report, args.top))
        print(f"wrote {args.html}")
    else:
        print_table(report, args.top)
    return 0
