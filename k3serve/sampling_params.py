"""SamplingParams: what a request asks of the sampler (pure Python, vLLM field names), and
StructuredOutputs: what its output must match.

References: vLLM `vllm/sampling_params.py`, OpenAI API (`logit_bias`, penalties, `n`).
Bad values raise ParamError (a ValueError) naming the field; the server turns that into a 400.
Every number is checked for finiteness and width here, and every token id against the model's
vocabulary by `check_vocab` at admission: a value that passes can never make a batched sampling
step raise (issue 18: one odd request used to fail every request in the step).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MIN_TEMPERATURE = 1e-2  # 0 < t below this is raised to it (vLLM's _MAX_TEMP): 1/t overflows fp32
PENALTY_RANGE = (1e-2, 1e2)  # repetition_penalty: logits / 1e-300 overflow fp32


KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag", "text")


@dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must match (pure data; no torch, no xgrammar).

    `StructuredOutputs` names one constraint, as vLLM's `StructuredOutputsParams` does: a JSON
    schema, any JSON object, a regex, a choice of strings, an EBNF grammar, or a structural tag
    (tool calls). Where the constrained text sits in the model's output is part of it:

    - `start_after`: token ids that open the constrained span (K3 XTML: `<|open|>response<|sep|>`,
      so the think channel before it stays free); empty = from the first generated token;
    - `stop_ids`: the tokens that may end the span once the grammar is complete (EOS, or K3's
      `<|close|>` of the response channel);
    - `tail`: tokens forced after the stop token, the fixed markup that closes the message
      (`response<|sep|><|close|>message<|sep|><|end_of_msg|>` for K3).

    A free part that is a channel the model must close (K3's think channel before the response)
    says how: `free_close` is the whole closing markup, ending with `start_after`
    (`<|close|>think<|sep|><|open|>response<|sep|>`): once its first token is sampled the rest is
    forced, `free_refused` are ids never sampled inside the channel (end of message, `<|open|>`: a
    reply cannot end while thinking), and after `free_budget` free tokens the closing is forced
    (vLLM's `thinking_token_budget`). Kind "text" constrains nothing after the channel closes.
    """

    kind: str
    spec: str = ""  # the schema / regex / grammar as text; choices as a JSON list
    start_after: tuple[int, ...] = ()
    stop_ids: tuple[int, ...] = ()
    tail: tuple[int, ...] = ()
    any_whitespace: bool = True
    markup: bool = False  # compiled over a vocabulary where K3's XTML specials are spelled (tool calls)
    free_close: tuple[int, ...] = ()
    free_refused: tuple[int, ...] = ()
    free_budget: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if self.free_close and tuple(self.free_close[-len(self.start_after) :]) != tuple(self.start_after):
            raise ValueError("free_close must end with start_after")
        if self.free_close and self.free_close[0] in self.free_refused:
            raise ValueError("free_close cannot open with a refused token")
        if self.free_budget is not None and self.free_budget < 0:
            raise ValueError(f"free_budget must be >= 0, got {self.free_budget}")

    @property
    def closes_free(self) -> bool:
        """The free part is a channel this constraint closes (free_close), not a span it waits for."""
        return bool(self.free_close)

    @property
    def key(self) -> tuple[str, str, bool, bool]:
        """What the compiled grammar depends on (the cache key)."""
        return self.kind, self.spec, self.any_whitespace, self.markup

    @classmethod
    def json_schema(cls, schema: Any, **kw) -> "StructuredOutputs":
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True), **kw)

    @classmethod
    def choice(cls, options: list[str], **kw) -> "StructuredOutputs":
        return cls("choice", json.dumps(list(options)), **kw)


class ParamError(ValueError):
    """A sampling field out of range; `param` names it for the API's error body."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


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
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token (0: only the prompt's own)
    structured: StructuredOutputs | None = None  # grammar the output must match (xgrammar)
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    keep_special_token_ids: list[int] = field(default_factory=list)  # rendered even when skipping
    # specials: the structural markers output parsers read (K3 <|open|> <|close|> <|sep|>)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._check_numbers()
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        lo, hi = PENALTY_RANGE
        checks = [
            ("n", self.n >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1, 0 (off) or a positive count"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", lo <= self.repetition_penalty <= hi, f"must be in [{lo}, {hi}]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", self.min_tokens >= 0, "must be >= 0"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens, "must not exceed max_tokens"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "must be >= 0"),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0, "must be >= 0"),
            ("logit_bias", all(-100 <= v <= 100 for v in self.logit_bias.values()), "values must be in [-100, 100]"),
            ("seed", self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, f"must be in [{SEED_MIN}, {SEED_MAX}]"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ParamError(name, f"{name} {why}, got {getattr(self, name)!r}")

    def _check_numbers(self) -> None:
        """Types and finiteness first: NaN/Infinity compare False or True in the wrong places."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ParamError(name, f"{name} must be a finite number, got {v!r}")
        if not all(math.isfinite(v) for v in self.logit_bias.values()):
            raise ParamError("logit_bias", "logit_bias values must be finite numbers")
        for name in ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "seed"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ParamError(name, f"{name} must be an integer, got {v!r}")
        for name in ("stop_token_ids", "keep_special_token_ids"):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in getattr(self, name)):
                raise ParamError(name, f"{name} must be a list of integer token ids")

    def check_vocab(self, vocab_size: int) -> None:
        """Every token id the sampler will index with must be a row of the [B, vocab_size] logits
        (a negative id would silently wrap around to the end of the vocabulary)."""
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and n > vocab_size:
                raise ParamError(name, f"{name} {n} exceeds the vocabulary size {vocab_size}")
        fields = (
            ("logit_bias", list(self.logit_bias)),
            ("stop_token_ids", self.stop_token_ids),
            ("keep_special_token_ids", self.keep_special_token_ids),
        )
        for name, ids in fields:
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ParamError(name, f"{name} has token id {bad}, outside the vocabulary (0..{vocab_size - 1})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def for_sample(self, index: int) -> "SamplingParams":
        """Params of parallel sample `index` of an n > 1 request: one sample each, and a seed
        offset by the index so samples differ yet stay reproducible (vLLM does the same)."""
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed > SEED_MAX:  # wrap within the generator's 64-bit seed space
            seed -= 2**64
        return replace(self, n=1, seed=seed)
