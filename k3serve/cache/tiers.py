"""The prefix cache's tiers below the device pools: which entries each holds (pure Python).

Two tiers, host memory then a disk directory, each an LRU of entries under a byte budget. An
entry is one prefix-cache key of the device pools (cache/prefix_cache.py's hash chain):
  ("block", h)  the latent rows of the block whose chained hash is h, every MLA layer;
  ("state", h)  the KDA recurrent and conv state after the block whose hash is h, every KDA
                layer (the checkpoint the device keys the same way).
A prefix of k blocks restores from the tiers when blocks 0..k-1 are each on the device or in a
tier and a state for block k-1 is (HybridCacheManager.lookup): latent rows without their state
are never a hit. The bytes live in k3serve/offload (host tensors, files); this index is what the
scheduler's bookkeeping consults, so it stays torch-free like the rest of cache/.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AbstractSet as Set
from typing import Callable

Key = tuple[str, bytes]  # ("block" | "state", 16-byte chained hash)
TIERS = ("cpu", "disk")  # host memory, then the directory (the labels metrics carry)


@dataclass
class TierStats:
    """Counters of one tier (Prometheus: k3serve:prefix_cache_tier_*{tier=...})."""

    queries: int = 0  # lookups that reached this tier (the device run ended short)
    hits: int = 0  # entries it gave: loaded into the device pools (cpu), read into host memory (disk)
    hit_tokens: int = 0  # tokens of prefix hits that loaded from host memory (cpu)
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    rejected: int = 0  # files found torn, corrupt or foreign, dropped
    load_seconds: float = 0.0


class TierLRU:
    """Entries of one tier, oldest first, under `budget` bytes."""

    def __init__(self, budget: int):
        self.budget = budget
        self.used = 0
        self._size: OrderedDict[Key, int] = OrderedDict()

    def __contains__(self, key: Key) -> bool:
        return key in self._size

    def __len__(self) -> int:
        return len(self._size)

    def touch(self, key: Key) -> None:
        self._size.move_to_end(key)

    def add(self, key: Key, nbytes: int, keep: Set[Key] = frozenset()) -> list[Key]:
        """Insert (or refresh) an entry; the entries evicted to stay within budget, oldest first.
        An entry larger than the whole budget is evicted at once (returned itself). Entries in
        `keep` (touched first, so only newer ones stand behind them) are never evicted: when the
        oldest is one, the newcomer goes instead."""
        if key in self._size:
            self.touch(key)
            return []
        self._size[key] = nbytes
        self.used += nbytes
        out = []
        while self.used > self.budget and self._size:
            old = next(iter(self._size))
            if old in keep:
                old = key
            self.used -= self._size.pop(old)
            out.append(old)
            if old == key:
                break
        return out

    def remove(self, key: Key) -> bool:
        n = self._size.pop(key, None)
        if n is None:
            return False
        self.used -= n
        return True

    def keys(self) -> list[Key]:
        return list(self._size)


@dataclass
class TierIndex:
    """What each tier holds, and its stats; the store (k3serve/offload) keeps it current."""

    cpu: TierLRU
    disk: TierLRU | None = None
    stats: dict[str, TierStats] = field(default_factory=lambda: {t: TierStats() for t in TIERS})
    prefetching: set = field(default_factory=set)  # disk entries being read into host memory
    # a directory shared with other engines: `discover(key)` indexes an entry one of them wrote
    # since this engine's start-up scan (offload/store.py), True if it found one
    discover: Callable[[Key], bool] | None = None

    def where(self, key: Key) -> str | None:
        if key in self.cpu:
            return "cpu"
        if self.disk is not None and (key in self.disk or (self.discover is not None and self.discover(key))):
            return "disk"
        return None
