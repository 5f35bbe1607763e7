"""Request fields -> `StructuredOutputs`: OpenAI `response_format`, vLLM's `structured_outputs`
and its older `guided_*` fields, with where the constrained span sits for this endpoint.

K3 XTML chat: the span is the response channel's body. It opens at `<|open|>response<|sep|>`
(already in the prompt when thinking is off; generated after the think channel otherwise),
ends with `<|close|>`, and the rest of the message markup is forced after it. Completions and
Jinja-templated chat: the span is the whole output, ended by EOS.
"""

from __future__ import annotations

import json
from typing import Any

from k3serve.chat.k3_xtml import EOM, OPEN, Seg, close_tag, encode_segments, open_tag
from k3serve.sampling_params import StructuredOutputs
from k3serve.server.openai.errors import APIError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
SO_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
BACKENDS = (None, "auto", "xgrammar")


def _from_response_format(rf: dict | None) -> tuple[str, Any] | None:
    if not rf or rf.get("type") in (None, "text"):
        return None
    if rf["type"] == "json_object":
        return "json_object", None
    if rf["type"] == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), (dict, bool)):
            raise APIError(
                400, "response_format.json_schema.schema must be a JSON schema object", param="response_format"
            )
        return "json", js["schema"]
    raise APIError(
        400,
        f"response_format type {rf['type']!r} is not one of text, json_object, json_schema",
        param="response_format",
    )


def requested(req, any_whitespace: bool = False) -> tuple[str, Any, bool] | None:
    """(kind, spec, any_whitespace) of the one constraint a request asks for, or None.
    `any_whitespace`: the server's default (--structured-outputs-config), a request's own wins."""
    found: list[tuple[str, str, Any]] = []
    rf = _from_response_format(getattr(req, "response_format", None))
    if rf:
        found.append(("response_format", *rf))
    # JSON under a schema or json_object gets no free whitespace runs unless asked for: a model
    # can pad JSON with whitespace until max_tokens (vLLM's disable_any_whitespace, on here)
    any_ws = any_whitespace
    so = req.structured_outputs
    if so is not None:
        kinds = [k for k in SO_KINDS if so.get(k) not in (None, False)]
        unknown = sorted(set(so) - set(SO_KINDS) - {"disable_any_whitespace", "backend"})
        if unknown:
            raise APIError(400, f"structured_outputs.{unknown[0]} is not supported", param="structured_outputs")
        if len(kinds) != 1:
            raise APIError(
                400, "structured_outputs needs exactly one of " + ", ".join(SO_KINDS), param="structured_outputs"
            )
        found.append(("structured_outputs", kinds[0], so[kinds[0]]))
        any_ws = not so.get("disable_any_whitespace", not any_whitespace)
    for field, kind in GUIDED.items():
        if getattr(req, field) is not None:
            found.append((field, kind, getattr(req, field)))
    if req.guided_whitespace_pattern is not None:
        raise APIError(
            400,
            "guided_whitespace_pattern is not supported; use structured_outputs.disable_any_whitespace",
            param="guided_whitespace_pattern",
        )
    if req.guided_decoding_backend not in BACKENDS:
        raise APIError(
            400,
            f"guided_decoding_backend must be xgrammar (or auto), got {req.guided_decoding_backend!r}",
            param="guided_decoding_backend",
        )
    if len(found) > 1:
        raise APIError(400, f"give one output constraint, not {found[0][0]} and {found[1][0]}", param=found[1][0])
    if not found:
        return None
    field, kind, spec = found[0]
    if kind == "choice" and (not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec)):
        raise APIError(400, f"{field}: choice must be a non-empty list of non-empty strings", param=field)
    if kind in ("regex", "grammar") and not isinstance(spec, str):
        raise APIError(400, f"{field}: {kind} must be a string", param=field)
    return kind, spec, any_ws


XGRAMMAR_MISSING = (
    "structured outputs and required / named tool_choice need xgrammar, which is not installed: "
    "pip install --no-deps xgrammar==0.2.9 (or pip install 'k3serve[structured]')"
)


def xgrammar_missing() -> str | None:
    """None when xgrammar imports, else what to install (said once at start, and as a 501)."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return XGRAMMAR_MISSING
    return None


def need_xgrammar() -> None:
    if (why := xgrammar_missing()) is not None:
        raise APIError(501, why, param="structured_outputs")


def to_spec(kind: str, spec: Any, any_ws: bool, **where) -> StructuredOutputs:
    if kind == "json":
        return StructuredOutputs.json_schema(spec, any_whitespace=any_ws, **where)
    if kind == "choice":
        return StructuredOutputs.choice(spec, **where)
    if kind == "structural_tag" and not isinstance(spec, str):
        spec = json.dumps(spec)
    return StructuredOutputs(kind, "" if spec is None else spec, any_whitespace=any_ws, **where)


def k3_chat_span(tokenizer, start_channel: str | None, think_budget: int | None = None) -> dict:
    """start_after / stop_ids / tail for the K3 response channel, and the think channel's
    closing when the prompt opened one."""
    closing = encode_segments(tokenizer, close_tag("response") + close_tag("message") + [Seg(EOM, True)])
    return {
        **k3_think_close(tokenizer, start_channel, think_budget),
        "stop_ids": (closing[0],),
        "tail": tuple(closing[1:]),
    }


def k3_think_close(tokenizer, start_channel: str | None, think_budget: int | None, refuse: bool = True) -> dict:
    """The think channel a constrained K3 reply must close before its response: `<|close|>`
    starts `<|close|>think<|sep|><|open|>response<|sep|>` (the rest forced), the end of the
    message and `<|open|>` are refused inside it (`refuse`), and the closing is forced after
    `think_budget` tokens. Nothing when the prompt opened the response channel itself."""
    if start_channel != "think":
        return {}
    opening = encode_segments(tokenizer, open_tag("response"))
    refused = (tokenizer.token_to_id(EOM), tokenizer.token_to_id(OPEN)) if refuse else ()
    return {
        "start_after": tuple(opening),
        "free_budget": think_budget,
        "free_refused": refused,
        "free_close": tuple(encode_segments(tokenizer, close_tag("think")) + opening),
    }


def whole_output_span(eos_token_id: int | None) -> dict:
    return {"stop_ids": (eos_token_id,) if eos_token_id is not None else ()}
