"""Decode context parallelism's cache layout (issue 62 item 2; vLLM's
--decode-context-parallel-size and --cp-kv-cache-interleave-size).

K3's MLA caches one latent "head" per token, so under TP every rank would hold the whole latent
cache. With DCP over the N ranks of the TP group, position p of a sequence lives on rank
(p // I) % N only (I: the interleave), so each rank holds 1/N of the rows. The scheduler's
blocks stay as they are: logical block b (block_size tokens, the block tables and prefix
hashes of cache/) is, on each rank, the `block_size / N` local rows b * block_size / N .., its
tokens in position order. A global row g = b * block_size + o (o the offset in the block) is

    chunk c = o // I,   owner (c % N),   local row b * (block_size / N) + (c // N) * I + o % I

which needs block_size % (N * I) == 0 (checked in config). Readers of whole blocks (the prefix
tiers, P/D hand-offs: executor read_rows / write_rows) gather every rank's rows and split
them again on write, so an entry written under one DCP size is read under any other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DCPLayout:
    size: int = 1  # N ranks sharing one latent cache by token
    interleave: int = 1  # I consecutive tokens on one rank before the next
    block_size: int = 16  # the scheduler's tokens per block

    @property
    def local_block(self) -> int:
        """Rows of one logical block on each rank."""
        return self.block_size // self.size

    def owner(self, positions: torch.Tensor) -> torch.Tensor:
        """The rank holding each position (or global row: the same since N * I divides block_size)."""
        return (positions // self.interleave) % self.size

    def local(self, rows: torch.Tensor) -> torch.Tensor:
        """Each global row's row on its owner, [R] long."""
        N, I, bs = self.size, self.interleave, self.block_size
        block, offset = rows // bs, rows % bs
        chunk = offset // I
        return block * (bs // N) + (chunk // N) * I + offset % I

    def split(self, rows: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask [R] of the global rows `rank` holds, their local rows [R'])."""
        mine = self.owner(rows) == rank
        return mine, self.local(rows[mine])

    def sequence_rows(self, table: list[int], length: int, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's positions 0..length-1 that `rank` holds: (positions [L'], local rows [L'])."""
        pos = torch.arange(length, device=device)
        pos = pos[self.owner(pos) == rank]
        blocks = torch.tensor(table, dtype=torch.long, device=device)
        return pos, self.local(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)


def layout_of(group, block_size: int) -> DCPLayout | None:
    """The DCP layout of a TPGroup (parallel/group.py), None without DCP."""
    if group.dcp <= 1:
        return None
    return DCPLayout(group.dcp, group.dcp_interleave, block_size)


def shard_of(tp_rank: int, dcp: int) -> int:
    """The token shard TP rank `tp_rank` holds: its place in its group of `dcp` consecutive ranks."""
    return tp_rank % dcp
