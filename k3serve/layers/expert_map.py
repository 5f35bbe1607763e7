"""Logical -> physical experts of one MoE layer under EPLB (issue 62; vLLM's expert map).

With expert parallelism over M ranks and R redundant slots, the layer's routed experts occupy
P = E + R physical slots, S = P / M on each rank (rank r: slots [r*S, (r+1)*S)), and a logical
expert may have several replicas. The router picks logical ids; `physical` turns each (token,
choice) into one replica's slot, and from there every expert-parallel path (TP + EP, the
DP-attention gather form and all-to-all) runs unchanged on slot ids, as it ran on expert ids.

The maps are device buffers of fixed shape (l2p [E, R + 1], replicas [E]) that a rebalance
overwrites in place, so a compiled or captured step reads the new placement without a recompile.
Which replica serves a choice: (row + choice index) mod its replica count, so the rows of a
batch spread evenly over an expert's replicas, and every rank that sees the same rows (the
gather form, TP + EP) picks the same slot.
"""

from __future__ import annotations

import torch
from torch import nn

from k3serve.parallel.eplb_policy import initial_placement


class ExpertMap(nn.Module):
    def __init__(self, experts: int, slots: int):
        super().__init__()
        self.experts, self.slots = experts, slots
        width = slots - experts + 1  # the most replicas one expert can have
        # real tensors even inside a model built on the meta device (models/registry.py); not
        # weights, nor buffers (the model's weight bytes are the planner's): `_apply` moves them
        self.l2p = torch.zeros(experts, width, dtype=torch.long, device="cpu")
        self.replicas = torch.ones(experts, dtype=torch.long, device="cpu")
        self.p2l: list[int] = []
        self.set(initial_placement(experts, slots))

    def _apply(self, fn, recurse=True):
        """`model.to(device)` moves the maps (a dtype cast leaves these integer tensors alone)."""
        self.l2p, self.replicas = fn(self.l2p), fn(self.replicas)
        return super()._apply(fn, recurse)

    @torch.no_grad()
    def set(self, p2l: list[int]) -> None:
        """Take a placement (the logical expert of each physical slot, [P]); buffers in place."""
        if len(p2l) != self.slots or sorted(set(p2l)) != list(range(self.experts)):
            raise ValueError(f"a placement must give each of {self.experts} experts a slot of {self.slots}")
        rows: list[list[int]] = [[] for _ in range(self.experts)]
        for p, e in enumerate(p2l):
            rows[e].append(p)
        width, device = self.l2p.shape[1], self.l2p.device  # explicit: a model may be built under torch.device("meta")
        self.l2p.copy_(torch.tensor([r + [r[0]] * (width - len(r)) for r in rows], dtype=torch.long, device=device))
        self.replicas.copy_(torch.tensor([len(r) for r in rows], dtype=torch.long, device=device))
        self.p2l = list(p2l)

    def physical(self, ids: torch.Tensor) -> torch.Tensor:
        """Logical expert ids [n, k] -> the physical slot serving each choice [n, k] (long)."""
        n, k = ids.shape
        spread = torch.arange(n, device=ids.device)[:, None] + torch.arange(k, device=ids.device)[None, :]
        return self.l2p[ids, spread % self.replicas[ids]]
