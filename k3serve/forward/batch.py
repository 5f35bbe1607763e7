"""ForwardBatch: what the model is asked to compute in one step.

The model receives it and the cache (forward/cache.py) explicitly; there is no hidden global
context (style-anchors §7). Tokens of several sequences are flattened into one [N] stream;
per-sequence metadata says where each sequence's KDA state slot and MLA latent blocks are.
`StepRows` holds the device index tensors of the rows that run one position at a time, built
once per step; a verify pass's per-position KDA states come back in `ForwardOut` (forward/out.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


# A prefill chunk of at most this many tokens runs one position at a time too (a verify pass
# without records): on CPU the row-wise kernels beat the prefill path's per-layer torch calls at
# this size (demo model, a 10-token chunk after a prefix hit: ~0.4 ms vs ~3.8 ms). It matches
# kernels/cpu/core/common.h kSmallM, the most rows the GEMV-shaped kernels take.
SHORT_PREFILL = 16
# verify passes whose KDA records live at once: under pipeline stages a pass's rollback may follow
# the next step's forward (two steps in flight), so a rank keeps two (runner/rank_step.py) and a
# backend that reuses record buffers rotates two of them (backends/cpu.py)
RECORDS_IN_FLIGHT = 2


@dataclass
class StepRows:
    """Device tensors of the rows that run one position at a time (decodes, verify passes and
    prefill chunks of at most SHORT_PREFILL tokens), built once per batch so that no layer
    rebuilds index lists from the Python metadata.

    Sequences are ordered verifying first (batch order), then the others in batch order; R rows
    in all. `fresh` rides along for the whole batch: the KDA state slots of its new sequences,
    which the model zeroes before its layers run, whichever path then prefills them.
    """

    seqs: list[int]  # batch indices of these sequences, in that order
    decodes: list[int]  # the single-token decodes among them (seqs without the verify head)
    fresh: torch.Tensor  # [F] KDA state slots of the batch's new sequences (context 0), every length
    rows: torch.Tensor  # [R] flat-batch rows, grouped by sequence
    starts: torch.Tensor  # [S + 1] rows of sequence j are starts[j]..starts[j+1] of `rows`
    slots: torch.Tensor  # [S] KDA state slots
    seq: torch.Tensor  # [R] index j (into `seqs` / `table`) of each row
    positions: torch.Tensor  # [R] absolute position of each row
    table: torch.Tensor  # [S, W] block tables padded with -1 (never read: positions stay inside)
    cache_rows: torch.Tensor  # [R] latent-cache row each position writes
    longest: int  # most rows of one sequence (the verify record length)
    covers_all: bool  # every row of the batch is one of these (a pure decode / verify step)
    identity: bool  # ... and `rows` is 0..N-1 in order (no gather / scatter needed)

    @classmethod
    def build(cls, batch: "ForwardBatch") -> "StepRows":
        verify = set(batch.verify)
        decodes = [i for i, n in enumerate(batch.seq_lens) if n == 1 and batch.context_lens[i] > 0 and i not in verify]
        rest = [i for i, n in enumerate(batch.seq_lens) if 1 <= n <= SHORT_PREFILL and i not in verify]
        seqs = list(batch.verify) + rest
        fresh = [batch.state_slots[i] for i, n in enumerate(batch.seq_lens) if n and batch.context_lens[i] == 0]
        bounds = batch.seq_bounds()
        rows, seq, pos, cache_rows, starts = [], [], [], [], [0]
        for j, i in enumerate(seqs):
            b, e = bounds[i]
            ctx, table = batch.context_lens[i], batch.block_tables[i]
            for t in range(e - b):
                p = ctx + t
                rows.append(b + t)
                seq.append(j)
                pos.append(p)
                cache_rows.append(table[p // batch.block_size] * batch.block_size + p % batch.block_size)
            starts.append(len(rows))
        width = max((len(batch.block_tables[i]) for i in seqs), default=0)
        # every index list in one tensor (one host-to-device copy, ~5 us a torch.tensor call
        # saved per list), each field a contiguous view of it
        table = [b for i in seqs for b in batch.block_tables[i] + [-1] * (width - len(batch.block_tables[i]))]
        parts = (rows, starts, [batch.state_slots[i] for i in seqs], seq, pos, cache_rows, table, fresh)
        flat = torch.tensor([v for part in parts for v in part], dtype=torch.long, device=batch.input_ids.device)
        rows_t, starts_t, slots_t, seq_t, pos_t, cache_t, table_t, fresh_t = flat.split([len(part) for part in parts])
        return cls(
            seqs,
            decodes,
            fresh_t,
            rows_t,
            starts_t,
            slots_t,
            seq_t,
            pos_t,
            table_t.view(len(seqs), width),
            cache_t,
            max((starts[j + 1] - starts[j] for j in range(len(seqs))), default=0),
            covers_all=len(rows) == len(batch.input_ids),
            identity=rows == list(range(len(batch.input_ids))),
        )


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [N] int64, sequences concatenated
    seq_lens: list[int]  # new tokens per sequence (sum = N)
    context_lens: list[int]  # tokens already in the cache before this step, per sequence
    state_slots: list[int]  # KDA state slot per sequence
    block_tables: list[list[int]]  # MLA latent block ids per sequence (cover context + new)
    block_size: int
    verify: list[int] = field(default_factory=list)  # sequences verifying drafts: KDA records per-position states
    media_rows: torch.Tensor | None = None  # [M] rows of the flat batch whose embedding is a media row
    media_embeds: torch.Tensor | None = None  # [M, d] vision-tower rows for them (multimodal/prompt_media.py)
    step: StepRows = field(init=False)  # decode / verify rows as device tensors, built once here
    # the step's output slot for KDA verify records, layer -> (rec [S, T, H, D, D], conv [S, T, K-1, 3P]),
    # filled by the KDA layers of a verify pass and handed back in ForwardOut (not kept on the cache)
    kda_records: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(init=False, default_factory=dict)
    # index tensors the layers' per-sequence paths ask for, each built once a step on the batch's
    # device (not once per layer, and never a CPU index into a device tensor)
    _memo: dict = field(init=False, repr=False, default_factory=dict)

    static = False  # forward/static.py StaticStep says True: the fixed-shape decode of the graph backend

    def __post_init__(self) -> None:
        self.step = StepRows.build(self)

    @property
    def fresh(self) -> torch.Tensor:
        """[F] KDA state slots of the batch's new sequences, zeroed before the layers run."""
        return self.step.fresh

    def keep_kda_records(self, layer: int, bufs: tuple[torch.Tensor, torch.Tensor]) -> None:
        """A KDA layer's verify records [S', T, ...]: verifying sequences come first in `step`,
        so theirs are the buffers' head (the rest of a reused store is scratch)."""
        if not self.verify:
            return
        V = len(self.verify)
        self.kda_records[layer] = bufs if V == bufs[0].shape[0] else (bufs[0][:V], bufs[1][:V])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def _once(self, key, build):
        value = self._memo.get(key)
        if value is None:
            value = self._memo[key] = build()
        return value

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def index(self, key, values: list[int]) -> torch.Tensor:
        """A long tensor of `values` on the batch's device, built once a step under `key`."""
        return self._once(("index", key), lambda: torch.tensor(values, dtype=torch.long, device=self.device))

    def seq_bounds(self) -> list[tuple[int, int]]:
        """[start, end) of each sequence in the flattened token stream (read-only: shared)."""

        def build():
            out, pos = [], 0
            for n in self.seq_lens:
                out.append((pos, pos + n))
                pos += n
            return out

        return self._once("bounds", build)

    def cache_rows(self, seq: int, start: int, end: int) -> torch.Tensor:
        """Latent-cache rows of positions [start, end) of sequence `seq`, end <= its context +
        new tokens: a slice of the rows of [0, end) built once a step."""

        def build():
            n = self.context_lens[seq] + self.seq_lens[seq]
            pos = torch.arange(n, device=self.device)
            table = torch.tensor(self.block_tables[seq], dtype=torch.long, device=self.device)
            return table[pos // self.block_size] * self.block_size + pos % self.block_size

        return self._once(("rows", seq), build)[start:end]

    def dcp_rows(self, seq: int, layout, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode context parallelism (parallel/dcp.py DCPLayout): (positions [L'], this rank's
        local latent rows [L']) of the positions of [0, context + new) of sequence `seq` that
        `rank` holds; built once a step."""
        n = self.context_lens[seq] + self.seq_lens[seq]
        return self._once(("dcp rows", seq), lambda: layout.sequence_rows(self.block_tables[seq], n, rank, self.device))

    def padded_rows(self, seqs: list[int], lengths: list[int]) -> torch.Tensor:
        """Latent-cache rows of positions [0, lengths[j]) of sequences seqs[j], padded with row 0
        to [len(seqs), max(lengths)] (callers mask the padding); built once a step."""

        def build():
            L = max(lengths)
            pos = torch.arange(L, device=self.device)
            width = -(-L // self.block_size)
            table = torch.tensor(
                [(self.block_tables[i] + [0] * width)[:width] for i in seqs], dtype=torch.long, device=self.device
            )
            rows = table[:, pos // self.block_size] * self.block_size + pos % self.block_size
            lens = torch.tensor(lengths, device=self.device)
            return torch.where(pos.unsqueeze(0) < lens.unsqueeze(1), rows, 0)

        return self._once(("padded", tuple(seqs), tuple(lengths)), build)

    def last_token_indices(self) -> torch.Tensor:
        return torch.tensor([e - 1 for _, e in self.seq_bounds()], dtype=torch.long)
