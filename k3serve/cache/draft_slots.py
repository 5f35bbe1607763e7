"""Slot-per-draft rollback for the static verify step (pure Python; vLLM's Mamba spec-decode
layout, fla's 2-D `ssm_state_indices`).

A verify pass of 1 + k positions writes the KDA state after position t of a sequence into a slot
of its own, `row(g)[t]`, instead of a records buffer that a rollback then copies from. Each state
slot g the StatePool hands out owns a row of 1 + k physical slots: `row(g)[0]` holds the request's
state now (`live(g)`, what HybridCacheManager.state_slot returns), the other k are spare.
Accepting position t swaps row(g)[0] and row(g)[t]: the accepted state becomes the live one
without moving a byte. Position 0's state overwrites the live slot in place (the kernels read it
first); positions past a sequence's drafts write spares nobody reads. A row stays permuted after
its request ends: the next request of slot g starts from whatever row(g)[0] is, which every
writer (fresh zeroing, checkpoint restores, tier loads, hand-offs) addresses through state_slot.

Physical layout of the state tensors (forward/cache.py, allocated by runner/model_runner.py
allocate_cache): the live slots, the checkpoint slots, the scratch slot, then num_slots x k
spares (bytes the verify records took: cache/sizing.py spec_records_bytes reserves (1 + k)
states per running sequence, and num_slots <= max_num_seqs).
"""

from __future__ import annotations


def first_spare(num_slots: int, num_checkpoints: int) -> int:
    """Where the spares start: after the live, checkpoint and scratch slots."""
    return num_slots + num_checkpoints + 1


class DraftSlots:
    def __init__(self, num_slots: int, k: int, start: int):
        if num_slots < 1 or k < 1:
            raise ValueError(f"draft slots need state slots and drafts, got {num_slots} and k={k}")
        self.k, self.start = k, start
        self._rows = [[g] + [start + g * k + j for j in range(k)] for g in range(num_slots)]

    @property
    def num_spare(self) -> int:
        return len(self._rows) * self.k

    def live(self, g: int) -> int:
        """The physical slot holding state slot g's state now."""
        return self._rows[g][0]

    def row(self, g: int) -> list[int]:
        """The 1 + k physical slots a verify pass writes positions 0..k of g to."""
        return list(self._rows[g])

    def accept(self, g: int, position: int) -> None:
        """After a verify pass: the state after `position` (0..k) becomes g's live state."""
        if not 0 <= position <= self.k:
            raise ValueError(f"accepted position {position} outside 0..{self.k}")
        r = self._rows[g]
        r[0], r[position] = r[position], r[0]
