"""`k3serve serve [MODEL] ...`: flags in vLLM's spelling, engine + app, uvicorn.

Flags the build cannot honour fail with a message instead of being ignored; only
`--trust-remote-code` is accepted as a no-op (the architectures are native).
"""

from __future__ import annotations

import argparse
import json
import logging

DEFAULT_SERVED_NAME = "k3serve/default-tiny-k3"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="checkpoint dir (default: the bundled tiny model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="name clients use in `model` (default: MODEL)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/*")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--trust-remote-code", action="store_true", help="accepted; the architectures are native")
    p.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "fastsafetensors"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cache-memory", help="cache bytes, e.g. 1GiB (default: a fraction of free memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="hybrid prefix caching: latent blocks + exact KDA checkpoints (default on)")
    p.add_argument("--prefix-cache-state-interval", type=int, default=0,
                   help="also checkpoint KDA state every N prompt tokens (0: prompt ends and junctions only)")
    p.add_argument("--prefix-cache-state-fraction", type=float, default=0.1,
                   help="share of the cache memory reserved for KDA checkpoints")
    p.add_argument("--speculative-config", help="JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'")
    p.add_argument("--enable-auto-tool-choice", action="store_true")
    p.add_argument("--tool-call-parser", choices=("kimi_k3", "kimi_k2"))
    p.add_argument("--reasoning-parser", choices=("kimi_k3", "kimi_k2"))
    p.add_argument("--max-waiting", type=int, default=4096, help="queued requests before 503")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def engine_kwargs(args: argparse.Namespace) -> dict:
    if args.tensor_parallel_size != 1:
        raise ValueError("--tensor-parallel-size > 1 needs the distributed runner, which this build does not "
                         "have yet; run with --tensor-parallel-size 1")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (kimi_k3 or kimi_k2)")
    spec = None
    if args.speculative_config:
        try:
            spec = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    return dict(dtype=args.dtype, load_format=args.load_format, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                block_size=args.block_size, cache_memory=args.cache_memory, seed=args.seed,
                enable_prefix_caching=args.enable_prefix_caching, speculative_config=spec,
                prefix_cache_state_interval=args.prefix_cache_state_interval,
                prefix_cache_state_fraction=args.prefix_cache_state_fraction)


def build_server(args: argparse.Namespace):
    from k3serve.engine.async_engine import AsyncEngine
    from k3serve.engine.llm_engine import LLMEngine
    from k3serve.server.app import build_app
    from k3serve.server.state import ServerState

    engine = AsyncEngine(LLMEngine.from_args(args.model, **engine_kwargs(args)), max_waiting=args.max_waiting)
    from k3serve.demo import bundled_demo
    default_name = "k3serve/demo-k3" if bundled_demo() else DEFAULT_SERVED_NAME
    state = ServerState(engine, args.served_model_name or args.model or default_name,
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                        api_key=args.api_key)
    return build_app(state), state


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    app, state = build_server(args)
    logging.getLogger("k3serve.server").info("serving %s on http://%s:%d", state.served_model_name,
                                             args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
