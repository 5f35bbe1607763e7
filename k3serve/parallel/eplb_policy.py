"""Where each expert goes: the expert-parallel load balancer's placement (issue 62, EPLB).

Input: one MoE layer's load per logical expert over a window (routed assignments), the number
of physical slots P = E + R (R redundant), the expert groups, the nodes and the ranks. Output:
the logical expert each physical slot holds, `p2l` [P], rank r holding slots [r*S, (r+1)*S)
(S = P / ranks). Plain Python, no torch: it runs on the host between steps, the same on every
rank (same loads in, same placement out).

The hierarchical form DeepSeek published with its EPLB, written here from its description:
1. groups to nodes: whole expert groups (the router's `n_group`) are packed onto the nodes so
   each node's group load is even (experts of one group stay on one node: a token's top-k group
   choice then crosses few nodes);
2. replicas within a node: the node's R/N redundant slots go one at a time to the expert whose
   load per replica is highest;
3. replicas to ranks: the node's replicas (load / replica count each) are packed onto its ranks,
   S per rank, heaviest first to the lightest rank with room, preferring a rank that does not
   hold that expert yet.
With one node, or groups that do not divide over the nodes, steps 2-3 run over all ranks at once
(DeepSeek's global policy, the one it uses for decode). Finally each rank's slots are ordered to
keep experts where they already are (`settle`), so a rebalance moves only what changed.
"""

from __future__ import annotations

import heapq
from collections import Counter


def initial_placement(experts: int, slots: int) -> list[int]:
    """Before any load is seen: physical slot p holds logical expert p mod E (vLLM's start), so
    with no redundant slots rank r holds its plain expert-parallel share [r*E/M, (r+1)*E/M)."""
    return [p % experts for p in range(slots)]


def initial_slot(expert: int, rank: int, per_rank: int, experts: int) -> int | None:
    """The local slot rank `rank` loads logical `expert` into under `initial_placement` (slot p
    holds p mod E; per_rank <= E, so at most one), or None when the rank does not hold it."""
    j = (expert - rank * per_rank) % experts
    return j if j < per_rank else None


def expert_slots(experts: int, group) -> int:
    """Physical expert slots on each rank of an expert-parallel group (parallel/group.py TPGroup):
    (E + R) / M under EPLB's R redundant ones, else E / M."""
    return group.split(experts + (group.redundant_experts or 0), "num_experts")


def replicate(load: list[float], slots: int, most: int | None = None) -> list[int]:
    """Replica count per expert (each >= 1, at most `most`, summing to `slots`): each extra slot
    to the expert with the highest load per replica (ties: the lower id). `most`: the ranks: a
    rank holding two replicas of one expert takes the same share as one holding one of fewer."""
    count = [1] * len(load)
    heap = [(-w, e) for e, w in enumerate(load)]
    heapq.heapify(heap)
    for _ in range(slots - len(load)):
        _, e = heapq.heappop(heap)
        count[e] += 1
        if most is None or count[e] < most:
            heapq.heappush(heap, (-load[e] / count[e], e))
    return count


def pack(items: list[tuple[float, int]], packs: int, per_pack: int) -> list[list[int]]:
    """Items (weight, key) into `packs` bins of exactly `per_pack` items: heaviest first, each to
    the lightest bin with room, preferring a bin that does not hold an item of that key yet
    (two replicas of one expert on one rank balance nothing). Returns each bin's keys."""
    assert len(items) == packs * per_pack, (len(items), packs, per_pack)
    bins: list[list[int]] = [[] for _ in range(packs)]
    totals = [0.0] * packs
    for w, key in sorted(items, key=lambda it: (-it[0], it[1])):
        room = [b for b in range(packs) if len(bins[b]) < per_pack]
        fresh = [b for b in room if key not in bins[b]] or room
        b = min(fresh, key=lambda b: (totals[b], b))
        bins[b].append(key)
        totals[b] += w
    return bins


def _replicas_to_ranks(load: list[float], experts: list[int], slots: int, ranks: int) -> list[list[int]]:
    """Steps 2-3 for the experts of one node: its `slots` physical slots over its `ranks` ranks."""
    count = replicate([load[e] for e in experts], slots, ranks)
    items = [(load[e] / c, e) for e, c in zip(experts, count) for _ in range(c)]
    return pack(items, ranks, slots // ranks)


def rebalance(load: list[float], slots: int, ranks: int, groups: int = 1, nodes: int = 1) -> list[list[int]]:
    """The logical experts of each rank's S slots (unordered within a rank), for one layer."""
    experts = len(load)
    if slots % ranks or slots < experts:
        raise ValueError(f"{slots} physical expert slots cannot be split over {ranks} ranks with {experts} experts")
    if nodes > 1 and ranks % nodes == 0 and slots % nodes == 0 and groups % nodes == 0 and experts % groups == 0:
        size = experts // groups
        group_load = [(sum(load[g * size : (g + 1) * size]), g) for g in range(groups)]
        out: list[list[int]] = []
        for node_groups in pack(group_load, nodes, groups // nodes):
            node_experts = [g * size + i for g in sorted(node_groups) for i in range(size)]
            out += _replicas_to_ranks(load, node_experts, slots // nodes, ranks // nodes)
        return out
    return _replicas_to_ranks(load, list(range(experts)), slots, ranks)


def settle(old: list[int], per_rank: list[list[int]]) -> list[int]:
    """The new `p2l` [P]: rank r's experts `per_rank[r]` laid into its slots, an expert it held
    before kept in its old slot (no copy), ranks matched to the new sets by most overlap."""
    ranks = len(per_rank)
    per = len(old) // ranks
    held = [old[r * per : (r + 1) * per] for r in range(ranks)]
    # which new set goes to which rank: the greatest overlap first (a set's keys are multisets)
    pairs = sorted(
        ((-_overlap(held[r], per_rank[s]), r, s) for r in range(ranks) for s in range(ranks)),
    )
    rank_of: dict[int, int] = {}
    used: set[int] = set()
    for _, r, s in pairs:
        if r not in rank_of.values() and s not in used:
            rank_of[s] = r
            used.add(s)
    p2l = [-1] * len(old)
    for s, r in rank_of.items():
        want = Counter(per_rank[s])
        slots = range(r * per, (r + 1) * per)
        for p in slots:  # stays where it is
            if want[old[p]] > 0:
                want[old[p]] -= 1
                p2l[p] = old[p]
        rest = sorted(want.elements())  # the newcomers, into the slots left
        for p in slots:
            if p2l[p] < 0:
                p2l[p] = rest.pop(0)
    return p2l


def _overlap(a: list[int], b: list[int]) -> int:
    return sum((Counter(a) & Counter(b)).values())


def rank_loads(load: list[float], p2l: list[int], ranks: int) -> list[float]:
    """Each rank's expected load under `p2l`: an expert's load shared evenly by its replicas."""
    count = [0] * len(load)
    for e in p2l:
        count[e] += 1
    per = len(p2l) // ranks
    return [sum(load[e] / count[e] for e in p2l[r * per : (r + 1) * per]) for r in range(ranks)]


def imbalance(per_rank: list[float]) -> float:
    """max / mean load per rank (1.0: even; an idle window counts as even)."""
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean else 1.0
