"""`k3serve serve [MODEL] ...`: flags in vLLM's spelling, engine + app, uvicorn.

Flags the build cannot honour fail with a message instead of being ignored; the other `vllm
serve` flags a launch script is likely to pass are in `vllm_flags.py` (accepted no-ops,
logged, or refused with the reason).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
from pathlib import Path

from k3serve.server.flags import config_kwargs
from k3serve.server.heap import limit_arenas

DEFAULT_SERVED_NAME = "k3serve/default-tiny-k3"
STRAGGLERS_S = 0.5  # uvicorn's wait for the connections it closes at shutdown, after the drain


def tracing(endpoint: str | None, service: str = "k3serve"):
    """Tracing to `endpoint` (server/observability/tracing.py), or None."""
    if not endpoint:
        return None
    from k3serve.server.observability.tracing import Tracing

    return Tracing(endpoint, service)


def resolve_args(args: argparse.Namespace) -> list[str]:
    """Reconcile vLLM spellings with k3serve's, refuse what cannot hold; returns notes to log."""
    from k3serve.server.vllm_flags import check_vllm_flags

    if args.model_flag:
        if args.model and args.model != args.model_flag:
            raise ValueError(f"MODEL {args.model!r} and --model {args.model_flag!r} disagree; give one")
        args.model = args.model_flag
    if args.enable_chunked_prefill is False:
        raise ValueError(
            "--no-enable-chunked-prefill: not supported: k3serve always chunks prefill on the "
            "64-token KDA grid (--max-num-batched-tokens sets the chunk)"
        )
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.max_logprobs < 0:
        raise ValueError(f"--max-logprobs must be >= 0, got {args.max_logprobs}")
    if args.disable_log_requests:
        args.enable_log_requests = False
    if args.disable_log_stats:
        args.stats_log_interval = 0.0
    if args.dtype in ("half", "float16"):
        raise ValueError(
            f"--dtype {args.dtype}: not supported: K3 and Kimi-Linear activations leave float16's range "
            "(vLLM maps no fp16 kernel for them either); use --dtype bfloat16, or float32"
        )
    if args.dtype == "float":
        args.dtype = "float32"
    notes = structured_outputs_config(args)
    return notes + check_vllm_flags(args)


def structured_outputs_config(args: argparse.Namespace) -> list[str]:
    """--structured-outputs-config: the backend must be xgrammar (or auto); disable_any_whitespace
    sets the default of requests that do not say (server/parsers/response_format.py reads args)."""
    cfg = args.structured_outputs_config
    if cfg is None:
        return []
    if not isinstance(cfg, dict):
        raise ValueError("--structured-outputs-config must be a JSON object")
    backend = cfg.get("backend", "auto")
    if backend not in ("auto", "xgrammar"):
        raise ValueError(
            f"--structured-outputs-config backend {backend!r}: not supported: k3serve enforces output "
            "constraints with xgrammar only ('auto' or 'xgrammar')"
        )
    unknown = sorted(set(cfg) - {"backend", "disable_any_whitespace"})
    if unknown:
        raise ValueError(
            f"--structured-outputs-config: unknown keys {unknown} (known: backend, disable_any_whitespace)"
        )
    return [
        f"structured outputs: xgrammar, any whitespace in JSON "
        f"{'refused' if cfg.get('disable_any_whitespace', True) else 'allowed'} unless a request says"
    ]


def engine_kwargs(args: argparse.Namespace) -> dict:
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.kv_transfer_config is not None and args.data_parallel_size != 1:
        raise ValueError(
            "--kv-transfer-config with --data-parallel-size > 1 is not built: run one replica per "
            "prefill or decode server and put `k3serve router` in front"
        )
    if (
        args.kv_transfer_config is not None
        and args.tensor_parallel_size != 1
        and (args.nnodes > 1 or args.distributed_executor_backend == "ray")
    ):
        raise ValueError(
            "--kv-transfer-config with --tensor-parallel-size > 1 needs every rank on this node (the "
            "hand-off's KDA heads go over the workers' pipes): not with --nnodes or the ray backend"
        )
    if args.distributed_executor_backend == "uni" and args.tensor_parallel_size != 1:
        raise ValueError("--distributed-executor-backend uni runs one process: it needs --tensor-parallel-size 1")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (kimi_k3 or kimi_k2)")
    spec = None
    if args.speculative_config:
        try:
            spec = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    kw = config_kwargs(args)  # every EngineConfig field a flag sets, read by name: no hand copy
    return kw | dict(
        load_progress=True,
        speculative_config=spec,
        kv_cache_dtype="fp8" if args.kv_cache_dtype == "fp8_e4m3" else args.kv_cache_dtype,  # vLLM's alias
        distributed_executor_backend="ray" if args.distributed_executor_backend == "ray" else "mp",  # uni: one rank
    )


def start_engines(args: argparse.Namespace):
    """One AsyncEngine, or a DPEngine over --data-parallel-size replicas of it."""
    from k3serve.engine.async_engine import AsyncEngine
    from k3serve.engine.dp_engine import DPEngine

    from k3serve.config.engine_config import EngineConfig

    kwargs = engine_kwargs(args)
    dp = args.data_parallel_size
    dp_attention = dp > 1 and args.enable_expert_parallel  # experts over the DP ranks (engine/lockstep.py)
    from k3serve.engine.dp_llm_engine import build_replicas

    config = EngineConfig.from_kwargs(args.model, **kwargs)
    replicas = [AsyncEngine(e, max_waiting=args.max_waiting) for e in build_replicas(config, dp, dp_attention)]
    return replicas[0] if len(replicas) == 1 else DPEngine(replicas, lockstep=dp_attention)


def kv_transfer(args: argparse.Namespace):
    from k3serve.server.pd.kv_transfer import KVTransferConfig

    return None if args.kv_transfer_config is None else KVTransferConfig.from_dict(args.kv_transfer_config)


def media_limits(args: argparse.Namespace):
    from k3serve.server.openai.media_parts import MediaLimits

    limit = args.limit_mm_per_prompt
    if (
        not isinstance(limit, dict)
        or set(limit) - {"image", "video"}
        or not all(isinstance(v, int) and v >= 0 for v in limit.values())
    ):
        raise ValueError(f'--limit-mm-per-prompt takes a JSON object like {{"image": 4, "video": 1}}, got {limit!r}')
    return MediaLimits(
        images_per_prompt=limit.get("image", 8),
        videos_per_prompt=limit.get("video", 1),
        allowed_domains=tuple(args.allowed_media_domains),
    )


def chat_template_arg(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template given inline (as vLLM takes it)."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except OSError as e:  # a long inline template can be an invalid path
        if "{" not in value:
            raise ValueError(f"--chat-template {value}: {e}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: not a file, and not a Jinja template either")


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else --api-key-file, else $K3SERVE_API_KEY; None: no auth."""
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().splitlines()[0].strip()
        except (OSError, IndexError) as e:
            raise ValueError(f"--api-key-file {args.api_key_file}: cannot read a key ({e})") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file}: the first line is empty")
        return args.api_key or key
    return args.api_key or os.environ.get("K3SERVE_API_KEY") or None


def build_server(args: argparse.Namespace):
    from k3serve.server.app import build_app
    from k3serve.config.generation_config import load_generation_defaults
    from k3serve.server.state import ServerState

    log = logging.getLogger("k3serve.server")
    for note in resolve_args(args):
        log.info("%s", note)
    from k3serve.server.parsers.response_format import xgrammar_missing

    if (why := xgrammar_missing()) is not None:
        log.warning("%s; those requests are answered 501", why)
    template = chat_template_arg(args.chat_template)
    engine = start_engines(args)
    defaults = load_generation_defaults(args.generation_config, engine.info().model_path)
    if defaults:
        log.info("request defaults from generation_config.json (a request's own values win): %s", defaults)
    from k3serve.demo import bundled_demo

    default_name = "k3serve/demo-k3" if bundled_demo() else DEFAULT_SERVED_NAME
    state = ServerState(
        engine,
        args.served_model_name or args.model or default_name,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        api_key=api_key(args),
        wedged_after_s=args.health_step_timeout,
        log_requests=args.enable_log_requests,
        chat_template=template,
        sampling_defaults=defaults,
        max_logprobs=args.max_logprobs,
        max_stored_responses=args.max_stored_responses,
        media_limits=media_limits(args),
        kv_transfer=kv_transfer(args),
        response_role=args.response_role,
        json_any_whitespace=not (args.structured_outputs_config or {}).get("disable_any_whitespace", True),
        tracing=tracing(args.otlp_traces_endpoint),
    )
    app = build_app(
        state,
        max_body_bytes=args.max_request_body_bytes,
        body_timeout_s=args.timeout_body,
        metrics_public=args.allow_unauthenticated_metrics,
        stats_interval_s=args.stats_log_interval,
        cors=dict(
            allow_origins=args.allowed_origins,
            allow_methods=args.allowed_methods,
            allow_headers=args.allowed_headers,
            allow_credentials=args.allow_credentials,
        )
        if args.allowed_origins
        else None,
        root_path=args.root_path,
        request_id_headers=args.enable_request_id_headers,
    )
    return app, state


def headless(args: argparse.Namespace) -> int | None:
    """On a node other than 0 (or a torchrun rank other than 0): run this node's tensor-parallel
    ranks until the driver shuts down, and return their exit status; None on the serving node."""
    from k3serve.config.engine_config import EngineConfig
    from k3serve.distributed.worker_group import WorkerLaunch, run_headless, worker_base
    from k3serve.distributed.multinode import NodeLayout, torchrun_layout, torchrun_rank
    from k3serve.distributed.worker import WorkerSpec, worker_main
    from k3serve.demo import default_model
    from k3serve.executor.placement import placement

    ran = torchrun_rank()
    if (ran is None and args.node_rank == 0) or (ran is not None and ran[0] == 0):
        return None
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
    where = placement(config)
    path = str(config.model or default_model())
    if ran is not None:  # torchrun started this process as one rank: be it
        nodes = torchrun_layout()
        launch = WorkerLaunch.from_config(config, where, path)
        worker_main(WorkerSpec(rank=ran[0], **worker_base(launch, ran[1], nodes, nodes.master_port, None)))
        return 0
    nodes = NodeLayout(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    dp, tp = args.data_parallel_size, args.tensor_parallel_size
    if dp > 1 and args.enable_expert_parallel:  # DP-attention ranks: commands over their own connections
        from k3serve.distributed.dp_workers import run_headless_dp

        logging.getLogger("k3serve.server").info(
            "node %d of %d: DP-attention ranks %s, driver at %s:%d",
            args.node_rank,
            args.nnodes,
            nodes.ranks(dp * tp),
            args.master_addr,
            args.master_port,
        )
        launch = WorkerLaunch.from_config(config, where, path, ranks=dp * tp)
        return run_headless_dp(launch, dp, tp, nodes, all2all=config.all2all_backend)
    logging.getLogger("k3serve.server").info(
        "node %d of %d: tensor-parallel ranks %s, driver at %s:%d",
        args.node_rank,
        args.nnodes,
        nodes.ranks(tp * config.pipeline_parallel_size),
        args.master_addr,
        args.master_port,
    )
    return run_headless(WorkerLaunch.from_config(config, where, path), tp * config.pipeline_parallel_size, nodes)


def start_line(args: argparse.Namespace) -> str:
    from k3serve import __version__

    model = args.model or args.model_flag or "the default model"
    role = f"node {args.node_rank} of {args.nnodes} for" if args.node_rank else "serving"
    return f"k3serve {__version__}: {role} {model}; importing torch, then loading the model"


def serve(args: argparse.Namespace) -> int:
    from k3serve.server.http import draining_server, uvicorn_config

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    # said before torch and the engine are imported: on a loaded machine they took 20 s and more,
    # with nothing in the log to say what was starting
    logging.getLogger("k3serve.server").info("%s", start_line(args))
    limit_arenas()  # before any serving thread allocates (server/heap.py)
    status = headless(args)
    if status is not None:
        return status
    app, state = build_server(args)
    # start-up's objects (modules, torch.compile's machinery, the model's Python objects) go to
    # the permanent generation, as vLLM freezes its heap after start: a full collection while
    # serving walks only what serving made (with dynamo imported, a full pass over the start-up
    # heap took ~0.2 s on 2 cores, a stall of the event loop). Here, in the server process's
    # entry, not in build_server: a process that builds several servers (the tests) would
    # freeze the ones it drops, and their threads would run on
    gc.collect()
    gc.freeze()
    logging.getLogger("k3serve.server").info(
        "serving %s on http://%s:%d%s",
        state.served_model_name,
        args.host,
        args.port,
        " (API key required)" if state.api_key else "",
    )
    # The drain (new requests 503, in-flight ones given --shutdown-timeout) happens before
    # uvicorn's shutdown, which then only has stragglers to cancel. Not a timeout of 0: uvicorn
    # waits for its tasks with asyncio.wait_for, which times out at 0 even with none left, and
    # every shutdown logged "ERROR: Cancel 0 running task(s), timeout graceful shutdown exceeded"
    config = uvicorn_config(
        app,
        args.host,
        args.port,
        log_level=args.uvicorn_log_level or args.log_level,
        header_timeout=args.timeout_header,
        keep_alive_timeout=args.timeout_keep_alive,
        graceful_shutdown_timeout=STRAGGLERS_S,
    )
    server = draining_server(config, state.lifecycle, args.timeout_graceful_shutdown)
    # uvicorn re-raises the SIGTERM / SIGINT it handled once its shutdown is done; that shutdown
    # was clean (in-flight requests drained or answered 503), so the exit status is 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.run()
    except KeyboardInterrupt:
        return 0
    return 0
