"""The tensor-parallel group a model is built for: rank, size, and its collectives.

A model built with the default `TPGroup()` (size 1) is the single-process model: every
collective below is the identity, so TP1 runs exactly the code it ran before. With size N
the layers hold 1/N of the heads / intermediate channels (or, with expert parallelism, 1/N
of the routed experts) and each block returns a partial sum that `all_reduce` completes, at
the points vLLM reduces (after o_proj, after the MLP / MoE down projection).

The process group is a `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (CUDA) made directly
on a TCPStore, not torch.distributed's global default group: several engines (tests, a
DP launcher) can live in one process, each with its own group.
References: vLLM `distributed/parallel_state.py`, `distributed/communication_op.py`.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

_names = itertools.count()
_registered: list = []  # the wrapping ProcessGroups stay alive as long as the process


def register_functional(backend, rank: int, size: int, device_type: str = "cpu") -> str:
    """Register a gloo (CPU) or NCCL (`device_type` "cuda") backend under a process-unique name,
    wrapped in the ProcessGroup that torch's functional collectives resolve by name: inside a
    compiled step the collectives are graph nodes (`_c10d_functional.all_reduce` + `wait_tensor`),
    no host wait or timing in the forward; on CUDA they are captured into the step's graph.
    Eager code keeps calling the backend itself."""
    pg = dist.ProcessGroup(dist.HashStore(), rank, size)
    kind = dist.ProcessGroup.BackendType.NCCL if device_type == "cuda" else dist.ProcessGroup.BackendType.GLOO
    pg._set_default_backend(kind)
    pg._register_backend(torch.device(device_type), kind, backend)
    name = f"k3serve-tp-{next(_names)}"
    pg._set_group_name(name)
    torch._C._distributed_c10d._register_process_group(name, pg)
    _registered.append((pg, backend))
    return name


class CollectiveError(RuntimeError):
    """A collective failed (a peer died or timed out): the group cannot be used again."""


@dataclass
class CommStats:
    """What this rank's collectives cost: calls, payload bytes and wall seconds per kind."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds


def _collective(stats: CommStats, kind: str, x: torch.Tensor | int, op):
    """op() over the shared segment or the process group, timed into `stats` with x's bytes (or
    x bytes); a failure (a peer gone, a timeout) becomes CollectiveError."""
    began = time.perf_counter()
    try:
        out = op()
    except RuntimeError as e:
        raise CollectiveError(f"tensor-parallel {kind} failed: {str(e).splitlines()[0] if str(e) else e}") from e
    stats.add(kind, x if isinstance(x, int) else x.numel() * x.element_size(), time.perf_counter() - began)
    return out


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # routed experts split by expert id instead of by channel
    pg: Any = None  # the torch.distributed process group object (None for size 1)
    shm: Any = None  # parallel/shm.py ShmComm: ranks on one host meet in shared memory (else gloo)
    stats: CommStats = field(default_factory=CommStats, compare=False)
    size_flag: str = "--tensor-parallel-size"  # what sets `size` (DP-attention's expert group: the DP size)
    all2all: str = "auto"  # DP-attention's token exchange for the experts (layers/moe_dispatch.py)
    # EPLB's redundant expert slots over the group (--eplb-config num_redundant_experts): the routed
    # experts occupy E + R physical slots, (E + R) / size per rank (layers/expert_map.py)
    redundant_experts: int = 0
    # decode context parallelism (--decode-context-parallel-size, parallel/dcp.py): the MLA latent
    # cache sharded by token over the group's ranks, `dcp_interleave` tokens at a time; 1: whole
    dcp: int = 1
    dcp_interleave: int = 1
    # the N ranks that share one latent cache when N < size: consecutive TP ranks (their heads
    # consecutive too), rank t in group t // N at position t % N; None: this group itself
    dcp_group: "TPGroup | None" = field(default=None, compare=False)

    @property
    def context_group(self) -> "TPGroup":
        """The group the latent cache is sharded over (decode context parallelism)."""
        return self if self.dcp_group is None else self.dcp_group

    functional: str | None = field(default=None, compare=False)  # the group's name for compiled steps
    device_type: str = "cpu"  # where its tensors live: "cpu" (gloo) or "cuda" (NCCL, `nccl_group`)

    def enable_functional(self) -> None:
        """Register the group for compiled steps (the graph backend, before it compiles); other
        engines never wrap or keep their backend. The name is set on this shared object, which
        every layer of the model holds."""
        if self.size > 1 and self.pg is not None and self.functional is None:
            name = register_functional(self.pg, self.rank, self.size, self.device_type)
            object.__setattr__(self, "functional", name)

    def split(self, n: int, what: str) -> int:
        """This rank's share of a dimension of size n; an error naming it when N does not divide it."""
        if n % self.size:
            raise ValueError(f"{what} = {n} is not divisible by {self.size_flag} {self.size}")
        return n // self.size

    def _on_device(self, x: torch.Tensor) -> torch.Tensor:
        """A host value (a row count, a bucket offer) on an NCCL group travels on the rank's GPU."""
        return x.cuda() if self.device_type == "cuda" and x.device.type == "cpu" else x

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks (in place where possible), [same shape]."""
        if self.size == 1:
            return x
        if torch.compiler.is_compiling():  # a graph node in the compiled step (CommStats not counted)
            return funcol.all_reduce(x, "sum", self.functional)
        home, x = x.device, self._on_device(x.contiguous())
        if self.shm is not None and self.shm.fits(x):
            return _collective(self.stats, "all_reduce", x, lambda: self.shm.all_reduce(x))
        return _collective(self.stats, "all_reduce", x, lambda: (self.pg.allreduce([x]).wait(), x)[1]).to(home)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x [..., n] along the last dim -> [..., N * n] (rank order)."""
        if self.size == 1:
            return x
        if torch.compiler.is_compiling():  # rank-major rows [N * R, n] -> [R, N * n] (rank order per row)
            g = funcol.all_gather_tensor(x.contiguous(), 0, self.functional)
            return g.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])
        home, x = x.device, self._on_device(x.contiguous())
        if self.shm is not None and self.shm.fits(x):
            return _collective(self.stats, "all_gather", x, lambda: self.shm.all_gather(x))
        parts = [torch.empty_like(x) for _ in range(self.size)]
        _collective(self.stats, "all_gather", x, lambda: self.pg.allgather([parts], [x]).wait())
        return torch.cat(parts, -1).to(home)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """x [N * n, ...] summed over the ranks; this rank's chunk [n, ...] (rank r: rows r*n..)."""
        if self.size == 1:
            return x
        if torch.compiler.is_compiling():  # a graph node in the compiled step
            return funcol.reduce_scatter_tensor(x.contiguous(), "sum", 0, self.functional)
        x = x.contiguous()
        if self.shm is not None and self.shm.fits(x):
            return _collective(self.stats, "reduce_scatter", x, lambda: self.shm.reduce_scatter(x))
        out = x.new_empty(x.shape[0] // self.size, *x.shape[1:])
        _collective(self.stats, "reduce_scatter", x, lambda: self.pg._reduce_scatter_base(out, x).wait())
        return out

    def row_counts(self, send: list[int]) -> list[int]:
        """Every rank's send[d] (rows for rank d), gathered: the [src * N + dst] matrix an
        all_to_all takes (one small all_gather, so every rank knows every offset)."""
        if self.size == 1:
            return list(send)
        return [int(c) for c in self.all_gather(torch.tensor(send, dtype=torch.float32))]

    def all_to_all(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [rows, ...] grouped by destination rank, as counts [src * N + dst] (row_counts) says.
        Returns the rows every rank sent this one [received, ...], in source order. The transport
        depends on counts alone (the same choice on every rank); the payload counted is what
        leaves this rank (its rows for the other ranks)."""
        if self.size == 1:
            return x
        x, n, me = x.contiguous(), self.size, self.rank
        row = x.element_size() * math.prod(x.shape[1:])  # bytes per row
        send = counts[me * n : (me + 1) * n]
        recv = [counts[r * n + me] for r in range(n)]
        away = (sum(send) - send[me]) * row
        if (
            self.shm is not None
            and max(sum(counts[r * n : (r + 1) * n]) for r in range(n)) * row <= self.shm.slot_bytes
        ):
            return _collective(self.stats, "all_to_all", away, lambda: self.shm.all_to_all(x, counts))
        out = x.new_empty(sum(recv), *x.shape[1:])
        _collective(
            self.stats,
            "all_to_all",
            away,
            lambda: self.pg.alltoall_base(out, x, recv, send, dist.AllToAllOptions()).wait(),
        )
        return out


NO_TP = TPGroup()


def process_group(store, rank: int, size: int, device_type: str, timeout_s: float):
    """A process group of `size` ranks on `store` (a rendezvous): ProcessGroupNCCL for tensors on
    the GPU (`device_type` "cuda": each rank on its current CUDA device), ProcessGroupGloo for the
    CPU. The device type picks it; every TP, EP and DP group of the engine is built here."""
    import datetime

    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def nccl_group(store, rank: int, size: int, expert_parallel: bool = False, timeout_s: float = 120.0) -> TPGroup:
    """A TPGroup over ProcessGroupNCCL on `store`, for tensors on the GPU: its eager collectives
    call NCCL, its compiled ones are functional collectives captured with the step
    (tests/distributed/test_nccl_group.py; the engine's ranks build theirs in
    distributed/worker.py make_group)."""
    pg = process_group(store, rank, size, "cuda", timeout_s)
    return TPGroup(rank, size, expert_parallel, pg, device_type="cuda")


def vocab_shard(vocab: int, tp: TPGroup) -> tuple[int, int]:
    """(first id, rows) of this rank's vocabulary shard: ceil(V / N) rows each, the last one
    padded with zero rows, so every rank's logits have the same width for all_gather."""
    rows = -(-vocab // tp.size)
    return tp.rank * rows, rows
