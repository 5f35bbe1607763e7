"""Pool of MLA latent-cache blocks with reference counts (pure Python).

A block holds `block_size` tokens of latent KV for every MLA layer; its device rows live in
the runner's `CacheTensors.latent[l][block * block_size + offset]`. Ref counts let several
requests share a read-only block (prefix caching); a block returns to the free list when its
count reaches zero. Reference: vLLM `v1/core/block_pool.py` (free queue + ref_cnt).
"""

from __future__ import annotations

from collections import deque


class CacheAccountingError(RuntimeError):
    """A double free or a free of something never allocated: a bookkeeping bug, never user error."""


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with ref count 1; all or nothing."""
        if n > len(self._free):
            raise CacheAccountingError(f"asked for {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        return out

    def share(self, blocks: list[int]) -> None:
        """Another owner takes a reference to blocks that are already in use."""
        for b in blocks:
            if self._ref[b] < 1:
                raise CacheAccountingError(f"block {b} is free and cannot be shared")
            self._ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero become free."""
        for b in blocks:
            if self._ref[b] < 1:
                raise CacheAccountingError(f"block {b} freed twice")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)
