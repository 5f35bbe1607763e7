"""Pool of KDA state slots (pure Python).

One slot = the recurrent state [H, D, D] and the conv window [K-1, 3P] of every KDA layer for
one request; its device tensors are `CacheTensors.recurrent[l][slot]` / `conv[l][slot]`.
A slot's size does not depend on sequence length (k3-model-spec.md §3.5), so the pool is
sized in requests, not tokens. Reference: vLLM `MambaManager` (one live state per request),
SGLang `MambaPool`.
"""

from __future__ import annotations

from k3serve.cache.block_pool import CacheAccountingError


class StatePool:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._used = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise CacheAccountingError("no free KDA state slot")
        slot = self._free.pop()
        self._used[slot] = True
        return slot

    def free(self, slot: int) -> None:
        if not self._used[slot]:
            raise CacheAccountingError(f"state slot {slot} freed twice")
        self._used[slot] = False
        self._free.append(slot)
