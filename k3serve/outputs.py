"""What a step returns (`StepOutput`: the runner's sampled tokens, per request) and what the
engine returns (`RequestOutput` / `CompletionOutput`, vLLM's shape, as vLLM keeps them in
`vllm/outputs.py`): value types that every floor above the scheduler reads.

Request outputs are cumulative: each carries all tokens and text so far, so a slow consumer can
skip intermediate ones and lose nothing (the async engine relies on this for backpressure).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class ModelFault(str):
    """A request's failure reason that is the model's fault (non-finite logits from its
    weights), not the request's: the server answers 500 naming the model, never a 400 that
    blames the client's sampling settings."""


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


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}, sampled first
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)  # arrival/first_token/finish times (s)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set when this request failed alone (the others in its steps go on)
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # predicts it)
    prompt_logprobs: list[PromptLogprob | None] | None = None
