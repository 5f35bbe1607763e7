"""A request as the scheduler sees it: token ids, progress, and why it finished (pure Python).

Progress is one number, `num_computed_tokens`: tokens whose KDA state and MLA latent rows are
in the cache. Preemption by recompute resets it to 0 and keeps the generated tokens, so the
resumed prefill covers prompt + output and sampling continues where it stopped
(vLLM v1 `Request`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from k3serve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    max_model_len: int
    arrival: int = 0  # admission order key (a counter, not wall time: deterministic)
    priority: int = 0  # lower runs first under the "priority" policy (vLLM convention)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    checkpoint_at: list[int] = field(default_factory=list)  # prefix-cache save points still ahead
    num_cached_tokens: int = 0  # prompt tokens restored from the prefix cache at admission
    spec_token_ids: list[int] = field(default_factory=list)  # drafts proposed for the next step
    spec_draft_tokens: int = 0  # drafts verified over the request's life, and how many were accepted
    spec_accepted_tokens: int = 0
    # the prompt ids prefix caching hashes: media pads replaced by ids derived from the image
    # (multimodal/prompt_media.py), so a cached prefix is reused only for the same images; None: the prompt
    prompt_cache_ids: list[int] | None = None
    # prefill/decode hand-off (engine/handoff.py): finishing leaves the cache to the engine, which
    # copies the request's latent rows and KDA state out for a decode engine before freeing it
    keep_cache: bool = False

    @property
    def max_drafts(self) -> int:
        """Drafts worth verifying now: every emitted token must fit under max_total_tokens."""
        return max(0, self.max_total_tokens - self.num_tokens - 1)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building all_token_ids (a decode step reads one token)."""
        p, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return p[start:end]
        return p[start:] + self.output_token_ids[: end - n]

    @property
    def cache_token_ids(self) -> list[int]:
        """What the prefix cache keys blocks and checkpoints by (== all_token_ids without media)."""
        return (self.prompt_cache_ids or self.prompt_token_ids) + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        limit = self.params.max_tokens
        cap = self.max_model_len if limit is None else len(self.prompt_token_ids) + limit
        return min(cap, self.max_model_len)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> bool:
        """Record a sampled token; True when it ends the request (stop token or length)."""
        self.output_token_ids.append(token_id)
        p = self.params
        past_min = len(self.output_token_ids) > p.min_tokens
        if past_min and not p.ignore_eos and token_id == self.eos_token_id:
            self.finish_reason = "stop"
        elif past_min and token_id in p.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token_id
        elif self.num_tokens >= self.max_total_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None
