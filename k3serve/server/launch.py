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

from k3serve.config.engine_config import ALL2ALL_BACKENDS, KERNELS
from k3serve.server.vllm_flags import add_vllm_flags

DEFAULT_SERVED_NAME = "k3serve/default-tiny-k3"
STRAGGLERS_S = 0.5  # uvicorn's wait for the connections it closes at shutdown, after the drain


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """How the model runs (k3serve/backends), as `serve` and `generate` spell it."""
    p.add_argument(
        "--kernels",
        default="auto",
        choices=KERNELS,
        help="execution backend: auto (the compiled CPU kernels when they build; triton on a GPU, "
        "graph without Triton), cpp (require the CPU kernels), torch (the reference), graph "
        "(decode steps compiled whole, captured as CUDA graphs on a GPU), triton (graph with the "
        "Triton KDA/MLA/MoE kernels; on a CPU only under TRITON_INTERPRET=1)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no torch.compile and no CUDA graphs (auto on a GPU then runs the torch reference)",
    )
    p.add_argument(
        "--compilation-config",
        "-O",
        type=json.loads,
        default=None,
        help="the graph backend's compile settings as JSON, vLLM's keys: "
        '{"cudagraph_capture_sizes": [1, 2, 4, 8], "max_cudagraph_capture_size": 64, '
        '"backend": "inductor"}',
    )


def backend_kwargs(args: argparse.Namespace) -> dict:
    return dict(kernels=args.kernels, enforce_eager=args.enforce_eager, compilation_config=args.compilation_config)


def add_source_args(p: argparse.ArgumentParser) -> None:
    """Where a model given as a Hugging Face repo id comes from (weights/hub.py), vLLM's flags."""
    p.add_argument("--revision", help="branch, tag or commit of a Hugging Face repo id (default: main)")
    p.add_argument("--download-dir", help="hub cache folder for a repo id (default: HF_HUB_CACHE)")
    p.add_argument("--hf-token", help="token for gated repos (default: HF_TOKEN or the saved login)")


def tracing(endpoint: str | None, service: str = "k3serve"):
    """Tracing to `endpoint` (server/tracing.py), or None."""
    if not endpoint:
        return None
    from k3serve.server.tracing import Tracing

    return Tracing(endpoint, service)


def source_kwargs(args: argparse.Namespace) -> dict:
    return dict(revision=args.revision, download_dir=args.download_dir, hf_token=args.hf_token)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="checkpoint dir or Hugging Face repo id (default: the bundled tiny model)")
    p.add_argument("--model", dest="model_flag", help="the same as MODEL (vLLM's older spelling)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="name clients use in `model` (default: MODEL)")
    p.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` on every route but /health and /ping "
        "(also K3SERVE_API_KEY, or --api-key-file; the flag shows in `ps`)",
    )
    p.add_argument("--api-key-file", help="read the API key from this file (first line)")
    p.add_argument(
        "--allow-unauthenticated-metrics",
        action="store_true",
        help="serve /metrics without the API key (for a scraper without credentials)",
    )
    p.add_argument("--max-request-body-bytes", type=int, default=32 * 2**20, help="413 above this")
    p.add_argument(
        "--timeout-header",
        type=float,
        default=10.0,
        help="seconds a connection may take to send a request head before it is closed",
    )
    p.add_argument(
        "--timeout-body",
        type=float,
        default=30.0,
        help="seconds to wait for the next chunk of a request body before 408",
    )
    p.add_argument("--timeout-keep-alive", type=int, default=5, help="idle keep-alive seconds (uvicorn)")
    p.add_argument(
        "--health-step-timeout",
        type=float,
        default=120.0,
        help="/health answers 503 while one engine step has run longer than this (seconds)",
    )
    p.add_argument(
        "--timeout-graceful-shutdown",
        "--shutdown-timeout",
        type=int,
        default=10,
        help="seconds in-flight requests get at SIGTERM/SIGINT while new ones are answered 503; "
        "then what is left is cancelled (503). 0 aborts at once",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks the attention heads and MLP channels are split over (one local process each)",
    )
    p.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="pipeline stages the layers are split over (AttnRes blocks kept whole), each of "
        "--tensor-parallel-size ranks: TP x PP local worker processes",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="split the routed experts over those ranks by expert id instead of by channel",
    )
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine replicas behind this server, each with its own cache; requests go to the replica "
        "holding their longest cached prefix, else the least loaded (engine/dp_engine.py)",
    )
    p.add_argument(
        "--data-parallel-backend",
        "-dpb",
        default="mp",
        choices=("mp", "threads"),
        help="DP-attention (--data-parallel-size with --enable-expert-parallel): mp runs each rank's "
        "model in its own worker process; threads keeps them in this process (the GIL shared)",
    )
    p.add_argument(
        "--all2all-backend",
        default="auto",
        choices=ALL2ALL_BACKENDS,
        help="DP-attention + EP: alltoall sends a token's row only to the ranks owning its experts; "
        "allgather_reducescatter (or naive) sends every rank's rows to every rank",
    )
    p.add_argument(
        "--enable-eplb",
        action="store_true",
        help="expert-parallel load balancing: move (and replicate) experts between the ranks from their "
        "measured load (runner/eplb.py); needs --enable-expert-parallel",
    )
    p.add_argument(
        "--eplb-config",
        default=None,
        help='EPLB as JSON, vLLM\'s keys: {"window_size": 1000, "step_interval": 3000, '
        '"num_redundant_experts": 0, "log_balancedness": false}',
    )
    p.add_argument(
        "--distributed-executor-backend",
        default="mp",
        choices=("mp", "ray", "uni"),
        help="mp: worker processes started by this command (or by --node-rank n / torchrun on other "
        "nodes); ray: ranks as Ray actors on the cluster at RAY_ADDRESS; uni: one process (-tp 1)",
    )
    p.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="nodes the tensor-parallel ranks span; node 0 serves, the others run this command with "
        "--node-rank n and serve no HTTP (or launch every rank with torchrun)",
    )
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (the rendezvous store)")
    p.add_argument("--master-port", type=int, default=0, help="node 0's rendezvous port (needed with --nnodes > 1)")
    p.add_argument(
        "--distributed-timeout",
        type=float,
        default=120.0,
        help="seconds a collective or a worker's start-up may take before the engine reports it dead",
    )
    p.add_argument("--trust-remote-code", action="store_true", help="accepted; the architectures are native")
    p.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "fastsafetensors"))
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "float", "bfloat16", "half", "float16"),
        help="compute dtype: float32 (vLLM's 'float'), bfloat16; half/float16 are refused (K3's activations "
        "leave fp16's range: use bfloat16)",
    )
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=("fcfs", "priority"),
        help="fcfs, or priority: a request's `priority` field orders admission (lower first, vLLM's rule)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="a YAML file of flags (vLLM's --config): its keys are flag names, "
        "values their values; flags on the command line win",
    )
    p.add_argument("--response-role", default="assistant", help="the role chat completions answer with (vLLM's flag)")
    p.add_argument(
        "--root-path",
        default="",
        help="the path prefix a proxy routes to this server (/api): paths under it are served as the path after it",
    )
    p.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="every response carries X-Request-Id (the request's own, or a new one)",
    )
    p.add_argument(
        "--structured-outputs-config",
        type=json.loads,
        default=None,
        help='vLLM\'s JSON: {"backend": "auto"|"xgrammar", "disable_any_whitespace": true|false}',
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory (tiktoken.model or tokenizer.json and tokenizer_config.json); default: the model's",
    )
    add_backend_args(p)
    add_source_args(p)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cache-memory", help="cache bytes, e.g. 1GiB (default: a fraction of free memory)")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="fraction of the device's total memory for weights + activations + cache, as vLLM "
        "means it (on CPU: of MemTotal); --cache-memory wins",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "fp8", "fp8_e4m3"),
        help="MLA latent cache dtype; fp8 = float8_e4m3 (half of bf16's bytes) with the checkpoint's "
        "per-layer k_scale where it has one, else unit scale (or --calculate-kv-scales)",
    )
    p.add_argument(
        "--calculate-kv-scales",
        action="store_true",
        help="fp8 latent cache: each MLA layer's scale from the first rows it writes (max |latent| / 200, "
        "as vLLM), kept for the engine's life and with the disk prefix tier",
    )
    p.add_argument(
        "--quantization",
        "-q",
        help="must match the checkpoint (compressed-tensors / mxfp4 / nvfp4): "
        "k3serve reads the format from config.json and never requantizes",
    )
    p.add_argument(
        "--chat-template",
        help="Jinja chat template, a file or the template itself (default: K3 XTML "
        "for K3 tokenizers, else the checkpoint's own template)",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="'auto': request defaults (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens) from the model's generation_config.json; 'vllm': none; or a folder",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="always on: prefill is chunked on the 64-token KDA grid",
    )
    p.add_argument("--max-logprobs", type=int, default=20, help="largest logprobs / top_logprobs a request may ask")
    p.add_argument(
        "--limit-mm-per-prompt",
        type=json.loads,
        default={"image": 8, "video": 1},
        help='media per request, JSON: {"image": 8, "video": 1}',
    )
    p.add_argument(
        "--mm-encoder-cache",
        default="256MiB",
        help="memory for vision-tower rows kept by image / video-chunk digest, e.g. 1GiB (0: none)",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="*",
        default=[],
        help="hosts image / video URLs may be fetched from (default: none; data: URLs always work)",
    )
    p.add_argument(
        "--kv-transfer-config",
        type=json.loads,
        default=None,
        help='prefill/decode disaggregation, JSON: {"kv_connector": "K3HttpConnector", '
        '"kv_role": "kv_producer"} (server/kv_transfer.py)',
    )
    p.add_argument(
        "--max-stored-responses",
        type=int,
        default=1024,
        help="/v1/responses kept in memory for previous_response_id (oldest evicted)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hybrid prefix caching: latent blocks + exact KDA checkpoints (default on)",
    )
    p.add_argument(
        "--prefix-cache-state-interval",
        type=int,
        default=0,
        help="also checkpoint KDA state every N prompt tokens (0: prompt ends and junctions only)",
    )
    p.add_argument(
        "--prefix-cache-state-fraction",
        type=float,
        default=0.1,
        help="share of the cache memory reserved for KDA checkpoints",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        help="OpenTelemetry collector for per-request spans (OTLP/HTTP, e.g. http://127.0.0.1:4318)",
    )
    p.add_argument(
        "--mamba-ssm-cache-dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="the KDA recurrent state's dtype (auto: float32, the model card's; bfloat16 halves its bytes)",
    )
    p.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        help="GiB of host memory for prefix-cache entries below the device pools (latent blocks and "
        "exact KDA states; default off, or 1 with --kv-offloading-dir)",
    )
    p.add_argument(
        "--kv-offloading-backend",
        default="native",
        choices=("native",),
        help="the tiers' implementation (k3serve/offload)",
    )
    p.add_argument(
        "--kv-offloading-dir",
        default=None,
        help="directory tier below host memory: kept across restarts, shareable by engines of one model",
    )
    p.add_argument("--kv-offloading-dir-size", type=float, default=16.0, help="GiB the directory tier may hold")
    p.add_argument(
        "--kv-offloading-write-policy",
        default="write_through",
        choices=("write_through", "write_back"),
        help="when entries go to the tiers (SGLang's HiCache names): as the pools publish them "
        "(default; what a shared directory and a restart see), or only as the pools evict them",
    )
    p.add_argument("--speculative-config", help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--enable-auto-tool-choice", action="store_true")
    p.add_argument("--tool-call-parser", choices=("kimi_k3", "kimi_k2"))
    p.add_argument("--reasoning-parser", choices=("kimi_k3", "kimi_k2"))
    p.add_argument("--max-waiting", type=int, default=4096, help="queued requests before 503")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument(
        "--uvicorn-log-level",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's own log level (default: --log-level)",
    )
    p.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request's id, sizes and sampling fields when it starts, and its end",
    )
    p.add_argument("--disable-log-requests", action="store_true", help="the default; turns --enable-log-requests off")
    p.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line (--stats-log-interval 0)")
    p.add_argument(
        "--stats-log-interval", type=float, default=10.0, help="seconds between engine stats lines in the log (0: none)"
    )
    p.add_argument("--allowed-origins", type=json.loads, default=[], help="CORS, JSON list, e.g. '[\"*\"]'")
    p.add_argument("--allowed-methods", type=json.loads, default=["*"], help="CORS, JSON list")
    p.add_argument("--allowed-headers", type=json.loads, default=["*"], help="CORS, JSON list")
    p.add_argument("--allow-credentials", action="store_true", help="CORS")
    add_vllm_flags(p)


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
    sets the default of requests that do not say (server/structured.py reads args)."""
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


def apply_config_file(argv: list[str]) -> list[str]:
    """vLLM's `--config FILE.yaml`: the file's keys become flags placed before the command
    line's own, so a flag given on the command line wins (argparse keeps the last value)."""
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        return argv
    import yaml

    i = next(j for j, a in enumerate(argv) if a == "--config" or a.startswith("--config="))
    path = argv[i].split("=", 1)[1] if "=" in argv[i] else argv[i + 1]
    rest = argv[:i] + argv[i + (1 if "=" in argv[i] else 2) :]
    try:
        values = yaml.safe_load(open(path)) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: cannot read it: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: a YAML mapping of flag names to values is expected")
    p = argparse.ArgumentParser(add_help=False)
    add_serve_args(p)  # what each key's flag takes: a value, several, or none (a switch)
    flags = []
    for key, value in values.items():
        flags += _config_flag(path, str(key), value, p._option_string_actions)
    # the subcommand ("serve") and a MODEL right after it; the file's flags follow (a list's
    # values would swallow a MODEL after them), the command line's come last
    head = rest[:2] if len(rest) > 1 and not rest[1].startswith("-") else rest[:1]
    return head + flags + rest[len(head) :]


_YES, _NO = ("true", "yes", "on", "1"), ("false", "no", "off", "0", "")


def _config_flag(path: str, key: str, value, actions: dict) -> list[str]:
    """One --config entry as command-line words. A switch's false is said (`--no-X` where the
    flag has one): dropping it left `enable_prefix_caching: false` on. 0 and "" are values."""
    flag = "--" + key.replace("_", "-")
    action = actions.get(flag)  # None: not a serve flag (run-batch's own, or a typo): argparse judges it
    if value is None:
        return []  # YAML's null: the flag's default
    if action is not None and action.nargs == 0:  # a switch: store_true, or --X / --no-X
        return _config_switch(path, key, flag, value, actions)
    if isinstance(value, bool) and action is None:
        return [flag]  # argparse names the unknown flag (a typo's false used to vanish)
    if isinstance(value, bool):
        raise ValueError(f"--config {path}: {key} takes a value, not {str(value).lower()}")
    if isinstance(value, list) and action is not None and action.nargs in ("*", "+"):
        return [flag, *(str(v) for v in value)]
    return [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]


def _config_switch(path: str, key: str, flag: str, value, actions: dict) -> list[str]:
    on = value if isinstance(value, bool) else str(value).strip().lower()
    if on not in (True, False, *_YES, *_NO):
        raise ValueError(f"--config {path}: {key} is a switch: give true or false, not {value!r}")
    if on is True or on in _YES:
        return [flag]
    no = "--no-" + flag[2:]
    return [no] if no in actions else []  # a store_true flag's false is its default


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
    return dict(
        dtype=args.dtype,
        load_format=args.load_format,
        **backend_kwargs(args),
        **source_kwargs(args),
        load_progress=True,
        tokenizer=args.tokenizer,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        cache_memory=args.cache_memory,
        seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
        speculative_config=spec,
        prefix_cache_state_interval=args.prefix_cache_state_interval,
        prefix_cache_state_fraction=args.prefix_cache_state_fraction,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
        kv_offloading_size=args.kv_offloading_size,
        kv_offloading_backend=args.kv_offloading_backend,
        kv_offloading_dir=args.kv_offloading_dir,
        kv_offloading_dir_size=args.kv_offloading_dir_size,
        kv_offloading_write_policy=args.kv_offloading_write_policy,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype="fp8" if args.kv_cache_dtype == "fp8_e4m3" else args.kv_cache_dtype,
        quantization=args.quantization,
        mm_encoder_cache=args.mm_encoder_cache,
        max_logprobs=args.max_logprobs,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        distributed_timeout=args.distributed_timeout,
        all2all_backend=args.all2all_backend,
        enable_eplb=args.enable_eplb,
        eplb_config=args.eplb_config,
        data_parallel_backend=args.data_parallel_backend,
        distributed_executor_backend="ray" if args.distributed_executor_backend == "ray" else "mp",
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        scheduling_policy=args.scheduling_policy,
    )


def start_engines(args: argparse.Namespace):
    """One AsyncEngine, or a DPEngine over --data-parallel-size replicas of it."""
    from k3serve.engine.async_engine import AsyncEngine
    from k3serve.engine.dp_engine import DPEngine

    from k3serve.config.engine_config import EngineConfig

    kwargs = engine_kwargs(args)
    dp = args.data_parallel_size
    dp_attention = dp > 1 and args.enable_expert_parallel  # experts over the DP ranks (engine/lockstep.py)
    from k3serve.engine.build import build_replicas

    config = EngineConfig.from_kwargs(args.model, **kwargs)
    replicas = [AsyncEngine(e, max_waiting=args.max_waiting) for e in build_replicas(config, dp, dp_attention)]
    return replicas[0] if len(replicas) == 1 else DPEngine(replicas, lockstep=dp_attention)


def kv_transfer(args: argparse.Namespace):
    from k3serve.server.kv_transfer import KVTransferConfig

    return None if args.kv_transfer_config is None else KVTransferConfig.from_dict(args.kv_transfer_config)


def media_limits(args: argparse.Namespace):
    from k3serve.server.media import MediaLimits

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
    from k3serve.server.structured import xgrammar_missing

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
    from k3serve.distributed.executor import run_headless, worker_base
    from k3serve.distributed.multinode import NodeLayout, torchrun_layout, torchrun_rank
    from k3serve.distributed.worker import WorkerSpec, worker_main
    from k3serve.demo import default_model
    from k3serve.executor.placement import placement

    ran = torchrun_rank()
    if (ran is None and args.node_rank == 0) or (ran is not None and ran[0] == 0):
        return None
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
    where = placement(config)
    kw = dict(
        expert_parallel=config.enable_expert_parallel,
        redundant_experts=config.redundant_experts,
        pp_size=config.pipeline_parallel_size,
        dtype=where.dtype,
        load_format=config.load_format,
        kernels=config.kernels,
        device=where.device,
        timeout_s=config.distributed_timeout,
    )
    path = str(config.model or default_model())
    if ran is not None:  # torchrun started this process as one rank: be it
        nodes = torchrun_layout()
        worker_main(WorkerSpec(rank=ran[0], **worker_base(path, ran[1], nodes, nodes.master_port, shm_path=None, **kw)))
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
        kw.pop("expert_parallel")
        return run_headless_dp(path, dp, tp, nodes, all2all=config.all2all_backend, **kw)
    logging.getLogger("k3serve.server").info(
        "node %d of %d: tensor-parallel ranks %s, driver at %s:%d",
        args.node_rank,
        args.nnodes,
        nodes.ranks(tp * config.pipeline_parallel_size),
        args.master_addr,
        args.master_port,
    )
    return run_headless(path, tp * config.pipeline_parallel_size, nodes, **kw)


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
