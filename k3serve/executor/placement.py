"""Where each rank runs and how its groups talk: one rule for every executor, and which backend it
runs (`resolve_backend`: decided once by the engine's build, carried to every rank by the
allocation).

The driver's placement (device, dtypes) comes from the engine's flags; rank r of a layout runs
on the same device type, and on CUDA on GPU `local_rank` of its node's visible devices
(CUDA_VISIBLE_DEVICES is honoured: indices are of the visible ones; under Ray each actor sees
only the GPU Ray gave it). A group of CUDA ranks is a ProcessGroupNCCL, of CPU ranks a
ProcessGroupGloo (plus the shared-memory transport on one host): the device type picks it,
nothing else differs (parallel/group.py `process_group`). Reference: vLLM
`distributed/parallel_state.py` (device group per rank, `local_rank`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("k3serve.engine")


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype


def placement(config) -> Placement:
    """The driver's (rank 0's) device and dtypes for an EngineConfig."""
    dev = config.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(dev)
    if device.type == "cuda" and device.index is None:  # "cuda" != "cuda:0" when tensors are compared
        device = torch.device("cuda", torch.cuda.current_device())
    name = config.dtype if config.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    kv = config.kv_cache_dtype if config.kv_cache_dtype != "auto" else name
    return Placement(device, TORCH_DTYPES[name], TORCH_DTYPES[kv])


def rank_device(device_type: str, local_rank: int) -> torch.device:
    """A rank's device: the CPU, or GPU `local_rank` of this node's visible ones."""
    return torch.device("cuda", local_rank) if device_type == "cuda" else torch.device(device_type)


def group_backend(device_type: str) -> str:
    """The collectives library of a group whose tensors live on `device_type`."""
    return "nccl" if device_type == "cuda" else "gloo"


def check_multi_rank(where: Placement, flag: str) -> None:
    """Ranks on CUDA take GPUs 0..N-1 of the visible ones, the driver's rank GPU 0: a driver
    placed on another GPU by --device would share one with a rank."""
    if where.device.type == "cuda" and where.device.index not in (None, 0):
        raise ValueError(
            f"{flag} > 1 on {where.device}: the ranks take cuda:0..N-1 of the visible GPUs; choose "
            "them with CUDA_VISIBLE_DEVICES and leave --device as cuda or auto"
        )


def resolve_backend(config, device: torch.device) -> str:
    """The backend of an engine (an EngineConfig) whose driver runs on `device`: `resolve_mode`,
    then the layouts the compiled steps do not cover run torch ("auto" on a GPU asked for them)."""
    mode = resolve_mode(config.kernels, device, config.enforce_eager, config.ssm_dtype)
    if config.decode_context_parallel_size > 1 and mode != "torch":  # "auto"
        log.info("decode context parallelism runs the torch path: the token-sharded MLA attention (layers/mla_dcp.py)")
        mode = "torch"
    return mode


def resolve_mode(mode: str, device: torch.device, enforce_eager: bool = False, ssm_dtype: str = "float32") -> str:
    """A `--kernels` mode for a model on `device` (what a worker loads with; the engine's whole
    rule is `resolve`): the compiled kernels read CPU tensors only,
    so an engine elsewhere builds none and "cpp" there is refused by name; "auto" on a GPU is the
    triton backend (compiled, captured decode steps with the Triton kernels; "graph" where Triton
    or fla-core is not installed), or the torch reference under --enforce-eager. "triton" where
    its kernels cannot run (not installed; a CPU without TRITON_INTERPRET=1) is refused by name.
    A KDA state other than float32 (`ssm_dtype`) leaves the C++ kernels (float32 state) aside.
    DP-attention replicas take the same backends: their static steps agree on one bucket and
    exchange tokens at a fixed shape (runner/graph_step.py), over NCCL on GPUs."""
    from k3serve.kernels.triton import unavailable

    if mode == "triton" and (why := unavailable(device.type)):
        raise ValueError(why)
    if ssm_dtype != "float32" and mode == "cpp":
        raise ValueError(
            "kernels='cpp' keeps the KDA state in float32: with --mamba-ssm-cache-dtype "
            f"{ssm_dtype} use 'torch', 'graph' or 'triton'"
        )
    if device.type == "cpu":
        if ssm_dtype != "float32" and mode == "auto":
            log.info("KDA state in %s: the CPU kernels (float32 state) stand aside; layers run torch", ssm_dtype)
            return "torch"
        return mode
    if mode in ("torch", "graph", "triton"):
        return mode
    if mode == "cpp":
        raise ValueError(
            f"kernels='cpp': the compiled kernels are CPU-only and this engine runs on {device}; "
            "use 'auto', 'triton', 'graph' or 'torch'"
        )
    if enforce_eager:
        return "torch"
    return "graph" if unavailable(device.type) else "triton"
