"""`k3serve` command line: inspect | build-tiny (later: generate, serve, plan, bench)."""

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="layer schedule, params, bytes, cache sizes of a model")
    p.add_argument("model", nargs="?", help="checkpoint dir, config.json, or bundled name "
                   "(moonshotai/Kimi-K3, moonshotai/Kimi-Linear-48B-A3B-Instruct); "
                   "default: the bundled tiny model")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=_cmd_inspect)
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
