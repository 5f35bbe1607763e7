"""What the engine returns (vLLM `RequestOutput` / `CompletionOutput` shape).

Outputs are cumulative: each carries all tokens and text so far, so a slow consumer can skip
intermediate ones and lose nothing (the async engine relies on this for backpressure).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3serve.scheduler.batch import PromptLogprob


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
