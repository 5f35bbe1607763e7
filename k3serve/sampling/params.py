"""SamplingParams: what a request asks of the sampler (pure Python, vLLM field names).

References: vLLM `vllm/sampling_params.py`, OpenAI API (`logit_bias`, penalties, `n`).
Bad values raise ValueError naming the field; the server turns that into a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in prompt or output
    presence_penalty: float = 0.0  # OpenAI: subtract once if the token occurred in the output
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the output
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (0: only the sampled one)
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    keep_special_token_ids: list[int] = field(default_factory=list)  # rendered even when skipping
    # specials: the structural markers output parsers read (K3 <|open|> <|close|> <|sep|>)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        checks = [
            ("n", self.n >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1, 0 (off) or a positive count"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", self.min_tokens >= 0, "must be >= 0"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "must not exceed max_tokens"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("logit_bias", all(-100 <= v <= 100 for v in self.logit_bias.values()),
             "values must be in [-100, 100]"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)

    def for_sample(self, index: int) -> "SamplingParams":
        """Params of parallel sample `index` of an n > 1 request: one sample each, and a seed
        offset by the index so samples differ yet stay reproducible (vLLM does the same)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
