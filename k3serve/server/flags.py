"""`k3serve serve` flags in vLLM's spelling (and `generate`'s backend and source flags): the
argparse definitions, and the kwargs of the groups other commands share. What they become is
server/launch.py's (engine_kwargs, build_server)."""

from __future__ import annotations

import argparse
import json

from dataclasses import fields

from k3serve.config.engine_config import ALL2ALL_BACKENDS, KERNELS, EngineConfig
from k3serve.server.vllm_flags import add_vllm_flags


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


def config_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields a command's flags set, by name (a flag's dest is its field's name):
    what `serve` and `generate` hand the engine, written once."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig) if f.name != "model" and hasattr(args, f.name)}


def add_source_args(p: argparse.ArgumentParser) -> None:
    """Where a model given as a Hugging Face repo id comes from (weights/hub.py), vLLM's flags."""
    p.add_argument("--revision", help="branch, tag or commit of a Hugging Face repo id (default: main)")
    p.add_argument("--download-dir", help="hub cache folder for a repo id (default: HF_HUB_CACHE)")
    p.add_argument("--hf-token", help="token for gated repos (default: HF_TOKEN or the saved login)")


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
        "--decode-context-parallel-size",
        "-dcp",
        type=int,
        default=1,
        help="shard the MLA latent cache by token over this many of the --tensor-parallel-size ranks "
        "(each attends over its rows; the outputs merge by log-sum-exp): 1/N of the latent bytes per rank",
    )
    p.add_argument(
        "--cp-kv-cache-interleave-size",
        type=int,
        default=1,
        help="with --decode-context-parallel-size: consecutive tokens on one rank before the next "
        "(--block-size must be a multiple of it times the DCP size)",
    )
    p.add_argument(
        "--numa",
        choices=("distribute", "isolate", "none"),
        default=None,
        help="CPU ranks, one thread per physical core, pinned: spread over the NUMA nodes (distribute, the "
        "default on several nodes), all on node 0 (isolate), or the cores in order (none)",
    )
    p.add_argument(
        "--cpu-threads-bind",
        default=None,
        help="CPU ranks' CPUs, one list per rank: '0-31|32-63' (vLLM's VLLM_CPU_OMP_THREADS_BIND); auto: --numa's plan",
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
        help="a quantized checkpoint's own format (compressed-tensors / mxfp4 / nvfp4: read from "
        "config.json, never requantized), or mxfp4 / nvfp4 on an unquantized checkpoint: its routed "
        "experts quantized at load, the bytes `k3serve convert` writes, without a second copy on disk",
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
        '"kv_role": "kv_producer"} (server/pd/kv_transfer.py)',
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
