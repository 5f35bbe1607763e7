"""One request as the engine tracks it: its n samples (scheduler requests), their detokenizers
and logprobs, and the group's timing metrics and prompt logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from k3serve.outputs import PromptLogprob, SampledToken
from k3serve.scheduler.request import Request
from k3serve.tokenizer.detokenizer import IncrementalDetokenizer

PromptInput = str | list[int] | dict  # text, token ids, or {"prompt_token_ids" | "prompt", "multi_modal_data"}


@dataclass
class Sample:
    """One sequence's output processor: its tokens become logprobs and text, and it says where
    the output stops (a stop string); the scheduler, which owns the request, ends it there."""

    req: Request
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float = 0.0

    def take(self, tok: SampledToken, seen: int) -> str | None:
        """The request's `seen`-th output token: its logprobs and text; the stop string it
        completes, if any (the output then ends with this token)."""
        req = self.req
        if self.logprobs is not None and tok.logprob is not None:
            self.logprobs.append({tok.token_id: tok.logprob, **dict(tok.top_logprobs)})
            self.cumulative_logprob += tok.logprob
        ended_by_token = seen == len(req.output_token_ids) and req.finished and req.finish_reason == "stop"
        if ended_by_token and not req.params.include_stop_str_in_output:
            return None  # a stop token's text is not part of the output
        return self.detok.add(tok.token_id)


@dataclass
class Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[Sample]
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    prompt_logprobs: dict[int, PromptLogprob] | None = None  # prompt index -> entry, as computed

    @property
    def finished(self) -> bool:
        return all(s.req.finished for s in self.samples)
