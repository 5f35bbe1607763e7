"""`k3serve` command line: serve | router | plan | bench | generate | inspect | train-dspark | build-tiny."""

from __future__ import annotations

import argparse
import json
import sys

from k3serve.config.parse import ConfigError
from k3serve.weights.errors import CheckpointError


def _cmd_inspect(args: argparse.Namespace) -> int:
    from k3serve.demo import default_model
    from k3serve.weights.inspect import format_report, inspect_model, report_dict

    target = args.model or str(default_model())
    report = inspect_model(target)
    print(json.dumps(report_dict(report), indent=2) if args.json else format_report(report))
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from k3serve.weights.convert import convert
    from k3serve.weights.hub import resolve_model

    src = resolve_model(args.src, args.revision, args.download_dir, None)
    r = convert(src, args.dst, args.experts, progress=not args.quiet)
    print(
        f"{args.dst}: {r.tensors:,} tensors, {r.quantized:,} routed expert matrices packed {args.experts.upper()}; "
        f"{r.bytes_in / 2**30:.2f} GiB -> {r.bytes_out / 2**30:.2f} GiB in {r.seconds:.1f} s"
    )
    return 0


def _cmd_build_tiny(args: argparse.Namespace) -> int:
    from k3serve.testing.builder import build_tiny_checkpoint
    from k3serve.testing.tiny_configs import (
        kimi_linear_400m_config,
        tiny_k3_config,
        tiny_kimi_linear_config,
        with_mxfp4_experts,
        with_nvfp4_experts,
    )

    if args.size == "400m" and args.kind != "kimi_linear":
        raise SystemExit("build-tiny: --size 400m is a Kimi-Linear layout (use --kind kimi_linear)")
    if args.vision and args.kind != "k3":
        raise SystemExit("build-tiny: --vision: Kimi-Linear has no vision tower (use --kind k3)")
    if args.mxfp4 and args.kind != "kimi_linear":
        raise SystemExit("build-tiny: --mxfp4: the tiny K3 ships MXFP4 experts already (--mxfp4 is for kimi_linear)")
    config = kimi_linear_400m_config() if args.size == "400m" else None
    if args.mxfp4:
        config = with_mxfp4_experts(config or tiny_kimi_linear_config())
    if args.mxfp4 and args.nvfp4:
        raise SystemExit("build-tiny: --mxfp4 and --nvfp4 are two packings of the same experts: pick one")
    if args.kind == "k3" and args.vision is False:  # the tiny K3 carries a tower unless told not to
        config = tiny_k3_config()
        del config["vision_config"]
    if args.nvfp4:
        config = with_nvfp4_experts(config or (tiny_k3_config() if args.kind == "k3" else tiny_kimi_linear_config()))
    out = build_tiny_checkpoint(args.out, kind=args.kind, seed=args.seed, config=config)
    tower = " with a MoonViT3d tower and projector" if args.kind == "k3" and args.vision is not False else ""
    tower += " with MXFP4 experts" if args.mxfp4 else " with NVFP4 experts" if args.nvfp4 else ""
    print(f"wrote {args.size} {args.kind} checkpoint{tower} (random weights, seed {args.seed}) to {out}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import logging
    import time

    from k3serve import LLM, SamplingParams
    from k3serve.server.flags import config_kwargs

    if not args.json:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.prompt_token_ids:
        prompts = [{"prompt_token_ids": [int(t) for t in args.prompt_token_ids.split(",")]}]
    elif args.prompt:
        prompts = args.prompt
    else:
        raise ValueError("give --prompt TEXT (repeatable) or --prompt-token-ids 1,2,3")
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        stop=args.stop or [],
    )
    llm = LLM(args.model, **config_kwargs(args))
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    out = [
        {
            "prompt_token_ids": r.prompt_token_ids,
            "token_ids": r.outputs[0].token_ids,
            "text": r.outputs[0].text,
            "finish_reason": r.outputs[0].finish_reason,
        }
        for r in results
    ]
    if args.json:
        print(json.dumps(out if len(out) > 1 else out[0]))
    else:
        for o in out:
            print(o["text"])
        n = sum(len(o["token_ids"]) for o in out)
        print(f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from k3serve.server.launch import serve

    return serve(args)


def _cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from k3serve.server.http import uvicorn_config
    from k3serve.server.pd.proxy import build_router

    from k3serve.server.launch import tracing

    app = build_router(
        args.prefill,
        args.decode,
        tracing=tracing(args.otlp_traces_endpoint, "k3serve-router"),
        decode_prefill_tokens=args.decode_prefill_tokens,
    )
    uvicorn.Server(uvicorn_config(app, args.host, args.port, log_level=args.uvicorn_log_level)).run()
    return 0


def _cmd_train_demo(args: argparse.Namespace) -> int:
    import logging

    from k3serve.demo.train import train_demo, train_demo_draft

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if not args.draft_only:  # unset flags keep train_demo's own defaults (the shipped recipe)
        given = {
            "steps": args.steps,
            "num_conversations": args.num_conversations,
            "drill_steps": args.drill_steps,
            "batch": args.batch,
            "lr": args.lr,
        }
        r = train_demo(
            args.out,
            seed=args.seed,
            time_limit_s=args.time_limit,
            device=args.device,
            checkpoint_every=args.checkpoint_every,
            resume=args.resume,
            **{k: v for k, v in given.items() if v is not None},
        )
        print(
            f"wrote the demo model to {r['out']}: {r['steps']} steps, loss {r['first_loss']:.3f} -> "
            f"{r['last_loss']:.3f}, {r['seconds']:.0f}s"
        )
    if args.no_draft:
        return 0
    d = train_demo_draft(args.out, seed=args.seed)
    print(f"wrote its DSpark draft to {d['out']} (loss {d['first_loss']:.3f} -> {d['last_loss']:.3f})")
    return 0


def _cmd_train_dspark(args: argparse.Namespace) -> int:
    import logging

    from k3serve.spec_decode.train_dspark import distill_dspark

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from k3serve.demo import default_model

    target = args.target or str(default_model())
    r = distill_dspark(
        target,
        args.out,
        block_size=args.block_size,
        steps=args.steps,
        num_seqs=args.num_seqs,
        seq_len=args.seq_len,
        seed=args.seed,
    )
    print(f"wrote dspark draft to {r['out']} (loss {r['first_loss']:.3f} -> {r['last_loss']:.3f})")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from k3serve.bench.cli import run_bench

    return run_bench(args)


def _cmd_run_batch(args: argparse.Namespace) -> int:
    import logging

    from k3serve.server.openai.run_batch import run_batch

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    return run_batch(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    from k3serve.planner.cli import run_plan

    return run_plan(args)


def build_parser() -> argparse.ArgumentParser:
    from k3serve.bench.cli import add_bench_args
    from k3serve.planner.cli import add_plan_args
    from k3serve.server.flags import add_backend_args, add_serve_args, add_source_args

    # no abbreviations: vLLM's `--tokenizer PATH` was read as `--tokenizer-mode` by prefix
    parser = argparse.ArgumentParser(prog="k3serve", description=__doc__, allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the bundled tiny model)")
    add_serve_args(p)
    p.set_defaults(func=_cmd_serve)
    p = sub.add_parser("run-batch", help="OpenAI batch file (JSONL) through the engine, as vLLM's run-batch")
    p.add_argument("-i", "--input-file", required=True, help="JSONL: {custom_id, method, url, body} per line")
    p.add_argument("-o", "--output-file", required=True, help="JSONL: one OpenAI batch output record per line")
    add_serve_args(p)
    p.set_defaults(func=_cmd_run_batch)
    p = sub.add_parser("router", help="prefill/decode disaggregation proxy in front of k3serve servers")
    p.add_argument("--prefill", nargs="+", required=True, help="prefill servers (--kv-transfer-config kv_producer)")
    p.add_argument("--decode", nargs="+", required=True, help="decode servers (--kv-transfer-config kv_consumer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--uvicorn-log-level", default="info")
    p.add_argument("--otlp-traces-endpoint", help="OpenTelemetry collector for the router's spans (OTLP/HTTP)")
    p.add_argument(
        "--decode-prefill-tokens",
        type=int,
        default=0,
        help="a decode server whose prefix cache (device, or a tier directory shared with the prefill servers) "
        "holds all but at most N of a prompt's tokens serves it without a prefill server (0: never)",
    )
    p.set_defaults(func=_cmd_router)
    p = sub.add_parser("plan", help="capacity planner: fit, GPU count, concurrency, latency, launch commands")
    add_plan_args(p)
    p.set_defaults(func=_cmd_plan)
    p = sub.add_parser("inspect", help="layer schedule, params, bytes, cache sizes of a model")
    p.add_argument(
        "model",
        nargs="?",
        help="checkpoint dir, config.json, or bundled name "
        "(moonshotai/Kimi-K3, moonshotai/Kimi-Linear-48B-A3B-Instruct); "
        "default: the bundled tiny model",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_cmd_inspect)
    p = sub.add_parser("generate", help="offline generation through the engine (continuous batching)")
    p.add_argument("--model", help="checkpoint dir or Hugging Face repo id (default: the bundled tiny model)")
    p.add_argument("--prompt", action="append", help="prompt text; repeat for several prompts")
    p.add_argument("--prompt-token-ids", help="comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append", help="stop string; repeatable")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "fastsafetensors"))
    add_backend_args(p)
    add_source_args(p)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--cache-memory", help="cache bytes, e.g. 1GiB (default: a fraction of free memory)")
    p.add_argument("--json", action="store_true", help="print token ids and text as JSON")
    p.set_defaults(func=_cmd_generate)
    p = sub.add_parser("bench", help="load generator with vLLM bench-serve metrics and A/B ablations")
    add_bench_args(p)
    p.set_defaults(func=_cmd_bench)
    p = sub.add_parser("train-demo", help="train the bundled demo model (tokenizer, QAT K3, export)")
    p.add_argument("out")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the shipped recipe's)")
    p.add_argument("--num-conversations", type=int, help="synthetic conversations (default: the shipped recipe's)")
    p.add_argument("--time-limit", type=float, help="stop after this many seconds")
    p.add_argument("--draft-only", action="store_true", help="only (re)distil the DSpark draft of OUT")
    p.add_argument("--drill-steps", type=int, help="first steps on copy / lookup drills (retrieval-first curriculum)")
    p.add_argument("--batch", type=int, help="sequences per step")
    p.add_argument("--lr", type=float)
    p.add_argument("--device", default="cpu", help="cpu or cuda (minutes of an H200 exceed days of 2 CPU cores)")
    p.add_argument("--threads", type=int, help="torch CPU threads (1 for a background run beside other work)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save OUT/train_state.pt every N steps")
    p.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    p.add_argument("--no-draft", action="store_true", help="skip the DSpark distillation afterwards")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_train_demo)
    p = sub.add_parser("train-dspark", help="distil a tiny DSpark drafter from a target checkpoint")
    p.add_argument("out")
    p.add_argument("--target", help="target checkpoint dir (default: the default model)")
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--num-seqs", type=int, default=48)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_train_dspark)
    p = sub.add_parser("convert", help="a bf16 / fp32 checkpoint with its routed experts packed MXFP4 or NVFP4")
    p.add_argument("src", help="checkpoint folder or hub id (bf16 / fp32, no quantization_config)")
    p.add_argument("dst", help="a new folder: safetensors shards, index, config.json, tokenizer files")
    p.add_argument(
        "--experts",
        choices=("mxfp4", "nvfp4"),
        default="mxfp4",
        help="mxfp4: K3's own mxfp4-pack-quantized (E8M0 per 32); nvfp4: nvfp4-pack-quantized (E4M3 per 16 + global)",
    )
    p.add_argument("--revision", default=None, help="hub revision of SRC")
    p.add_argument("--download-dir", default=None, help="hub cache for SRC")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=_cmd_convert)
    p = sub.add_parser("build-tiny", help="write a tiny random-weight checkpoint in the real layout")
    p.add_argument("out")
    p.add_argument("--kind", choices=("k3", "kimi_linear"), default="k3")
    p.add_argument(
        "--size",
        choices=("tiny", "400m"),
        default="tiny",
        help="400m: a ~408 M-param Kimi-Linear (110 M active) for bandwidth-bound benchmarks",
    )
    p.add_argument(
        "--mxfp4", action="store_true", help="kimi_linear: routed experts packed MXFP4 (K3's compressed-tensors layout)"
    )
    p.add_argument(
        "--nvfp4",
        action="store_true",
        help="routed experts packed NVFP4 (compressed-tensors nvfp4-pack-quantized: E4M3 scales per 16, a global scale)",
    )
    p.add_argument(
        "--vision",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="K3: write the tiny vision tower + projector in the release layout (the default); --no-vision: text only",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_build_tiny)
    for command in sub.choices.values():  # argparse reads it at parse time; subcommands do not inherit it
        command.allow_abbrev = False
    return parser


def main(argv: list[str] | None = None) -> int:
    from k3serve.server.config_file import apply_config_file

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = apply_config_file(argv)
    except ValueError as e:
        print(f"k3serve: error: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, CheckpointError, ValueError) as e:
        print(f"k3serve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
