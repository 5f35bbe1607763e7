"""EPLB's placement (k3serve/parallel/eplb_policy.py) and its config, without a model."""

from __future__ import annotations

import random

import pytest

from k3serve.config.eplb import EPLBConfig
from k3serve.parallel.eplb_policy import (
    imbalance,
    initial_placement,
    initial_slot,
    rank_loads,
    rebalance,
    replicate,
    settle,
)


def zipf(experts: int, seed: int, s: float = 1.2) -> list[float]:
    rng = random.Random(seed)
    w = [1000.0 / (i + 1) ** s for i in range(experts)]
    rng.shuffle(w)
    return w


def check_placement(p2l: list[int], experts: int, ranks: int) -> None:
    assert sorted(set(p2l)) == list(range(experts))  # every expert has a slot
    per = len(p2l) // ranks
    for r in range(ranks):  # no rank holds two replicas of one expert (they would balance nothing)
        own = p2l[r * per : (r + 1) * per]
        assert len(set(own)) == len(own)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("experts,ranks,redundant", [(64, 8, 8), (256, 16, 32), (896, 16, 128), (8, 2, 2)])
def test_skewed_loads_are_evened_to_within_15_percent(experts, ranks, redundant, seed):
    load = zipf(experts, seed)
    old = initial_placement(experts, experts + redundant)
    new = settle(old, rebalance(load, experts + redundant, ranks))
    check_placement(new, experts, ranks)
    before, after = imbalance(rank_loads(load, old, ranks)), imbalance(rank_loads(load, new, ranks))
    assert after <= 1.15, (before, after)
    assert after < before


def test_replicas_go_to_the_hottest_experts():
    assert replicate([10.0, 1.0, 5.0], 6) == [3, 1, 2]  # 10/3, 1, 5/2: no extra slot lowers the max more


def test_hierarchical_keeps_each_group_on_one_node():
    experts, groups, nodes, ranks, slots = 32, 8, 2, 4, 40
    load = zipf(experts, 0)
    per_rank = rebalance(load, slots, ranks, groups=groups, nodes=nodes)
    size = experts // groups
    node_of_group: dict[int, set[int]] = {}
    for r, keys in enumerate(per_rank):
        for e in keys:
            node_of_group.setdefault(e // size, set()).add(r // (ranks // nodes))
    assert all(len(n) == 1 for n in node_of_group.values())
    check_placement(settle(initial_placement(experts, slots), per_rank), experts, ranks)


def test_settle_moves_only_what_changed():
    p2l = initial_placement(16, 20)
    per = 5
    same = [p2l[r * per : (r + 1) * per][::-1] for r in range(4)][::-1]  # the same sets, shuffled
    assert settle(p2l, same) == p2l
    load = zipf(16, 3)
    new = settle(p2l, rebalance(load, 20, 4))
    again = settle(new, rebalance(load, 20, 4))
    assert again == new  # the same load twice: nothing moves the second time


def test_initial_slots_match_the_plain_expert_split():
    # no redundant slot: rank r holds experts [r*E/M, (r+1)*E/M) in order, as before EPLB
    for e in range(8):
        for r in range(2):
            want = e - 4 * r if 4 * r <= e < 4 * (r + 1) else None
            assert initial_slot(e, r, 4, 8) == want
    p2l = initial_placement(8, 10)  # with 2 redundant: rank 1's last slots hold experts 0 and 1
    assert p2l[5:] == [5, 6, 7, 0, 1]
    assert [initial_slot(e, 1, 5, 8) for e in range(8)] == [3, 4, None, None, None, 0, 1, 2]


def test_eplb_config_takes_vllms_keys_and_names_a_bad_one():
    c = EPLBConfig.parse(
        '{"window_size": 10, "step_interval": 20, "num_redundant_experts": 4, "log_balancedness": true}'
    )
    assert (c.window_size, c.step_interval, c.num_redundant_experts, c.log_balancedness) == (10, 20, 4, True)
    with pytest.raises(ValueError, match="unknown keys \\['windowsize'\\]"):
        EPLBConfig.parse({"windowsize": 3})
    with pytest.raises(ValueError, match="num_redundant_experts"):
        EPLBConfig.parse({"num_redundant_experts": -1})
    with pytest.raises(ValueError, match="use_async"):
        EPLBConfig.parse({"use_async": True})
