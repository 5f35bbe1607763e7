"""ForwardOut: what one forward of the model returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardOut:
    hidden: torch.Tensor  # [N, d] final hidden states (after the final norm)
    # layer -> [N, d] output hidden states of the layers asked for (the tap layers a DSpark drafter reads)
    taps: dict[int, torch.Tensor] = field(default_factory=dict)
    # a verify pass's per-position KDA states, layer -> (rec [S, T, H, D, D], conv [S, T, K-1, 3P]),
    # S = verifying sequences in batch order; spec_decode/rollback.py picks each one's accepted position
    kda_records: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
