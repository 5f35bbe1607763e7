"""Where the prefix-cache tiers read and write a replica's device cache (offload/store.py).

`LocalPort`: this process's cache tensors, and under tensor parallelism the other ranks' KDA
heads over their pipes (the latent is whole on every rank: a block is read from rank 0 and
written to every rank). `RemotePort`: a DP-attention replica whose model and cache live in
worker processes (distributed/dp_replicas.py RemoteRank): every read and write goes over the
replica's pipes, between its steps (each replica's engine thread calls here, in order with its
own forwards, so no command lands inside a collective).

Entries are dicts of tensors named as on disk: a block `latent.{l}` [block_size, c + r] per MLA
layer; a state `recurrent.{l}` [H/n, D, D] and `conv.{l}` [K-1, 3P/n] per KDA layer for rank 0,
`recurrent.{l}.r{r}` / `conv.{l}.r{r}` for rank r >= 1. A LocalPort's reads are views of the
device rows (the store copies them to host memory); a RemotePort's are CPU tensors already.
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


class LocalPort:
    def __init__(self, cache, workers, block_size: int, mla: list[int], kda: list[int]):
        self.cache, self.workers, self.bs, self.mla, self.kda = cache, workers, block_size, mla, kda

    def read_blocks(self, blocks: list[int]) -> list[dict[str, torch.Tensor]]:
        c, bs = self.cache, self.bs
        return [{f"latent.{l}": c.latent[l][b * bs : (b + 1) * bs] for l in self.mla} for b in blocks]

    def read_state(self, slot: int) -> dict[str, torch.Tensor]:
        c = self.cache
        mine = ({l: c.recurrent[l][slot] for l in self.kda}, {l: c.conv[l][slot] for l in self.kda})
        others = self.workers.call("read_state", slot) if self.workers is not None else []  # their heads
        return _state_entry(self.kda, [mine, *others])

    def write_blocks(self, blocks: list[int], entries: list[dict], non_blocking: bool) -> None:
        c, bs = self.cache, self.bs
        for b, entry in zip(blocks, entries):
            for l in self.mla:
                c.latent[l][b * bs : (b + 1) * bs].copy_(entry[f"latent.{l}"], non_blocking=non_blocking)
        if self.workers is not None and blocks:  # the latent is whole on every rank
            latent = {l: torch.cat([e[f"latent.{l}"] for e in entries]) for l in self.mla}
            self.workers.send("write_state", -1, {}, {}, _rows(blocks, bs), latent)

    def write_state(self, slot: int, entry: dict, non_blocking: bool) -> None:
        c = self.cache
        rec, conv = _state_shard(self.kda, entry, 0)
        for l in self.kda:
            c.recurrent[l][slot].copy_(rec[l], non_blocking=non_blocking)
            c.conv[l][slot].copy_(conv[l], non_blocking=non_blocking)
        if self.workers is not None:  # each rank its own heads
            self.workers.send_each(
                "write_state", [(slot, *_state_shard(self.kda, entry, r)) for r in range(1, self.workers.size)]
            )


class RemotePort:
    """A DP-attention replica's cache in its worker processes: rank 0 of the replica answers
    block reads (every rank holds the latent whole), each of its ranks its heads of a state."""

    def __init__(self, remote, block_size: int, mla: list[int], kda: list[int]):
        self.workers, self.bs, self.mla, self.kda = remote.workers, block_size, mla, kda
        self.ranks = list(remote.workers.ranks_of(remote.rank))

    def read_blocks(self, blocks: list[int]) -> list[dict[str, torch.Tensor]]:
        if not blocks:
            return []
        (latent,) = self.workers.call_ranks(self.ranks[:1], "read_rows", [(_rows(blocks, self.bs),)])
        bs = self.bs
        return [{f"latent.{l}": latent[l][i * bs : (i + 1) * bs] for l in self.mla} for i in range(len(blocks))]

    def read_state(self, slot: int) -> dict[str, torch.Tensor]:
        return _state_entry(self.kda, self.workers.call_ranks(self.ranks, "read_state", [(slot,)] * len(self.ranks)))

    def write_blocks(self, blocks: list[int], entries: list[dict], non_blocking: bool) -> None:
        if not blocks:
            return
        latent = {l: torch.cat([e[f"latent.{l}"] for e in entries]) for l in self.mla}
        self.workers.send_ranks(
            self.ranks, "write_state", [(-1, {}, {}, _rows(blocks, self.bs), latent)] * len(self.ranks)
        )

    def write_state(self, slot: int, entry: dict, non_blocking: bool) -> None:
        per_rank = [(slot, *_state_shard(self.kda, entry, r)) for r in range(len(self.ranks))]
        self.workers.send_ranks(self.ranks, "write_state", per_rank)
