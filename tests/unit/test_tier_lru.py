"""cache/tiers.py TierLRU: oldest first under a byte budget; held entries never evicted."""

from k3serve.cache.tiers import TierLRU


def k(i: int):
    return ("block", bytes([i]) * 16)


def test_the_oldest_go_first_and_an_oversized_entry_goes_at_once():
    lru = TierLRU(30)
    assert [lru.add(k(i), 10) for i in range(3)] == [[], [], []]
    lru.touch(k(0))
    assert lru.add(k(3), 10) == [k(1)] and lru.keys() == [k(2), k(0), k(3)]
    assert lru.add(k(4), 31) == [k(2), k(0), k(3), k(4)] and lru.used == 0


def test_held_entries_stay_and_the_newcomer_goes_when_only_they_are_older():
    lru = TierLRU(30)
    for i in range(3):
        lru.add(k(i), 10)
    held = {k(0), k(1)}
    for key in (k(0), k(1)):  # as PrefixTiers.hold touches them (here in a fixed order)
        lru.touch(key)
    assert lru.add(k(3), 10, held) == [k(2)]  # an unheld older entry still goes first
    assert lru.add(k(4), 10, held) == [k(4)]  # the oldest is held: the newcomer goes
    assert lru.keys() == [k(0), k(1), k(3)] and lru.used == 30
    assert lru.add(k(5), 10) == [k(0)]  # released: the oldest goes again
