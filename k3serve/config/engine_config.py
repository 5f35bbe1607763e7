"""EngineConfig: every engine knob, named like the CLI flags (`--max-model-len` -> max_model_len).

Knobs whose feature is not built yet fail loudly instead of being ignored (issue contract).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

DTYPES = ("auto", "float32", "bfloat16")
KV_DTYPES = DTYPES + ("fp8",)  # fp8: float8_e4m3fn latent rows, unit scale (vLLM's default k_scale 1.0)
KERNELS = ("auto", "cpp", "torch", "graph", "triton")  # execution backends (k3serve/backends)
QUANTIZATIONS = ("compressed-tensors", "mxfp4", "nvfp4")  # what a checkpoint's quantization_config can be

# how DP-attention ranks exchange tokens for their experts, as vLLM's --all2all-backend spells it:
# alltoall (rows only to the ranks owning a token's experts), allgather_reducescatter / naive
# (every rank's rows to every rank), auto (layers/moe_dispatch.py gather_form)
ALL2ALL_BACKENDS = ("auto", "alltoall", "allgather_reducescatter", "naive")


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint dir; None = the bundled default tiny model
    tokenizer: str | None = None  # default: the model dir
    # a Hugging Face repo id as `model` (weights/hub.py): its revision, the cache folder, the token
    revision: str | None = None
    download_dir: str | None = None
    hf_token: str | None = field(default=None, repr=False)
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on GPU
    kv_cache_dtype: str = "auto"  # auto = the model dtype; fp8 = float8_e4m3 MLA latent cache
    # fp8 latent cache: its per-layer scales from the first rows each layer writes (vLLM's flag);
    # without it the checkpoint's `self_attn.k_scale` where present, else unit scale
    calculate_kv_scales: bool = False
    # the KDA recurrent state's dtype (vLLM's mamba_ssm_cache_dtype; SGLang's --mamba-ssm-dtype): auto =
    # float32, the model card's; bfloat16 halves the state's bytes (its drift: docs/features.md)
    mamba_ssm_cache_dtype: str = "auto"
    max_model_len: int | None = None  # None = min(max_position_embeddings, 8192)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    cache_memory: int | str | None = None  # absolute ("1GiB"); wins over the fraction
    cache_memory_fraction: float | None = None  # of free memory after weights; default 0.9 GPU, 0.1 CPU
    gpu_memory_utilization: float | None = None  # vLLM: fraction of TOTAL device memory for everything
    # a quantized checkpoint's own format (never requantized), or mxfp4 / nvfp4 on an unquantized
    # one: its routed experts quantized as they load (the bytes `k3serve convert` writes)
    quantization: str | None = None
    max_logprobs: int = 20
    mm_encoder_cache: int | str = "256MiB"  # vision-tower rows kept by image digest (models with a tower)
    num_state_slots: int | None = None  # fix the KDA slot count instead of deriving it
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True
    prefix_cache_state_fraction: float = 0.1  # of the cache budget, for KDA checkpoints
    prefix_cache_state_interval: int = 0  # extra checkpoint every N prompt tokens (multiple of block_size)
    # prefix-cache tiers below the device pools (k3serve/offload), vLLM's names: host memory in GiB,
    # then a directory (kept across restarts, shareable by engines of one model) and its GiB
    kv_offloading_size: float | None = None  # None: off, or 1 GiB when a directory is given
    kv_offloading_backend: str = "native"
    kv_offloading_dir: str | None = None
    kv_offloading_dir_size: float = 16.0
    kv_offloading_write_policy: str = "write_through"  # or "write_back": entries go down as the pools evict them
    speculative_config: dict[str, Any] | None = None
    seed: int = 0
    load_format: str = "auto"
    device: str = "auto"  # auto = cuda when available, else cpu
    load_progress: bool = False  # a per-shard progress bar while loading (the server turns it on)
    # auto: the compiled CPU kernels when they build (CPU), the graph step (CUDA) | cpp: require
    # them | torch: the reference | graph: the compiled static decode step (backends/graph.py)
    kernels: str = "auto"
    enforce_eager: bool = False  # vLLM's flag: no torch.compile, no CUDA graphs
    compilation_config: Any = None  # vLLM's --compilation-config JSON (config/compilation.py)
    tensor_parallel_size: int = 1  # ranks the model's heads / channels are split over (distributed/)
    pipeline_parallel_size: int = 1  # stages the layers are split over, TP ranks each (config/stages.py)
    # decode context parallelism: the MLA latent cache sharded by token over the TP ranks, each
    # attending over its rows, outputs merged by log-sum-exp (parallel/dcp.py, layers/mla_dcp.py)
    decode_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1  # tokens on one rank before the next
    enable_expert_parallel: bool = False  # routed experts split by expert id over those ranks instead
    # CPU ranks pinned one thread per physical core (executor/cpu_topology.py): spread over the NUMA
    # nodes (llama.cpp's --numa distribute, the default on several nodes), all on node 0
    # (isolate) or the cores in order (none); or vLLM's explicit CPU lists, "0-31|32-63"
    numa: str | None = None
    cpu_threads_bind: str | None = None
    all2all_backend: str = "auto"  # DP-attention + EP's token exchange (layers/moe_dispatch.py)
    # the expert-parallel load balancer (runner/eplb.py): rebalance experts over the ranks from
    # their measured load; its window, interval and redundant slots in vLLM's --eplb-config JSON
    enable_eplb: bool = False
    eplb_config: Any = None
    # DP-attention replicas' models: mp = one worker process each (distributed/dp_workers.py),
    # threads = in this process (engine/lockstep.py threads; no process start-up, the GIL shared)
    data_parallel_backend: str = "mp"
    distributed_executor_backend: str = "mp"  # mp: worker processes started here | ray: Ray actors
    distributed_timeout: float = 120.0  # seconds any collective or worker start-up may take
    nnodes: int = 1  # nodes the TP ranks span (node 0 runs the server; others `--node-rank n`)
    node_rank: int = 0
    master_addr: str = "127.0.0.1"  # node 0's address: the rendezvous store
    master_port: int = 0  # its port (required with nnodes > 1; 0 = any, one node)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def redundant_experts(self) -> int | None:
        """EPLB's redundant expert slots for the expert group (parallel/group.py), None: EPLB off."""
        return self.eplb_config.num_redundant_experts if self.enable_eplb else None

    @property
    def ssm_dtype(self) -> str:
        """The KDA recurrent state's dtype name ("auto": float32)."""
        return "float32" if self.mamba_ssm_cache_dtype == "auto" else self.mamba_ssm_cache_dtype

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        from k3serve.config.compilation import CompilationConfig

        self.compilation_config = CompilationConfig.parse(self.compilation_config)
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.calculate_kv_scales and self.kv_cache_dtype != "fp8":
            raise ValueError(
                "calculate_kv_scales calibrates the fp8 latent cache's scales: add kv_cache_dtype fp8 "
                "(--kv-cache-dtype fp8), or drop it"
            )
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization {self.quantization!r} is not supported: k3serve serves a quantized "
                f"checkpoint's own format ({' / '.join(QUANTIZATIONS)}) and never requantizes it; mxfp4 "
                f"or nvfp4 on an unquantized checkpoint quantizes its routed experts at load"
            )
        if self.cache_memory_fraction is not None and not 0 < self.cache_memory_fraction <= 1:
            raise ValueError(f"cache_memory_fraction must be in (0, 1], got {self.cache_memory_fraction}")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if not 0 < self.prefix_cache_state_fraction < 1:
            raise ValueError(f"prefix_cache_state_fraction must be in (0, 1), got {self.prefix_cache_state_fraction}")
        if self.prefix_cache_state_interval % self.block_size:
            raise ValueError(f"prefix_cache_state_interval must be a multiple of block_size {self.block_size}")
        if self.mamba_ssm_cache_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(
                f"mamba_ssm_cache_dtype must be auto, float32 or bfloat16, got {self.mamba_ssm_cache_dtype!r}"
            )
        if self.kv_offloading_backend != "native":
            raise ValueError(
                f"kv_offloading_backend {self.kv_offloading_backend!r} is not available: k3serve's "
                "tiers are 'native' (host memory and --kv-offloading-dir)"
            )
        if self.kv_offloading_write_policy not in ("write_through", "write_back"):
            raise ValueError(
                "kv_offloading_write_policy must be write_through or write_back, got "
                f"{self.kv_offloading_write_policy!r}"
            )
        if (self.kv_offloading_size is not None and self.kv_offloading_size <= 0) or self.kv_offloading_dir_size <= 0:
            raise ValueError("kv_offloading_size and kv_offloading_dir_size are GiB and must be > 0")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.decode_context_parallel_size != 1 or self.cp_kv_cache_interleave_size != 1:
            self._check_dcp()
        if self.numa is not None and self.numa not in ("distribute", "isolate", "none"):
            raise ValueError(f"numa must be distribute, isolate or none, got {self.numa!r}")
        if self.data_parallel_backend not in ("mp", "threads"):
            raise ValueError(
                f"data_parallel_backend must be 'mp' (a worker process per DP-attention rank) or "
                f"'threads' (in this process), got {self.data_parallel_backend!r}"
            )
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            raise ValueError(f"all2all_backend must be one of {ALL2ALL_BACKENDS}, got {self.all2all_backend!r}")
        from k3serve.config.eplb import EPLBConfig

        self.eplb_config = EPLBConfig.parse(self.eplb_config)
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError(
                "enable_eplb balances experts split by id over ranks: add enable_expert_parallel "
                "(--enable-expert-parallel) with --tensor-parallel-size or --data-parallel-size > 1"
            )
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                f"distributed_executor_backend must be 'mp' (worker processes started here) or "
                f"'ray' (Ray actors on the cluster), got {self.distributed_executor_backend!r}"
            )
        if self.speculative_config:
            from k3serve.config.speculative import SpeculativeConfig

            SpeculativeConfig.from_dict(self.speculative_config)  # fail early, naming the key
        if self.extra:
            raise ValueError(f"unknown engine arguments: {sorted(self.extra)}")

    def _check_dcp(self) -> None:
        """The layouts decode context parallelism runs in; the others refused by their flag."""
        n, i, tp = self.decode_context_parallel_size, self.cp_kv_cache_interleave_size, self.tensor_parallel_size
        if n < 1 or i < 1:
            raise ValueError(f"decode_context_parallel_size and cp_kv_cache_interleave_size must be >= 1, got {n}, {i}")
        if tp % n:
            raise ValueError(
                f"--decode-context-parallel-size {n} must divide --tensor-parallel-size {tp}: the latent "
                "cache is sharded over the tensor-parallel ranks"
            )
        if self.block_size % (n * i):
            raise ValueError(
                f"--block-size {self.block_size} must be a multiple of --decode-context-parallel-size {n} x "
                f"--cp-kv-cache-interleave-size {i}: each rank holds whole rows of every block"
            )
        if n > 1 and self.kernels not in ("auto", "torch"):
            raise ValueError(
                f"--kernels {self.kernels} with --decode-context-parallel-size: the token-sharded attention "
                "runs in the torch path (layers/mla_dcp.py); use --kernels auto or torch"
            )

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in fields(cls)} - {"extra"}
        extra = {k: v for k, v in kwargs.items() if k not in known}
        return cls(model=model, extra=extra, **{k: v for k, v in kwargs.items() if k in known})
