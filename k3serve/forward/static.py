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
  token_mask [B, M]  a bucket with grammar masks: each row's allowed tokens, xgrammar's int32
                     bitmask words paired into int64 (bit k of word w: token 64 w + k; padding
                     rows and unconstrained ones all ones), M = ceil(V / 64)
  penalties  [3, B]  a bucket with penalties: presence, frequency, repetition (float64 bits)
  prompt_ids [B, Pp] and output_ids [B, Po]: each row's prompt and output so far (the
                     penalties' counts), padded with V (a column the counts drop)
Derived inside the compiled step, once (`expand`): context_rows [N, W * bs] and lens [N].

A layer tells a static step from a ForwardBatch by `static` (forward/batch.py has it False);
the graph backend (backends/graph.py) runs the former with fixed-shape, sync-free ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SAMPLING_INTS = ("top_k", "seed", "position")
SAMPLING_FLOATS = ("temperature", "top_p", "min_p")
PENALTY_DEFAULTS = (("presence", 0.0), ("frequency", 0.0), ("repetition", 1.0))  # off
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
    token_mask: torch.Tensor | None = None  # [B, ceil(V / 64)] int64 grammar bits, or None
    penalties: torch.Tensor | None = None  # [3, B] float64 bits, or None
    prompt_ids: torch.Tensor | None = None  # [B, Pp]
    output_ids: torch.Tensor | None = None  # [B, Po]
    context_rows: torch.Tensor | None = None  # [N, W * bs] latent rows of every position < W * bs
    lens: torch.Tensor | None = None  # [N] valid context rows (position + 1: causal within the new rows)
    # a pipeline stage after the first: the previous stage's [bank + 1, N, d] (AttnRes block
    # vectors, then h), received into this buffer before each call (runner/graph_step.py)
    incoming: torch.Tensor | None = None
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
            self.token_mask,
            self.penalties,
            self.prompt_ids,
            self.output_ids,
            rows,
            self.positions + 1,
            self.incoming,
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
        penal = (None, None, None)
        if self.penalties is not None:
            penal = self.penalties.contiguous().view(torch.float64).float().unbind(0)
        return DeviceSamplingParams(temperature, top_k, top_p, min_p, seed, position, *penal)

    def penalty_counts(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """Output token counts [B, V] fp32 and the prompt's tokens [B, V] bool, from the rows'
        histories (the padding id V lands in a column dropped here); (None, None) without."""
        if self.output_ids is None:
            return None, None
        B = self.output_ids.shape[0]
        ones = torch.ones(self.output_ids.shape, dtype=torch.float32, device=self.output_ids.device)
        counts = torch.zeros(B, vocab + 1, device=ones.device).scatter_add_(1, self.output_ids, ones)
        seen = torch.zeros(B, vocab + 1, dtype=torch.bool, device=ones.device)
        seen = seen.scatter(1, self.prompt_ids, torch.ones_like(self.prompt_ids, dtype=torch.bool))
        return counts[:, :vocab], seen[:, :vocab]


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
        mask_words: int = 0,
        history: tuple[int, int] = (0, 0),
        vocab: int = 0,
        incoming: tuple[int, int, torch.dtype] | None = None,
    ):
        """`mask_words`: ceil(V / 64) for a bucket whose steps carry grammar masks, else 0;
        `history`: (Pp, Po) for a bucket whose steps apply penalties, else (0, 0); `vocab` V:
        the histories' padding id; `incoming`: (bank + 1, d, dtype) of a pipeline stage after
        the first, whose step starts from the previous stage's [bank + 1, N, d]."""
        self.B, self.W, self.T, self.block_size = B, W, T, block_size
        self.scratch_slot, self.scratch_block = scratch_slot, scratch_block
        N, self.mask_words, self.history, self.vocab = B * T, mask_words, history, vocab
        Pp, Po = history
        self.sizes = [N, N, N, N, B * W, N, 6 * B, B * mask_words, 3 * B if Po else 0, B * Pp, B * Po]
        self.device_flat = torch.zeros(sum(self.sizes), dtype=torch.long, device=device)
        self.host = torch.zeros(sum(self.sizes), dtype=torch.long, pin_memory=device.type == "cuda")
        ids, pos, rows, slots, table, gather, sampling, mask, penal, prompt, output = self.device_flat.split(self.sizes)
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
            mask.view(B, mask_words) if mask_words else None,
            penal.view(3, B) if Po else None,
            prompt.view(B, Pp) if Po else None,
            output.view(B, Po) if Po else None,
        )
        if incoming is not None:
            parts, d, dtype = incoming
            self.step.incoming = torch.zeros(parts, N, d, dtype=dtype, device=device)
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
        token_mask: torch.Tensor | None = None,
        histories: list[tuple[list[int], list[int]]] | None = None,
    ) -> None:
        """Live sequences first (their tokens concatenated, seq_lens[j] <= T each), padding after;
        `slots`: each sequence's state slot, or in a verify bucket its row of T slots
        (cache/draft_slots.py row); `sampling`: the rows' device sampling values
        (sampling/device.py row_values), or None when the step returns logits; `token_mask`: the
        live rows' grammar bitmask, int32 [n, ceil(V / 32)] as xgrammar fills it, or None (a bucket
        with mask words then allows every token); `histories`: each live row's (prompt, output)
        token ids for the penalties (a row without penalties may give empty lists). One copy."""
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
        parts = [torch.tensor(ints, dtype=torch.long), floats.view(torch.long)]  # then the float64 bits
        if self.mask_words:  # the grammar bits
            parts.append(mask_words(token_mask, B, self.mask_words))
        if self.history[1]:  # the penalties and the histories they count
            penal = torch.tensor([r.get(k, d) for k, d in PENALTY_DEFAULTS for r in rows_s], dtype=torch.float64)
            parts.append(penal.view(torch.long))
            for i, width in enumerate(self.history):
                parts.append(history_ids([h[i] for h in histories or []], B, width, self.vocab))
        at = 0
        for part in parts:  # into the staging buffer in place (no concatenated copy a step)
            self.host[at : at + len(part)].copy_(part)
            at += len(part)
        self.device_flat.copy_(self.host, non_blocking=True)


def mask_words(token_mask: torch.Tensor | None, B: int, words: int) -> torch.Tensor:
    """xgrammar's int32 bitmask [n, ceil(V / 32)] (bit k of word w: token 32 w + k) as [B * words]
    int64, word pairs joined little-endian (bit k of word w: token 64 w + k); rows past n and
    the tail all ones (every token allowed)."""
    out = torch.full((B, 2 * words), -1, dtype=torch.int32)
    if token_mask is not None:
        out[: token_mask.shape[0], : token_mask.shape[1]] = token_mask
    return out.view(torch.int64).reshape(-1)


def history_ids(rows: list[list[int]], B: int, width: int, pad: int) -> torch.Tensor:
    """Token ids per row, [B * width] int64, each row padded with `pad` (rows past len(rows) too)."""
    out = torch.full((B, width), pad, dtype=torch.long)
    for j, ids in enumerate(rows):
        out[j, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out.reshape(-1)
