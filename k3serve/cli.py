"""`k3serve` command line: inspect | generate | build-tiny (later: serve, plan, bench)."""

from __future__ import annotations

import argparse
import json
import sys

from k3serve.config.parse import ConfigError
from k3serve.weights.errors import CheckpointError


def _cmd_inspect(args: argparse.Namespace) -> int:
    from k3serve.testing.builder import ensure_default_model
    from k3serve.weights.inspect import format_report, inspect_model, report_dict

    target = args.model or str(ensure_default_model())
    report = inspect_model(target)
    print(json.dumps(report_dict(report), indent=2) if args.json else format_report(report))
    return 0


def _cmd_build_tiny(args: argparse.Namespace) -> int:
    from k3serve.testing.builder import build_tiny_checkpoint

    out = build_tiny_checkpoint(args.out, kind=args.kind, seed=args.seed)
    print(f"wrote tiny {args.kind} checkpoint (random weights, seed {args.seed}) to {out}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import time

    import torch

    from k3serve.generate import SimpleGenerator
    from k3serve.models.registry import load_model
    from k3serve.testing.builder import ensure_default_model
    from k3serve.tokenizer import Tokenizer

    path = args.model or str(ensure_default_model())
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = load_model(path, dtype=dtype, load_format=args.load_format, progress=not args.json)
    tok = Tokenizer.from_dir(path)
    if args.prompt_token_ids:
        prompts = [[int(t) for t in args.prompt_token_ids.split(",")]]
    elif args.prompt:
        prompts = [tok.encode(p) for p in args.prompt]
    else:
        raise ValueError("give --prompt TEXT (repeatable) or --prompt-token-ids 1,2,3")
    bad = [t for p in prompts for t in p if not 0 <= t < model.cfg.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{model.cfg.vocab_size - 1})")
    start = time.perf_counter()
    results = SimpleGenerator(model).generate(prompts, args.max_tokens, args.temperature, args.seed,
                                              args.ignore_eos)
    elapsed = time.perf_counter() - start
    out = [{"prompt_token_ids": p, "token_ids": r.token_ids, "text": tok.decode(r.token_ids),
            "finish_reason": r.finish_reason} for p, r in zip(prompts, results)]
    if args.json:
        print(json.dumps(out if len(out) > 1 else out[0]))
    else:
        for o in out:
            print(o["text"])
        n = sum(len(r.token_ids) for r in results)
        print(f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="layer schedule, params, bytes, cache sizes of a model")
    p.add_argument("model", nargs="?", help="checkpoint dir, config.json, or bundled name "
                   "(moonshotai/Kimi-K3, moonshotai/Kimi-Linear-48B-A3B-Instruct); "
                   "default: the bundled tiny model")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_cmd_inspect)
    p = sub.add_parser("generate", help="offline generation (prefill + cached decode)")
    p.add_argument("--model", help="checkpoint dir (default: the bundled tiny model)")
    p.add_argument("--prompt", action="append", help="prompt text; repeat for several prompts")
    p.add_argument("--prompt-token-ids", help="comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "fastsafetensors"))
    p.add_argument("--json", action="store_true", help="print token ids and text as JSON")
    p.set_defaults(func=_cmd_generate)
    p = sub.add_parser("build-tiny", help="write a tiny random-weight checkpoint in the real layout")
    p.add_argument("out")
    p.add_argument("--kind", choices=("k3", "kimi_linear"), default="k3")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_build_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, CheckpointError, ValueError) as e:
        print(f"k3serve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
