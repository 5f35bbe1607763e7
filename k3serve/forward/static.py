"""StaticStep: a decode or verify step of fixed shape, the input of the compiled / captured step.

One `StaticStep` exists per (sequences B, block-table width W, positions T) bucket: T = 1 for
a decode, 1 + k for a speculative verify pass (the last token and k drafts). Its tensors are
persistent device buffers, views of one flat int64 tensor that a single host-to-device copy
fills every step (`StaticBuffers.fill`). N = B * T rows, sequence-major (row b * T + t).
Sequences past the live batch are padding (token 0 in the cache's scratch state slot); a
verifying sequence with fewer than k drafts pads its tail positions, whose latent rows go to
the scratch block. A fixed-shape step so never touches another request's state.

  input_ids  [N]     the token each row feeds
  positions  [N]     its absolute position (tokens already cached + t)
  cache_rows [N]     latent row its [c_n | k_pe] is written to (padding: the scratch block's)
  slots      [B]     KDA state slot (padding: the scratch slot); a verify step's [B, T]: the
                     physical slot the state after each position goes to, column 0 the live one
                     it starts from (cache/draft_slots.py: rollback picks a column, copies nothing)
  table      [B, W]  block table, padded with the scratch block
  gather     [N]     for each row of the flat batch (sequences concatenated, as ForwardBatch
                     orders them), its static row; the padding rows after them point at row 0
  sampling   [6, B]  top_k, seed, output position (int64), temperature, top_p, min_p (float64
                     bit patterns in the same buffer, so still one copy); decode steps only
Derived inside the compiled step, once (`expand`): context_rows [N, W * bs] and lens [N].

A layer tells a static step from a ForwardBatch by `static` (forward/batch.py has it False);
the graph backend (backends/graph.py) runs the former with fixed-shape, sync-free ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SAMPLING_INTS = ("top_k", "seed", "position")
SAMPLING_FLOATS = ("temperature", "top_p", "min_p")
PADDING_ROW = dict(top_k=0, seed=0, position=0, temperature=0.0, top_p=1.0, min_p=0.0)  # greedy


@dataclass
class StaticStep:
    input_ids: torch.Tensor
    positions: torch.Tensor
    cache_rows: torch.Tensor
    slots: torch.Tensor
    table: torch.Tensor
    gather: torch.Tensor
    sampling: torch.Tensor
    block_size: int
    T: int  # positions per sequence: 1 decode, 1 + k verify
    # DP-attention: the rows every DP rank brings to each MoE layer's fixed-shape token exchange
    # (the largest N of this step's ranks, agreed before it: runner/graph_step.py); 0 without
    ep_rows: int = 0
    scratch_row: int = -1  # the latent row padding rows write (the scratch block's first)
    context_rows: torch.Tensor | None = None  # [N, W * bs] latent rows of every position < W * bs
    lens: torch.Tensor | None = None  # [N] valid context rows (position + 1: causal within the new rows)
    static = True
    fresh = None  # a decode or verify step has no new sequence to zero
    media_rows = None
    # a static verify step writes each position's KDA state into its slot row: no records
    kda_records: dict = field(default_factory=dict)

    def expand(self) -> "StaticStep":
        """The per-row context rows every MLA layer reads, built once a step (inside the graph)."""
        bs, W = self.block_size, self.table.shape[1]
        pos = torch.arange(W * bs, device=self.table.device)
        table = self.table if self.T == 1 else self.table.repeat_interleave(self.T, 0)  # [N, W]
        rows = table[:, pos // bs] * bs + pos % bs  # [N, W * bs]
        return StaticStep(
            self.input_ids,
            self.positions,
            self.cache_rows,
            self.slots,
            self.table,
            self.gather,
            self.sampling,
            bs,
            self.T,
            self.ep_rows,
            self.scratch_row,
            rows,
            self.positions + 1,
        )

    def live(self) -> torch.Tensor:
        """[N] bool: the rows of live tokens (padding rows and padded draft positions write the
        scratch row), for counting expert load."""
        return self.cache_rows != self.scratch_row

    def sampling_params(self):
        """The rows' DeviceSamplingParams (sampling/device.py), read from the buffer."""
        from k3serve.sampling.device import DeviceSamplingParams

        top_k, seed, position = self.sampling[:3].unbind(0)
        temperature, top_p, min_p = self.sampling[3:].contiguous().view(torch.float64).float().unbind(0)
        return DeviceSamplingParams(temperature, top_k, top_p, min_p, seed, position)


class StaticBuffers:
    """The persistent buffers of one (B, W, T) bucket and the host staging they are filled from
    (pinned when the device is a GPU, so the copy is asynchronous and the step's only input copy)."""

    def __init__(
        self,
        B: int,
        W: int,
        block_size: int,
        device: torch.device,
        scratch_slot: int,
        scratch_block: int,
        T: int = 1,
        ep_rows: int = 0,
    ):
        self.B, self.W, self.T, self.block_size = B, W, T, block_size
        self.scratch_slot, self.scratch_block = scratch_slot, scratch_block
        N = B * T
        self.sizes = [N, N, N, N, B * W, N, 6 * B]
        self.device_flat = torch.zeros(sum(self.sizes), dtype=torch.long, device=device)
        self.host = torch.zeros(sum(self.sizes), dtype=torch.long, pin_memory=device.type == "cuda")
        ids, pos, rows, slots, table, gather, sampling = self.device_flat.split(self.sizes)
        slots = slots if T == 1 else slots.view(B, T)
        self.step = StaticStep(
            ids,
            pos,
            rows,
            slots,
            table.view(B, W),
            gather,
            sampling.view(6, B),
            block_size,
            T,
            ep_rows,
            scratch_block * block_size,
        )
        self.fill_padding()

    def fill_padding(self) -> None:
        """Every row a padding row (the state before warm-up and capture: they touch scratch only)."""
        self.fill([], [], [], [], [])

    def _slot_rows(self, slots: list) -> list[int]:
        if self.T == 1:
            return list(slots)
        if any(isinstance(r, int) or len(r) != self.T for r in slots):
            raise ValueError(f"a verify bucket of {self.T} positions takes a row of {self.T} state slots a sequence")
        return [s for r in slots for s in r]

    def fill(
        self,
        input_ids: list[int],
        seq_lens: list[int],
        slots: list,
        context_lens: list[int],
        block_tables: list[list[int]],
        sampling: list[dict] | None = None,
    ) -> None:
        """Live sequences first (their tokens concatenated, seq_lens[j] <= T each), padding after;
        `slots`: each sequence's state slot, or in a verify bucket its row of T slots
        (cache/draft_slots.py row); `sampling`: the rows' device sampling values
        (sampling/device.py row_values), or None when the step returns logits. One copy."""
        B, W, T, bs = self.B, self.W, self.T, self.block_size
        pad = B - len(seq_lens)
        scratch_row = self.scratch_block * bs
        ids, pos, rows, gather = [], [], [], []
        flat = 0
        for j, (n, ctx, t) in enumerate(zip(seq_lens, context_lens, block_tables)):
            ids += input_ids[flat : flat + n] + [0] * (T - n)
            pos += [ctx + i for i in range(T)]
            rows += [t[(ctx + i) // bs] * bs + (ctx + i) % bs for i in range(n)] + [scratch_row] * (T - n)
            gather += [j * T + i for i in range(n)]
            flat += n
        table = []
        for t in block_tables:
            table += t[:W] + [self.scratch_block] * (W - len(t))
        ints = (
            ids
            + [0] * (pad * T)
            + pos
            + [0] * (pad * T)
            + rows
            + [scratch_row] * (pad * T)
            + self._slot_rows(slots)
            + [self.scratch_slot] * (pad * T)
            + table
            + [self.scratch_block] * (pad * W)
            + gather
            + [0] * (B * T - len(gather))
        )
        rows_s = list(sampling or []) + [PADDING_ROW] * (B - len(sampling or []))
        ints += [r[k] for k in SAMPLING_INTS for r in rows_s]
        floats = torch.tensor([r[k] for k in SAMPLING_FLOATS for r in rows_s], dtype=torch.float64)
        split = len(self.host) - 3 * B  # the float64 bits of SAMPLING_FLOATS close the buffer
        self.host[:split].copy_(torch.tensor(ints, dtype=torch.long))
        self.host[split:].copy_(floats.view(torch.long))
        self.device_flat.copy_(self.host, non_blocking=True)
