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

import time
from dataclasses import dataclass, field
from typing import Any

import torch


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


def _collective(stats: CommStats, kind: str, x: torch.Tensor, op):
    """op() over the shared segment or the process group, timed into `stats`; a failure (a peer
    gone, a timeout) becomes CollectiveError."""
    began = time.perf_counter()
    try:
        out = op()
    except RuntimeError as e:
        raise CollectiveError(f"tensor-parallel {kind} failed: {str(e).splitlines()[0] if str(e) else e}") from e
    stats.add(kind, x.numel() * x.element_size(), time.perf_counter() - began)
    return out


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # routed experts split by expert id instead of by channel
    pg: Any = None  # the torch.distributed process group object (None for size 1)
    shm: Any = None  # distributed/shm.py ShmComm: ranks on one host meet in shared memory (else gloo)
    stats: CommStats = field(default_factory=CommStats, compare=False)
    size_flag: str = "--tensor-parallel-size"  # what sets `size` (DP-attention's expert group: the DP size)

    def split(self, n: int, what: str) -> int:
        """This rank's share of a dimension of size n; an error naming it when N does not divide it."""
        if n % self.size:
            raise ValueError(f"{what} = {n} is not divisible by {self.size_flag} {self.size}")
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks (in place where possible), [same shape]."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.shm is not None and self.shm.fits(x):
            return _collective(self.stats, "all_reduce", x, lambda: self.shm.all_reduce(x))
        return _collective(self.stats, "all_reduce", x, lambda: (self.pg.allreduce([x]).wait(), x)[1])

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x [..., n] along the last dim -> [..., N * n] (rank order)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.shm is not None and self.shm.fits(x):
            return _collective(self.stats, "all_gather", x, lambda: self.shm.all_gather(x))
        parts = [torch.empty_like(x) for _ in range(self.size)]
        _collective(self.stats, "all_gather", x, lambda: self.pg.allgather([parts], [x]).wait())
        return torch.cat(parts, -1)


NO_TP = TPGroup()


def vocab_shard(vocab: int, tp: TPGroup) -> tuple[int, int]:
    """(first id, rows) of this rank's vocabulary shard: ceil(V / N) rows each, the last one
    padded with zero rows, so every rank's logits have the same width for all_gather."""
    rows = -(-vocab // tp.size)
    return tp.rank * rows, rows
