"""Shared-memory collectives for the tensor-parallel ranks of one host (kernels/cpu/comm/shm_comm.cpp).

Gloo over loopback TCP takes ~1.6 ms per small all-reduce on the 2-core dev VM, and a decode
step makes 13-24 of them; ranks on one machine meet in a shared segment instead (vLLM's CPU
backend does the same). The driver creates the segment as a file under /dev/shm before the
workers start and unlinks it once every rank has mapped it, so nothing outlives the engine.
A tensor larger than a slot, or a build without the kernels, takes the gloo group instead;
every rank makes the same choice, because the choice depends only on the tensor's size.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import torch

SLOT_BYTES = 4 * 2**20  # one rank's message per buffer: a 2048-token fp32 chunk of width 512
_LINE = 64


def segment_bytes(world: int, slot_bytes: int = SLOT_BYTES) -> int:
    return -(-world * _LINE // 4096) * 4096 + 2 * world * slot_bytes


def create_segment(world: int, slot_bytes: int = SLOT_BYTES) -> str:
    """A zeroed segment file for `world` ranks; its path (the driver unlinks it after start-up)."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    path = root / f"k3serve-tp-{uuid.uuid4().hex}"
    with open(path, "wb") as f:
        f.truncate(segment_bytes(world, slot_bytes))
    return str(path)


class ShmComm:
    """This rank's view of the segment; `seq` numbers its collectives (every rank in the same order)."""

    def __init__(self, path: str, rank: int, world: int, kernels, timeout_s: float, slot_bytes: int = SLOT_BYTES):
        self.rank, self.world, self.kernels, self.timeout_s = rank, world, kernels, timeout_s
        self.slot_bytes, self.seq = slot_bytes, 0
        self.seg = torch.from_file(path, shared=True, size=segment_bytes(world, slot_bytes), dtype=torch.uint8)
        kernels.shm_attach(self.seg, rank)

    def fits(self, x: torch.Tensor, sums: bool = True) -> bool:
        """Whether x goes through a slot; `sums`: a reduction, which takes fp32 / bf16 only."""
        return x.numel() * x.element_size() <= self.slot_bytes and (
            not sums or x.dtype in (torch.float32, torch.bfloat16)
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x [...] contiguous, summed over the ranks in place (rank order: the same bits everywhere)."""
        self.seq += 1
        return self.kernels.shm_all_reduce(
            x, self.seg, self.rank, self.world, self.seq, self.slot_bytes, self.timeout_s
        )

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] -> [..., world * n] in rank order."""
        self.seq += 1
        parts = self.kernels.shm_all_gather(
            x, self.seg, self.rank, self.world, self.seq, self.slot_bytes, self.timeout_s
        )  # [world, ..., n]
        return torch.cat(parts.unbind(0), -1)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """x [world * n, ...] -> chunk `rank` [n, ...] of the sum over the ranks (rank order)."""
        self.seq += 1
        return self.kernels.shm_reduce_scatter(
            x, self.seg, self.rank, self.world, self.seq, self.slot_bytes, self.timeout_s
        )

    def all_to_all(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [rows, ...] grouped by destination; counts [world * world] rows src -> dst (row-major):
        the rows every rank sends this one, in source order."""
        self.seq += 1
        return self.kernels.shm_all_to_all(
            x, self.seg, self.rank, self.world, self.seq, self.slot_bytes, self.timeout_s, counts
        )
