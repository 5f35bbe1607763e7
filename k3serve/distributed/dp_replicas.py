"""The driver's side of DP-attention replicas whose models run in worker processes (issue 16):
each replica engine's executor (`DPWorkerExecutor`, over distributed/dp_workers.py's workers),
how the workers start for an EngineConfig, and which executor each replica's engine takes.
"""

from __future__ import annotations

import os

import torch

from k3serve.distributed.dp_workers import DPAttentionWorkers
from k3serve.executor.base import Allocation, Executor, ModelInfo
from k3serve.executor.placement import check_multi_rank
from k3serve.distributed.multinode import NodeLayout
from k3serve.distributed.worker_group import WorkerLaunch
from k3serve.parallel.group import TPGroup


class DPWorkerExecutor(Executor):
    """Replica r's ranks: its TP ranks' worker processes of the shared DP-attention group (one, or
    `tp_size`), reached over their pipes. The workers' liveness, faults and shutdown are the whole
    group's: any replica's executor reports and stops all of them."""

    def __init__(self, workers: DPAttentionWorkers, model_path: str, rank: int, info: ModelInfo, ep: TPGroup):
        """`ep`: the replica's rank and size in the expert group (no process group here: the
        workers' group spans DP x TP ranks)."""
        self.workers, self.model_path, self.rank, self._info, self.ep = workers, model_path, rank, info, ep
        self.ranks = list(workers.ranks_of(rank))  # the first is the replica's TP rank 0
        self.size = len(self.ranks)
        self._stats: dict = {}  # the workers' parallel_stats as of their last forward

    @property
    def info(self) -> ModelInfo:
        return self._info

    def allocate(self, alloc: Allocation) -> None:
        """The workers' caches for the plan, their backend and, for the graph backend, their
        static steps (they sample on the device, masking `alloc.masked_ids`)."""
        self.workers.send_replica(self.rank, "allocate", alloc)

    def execute(self, inputs, taps: tuple[int, ...] = ()):
        n = len(self.ranks)
        answers = self.workers.call_ranks(self.ranks, "dp_forward", [(inputs, taps)] + [(inputs, (), False)] * (n - 1))
        (result, self._stats), others = answers[0], answers[1:]
        if others:  # each TP rank counted the expert load of the rows it dispatched
            self._stats = merge_tp_stats(self._stats, [o[1] for o in others])
        return result

    def rollback(self, slots: list[int], accepted: list[int]) -> None:
        self.workers.send_replica(self.rank, "rollback", slots, accepted)

    def idle(self) -> None:
        self.workers.send_replica(self.rank, "idle")

    def read_state(self, slot: int) -> list[tuple[dict, dict]]:
        return self.workers.call_ranks(self.ranks, "read_state", [(slot,)] * self.size)

    def write_state(self, slot: int, shares: list[tuple[dict, dict]], non_blocking: bool = False) -> None:
        self.workers.send_ranks(self.ranks, "write_state", [(slot, *share) for share in shares])

    def read_rows(self, rows: torch.Tensor) -> dict[int, torch.Tensor]:
        (latent,) = self.workers.call_ranks(self.ranks[:1], "read_rows", [(rows,)])
        return latent

    def write_rows(self, rows: torch.Tensor, latent: dict[int, torch.Tensor], non_blocking: bool = False) -> None:
        latent = {i: t.cpu() for i, t in latent.items()}
        self.workers.send_ranks(self.ranks, "write_state", [(-1, {}, {}, rows, latent)] * self.size)

    def parallel_stats(self) -> dict:
        return self._stats

    def rank_weight_bytes(self) -> list[int]:
        return [self.workers.weight_bytes(r) for r in self.ranks]

    @property
    def alive(self) -> bool:
        return self.workers.alive

    @property
    def error(self) -> str | None:
        return self.workers.error

    @error.setter
    def error(self, why: str | None) -> None:
        self.workers.error = why

    def fail(self, why: str) -> None:
        self.workers.fail(why)

    def shutdown(self) -> None:
        self.workers.shutdown()  # every replica's: the first stops the group, the rest find it stopped


def merge_tp_stats(leader: dict, others: list[dict]) -> dict:
    """A DP rank's parallel_stats from its TP ranks': the leader's collectives, every rank's
    expert load summed (each counted the rows it dispatched)."""
    loads = [s["expert_tokens_per_rank"] for s in (leader, *others) if "expert_tokens_per_rank" in s]
    if not loads:
        return leader
    return {**leader, "expert_tokens_per_rank": tuple(sum(col) for col in zip(*loads))}


def start_dp_workers(config, m: int, model_path: str, where) -> list[DPWorkerExecutor]:
    """M DP-attention worker processes for `config` (an EngineConfig), loaded and ready; one
    executor per replica."""
    from k3serve.config.bundled import load_model_config

    check_multi_rank(where, "--data-parallel-size")
    n = config.tensor_parallel_size
    workers = DPAttentionWorkers(
        WorkerLaunch.from_config(config, where, model_path, ranks=m * n),
        m,
        all2all=config.all2all_backend,
        tp_size=n,
        nodes=NodeLayout(config.nnodes, config.node_rank, config.master_addr, config.master_port),
    )
    try:
        workers.wait_ready()
    except BaseException:
        workers.shutdown()
        raise
    cfg = load_model_config(model_path)
    return [
        DPWorkerExecutor(
            workers,
            model_path,
            r,
            ModelInfo(cfg, where.dtype, workers.weight_bytes(r * n)),
            TPGroup(
                r,
                m,
                True,
                size_flag="--data-parallel-size",
                all2all=config.all2all_backend,
                redundant_experts=config.redundant_experts,
            ),
        )
        for r in range(m)
    ]


def replica_executors(config, dp: int, dp_attention: bool, where) -> list[Executor | None]:
    """The executor of each of `dp` replicas: None (each engine starts its own) for plain
    replicas; under DP-attention + EP, a DPWorkerExecutor each (mp) or an in-process model with
    its expert group each (threads: the replicas step at once, each on its share of the cores)."""
    if not dp_attention:
        if dp > 1 and config.nnodes > 1:
            raise ValueError(
                "--data-parallel-size across --nnodes is built for DP-attention ranks "
                "(--enable-expert-parallel); plain replicas run on one node"
            )
        return [None] * dp
    from k3serve.distributed.start import model_source

    if config.data_parallel_backend == "mp":
        return list(start_dp_workers(config, dp, model_source(config), where))
    if config.tensor_parallel_size > 1 or config.nnodes > 1 or where.device.type != "cpu":
        raise ValueError(
            "--data-parallel-backend threads runs each DP-attention rank's whole model in this "
            "process: TP inside the DP ranks and several nodes need --data-parallel-backend mp (the "
            "default), as do GPUs (one process per GPU)"
        )
    from k3serve.executor import UniProcExecutor
    from k3serve.parallel.expert_group import expert_groups

    model_path, threads = model_source(config), max(1, (os.cpu_count() or 1) // dp)
    return [
        UniProcExecutor.load(
            model_path,
            where,
            load_format=config.load_format,
            quantization=config.quantization,
            progress=config.load_progress,
            ep=g,
            threads=threads,
        )
        for g in expert_groups(dp, config.distributed_timeout, config.all2all_backend, config.redundant_experts)
    ]
