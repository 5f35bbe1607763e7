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

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag", "text")


@dataclass(frozen=True)
class StructuredOutputs:
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


@dataclass
class ConstraintStats:
    """Counts for the metrics and the tests: drafts cut by the grammar before verification."""

    drafts_cut: int = 0
    masked_rows: int = 0
