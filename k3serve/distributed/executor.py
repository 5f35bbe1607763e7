"""The `mp` executor: tensor-parallel ranks 1..N-1 as local worker processes, rank 0 in the driver.

The scheduler, sampler and detokenizer stay single, pure Python, on the driver. Each step's
prepared batch (StepInputs) reaches every worker once, over its pipe; all ranks then run the
same forward (rank 0 in this process, a UniProcExecutor), whose all-reduces / all-gathers go
over one ProcessGroupGloo (CPU; the same calls take NCCL on CUDA). Only the driver's logits are
sampled.

The worker processes themselves (start, rendezvous, commands, faults, shutdown) are a
WorkerGroup (distributed/worker_group.py). Reference: vLLM v1 `executor/multiproc_executor.py`.
"""

from __future__ import annotations

import torch

from k3serve.distributed.multinode import NodeLayout
from k3serve.distributed.worker_group import WorkerGroup, WorkerLaunch
from k3serve.executor.base import Allocation, Executor, ModelInfo
from k3serve.executor.uniproc import UniProcExecutor
from k3serve.parallel.group import TPGroup


def check_layout(model_path: str, tp: TPGroup, quantization: str | None = None) -> None:
    """Refuse a layout the model cannot split before any worker starts: build rank 0's model on
    the meta device (no memory) and check the MXFP4 expert split, naming the dimension (the
    experts' format after `quantization` at load)."""
    from k3serve.config.bundled import load_model_config
    from k3serve.parallel.shard import check_expert_split
    from k3serve.models.registry import build_model, quantized_config

    cfg = quantized_config(load_model_config(model_path), quantization, tp)
    with torch.device("meta"):
        build_model(cfg, tp=tp)
    check_expert_split(cfg, tp)


class MultiprocExecutor(WorkerGroup, Executor):
    """Tensor-parallel ranks: rank 0 a UniProcExecutor in this process, ranks 1..N-1 workers that
    run every command rank 0 runs, in the same order (their collectives pair with its)."""

    def __init__(
        self, launch: WorkerLaunch, tp_size: int, *, where, progress: bool = True, nodes: NodeLayout = NodeLayout()
    ):
        """`tp_size` ranks per pipeline stage, `launch.pp_size` stages (rank 0, the driver's, on
        stage 0); `where`: the driver's placement."""
        super().__init__(launch, tp_size * launch.pp_size, nodes)
        self.model_path = launch.model_path
        try:
            groups = self.join_group()
            self.rank0 = UniProcExecutor.load(
                launch.model_path,
                where,
                load_format=launch.load_format,
                quantization=launch.quantization,
                progress=progress,
                **groups,
            )
            self.wait_ready()
        except BaseException:  # no worker outlives an executor that failed to start
            self.shutdown()
            raise

    @property
    def info(self) -> ModelInfo:
        return self.rank0.info

    @property
    def model(self):
        return self.rank0.model

    @property
    def cache(self):
        return self.rank0.cache

    @property
    def graphs(self):
        return self.rank0.graphs

    def use_kernels(self, mode: str):
        self.kernels = self.rank0.use_kernels(mode)
        return self.kernels

    def allocate(self, alloc: Allocation) -> None:
        """Every rank allocates its share of the same plan and runs the same backend."""
        self.send("allocate", alloc)
        self.rank0.allocate(alloc)

    def execute(self, inputs, taps: tuple[int, ...] = ()):
        self.send("forward", inputs, taps)  # a later pipeline stage captures the tap layers it holds
        return self.rank0.execute(inputs, taps)

    def launch(self, inputs, taps: tuple[int, ...] = ()):
        """Pipeline stages: every worker gets the step (each runs its steps in the order sent),
        rank 0 runs stage 0 and hands its rows on; `collect` receives what the later stages send."""
        self.send("forward", inputs, taps)
        return self.rank0.launch(inputs, taps)

    def collect(self, handle):
        return self.rank0.collect(handle)

    @property
    def pipelined(self) -> bool:
        return self.pp > 1

    def rollback(self, slots: list[int], accepted: list[int]) -> None:
        self.send("rollback", slots, accepted)
        self.rank0.rollback(slots, accepted)

    def idle(self) -> None:
        self.send("idle")
        self.rank0.idle()

    def read_state(self, slot: int) -> list[tuple[dict, dict]]:
        """Each TP rank's heads, rank 0's first (over the pipes); with pipeline stages each TP
        rank's share joins the layers of every stage (rank g = stage x TP + t)."""
        every = self.rank0.read_state(slot) + self.call("read_state", slot)
        shares = [({}, {}) for _ in range(self.size)]
        for g, (rec, conv) in enumerate(every):
            shares[g % self.size][0].update(rec)
            shares[g % self.size][1].update(conv)
        return shares

    def write_state(self, slot: int, shares: list[tuple[dict, dict]], non_blocking: bool = False) -> None:
        """TP rank t's share to every stage's rank t (each writes the layers it holds)."""
        self.send_each("write_state", [(slot, *shares[g % self.size]) for g in range(1, self.world)])
        self.rank0.write_state(slot, shares[:1], non_blocking)

    def read_rows(self, rows: torch.Tensor) -> dict[int, torch.Tensor]:
        """Every MLA layer's rows: rank 0's, and with pipeline stages the other stages' too;
        under decode context parallelism each rank's part of them, interleaved."""
        if self.dcp[0] > 1:
            return self._gather_rows(rows)
        if self.pp == 1:
            return self.rank0.read_rows(rows)
        out = self.rank0.read_rows(rows)
        for part in self.call("read_rows", rows):
            out.update({i: t.to(rows.device) for i, t in part.items()})
        return out

    def _gather_rows(self, rows: torch.Tensor) -> dict[int, torch.Tensor]:
        """DCP: TP rank t of each stage holds the rows of its stage's layers that parallel/dcp.py
        gives its shard, and sends those, in order (rank g = stage x TP + t; with DCP below TP
        several ranks hold a shard, and send the same rows)."""
        from k3serve.parallel.dcp import DCPLayout, shard_of

        parts = [self.rank0.read_rows(rows)] + self.call("read_rows", rows)
        owner = DCPLayout(*self.dcp).owner(rows.cpu())
        out: dict[int, torch.Tensor] = {}
        for g, part in enumerate(parts):
            for i, rows_held in part.items():
                if i not in out:
                    out[i] = torch.empty(len(rows), *rows_held.shape[1:], dtype=rows_held.dtype)
                out[i][owner == shard_of(g % self.size, self.dcp[0])] = rows_held.cpu()
        return {i: t.to(rows.device) for i, t in out.items()}

    def write_rows(self, rows: torch.Tensor, latent: dict[int, torch.Tensor], non_blocking: bool = False) -> None:
        self.send("write_state", -1, {}, {}, rows, {i: t.cpu() for i, t in latent.items()})
        self.rank0.write_rows(rows, latent, non_blocking)

    def parallel_stats(self) -> dict:
        return self.rank0.parallel_stats()

    def pipe_stats(self) -> list[tuple[int, float]]:
        """Every local rank's (pipeline stage, seconds waited for another stage), rank order."""
        return [self.rank0.rank_runner.pipe_stats()] + self.call("pipe_stats")

    def rank_weight_bytes(self) -> list[int]:
        """Rank 0's and each worker of this host's (ranks on other nodes report none here)."""
        local = [] if self.nodes.multi else self.nodes.ranks(self.world)[1:]
        return [self.rank0.info.weight_bytes] + [self.weight_bytes(r) for r in local]

    @property
    def transfers(self) -> bool:
        return self.local
