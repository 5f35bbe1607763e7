"""A pipeline stage's links (`--pipeline-parallel-size`, issue 62): point-to-point sends over a
process group of every rank (gloo on the CPU, NCCL on GPUs), rank g = stage * TP + t.

Each TP rank t of stage s sends its hidden state [N, d] (whole on every TP rank), with the
AttnRes block vectors banked so far, to TP rank t of stage s + 1; the last stage's TP rank 0
sends the step's results (logits, prompt logprob rows) and every stage's TP rank 0 the tap
layers' hidden states it captured to rank 0, the driver, which returns them to the engine.
Shapes are known on both sides from the step's inputs, so nothing but the tensors moves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from k3serve.config.stages import Stage, stage_layers


@dataclass
class StagePipe:
    stage: Stage
    stages: tuple[range, ...]  # every stage's layers (the driver receives what each captured)
    pg: Any  # the process group of all TP x PP ranks
    rank: int  # this rank's place in `pg`
    tp_size: int
    hidden: int  # d
    bank_size: int = 0  # AttnRes block vectors that arrive with the hidden state
    device: torch.device = torch.device("cpu")
    waited_s: float = 0.0  # seconds spent waiting for another stage (bench/pp_overlap.py)
    # the last send to the next stage, still in progress: (its work, the tensor it reads)
    _sending: tuple | None = field(default=None, repr=False)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    def _send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.pg.send([t.contiguous().to(self.device)], dst, tag).wait()

    def _recv(self, shape, dtype, src: int, tag: int = 0, into: torch.Tensor | None = None) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device) if into is None else into
        t0 = time.perf_counter()
        self.pg.recv([t], src, tag).wait()
        self.waited_s += time.perf_counter() - t0
        return t

    def send(self, h: torch.Tensor, bank: list[torch.Tensor]) -> None:
        """To the next stage: [bank + 1, N, d] (the block vectors, then h), without waiting for it
        to be received: the driver's stage then starts the next step while the next stage may
        still be sending it the last one's logits (a blocking send on both sides would wait on
        each other). The previous send is waited for first: the next stage took it when it
        began that step, so at most one is in progress."""
        self.send_stacked(torch.stack([*bank, h]).contiguous().to(self.device))

    def send_stacked(self, t: torch.Tensor) -> None:
        """`send` for a static step (runner/graph_step.py), whose stage returns [bank + 1, N, d]
        stacked already; N counts its bucket's padding rows, which the next stage's bucket has too."""
        self.flush()
        self._sending = (self.pg.send([t], self.rank + self.tp_size, 0), t)

    def receive_into(self, buf: torch.Tensor) -> None:
        """`receive` into a static step's input buffer [bank + 1, N, d] (the compiled step reads it)."""
        self._recv(None, None, self.rank - self.tp_size, into=buf)

    def flush(self) -> None:
        """Wait for the send to the next stage still in progress, if any."""
        if self._sending is not None:
            self._sending[0].wait()
            self._sending = None

    def receive(self, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """From the previous stage: h [N, d] and the bank of block vectors."""
        got = self._recv((self.bank_size + 1, n, self.hidden), dtype, self.rank - self.tp_size)
        return got[-1], list(got[:-1])

    @property
    def reports(self) -> bool:
        """This rank sends the driver what its stage computed (TP rank 0 of a stage after the first)."""
        return self.tp_rank == 0 and not self.stage.first

    def to_driver(self, tensors: list[torch.Tensor]) -> None:
        for i, t in enumerate(tensors):
            self._send(t, 0, tag=i + 1)

    def from_rank(self, src: int, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """The driver: tensors of these (shape, dtype) from rank `src`, in order."""
        return [self._recv(shape, dtype, src, tag=i + 1) for i, (shape, dtype) in enumerate(specs)]


def stage_pipe(cfg, pp: int, tp: int, rank: int, pg, device: torch.device | str = "cpu") -> StagePipe:
    """Rank `rank` (of pp x tp, stage-major) its stage and links: the split of config/stages.py."""
    stages = tuple(stage_layers(cfg, pp))
    s = rank // tp
    first = stages[s].start
    bank = sum(1 for b in cfg.attnres_block_starts if b < first) if cfg.use_attnres else 0
    return StagePipe(Stage(s, pp, stages[s]), stages, pg, rank, tp, cfg.hidden_size, bank, torch.device(device))
