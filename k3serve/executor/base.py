"""The executor interface: how many processes hold one replica's model, hidden from the engine.

The engine core prepares a step (runner/model_runner.py `prepare`), hands its `StepInputs` to
`execute`, and finishes the step from the `StepResult` (sampling, verification); rollbacks,
idle steps of DP-attention replicas, and the reads and writes of cache state that prefix tiers
and prefill/decode hand-offs make go through the same object. Implementations:
`UniProcExecutor` (the model in this process; also a DP-attention replica on an engine thread),
`MultiprocExecutor` and `RayExecutor` (tensor-parallel ranks, rank 0 in this process:
distributed/executor.py), `DPWorkerExecutor` (a DP-attention replica whose ranks are worker
processes: distributed/dp_replicas.py). Reference: vLLM v1 `executor/abstract.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from k3serve.cache.sizing import CachePlan
from k3serve.config.model_config import ModelConfig
from k3serve.parallel.group import CollectiveError


class WorkerDied(RuntimeError):
    """A rank's process is gone: the engine cannot run another step."""


# what breaks a replica's ranks for good: no request can run on them again
RANK_FAULTS = (WorkerDied, CollectiveError)


@dataclass(frozen=True)
class ModelInfo:
    """What the engine knows of the model its executor holds: its config, serving dtype and the
    weight bytes one rank holds (rank 0's; what the cache budget leaves room for)."""

    cfg: ModelConfig
    dtype: torch.dtype
    weight_bytes: int


@dataclass(frozen=True)
class Allocation:
    """What every rank builds its cache and backend from, once, after the engine planned the
    cache: the plan, the latent dtype's name, the backend mode, the graph backend's settings
    (runner/graph_step.py GraphSettings, or None), fp8 scale calibration, and the vocabulary ids
    never sampled (a rank that samples on the device masks them), the load balancer's settings."""

    plan: CachePlan
    kv_dtype: str
    mode: str
    graph: object = None
    calculate_kv_scales: bool = False
    masked_ids: tuple[int, ...] = field(default=())
    eplb: object = None  # config/eplb.py EPLBConfig when --enable-eplb (each rank's runner/eplb.py)
    nodes: int = 1  # the nodes the ranks span (--nnodes): EPLB keeps expert groups on one node


class Executor(ABC):
    """One replica's ranks. `size`: the ranks whose KDA heads make up one state (the TP size);
    `cache`: rank 0's cache tensors when they live in this process, else None; `ep`: a
    DP-attention replica's rank and size in the expert group (parallel/group.py TPGroup), else
    None."""

    size: int = 1
    ep = None
    model_path: str = ""  # the checkpoint folder the ranks loaded
    kernels = None  # the compiled CPU kernels module rank 0's backend runs, or None
    error: str | None = None  # why the ranks cannot serve (a worker died, a collective failed)

    @property
    @abstractmethod
    def info(self) -> ModelInfo: ...

    @property
    def lockstep(self) -> bool:
        """The replica meets the others in every MoE layer (DP-attention + EP): it steps every time."""
        return self.ep is not None

    @property
    def model(self):
        """The model object in this process (the drafters read its config and kernels), or None."""
        return None

    @property
    def cache(self):
        return None

    def use_kernels(self, mode: str):
        """Choose the backend of the model in this process (before `allocate`; workers take the
        mode from the allocation). Returns the compiled kernels module, or None."""
        return None

    @abstractmethod
    def allocate(self, alloc: Allocation) -> None: ...

    @abstractmethod
    def execute(self, inputs, taps: tuple[int, ...] = ()):
        """Every rank runs the step; rank 0's StepResult (runner/rank_step.py)."""

    def launch(self, inputs, taps: tuple[int, ...] = ()):
        """Start a step; `collect` gives its StepResult. Where `pipelined`, the first pipeline
        stage has run and handed it on, so a second step may start while the later stages work
        on this one; elsewhere the step runs here whole."""
        return self.execute(inputs, taps)

    def collect(self, handle):
        """The StepResult of a `launch`ed step."""
        return handle

    @property
    def pipelined(self) -> bool:
        """Whether two steps may be in flight at once (pipeline stages: the engine's overlap)."""
        return False

    @abstractmethod
    def rollback(self, slots: list[int], accepted: list[int]) -> None:
        """After an eager verify pass: each live slot takes its state at the accepted position."""

    @abstractmethod
    def idle(self) -> None:
        """A DP-attention replica with nothing scheduled: its MoE layers' collectives (or a padding step)."""

    @abstractmethod
    def read_state(self, slot: int) -> list[tuple[dict, dict]]:
        """Every rank's (recurrent {layer: [h, D, D]}, conv {layer: [K-1, 3hD]}) of one slot,
        rank order (rank 0's may be views of the cache: valid until the next step)."""

    @abstractmethod
    def write_state(self, slot: int, shares: list[tuple[dict, dict]], non_blocking: bool = False) -> None:
        """Each rank r takes shares[r] into `slot` (`non_blocking`: pinned host tensors, copied in
        stream order)."""

    @abstractmethod
    def read_rows(self, rows: torch.Tensor) -> dict[int, torch.Tensor]:
        """Latent rows [R, c + r] per MLA layer (whole on every rank: rank 0's)."""

    @abstractmethod
    def write_rows(self, rows: torch.Tensor, latent: dict[int, torch.Tensor], non_blocking: bool = False) -> None:
        """Latent rows (the cache's encoding) into every rank's cache."""

    def parallel_stats(self) -> dict:
        """Rank 0's collective totals and the expert load, for /metrics (engine/stats.py)."""
        return {}

    def rank_weight_bytes(self) -> list[int]:
        """The weight bytes each rank this process can see loaded, rank order (what `k3serve
        plan` predicts per rank)."""
        return [self.info.weight_bytes]

    @property
    def transfers(self) -> bool:
        """Whether state reads and writes reach every rank (a TP group over torchrun, Ray or
        several nodes has no pipe to its workers' caches)."""
        return True

    @property
    def alive(self) -> bool:
        return True

    def fail(self, why: str) -> None:
        """A collective failed: the group is broken for good."""

    def shutdown(self) -> None:
        """Stop the ranks this executor started (nothing for one process)."""
