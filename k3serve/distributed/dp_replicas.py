"""The driver's side of DP-attention replicas whose models run in worker processes (issue 16):
what each replica engine holds in place of a model and a RankRunner (`RemoteModel`,
`RemoteRank`, over distributed/dp_workers.py's workers), how the workers start for an
EngineConfig, and which extra arguments each replica's LLMEngine takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3serve.config.model_config import ModelConfig
from k3serve.distributed.dp_workers import DPAttentionWorkers
from k3serve.parallel.group import TPGroup
from k3serve.distributed.multinode import NodeLayout


@dataclass
class RemoteModel:
    """What a replica's engine in the driver knows of the model its worker holds: the config,
    the dtype and the worker's weight bytes (one meta tensor of that many bytes, so the sizing
    code that sums parameters and buffers counts them)."""

    cfg: ModelConfig
    dtype: torch.dtype
    nbytes: int
    ep: TPGroup  # the DP rank and size (no process group here; the workers' expert group spans DP x TP)

    def parameters(self):
        return iter(())

    def buffers(self):
        return iter((torch.empty(self.nbytes, dtype=torch.uint8, device="meta"),))

    def use_kernels(self, kernels: str):
        return None  # the worker chose its kernels when it loaded


class RemoteRank:
    """Replica r's RankRunner in the driver (runner/rank_step.py's interface), over the pipes of
    its workers (one, or its TP ranks); also the replica engine's `executor` (liveness, faults,
    shutdown of the whole group)."""

    def __init__(self, workers: DPAttentionWorkers, rank: int, model: RemoteModel):
        self.workers, self.rank, self.model = workers, rank, model
        self._stats: dict = {}  # the workers' parallel_stats as of their last forward

    def allocate(
        self, plan, kv_dtype: str, calculate_kv_scales: bool = False, mode=None, graph=None, masked_ids=()
    ) -> None:
        """The worker's cache for `plan`, its backend `mode` and, for the graph backend, its
        static steps (`graph`: GraphSettings; `masked_ids`: never sampled: it samples on the device)."""
        self.workers.send_replica(
            self.rank, "allocate", plan, kv_dtype, mode, graph, calculate_kv_scales, list(masked_ids)
        )

    def forward(self, inputs, taps: tuple[int, ...] = ()):
        ranks = list(self.workers.ranks_of(self.rank))
        answers = self.workers.call_ranks(
            ranks, "dp_forward", [(inputs, taps)] + [(inputs, (), False)] * (len(ranks) - 1)
        )
        (result, self._stats), others = answers[0], answers[1:]
        if others:  # each TP rank counted the expert load of the rows it dispatched
            self._stats = merge_tp_stats(self._stats, [o[1] for o in others])
        return result

    def rollback(self, slots: list[int], accepted: list[int]) -> None:
        self.workers.send_replica(self.rank, "rollback", slots, accepted)

    def idle(self) -> None:
        self.workers.send_replica(self.rank, "idle")

    def parallel_stats(self) -> dict:
        return self._stats

    @property
    def alive(self) -> bool:
        return self.workers.alive

    @property
    def error(self) -> str | None:
        return self.workers.error

    @property
    def local(self) -> bool:
        return False

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


def start_dp_workers(config, m: int) -> list[RemoteRank]:
    """M DP-attention worker processes for `config` (an EngineConfig), loaded and ready; one
    RemoteRank per replica."""
    from k3serve.config.bundled import load_model_config
    from k3serve.demo import default_model
    from k3serve.engine.setup import placement

    where, model_path = placement(config), str(config.model or default_model())
    if where.device.type != "cpu":
        raise ValueError(
            f"DP-attention worker processes on {where.device}: the NCCL group is not built yet; the gloo (CPU) one is"
        )
    n = config.tensor_parallel_size
    workers = DPAttentionWorkers(
        model_path,
        m,
        all2all=config.all2all_backend,
        dtype=where.dtype,
        load_format=config.load_format,
        kernels=config.kernels,
        device=where.device,
        timeout_s=config.distributed_timeout,
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
        RemoteRank(
            workers,
            r,
            RemoteModel(
                cfg,
                where.dtype,
                workers.weight_bytes(r * n),
                TPGroup(r, m, True, size_flag="--data-parallel-size", all2all=config.all2all_backend),
            ),
        )
        for r in range(m)
    ]


def replica_kwargs(config, dp: int, dp_attention: bool) -> list[dict]:
    """LLMEngine's extra arguments for each of `dp` replicas: nothing for plain replicas; under
    DP-attention + EP, a RemoteRank each (mp) or an in-process expert group each (threads)."""
    if not dp_attention:
        if dp > 1 and config.nnodes > 1:
            raise ValueError(
                "--data-parallel-size across --nnodes is built for DP-attention ranks "
                "(--enable-expert-parallel); plain replicas run on one node"
            )
        return [{}] * dp
    if config.data_parallel_backend == "mp":
        return [{"remote": r} for r in start_dp_workers(config, dp)]
    if config.tensor_parallel_size > 1 or config.nnodes > 1:
        raise ValueError(
            "--data-parallel-backend threads runs each DP-attention rank's whole model in this "
            "process: TP inside the DP ranks and several nodes need --data-parallel-backend mp (the default)"
        )
    from k3serve.parallel.expert_group import expert_groups

    return [{"ep": g} for g in expert_groups(dp, config.distributed_timeout, config.all2all_backend)]
