"""What the scheduler hands the runner (`ScheduledBatch`) and gets back (`StepOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from k3serve.scheduler.request import Request


class ModelFault(str):
    """A request's failure reason that is the model's fault (non-finite logits from its
    weights), not the request's: the server answers 500 naming the model, never a 400 that
    blames the client's sampling settings."""


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


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # log p(token) under the model's raw distribution
    top_logprobs: tuple[tuple[int, float], ...] = ()  # the n most likely (id, logprob), best first


@dataclass
class StepOutput:
    """Tokens emitted per request this step: one, or with speculation the accepted drafts plus
    the residual/bonus token."""

    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it failed alone this step
    # request id -> {prompt index i: its PromptLogprob} for the prompt tokens i >= 1 this step computed
    prompt_logprobs: dict[str, dict[int, PromptLogprob]] = field(default_factory=dict)
    # request id -> the verify position whose state slot becomes its live one (a static verify
    # step wrote each position's state to its own slot: cache/draft_slots.py)
    accepted: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptLogprob:
    """Prompt token i given tokens < i: its logprob and rank (1 = the model's top choice) and the
    top-n alternatives as (token id, logprob), best first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()
