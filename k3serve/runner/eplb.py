"""The expert-parallel load balancer on one rank (`--enable-eplb`, issue 62).

Every rank of the expert group steps it once per engine step, before the forward (the ranks
run their steps in lockstep, so their counters agree). Each MoE layer counts its routed
assignments per physical slot (`SparseMoE.expert_load`); at `step_interval` the last
`window_size` steps' counts become logical loads, every rank computes the same new placement
(parallel/eplb_policy.py), and the experts that change place are copied between ranks (one
all-to-all of their bytes per layer) into the existing buffers, with the layer's map
(layers/expert_map.py) rewritten in place: a compiled or captured step reads both by address.
The move runs between two steps, so no request waits more than that one pause.

DP-attention ranks each count only their own rows: their counts are summed over the group
first. Under TP + EP every rank routes every row and counts the same.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from k3serve.config.eplb import EPLBConfig
from k3serve.parallel.eplb_policy import imbalance, rank_loads, rebalance, settle

log = logging.getLogger("k3serve.eplb")

_PARTS = ("weight", "packed", "scale", "global_scale", "tables")  # ExpertWeights' buffers, [S, ...] each


@dataclass
class Rebalance:
    """One rebalance, as /metrics and the log report it: max/mean tokens per rank over the window
    (summed over the MoE layers) as it ran, and as the new placement would have run it."""

    step: int
    before: float
    after: float
    moved: int  # expert copies between ranks (a rank's own copy not counted)
    seconds: float


class ExpertBalancer:
    def __init__(self, model, config: EPLBConfig, nodes: int = 1):
        """`nodes`: the nodes the expert group's ranks span, node-major (--nnodes): the policy
        keeps each expert group's experts on one node where the groups divide over them."""
        self.layers = [m for m in model.moe_layers() if m.expert_map is not None]
        self.group = model.ep if model.ep is not None else model.tp
        self.nodes = nodes if self.group.size % nodes == 0 else 1
        self.summed = model.ep is not None  # DP-attention: each rank counted its own rows
        self.config, self.steps = config, 0
        self.base = self._counts()  # [layers, P]: the counts at the window's start
        self.history: list[Rebalance] = []

    def step(self) -> Rebalance | None:
        """Once per engine step on every rank, before its forward: a rebalance when one is due."""
        self.steps += 1
        interval, window = self.config.step_interval, self.config.window_size
        at = self.steps % interval
        if at == max(0, interval - window) % interval and at:  # the window opens
            self.base = self._counts()
        if at == 0:
            return self.rebalance()
        return None

    def _counts(self) -> torch.Tensor:
        if not self.layers:
            return torch.zeros(0, 0, dtype=torch.long)
        return torch.stack([m.expert_load.to("cpu") for m in self.layers])

    @torch.no_grad()
    def rebalance(self) -> Rebalance | None:
        """Move every layer's experts to the placement its window's load asks for."""
        if not self.layers:
            return None
        t0 = time.perf_counter()
        now = self._counts()
        window = (now - self.base).double()  # [layers, P] assignments per physical slot
        if self.summed:
            window = self.group.all_reduce(window.float()).double()
        M, moved = self.group.size, 0
        before = torch.zeros(M, dtype=torch.float64)
        after = [0.0] * M
        for layer, phys in zip(self.layers, window):
            emap = layer.expert_map
            old, P = emap.p2l, emap.slots
            before += phys.view(M, -1).sum(1)
            logical = [0.0] * emap.experts
            for p, e in enumerate(old):
                logical[e] += float(phys[p])
            new = settle(old, rebalance(logical, P, M, layer.cfg.num_expert_group, self.nodes))
            after = [a + b for a, b in zip(after, rank_loads(logical, new, M))]
            if new != old:
                moved += move_experts(layer, old, new, self.group)
                emap.set(new)
                layer.backend.experts_moved(layer)
        self.base = self._counts()
        event = Rebalance(self.steps, imbalance(before.tolist()), imbalance(after), moved, time.perf_counter() - t0)
        self.history.append(event)
        if self.config.log_balancedness and self.group.rank == 0:
            log.info(
                "EPLB step %d: max/mean tokens per rank %.3f -> %.3f (window estimate), %d experts moved in %.3f s",
                event.step,
                event.before,
                event.after,
                event.moved,
                event.seconds,
            )
        return event

    def stats(self) -> dict:
        """For /metrics (engine/stats.py): rebalances run and the last one's balance."""
        if not self.history:
            return {"eplb_rebalances": 0}
        last = self.history[-1]
        return {"eplb_rebalances": len(self.history), "eplb_balance": (last.before, last.after)}


def expert_buffers(layer) -> list[torch.Tensor]:
    """The layer's routed-expert tensors, each [S, ...] over its local slots (w1, w2, w3 parts)."""
    out = []
    for w in (layer.w1, layer.w2, layer.w3):
        for name in _PARTS:
            t = getattr(w, name, None)
            if t is not None:
                out.append(t)
    return out


def _row(buffers: list[torch.Tensor], j: int) -> torch.Tensor:
    """Local slot j's bytes, every buffer's in order: uint8 [W]."""
    return torch.cat([b[j].contiguous().reshape(-1).view(torch.uint8) for b in buffers])


def _write(buffers: list[torch.Tensor], j: int, row: torch.Tensor) -> None:
    at = 0
    for b in buffers:
        n = b[j].numel() * b.element_size()
        b[j].copy_(row[at : at + n].contiguous().view(b.dtype).view(b.shape[1:]))
        at += n


def move_experts(layer, old: list[int], new: list[int], group) -> int:
    """Copy into each slot whose expert changes that expert's weights: from this rank's own old
    slot when it held the expert, else from the lowest rank that held it (one all-to-all). Every
    rank derives the same plan from (old, new). Returns the copies that crossed ranks."""
    M, me = group.size, group.rank
    S = len(old) // M
    held: dict[int, dict[int, int]] = {}  # expert -> {rank: its first old slot there}
    for p, e in enumerate(old):
        held.setdefault(e, {}).setdefault(p // S, p)
    plan = []  # (source rank, source slot, destination rank, destination slot), destination order
    for p, e in enumerate(new):
        if old[p] != e:
            d = p // S
            s = d if d in held[e] else min(held[e])
            plan.append((s, held[e][s], d, p))
    buffers = expert_buffers(layer)
    # rows this rank writes, read before any write (a slot may be both source and destination)
    local = {p: _row(buffers, src - me * S) for s, src, d, p in plan if s == d == me}
    sends = [(d, p, src) for s, src, d, p in plan if s == me and d != me]  # (destination, slot) order
    counts = [0] * (M * M)
    for s, _, d, _ in plan:
        if s != d:
            counts[s * M + d] += 1
    received: dict[int, torch.Tensor] = {}
    if any(counts):
        rows = [_row(buffers, src - me * S) for _, _, src in sends]
        out = torch.stack(rows) if rows else _row(buffers, 0)[None][:0]  # [sent, W] uint8 (W kept when nothing is sent)
        got = group.all_to_all(out, counts)  # [received, W], in source order, each in (destination, slot) order
        mine = [p for _, p in sorted((s, p) for s, _, d, p in plan if d == me and s != me)]
        received = dict(zip(mine, got))
    for p, row in {**local, **received}.items():
        _write(buffers, p - me * S, row)
    return sum(counts)
