"""Pool of MLA latent-cache blocks with reference counts and content hashes (pure Python).

A block holds `block_size` tokens of latent KV for every MLA layer; its device rows live in
the runner's `CacheTensors.latent[l][block * block_size + offset]`. Ref counts let several
requests share a read-only block. With prefix caching, a full block is registered under the
chained hash of its prefix; when its last owner lets go it is not wiped but parked in an LRU
of cached-free blocks, reclaimed (and unregistered) only when fresh blocks run out.
Reference: vLLM `v1/core/block_pool.py` (free queue + ref_cnt + cached_block_hash_to_block).
"""

from __future__ import annotations

from collections import OrderedDict, deque


class CacheAccountingError(RuntimeError):
    """A double free or a free of something never allocated: a bookkeeping bug, never user error."""


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self.cached: dict[bytes, int] = {}  # block hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.num_evicted = 0
        # (hash, block) of the cached blocks allocate() reclaimed since the last drain, while the
        # prefix-cache tiers write back on eviction (None: not tracked)
        self.evicted: list[tuple[bytes, int]] | None = None

    @property
    def num_free(self) -> int:
        """Blocks allocate() can hand out: never-used plus cached-but-unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached_free(self) -> int:
        return len(self._evictable)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def allocate(self, n: int) -> list[int]:
        """n blocks with ref count 1; plain free ones first, then the least recently used cached."""
        if n > self.num_free:
            raise CacheAccountingError(f"asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                h = self._hash_of.pop(b)
                del self.cached[h]
                self.num_evicted += 1
                if self.evicted is not None:
                    self.evicted.append((h, b))
            self._ref[b] = 1
            out.append(b)
        return out

    def share(self, blocks: list[int]) -> None:
        """Another owner takes a reference (a cached-free block comes back into use)."""
        for b in blocks:
            if self._ref[b] == 0 and b not in self._evictable:
                raise CacheAccountingError(f"block {b} is free and cannot be shared")
            self._evictable.pop(b, None)
            self._ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; at zero a cached block parks in the LRU (newest
        last), an uncached one returns to the free list."""
        for b in blocks:
            if self._ref[b] < 1:
                raise CacheAccountingError(f"block {b} freed twice")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def register(self, block: int, block_hash: bytes) -> bool:
        """Publish a fully written, in-use block under its hash (first writer wins)."""
        if self._ref[block] < 1:
            raise CacheAccountingError(f"block {block} must be in use to be registered")
        if block_hash in self.cached or block in self._hash_of:
            return False
        self.cached[block_hash], self._hash_of[block] = block, block_hash
        return True

    def flush(self) -> int:
        """Forget every cached-free block (in-use blocks keep their hashes); how many."""
        n = len(self._evictable)
        while self._evictable:
            b, _ = self._evictable.popitem(last=False)
            del self.cached[self._hash_of.pop(b)]
            self._free.append(b)
        return n
