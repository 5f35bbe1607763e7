"""The model in this process: one rank's RankRunner behind the executor interface.

Alone it is the single-process engine; a tensor-parallel executor keeps one as its rank 0 (the
driver's share of the heads, distributed/executor.py); a DP-attention replica stepped on an
engine thread (`--data-parallel-backend threads`) is one with its expert group (`ep`).
Reference: vLLM v1 `executor/uniproc_executor.py`.
"""

from __future__ import annotations

import torch

from k3serve.executor.base import Allocation, Executor, ModelInfo
from k3serve.parallel.group import NO_TP, TPGroup
from k3serve.runner.rank_step import RankRunner, weight_bytes


class UniProcExecutor(Executor):
    def __init__(self, model, device: torch.device, threads: int | None = None, model_path: str = ""):
        """`model`: loaded and on `device` (models/registry.py load_model). `threads`: torch
        threads of the thread that steps it (OpenMP's count is per thread), or None to leave it:
        DP-attention replicas take cpu_count / M each, since their forwards run at once and an
        idle OpenMP thread spinning on a core a peer needs stalls every collective (2 cores, tiny
        K3 DP2+EP2, 8 streams: 361 tok/s at 2 threads each, 590 at 1)."""
        self._model, self.device, self.threads, self.model_path = model, device, threads, model_path
        self.ep = model.ep
        self._info = ModelInfo(model.cfg, model.dtype, weight_bytes(model))
        self.rank_runner: RankRunner | None = None  # after allocate

    @classmethod
    def load(
        cls,
        model_path: str,
        where,
        *,
        load_format: str = "auto",
        quantization: str | None = None,
        progress: bool = True,
        tp: TPGroup = NO_TP,
        ep: TPGroup | None = None,
        threads: int | None = None,
        pipe=None,
    ) -> "UniProcExecutor":
        """Load the checkpoint's share for (`tp`, `ep`, pipeline stage `pipe`) onto `where.device`
        (executor/placement.py Placement); `quantization`: routed experts quantized at load."""
        from k3serve.models.registry import load_model

        model = load_model(
            model_path,
            dtype=where.dtype,
            load_format=load_format,
            quantization=quantization,
            progress=progress,
            tp=tp,
            ep=ep,
            pipe=pipe,
        )
        return cls(model.to(where.device), where.device, threads, str(model_path))

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def model(self):
        return self._model

    @property
    def cache(self):
        return self.rank_runner.cache if self.rank_runner is not None else None

    @property
    def graphs(self):
        """The graph backend's static steps (runner/graph_step.py GraphSteps), or None."""
        return self.rank_runner.graphs if self.rank_runner is not None else None

    def use_kernels(self, mode: str):
        self.kernels = self._model.use_kernels(mode)
        return self.kernels

    def allocate(self, alloc: Allocation) -> None:
        self.rank_runner = RankRunner.allocate(self._model, alloc, self.device)

    def _threads(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)

    def execute(self, inputs, taps: tuple[int, ...] = ()):
        self._threads()
        return self.rank_runner.forward(inputs, taps)

    def launch(self, inputs, taps: tuple[int, ...] = ()):
        """The driver's first pipeline stage runs now; the later stages' answers are received
        by `collect` (RankRunner.forward `defer`)."""
        self._threads()
        return self.rank_runner.forward(inputs, taps, defer=True)

    def collect(self, handle):
        return handle() if callable(handle) else handle

    def rollback(self, slots: list[int], accepted: list[int]) -> None:
        self.rank_runner.rollback(slots, accepted)

    def idle(self) -> None:
        self._threads()
        self.rank_runner.idle()

    def read_state(self, slot: int) -> list[tuple[dict, dict]]:
        c = self.rank_runner.cache
        kda = [i for i, t in enumerate(c.recurrent) if t is not None]
        return [({i: c.recurrent[i][slot] for i in kda}, {i: c.conv[i][slot] for i in kda})]

    def write_state(self, slot: int, shares: list[tuple[dict, dict]], non_blocking: bool = False) -> None:
        ((rec, conv),) = shares
        self.rank_runner.write_state(slot, rec, conv, non_blocking=non_blocking)

    def read_rows(self, rows: torch.Tensor) -> dict[int, torch.Tensor]:
        return self.rank_runner.latent_rows(rows)  # on the device: the tiers copy them once

    def write_rows(self, rows: torch.Tensor, latent: dict[int, torch.Tensor], non_blocking: bool = False) -> None:
        self.rank_runner.write_state(-1, {}, {}, rows, latent, non_blocking)

    def parallel_stats(self) -> dict:
        return self.rank_runner.parallel_stats() if self.rank_runner is not None else {}
