"""HybridCacheManager: one facade over the two cache kinds a K3 request holds (pure Python).

  MLA layers -> paged latent blocks (grow with the sequence)   [BlockPool]
  KDA layers -> one fixed-size state slot per request           [StatePool]

The two pools are sized apart (see `sizing.plan_cache`), unlike vLLM's single page size that
inflates K3 attention blocks to 1,536 tokens (serving-notes.md §2.1). Answers are plain ints
and lists; the device tensors live in the runner and are never seen here.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.cache.block_pool import BlockPool, CacheAccountingError
from k3serve.cache.state_pool import StatePool


@dataclass(frozen=True)
class CacheAllocation:
    state_slot: int
    blocks: list[int]


@dataclass(frozen=True)
class CacheUsage:
    """Bytes one request holds: its state slot, latent rows in use, latent blocks reserved."""

    state_bytes: int
    latent_bytes_used: int
    latent_bytes_reserved: int


class HybridCacheManager:
    def __init__(self, num_blocks: int, num_slots: int, block_size: int,
                 slot_bytes: int = 0, token_bytes: int = 0):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.blocks = BlockPool(num_blocks)
        self.slots = StatePool(num_slots)
        self.slot_bytes, self.token_bytes = slot_bytes, token_bytes
        self._tables: dict[str, list[int]] = {}
        self._slot_of: dict[str, int] = {}

    # ---- queries ---------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_admit(self, num_tokens: int) -> bool:
        """A new request needing `num_tokens` latent rows fits: one slot and enough blocks."""
        return self.slots.num_free > 0 and self.blocks_for(num_tokens) <= self.blocks.num_free

    def can_append(self, req_id: str, num_tokens: int) -> bool:
        return self._missing(req_id, num_tokens) <= self.blocks.num_free

    def holds(self, req_id: str) -> bool:
        return req_id in self._slot_of

    def block_table(self, req_id: str) -> list[int]:
        return list(self._tables[req_id])

    def state_slot(self, req_id: str) -> int:
        return self._slot_of[req_id]

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free

    @property
    def num_requests(self) -> int:
        return len(self._slot_of)

    def usage(self, req_id: str, num_tokens: int) -> CacheUsage:
        return CacheUsage(self.slot_bytes, num_tokens * self.token_bytes,
                          len(self._tables[req_id]) * self.block_size * self.token_bytes)

    # ---- changes ---------------------------------------------------------------------
    def allocate(self, req_id: str, num_tokens: int) -> CacheAllocation:
        if req_id in self._slot_of:
            raise CacheAccountingError(f"request {req_id!r} already holds cache")
        if not self.can_admit(num_tokens):
            raise CacheAccountingError(f"request {req_id!r} does not fit ({num_tokens} tokens)")
        slot = self.slots.allocate()
        blocks = self.blocks.allocate(self.blocks_for(num_tokens))
        self._slot_of[req_id], self._tables[req_id] = slot, blocks
        return CacheAllocation(slot, list(blocks))

    def append(self, req_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to cover `num_tokens` rows; the new blocks, or None if they
        do not fit (then nothing changes and the caller preempts someone)."""
        missing = self._missing(req_id, num_tokens)
        if missing > self.blocks.num_free:
            return None
        new = self.blocks.allocate(missing)
        self._tables[req_id].extend(new)
        return new

    def free(self, req_id: str) -> None:
        if req_id not in self._slot_of:
            raise CacheAccountingError(f"request {req_id!r} holds no cache")
        self.blocks.free(self._tables.pop(req_id))
        self.slots.free(self._slot_of.pop(req_id))

    def _missing(self, req_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self._tables[req_id]))
