"""Prefix-caching pieces that are not blocks: chained block hashes and the KDA checkpoint store
(pure Python).

A KDA layer cannot resume from latent blocks alone: it needs its recurrent state and conv
window *exactly at* the prefix boundary (serving-notes.md §2.3-2.6). Checkpoints are copies of
a request's state slot taken right after the step whose chunk ended on that boundary; they live
in extra state slots with their own budget and LRU. A checkpoint becomes valid only after the
step that writes it has run (`commit`), so a request scheduled in that same step can never read
a half-written state (SGLang's never-written-slot bug, GSM8K 0.895 -> 0.150). Pinned
checkpoints (being copied from this step) are never evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from k3serve.cache.block_pool import CacheAccountingError


def block_hashes(
    token_ids: list[int], block_size: int, extra: bytes = b"", start: int = 0, parent: bytes | None = None
) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids` from block `start` on:
    h_i = blake2b(h_{i-1} | tokens of block i); h_{-1} = blake2b(extra) (media hashes etc.)."""
    h = parent if parent is not None else hashlib.blake2b(b"k3serve-root" + extra, digest_size=16).digest()
    out = []
    for i in range(start, len(token_ids) // block_size):
        block = array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        h = hashlib.blake2b(h + block, digest_size=16).digest()
        out.append(h)
    return out


@dataclass
class PrefixCacheStats:
    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    checkpoints_stored: int = 0
    checkpoints_evicted: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class CheckpointStore:
    """KDA state checkpoints keyed by the hash of the block that ends the prefix."""

    def __init__(self, slot_ids: list[int]):
        self.capacity = len(slot_ids)
        self._free = list(reversed(slot_ids))
        self._valid: OrderedDict[bytes, int] = OrderedDict()  # LRU: oldest first
        self._pending: dict[bytes, int] = {}
        self._pins: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()
        self.evicted: list[tuple[bytes, int]] | None = None  # (key, slot) evicted, when tracked

    @property
    def num_stored(self) -> int:
        return len(self._valid) + len(self._pending)

    def valid(self) -> list[tuple[bytes, int]]:
        """The usable checkpoints (key, slot), oldest first."""
        return list(self._valid.items())

    def get(self, key: bytes) -> int | None:
        return self._valid.get(key)

    def pin(self, key: bytes) -> int:
        """Use a valid checkpoint this step: refreshed in the LRU, safe from eviction until unpin."""
        slot = self._valid[key]
        self._valid.move_to_end(key)
        self._pins[key] = self._pins.get(key, 0) + 1
        return slot

    def unpin(self, key: bytes) -> None:
        n = self._pins.get(key, 0)
        if n < 1:
            raise CacheAccountingError("checkpoint unpinned more often than pinned")
        if n == 1:
            del self._pins[key]
        else:
            self._pins[key] = n - 1

    def begin(self, key: bytes) -> int | None:
        """A slot to write a checkpoint into this step, or None (exists, or everything pinned)."""
        if key in self._valid or key in self._pending or self.capacity == 0:
            return None
        if not self._free:
            victim = next((k for k in self._valid if k not in self._pins), None)
            if victim is None:
                return None
            slot = self._valid.pop(victim)
            self._free.append(slot)
            self.stats.checkpoints_evicted += 1
            if self.evicted is not None:
                self.evicted.append((victim, slot))
        slot = self._free.pop()
        self._pending[key] = slot
        return slot

    def commit(self) -> list[tuple[bytes, int]]:
        """The step that wrote the pending checkpoints has run: they become usable. Returns
        them as (key, slot)."""
        done = list(self._pending.items())
        for key, slot in done:
            self._valid[key] = slot
            self.stats.checkpoints_stored += 1
        self._pending.clear()
        return done

    def discard_pending(self) -> None:
        """The step meant to write the pending checkpoints failed: their slots go back unused."""
        self._free.extend(self._pending.values())
        self._pending.clear()

    def flush(self) -> int:
        """Drop every unpinned valid checkpoint; how many."""
        drop = [k for k in self._valid if k not in self._pins]
        for k in drop:
            self._free.append(self._valid.pop(k))
        return len(drop)
