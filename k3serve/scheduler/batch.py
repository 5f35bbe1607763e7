"""What the scheduler hands the runner (`ScheduledBatch`); what it gets back is k3serve/outputs.py's `StepOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

from k3serve.scheduler.request import Request


@dataclass
class ScheduledSeq:
    """Compute tokens [start, start + num_tokens) of one request this step."""

    request: Request
    start: int  # = tokens already cached (the sequence's context length)
    num_tokens: int
    state_slot: int
    block_table: list[int]
    sample: bool  # the chunk reaches the newest token: sample the next one
    drafts: list[int] = field(default_factory=list)  # speculative tokens verified after the newest one
    # with drafts and slot-per-draft rows (cache/draft_slots.py): the 1 + k slots its positions go to
    draft_row: list[int] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        n = self.num_tokens - len(self.drafts)
        return self.request.token_slice(self.start, self.start + n) + self.drafts


@dataclass
class ScheduledBatch:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids sent back to waiting
    restore_states: list[tuple[int, int]] = field(default_factory=list)  # (checkpoint slot, live slot) before
    save_states: list[tuple[int, int]] = field(default_factory=list)  # (live slot, checkpoint slot) after
    pinned: list[bytes] = field(default_factory=list)  # checkpoints read this step
    # from the host tier before the step (k3serve/offload): (block hash, block), (state key, slot)
    load_blocks: list[tuple[bytes, int]] = field(default_factory=list)
    load_states: list[tuple[bytes, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs
