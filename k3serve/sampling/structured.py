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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputs:
    kind: str
    spec: str = ""  # the schema / regex / grammar as text; choices as a JSON list
    start_after: tuple[int, ...] = ()
    stop_ids: tuple[int, ...] = ()
    tail: tuple[int, ...] = ()
    any_whitespace: bool = True
    markup: bool = False  # compiled over a vocabulary where K3's XTML specials are spelled (tool calls)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")

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
