"""One request as the engine tracks it: its n samples (scheduler requests), their detokenizers
and logprobs, and the group's timing metrics and prompt logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from k3serve.scheduler.batch import PromptLogprob
from k3serve.scheduler.request import Request
from k3serve.sampling.detokenizer import IncrementalDetokenizer

PromptInput = str | list[int] | dict  # text, token ids, or {"prompt_token_ids" | "prompt", "multi_modal_data"}


@dataclass
class Sample:
    req: Request
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float = 0.0


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
