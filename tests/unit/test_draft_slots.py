"""Slot-per-draft rows (cache/draft_slots.py) inside the cache manager: a request's state slot
follows the position its verify pass accepted, its row keeps the same physical slots, and a
slot's next request starts from whatever the row's live slot is (no copy anywhere)."""

from __future__ import annotations

import pytest

from k3serve.cache.block_pool import CacheAccountingError
from k3serve.cache.draft_slots import DraftSlots, first_spare
from k3serve.cache.manager import HybridCacheManager


def manager(k=3, slots=2, checkpoints=2):
    m = HybridCacheManager(16, slots, 4, enable_prefix_caching=True, num_checkpoints=checkpoints)
    m.use_draft_slots(DraftSlots(slots, k, first_spare(slots, checkpoints)))
    return m


def test_rows_sit_after_the_live_checkpoint_and_scratch_slots():
    m = manager()
    assert m.allocate("a", 5).state_slot == 0 and m.allocate("b", 5).state_slot == 1
    assert m.draft_row("a") == [0, 5, 6, 7] and m.draft_row("b") == [1, 8, 9, 10]  # 2 live, 2 checkpoints, scratch 4


def test_accepting_a_position_makes_its_slot_the_live_one():
    m = manager()
    m.allocate("a", 5)
    m.accept_draft("a", 2)
    assert m.state_slot("a") == 6 and m.draft_row("a") == [6, 5, 0, 7]
    m.accept_draft("a", 0)  # nothing accepted: position 0's state overwrote the live slot in place
    assert m.state_slot("a") == 6
    m.accept_draft("a", 3)
    assert m.state_slot("a") == 7 and sorted(m.draft_row("a")) == [0, 5, 6, 7]
    with pytest.raises(ValueError, match="outside 0..3"):
        m.accept_draft("a", 4)


def test_a_freed_slot_hands_its_permuted_row_to_the_next_request():
    m = manager(slots=1)
    m.allocate("a", 5)
    m.accept_draft("a", 1)
    m.free("a")
    m.accept_draft("a", 2)  # a request freed while its step ran: nothing to do
    alloc = m.allocate("b", 5)
    assert alloc.state_slot == m.state_slot("b") == 4  # first_spare(1, 2) == 4: the row's live slot now
    assert m.draft_row("b") == [4, 0, 5, 6]


def test_without_rows_nothing_changes_and_rows_come_before_any_request():
    m = HybridCacheManager(16, 2, 4)
    m.allocate("a", 5)
    assert m.state_slot("a") == 0 and m.draft_row("a") is None
    m.accept_draft("a", 1)
    assert m.state_slot("a") == 0
    with pytest.raises(CacheAccountingError, match="before any request"):
        m.use_draft_slots(DraftSlots(2, 3, 3))
