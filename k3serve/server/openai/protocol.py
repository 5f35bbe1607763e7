"""Request bodies of the OpenAI-compatible API (pydantic), and their sampling parameters.

Field names follow the OpenAI API plus vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, prompt_logprobs, ...). A field
this server does not honour is refused with a 400 naming it (`check_fields`), never dropped in
silence. Numbers and flags are strict types: a JSON `true` is not the integer 1, `0` is not a
boolean and "0.5" is not a number (lax pydantic coerced them: `best_of: true` ran as 1); such a
body is a 422 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator

from k3serve.server.openai.errors import APIError
from k3serve.sampling_params import SamplingParams


MAX_N = 128  # parallel samples per request; each holds a KDA state slot
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]; past it the distribution is flat noise (1e300 was served)


class _Open(BaseModel):
    """A shape checked field by field; fields it does not name pass through untouched."""

    model_config = ConfigDict(extra="allow")


class FunctionCall(_Open):
    name: str
    arguments: str | dict[str, Any] | list[Any] = "{}"


class ToolCallParam(_Open):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ContentPart(_Open):
    type: str
    text: str | None = None


class ChatMessage(_Open):
    """One OpenAI chat message; `role` values and part types are checked by the renderer (400)."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"] = "function"
    function: NamedFunction


def as_dicts(items: list[BaseModel] | None) -> list[dict] | None:
    """Validated models -> the plain dicts the renderers read (unset fields dropped)."""
    return None if items is None else [m.model_dump(exclude_unset=True) for m in items]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


# Why some well-known fields are refused (the rest get the generic message).
UNSUPPORTED = {
    "use_beam_search": "beam search is not supported; sample with n instead",
    "length_penalty": "beam search is not supported",
    "early_stopping": "beam search is not supported",
    "functions": "the legacy `functions` API is not supported; declare `tools`",
    "function_call": "the legacy `function_call` is not supported; use `tool_choice`",
}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept, so check_fields can name them

    model: str | None = None
    n: StrictInt = 1
    kv_transfer_params: dict[str, Any] | None = None  # {"do_remote_decode": true}: server/pd/kv_transfer.py
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    logit_bias: dict[str, StrictFloat] | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    priority: StrictInt = 0
    user: str | None = None
    prompt_logprobs: StrictInt | None = None  # vLLM: top-n logprobs of every prompt token
    skip_special_tokens: StrictBool = True
    add_special_tokens: StrictBool = False  # Kimi prompts carry no BOS: nothing to add either way
    # output constraints, enforced with xgrammar (server/parsers/response_format.py)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    def check_fields(self) -> None:
        """A 400 for the first field this server does not honour."""
        for name, value in (self.model_extra or {}).items():
            if name == "use_beam_search" and not value:
                continue  # false asks for what happens anyway
            why = UNSUPPORTED.get(name, "this server does not honour it")
            raise APIError(400, f"unsupported field `{name}`: {why}", param=name)

    @field_validator("n")
    @classmethod
    def _n_in_range(cls, n: int) -> int:
        if not 1 <= n <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}")
        return n

    def _check_temperature(self) -> None:
        """Above MAX_TEMPERATURE is a 400; NaN and below 0 are SamplingParams' (also 400s)."""
        t = self.temperature
        if t is not None and t > MAX_TEMPERATURE:
            raise APIError(400, f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {t!r}", param="temperature")

    def _min_tokens(self, max_tokens: int) -> int:
        """min_tokens past the max_tokens the request asked for is a 400 (vLLM's check); past a
        default cap (the context left) it is held to that cap."""
        asked = _asked_max(self)
        if asked is not None and self.min_tokens > asked:
            raise APIError(400, f"min_tokens ({self.min_tokens}) must be <= max_tokens ({asked})", param="min_tokens")
        return min(self.min_tokens, max_tokens)

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, defaults: dict | None = None, **extra: Any
    ) -> SamplingParams:
        """`defaults` (generation_config.json) fill what the request leaves unset."""
        d = defaults or {}
        self._check_temperature()

        def pick(name: str, fallback):
            own = getattr(self, name)
            return own if own is not None else d.get(name, fallback)

        try:
            bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
        try:
            return SamplingParams(
                n=self.n,
                temperature=pick("temperature", 1.0),
                top_p=pick("top_p", 1.0),
                top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0),
                repetition_penalty=pick("repetition_penalty", 1.0),
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                seed=self.seed,
                stop=self.stop or [],
                stop_token_ids=self.stop_token_ids or [],
                include_stop_str_in_output=self.include_stop_str_in_output,
                max_tokens=max_tokens,
                min_tokens=self._min_tokens(max_tokens),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=self.prompt_logprobs,
                logit_bias=bias,
                skip_special_tokens=self.skip_special_tokens,
                **extra,
            )
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(" ")[0]) from None


def _asked_max(req) -> int | None:
    return getattr(req, "max_completion_tokens", None) or req.max_tokens


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    add_generation_prompt: StrictBool = True
    thinking_token_budget: StrictInt | None = None  # vLLM's name; SGLang's is max_thinking_tokens
    max_thinking_tokens: StrictInt | None = None

    def thinking_budget(self) -> int | None:
        """The most tokens the think channel may take before its closing is forced, or None."""
        given = {n: v for n in ("thinking_token_budget", "max_thinking_tokens") if (v := getattr(self, n)) is not None}
        if len(set(given.values())) > 1:
            raise APIError(
                400, "thinking_token_budget and max_thinking_tokens disagree; give one", param="max_thinking_tokens"
            )
        for name, v in given.items():
            if v < 0:
                raise APIError(400, f"{name} must be >= 0, got {v}", param=name)
        return next(iter(given.values()), None)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    response_format: dict[str, Any] | None = None
    suffix: str | None = None
    best_of: StrictInt | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True  # strict as the other bodies' flags: "yes" is a 422
    chat_template_kwargs: dict[str, Any] | None = None  # as chat: {"thinking": false} renders that prompt
    add_special_tokens: StrictBool = False  # parsed for vLLM compatibility; Kimi prompts carry no BOS


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[StrictInt] = Field(default_factory=list)  # "5" or true is not an id
