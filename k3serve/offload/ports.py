"""Where the prefix-cache tiers read and write a replica's device cache (offload/store.py):
through its executor (executor/base.py), whatever holds the ranks. The latent is whole on every
rank (a block is read from rank 0 and written to every rank); each rank holds its heads of a KDA
state. A DP-attention replica's reads and writes go over its workers' pipes between its steps
(each replica's engine thread calls here, in order with its own forwards, so no command lands
inside a collective).

Entries are dicts of tensors named as on disk: a block `latent.{l}` [block_size, c + r] per MLA
layer; a state `recurrent.{l}` [H/n, D, D] and `conv.{l}` [K-1, 3P/n] per KDA layer for rank 0,
`recurrent.{l}.r{r}` / `conv.{l}.r{r}` for rank r >= 1. Reads may be device tensors or views of
the device rows (the store copies them to host memory at once).
"""

from __future__ import annotations

import torch


def _rows(blocks: list[int], bs: int) -> torch.Tensor:
    return torch.cat([torch.arange(b * bs, (b + 1) * bs) for b in blocks])


def _tag(rank: int) -> str:
    return f".r{rank}" if rank else ""


def _state_entry(kda: list[int], shards) -> dict[str, torch.Tensor]:
    """One state entry from each rank's (recurrent {l: [H/n, D, D]}, conv {l: ...}), rank order."""
    entry = {}
    for r, (rec, conv) in enumerate(shards):
        entry.update({f"recurrent.{l}{_tag(r)}": rec[l] for l in kda})
        entry.update({f"conv.{l}{_tag(r)}": conv[l] for l in kda})
    return entry


def _state_shard(kda: list[int], entry: dict, rank: int) -> tuple[dict, dict]:
    """Rank `rank`'s (recurrent, conv) of a state entry."""
    return {l: entry[f"recurrent.{l}{_tag(rank)}"] for l in kda}, {l: entry[f"conv.{l}{_tag(rank)}"] for l in kda}


class ExecutorPort:
    def __init__(self, executor, block_size: int, mla: list[int], kda: list[int]):
        self.executor, self.bs, self.mla, self.kda = executor, block_size, mla, kda

    def read_blocks(self, blocks: list[int]) -> list[dict[str, torch.Tensor]]:
        if not blocks:
            return []
        latent, bs = self.executor.read_rows(_rows(blocks, self.bs)), self.bs
        return [{f"latent.{l}": latent[l][i * bs : (i + 1) * bs] for l in self.mla} for i in range(len(blocks))]

    def read_state(self, slot: int) -> dict[str, torch.Tensor]:
        return _state_entry(self.kda, self.executor.read_state(slot))

    def write_blocks(self, blocks: list[int], entries: list[dict], non_blocking: bool) -> None:
        if not blocks:
            return
        latent = {l: _cat([e[f"latent.{l}"] for e in entries], non_blocking) for l in self.mla}
        self.executor.write_rows(_rows(blocks, self.bs), latent, non_blocking)

    def write_state(self, slot: int, entry: dict, non_blocking: bool) -> None:
        shares = [_state_shard(self.kda, entry, r) for r in range(self.executor.size)]
        self.executor.write_state(slot, shares, non_blocking)


def _cat(parts: list[torch.Tensor], pinned: bool) -> torch.Tensor:
    """Host entries in one tensor, in pinned memory when the copy to the device is asynchronous."""
    if not pinned:
        return torch.cat(parts)
    out = torch.empty(sum(p.shape[0] for p in parts), *parts[0].shape[1:], dtype=parts[0].dtype, pin_memory=True)
    return torch.cat(parts, out=out)
