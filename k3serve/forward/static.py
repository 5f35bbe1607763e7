"""StaticStep: a decode step of fixed shape, the input of the compiled / graph-captured step.

One `StaticStep` exists per (batch bucket B, block-table width W); its tensors are persistent
device buffers, views of one flat int64 tensor that a single host-to-device copy fills every
step (`StaticBuffers.fill`). Rows past the live batch are padding: they decode token 0 in the
cache's scratch state slot and write the scratch latent block, so a fixed-shape step never
touches a live request's state and needs no masking of its own.

Shapes (B rows, one new token each; bs = block size):
  input_ids [B]      the token each row feeds
  slots     [B]      KDA state slot (padding: the scratch slot)
  positions [B]      absolute position of the token (= tokens already cached)
  cache_rows [B]     latent row the token's [c_n | k_pe] is written to
  table     [B, W]   block table, padded with the scratch block
  sampling           [B] each: top_k, seed, output position (int64), temperature, top_p,
                     min_p (float64 bit patterns in the same buffer, so still one copy)
Derived inside the compiled step, once (`expand`): context_rows [B, W * bs] and lens [B].

A layer tells a static step from a ForwardBatch by `static` (forward/batch.py has it False);
the graph backend (backends/graph.py) runs the former with fixed-shape, sync-free torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

INDEX_FIELDS = 4  # input_ids, slots, positions, cache_rows (then the table)
SAMPLING_INTS = ("top_k", "seed", "position")
SAMPLING_FLOATS = ("temperature", "top_p", "min_p")
PADDING_ROW = dict(top_k=0, seed=0, position=0, temperature=0.0, top_p=1.0, min_p=0.0)  # greedy


@dataclass
class StaticStep:
    input_ids: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    cache_rows: torch.Tensor
    table: torch.Tensor
    block_size: int
    sampling: torch.Tensor | None = None  # [6, B] int64: SAMPLING_INTS, then SAMPLING_FLOATS' float64 bits
    context_rows: torch.Tensor | None = None  # [B, W * bs] latent rows of every position < W * bs
    lens: torch.Tensor | None = None  # [B] valid context rows (position + 1)
    static = True
    fresh = None  # a decode has no new sequence to zero
    media_rows = None
    verify: tuple = ()
    kda_records: dict = field(default_factory=dict)  # a decode records nothing (verify passes stay eager)

    def expand(self) -> "StaticStep":
        """The per-row context rows every MLA layer reads, built once a step (inside the graph)."""
        bs, W = self.block_size, self.table.shape[1]
        pos = torch.arange(W * bs, device=self.table.device)
        rows = self.table[:, pos // bs] * bs + pos % bs  # [B, W * bs]
        return StaticStep(self.input_ids, self.slots, self.positions, self.cache_rows, self.table, bs,
                          self.sampling, rows, self.positions + 1)

    def sampling_params(self):
        """The rows' DeviceSamplingParams (sampling/device.py), read from the buffer."""
        from k3serve.sampling.device import DeviceSamplingParams

        top_k, seed, position = self.sampling[:3].unbind(0)
        temperature, top_p, min_p = self.sampling[3:].contiguous().view(torch.float64).float().unbind(0)
        return DeviceSamplingParams(temperature, top_k, top_p, min_p, seed, position)


class StaticBuffers:
    """The persistent buffers of one (B, W) bucket and the host staging they are filled from
    (pinned when the device is a GPU, so the copy is asynchronous and the step's only input copy)."""

    def __init__(self, B: int, W: int, block_size: int, device: torch.device, scratch_slot: int, scratch_block: int):
        self.B, self.W, self.block_size = B, W, block_size
        self.scratch_slot, self.scratch_block = scratch_slot, scratch_block
        self.index_len = B * (INDEX_FIELDS + W)
        n = self.index_len + 6 * B
        self.device_flat = torch.zeros(n, dtype=torch.long, device=device)
        self.host = torch.zeros(n, dtype=torch.long, pin_memory=device.type == "cuda")
        ids, slots, pos, rows, table, sampling = self.device_flat.split([B, B, B, B, B * W, 6 * B])
        self.step = StaticStep(ids, slots, pos, rows, table.view(B, W), block_size, sampling.view(6, B))
        self.fill_padding()

    def fill_padding(self) -> None:
        """Every row a padding row (the state before warm-up and capture: they touch scratch only)."""
        self.fill([], [], [], [])

    def fill(self, input_ids: list[int], slots: list[int], context_lens: list[int],
             block_tables: list[list[int]], sampling: list[dict] | None = None) -> None:
        """Live rows first, padding after; `sampling`: the rows' device sampling values
        (sampling/device.py row_values), or None when the step returns logits. One copy."""
        B, W, bs = self.B, self.W, self.block_size
        n = len(input_ids)
        pad = B - n
        rows = [t[p // bs] * bs + p % bs for t, p in zip(block_tables, context_lens)]
        scratch_row = self.scratch_block * bs
        table = []
        for t in block_tables:
            table += t[:W] + [self.scratch_block] * (W - len(t))
        values = (list(input_ids) + [0] * pad + list(slots) + [self.scratch_slot] * pad
                  + list(context_lens) + [0] * pad + rows + [scratch_row] * pad
                  + table + [self.scratch_block] * (pad * W))
        rows_s = list(sampling or []) + [PADDING_ROW] * (B - len(sampling or []))
        ints = [r[k] for k in SAMPLING_INTS for r in rows_s]
        floats = torch.tensor([r[k] for k in SAMPLING_FLOATS for r in rows_s], dtype=torch.float64)
        self.host[:self.index_len + 3 * B].copy_(torch.tensor(values + ints, dtype=torch.long))
        self.host[self.index_len + 3 * B:].copy_(floats.view(torch.long))
        self.device_flat.copy_(self.host, non_blocking=True)
