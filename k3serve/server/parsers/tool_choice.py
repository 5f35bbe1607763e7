"""`tool_choice` "required" / named, enforced: a structural tag (xgrammar) that lets the model
emit only tool-call markup for the declared tools, arguments constrained by each tool's
parameter schema. K3: xgrammar's `kimi_k3_xml` argument style (string values raw, others
JSON); the K2 family (Kimi-Linear): `<|tool_calls_section_begin|>` +
`<|tool_call_begin|>functions.NAME:I<|tool_call_argument_begin|>{JSON}<|tool_call_end|>`... +
`<|tool_calls_section_end|>`, then EOS.

As vLLM's "required", the reply is tool calls only. The prompt already opened the first block
(`<|open|>think<|sep|>` or `<|open|>response<|sep|>`), so the constrained output is

  [think text <|close|>think<|sep|><|open|>response<|sep|>] <|close|>response<|sep|>
  <|open|>tools<|sep|> (<|open|>call tool="NAME" index="I"<|sep|> ARGUMENTS <|close|>call<|sep|>)+
  <|close|>tools<|sep|><|close|>message<|sep|>  then <|end_of_msg|> (EOS)

with one call for a named choice (or with parallel_tool_calls false). The think part is the
constraint's free channel (its closing forced once begun or once its budget is spent, the end of
the message refused inside it); the grammar starts at `<|close|>response`. Markers are matched as
text over a vocabulary in which the XTML specials carry their own spelling.

"auto" (declared tools only): the reply is free text (thinking, content, the end of the message,
EOS), but once a call opens (`<|open|>call` for K3, `<|tool_call_begin|>` for the K2 family) it
must be a declared tool's call with arguments its schema allows: xgrammar's triggered tags over
the whole reply. Without xgrammar, or with another output constraint, auto is unconstrained.
"""

from __future__ import annotations

from k3serve.chat.markers import (
    CLOSE,
    K2_ARGUMENT_BEGIN,
    K2_CALL_BEGIN,
    K2_CALL_END,
    K2_SECTION_BEGIN,
    K2_SECTION_END,
    K2_THINK,
    OPEN,
    SEP,
)
from k3serve.sampling.grammar import _JSON_CHARS, _LOOSE_CHARS, _XGR_JSON_CHARS
from k3serve.sampling_params import StructuredOutputs

# xgrammar's kimi_k3_xml style allows whitespace runs around argument values and between
# arguments. Around a length-bounded string value that whitespace would become part of the value
# (K3's parser keeps a value verbatim), breaking maxLength; K3's renderer writes none. So every
# optional whitespace run is dropped from the derived grammar. (Its `excludes`, which would keep
# markers out of values, switches maxLength / minLength off, as its warning says: not used; a
# value can never hold `<|close|>argument<|sep|>`, which is what ends it.)
WHITESPACE_RUN = "[ \\n\\r\\t]*"
# A raw string value is any text up to `<|close|>argument<|sep|>`; xgrammar lets it hold other
# XTML markers, which K3's parser cannot read back as a value (a named call came back as no call
# at all: `65 ft<|sep|>...<|close|>response<|sep|>...` inside `expression`). No marker is text.
VALUE_END = f'excludes=("{CLOSE}argument{SEP}")'
VALUE_EXCLUDES = f'excludes=("{CLOSE}argument{SEP}", "{OPEN}", "{CLOSE}", "{SEP}")'


def _call_tag(tool: dict):
    from xgrammar.structural_tag import ConstStringFormat, JSONSchemaFormat, RegexFormat, SequenceFormat, TagFormat

    fn = tool.get("function") or {}
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return TagFormat(
        begin=f'{OPEN}call tool="{fn["name"]}" index="',
        content=SequenceFormat(
            elements=[
                RegexFormat(pattern=r"[1-9][0-9]?"),
                ConstStringFormat(value=f'"{SEP}'),
                JSONSchemaFormat(json_schema=params, style="kimi_k3_xml"),
            ]
        ),
        end=f"{CLOSE}call{SEP}",
    )


def _chosen(tools: list[dict], choice, parallel: bool) -> tuple[list[dict], bool]:
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        return [t for t in tools if (t.get("function") or {}).get("name") == name], False
    return tools, parallel


def _grammar(elements: list, eos_token_id: int, **where) -> StructuredOutputs:
    import xgrammar as xgr
    from xgrammar.structural_tag import SequenceFormat, StructuralTag

    text = str(xgr.Grammar.from_structural_tag(StructuralTag(format=SequenceFormat(elements=elements))))
    text = text.replace(WHITESPACE_RUN, '""').replace(VALUE_END, VALUE_EXCLUDES)
    # JSON strings (K2 arguments, K3 object / array values) get the characters JSON allows, as
    # json_grammar gives a json_schema: a length-bounded one took raw control characters here,
    # and K2 arguments came back that json.loads refused
    text = text.replace(_LOOSE_CHARS, _JSON_CHARS).replace(_XGR_JSON_CHARS, _JSON_CHARS)
    return StructuredOutputs("grammar", text, stop_ids=(eos_token_id,), markup=True, **where)


def _k2_call_tag(tool: dict):
    from xgrammar.structural_tag import ConstStringFormat, JSONSchemaFormat, RegexFormat, SequenceFormat, TagFormat

    fn = tool.get("function") or {}
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return TagFormat(
        begin=f"{K2_CALL_BEGIN}functions.{fn['name']}:",
        content=SequenceFormat(
            elements=[
                RegexFormat(pattern=r"[0-9]{1,2}"),
                ConstStringFormat(value=K2_ARGUMENT_BEGIN),
                JSONSchemaFormat(json_schema=params),
            ]
        ),
        end=K2_CALL_END,
    )


def k2_tool_choice(tools: list[dict], choice, parallel: bool, eos_token_id: int) -> StructuredOutputs:
    from xgrammar.structural_tag import ConstStringFormat, TagsWithSeparatorFormat

    tools, parallel = _chosen(tools, choice, parallel)
    return _grammar(
        [
            ConstStringFormat(value=K2_SECTION_BEGIN[0]),
            TagsWithSeparatorFormat(
                tags=[_k2_call_tag(t) for t in tools], separator="", at_least_one=True, stop_after_first=not parallel
            ),
            ConstStringFormat(value=K2_SECTION_END[0]),
        ],
        eos_token_id,
    )


def k3_tool_choice(tools: list[dict], choice, think: dict, parallel: bool, eos_token_id: int) -> StructuredOutputs:
    """`think`: server/parsers/response_format.py k3_think_close, the think channel the prompt opened (its
    closing enforced and budgeted before the calls), or {} when the prompt opened the response."""
    from xgrammar.structural_tag import ConstStringFormat, TagsWithSeparatorFormat

    tools, parallel = _chosen(tools, choice, parallel)
    elements = [
        ConstStringFormat(value=f"{CLOSE}response{SEP}{OPEN}tools{SEP}"),
        TagsWithSeparatorFormat(
            tags=[_call_tag(t) for t in tools], separator="", at_least_one=True, stop_after_first=not parallel
        ),
        ConstStringFormat(value=f"{CLOSE}tools{SEP}{CLOSE}message{SEP}"),
    ]
    return _grammar(elements, eos_token_id, **think)


def json_tool_choice(tools: list[dict], choice, parallel: bool, eos_token_id: int | None) -> StructuredOutputs:
    """A format with no tool-call markup of its own (a Jinja template, no K2 parser): as vLLM
    does for every model, the reply is a JSON array of calls, `[{"name": NAME, "parameters":
    {...}}, ...]`, constrained by a JSON schema over the declared tools (one item for a named
    choice or parallel_tool_calls false); the output parser turns it into tool_calls."""
    tools, parallel = _chosen(tools, choice, parallel)
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "parameters": t["function"].get("parameters") or {"type": "object", "properties": {}},
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputs.json_schema(
        schema, any_whitespace=False, stop_ids=(eos_token_id,) if eos_token_id is not None else ()
    )


# tool_choice "auto": the text is free, but a call, once opened, is to a declared tool with
# arguments its schema allows. K3's lexer (server/parsers/xtml.py) reads a call's attributes in any
# order, so the trigger stops at the element's name (`<|open|>call`) and the tag spells the rest
# as the renderer writes it; the lexer also takes whitespace after `<|open|>`, which K3 never
# writes, so free text may not spell that either (`<|open|> call tool="x"` would escape the
# trigger). The K2 family's call marker is one token, its whole trigger.
K3_CALL_OPEN = f"{OPEN}call"
K3_LOOSE_OPEN = [OPEN + c for c in " \t\r\n"]


def _declared_calls(tags: list, trigger: str, parallel: bool, excludes: list[str]):
    """Free text in which `trigger` must open one of `tags`. Without parallel calls the text
    after the first call may not open another (one call, as for required)."""
    from xgrammar.structural_tag import (
        AnyTextFormat,
        DispatchFormat,
        OrFormat,
        SequenceFormat,
        TagFormat,
        TriggeredTagsFormat,
    )

    if parallel:
        return TriggeredTagsFormat(triggers=[trigger], tags=tags, excludes=excludes)
    # xgrammar's TriggeredTagsFormat(stop_after_first) followed by free text lets the free text
    # open an undeclared call; a dispatch on the trigger whose format carries the rest does not
    rest = OrFormat(elements=[TagFormat(begin=t.begin[len(trigger) :], content=t.content, end=t.end) for t in tags])
    after = AnyTextFormat(excludes=[trigger, *excludes])
    return DispatchFormat(rules=[(trigger, SequenceFormat(elements=[rest, after]))], loop=False, excludes=excludes)


def k3_auto_tool_choice(tools: list[dict], think: dict, parallel: bool, eos_token_id: int) -> StructuredOutputs:
    """The whole reply from its first token (thinking too: a call opened there is held to the
    same tools), or, with a thinking budget (`think`: k3_think_close), from the response on."""
    calls = _declared_calls([_call_tag(t) for t in tools], K3_CALL_OPEN, parallel, K3_LOOSE_OPEN)
    return _grammar([calls], eos_token_id, **think)


# markers a K2-family reply may write outside a call that the call vocabulary does not spell
# (sampling/grammar.py MARKUP has the first section spelling only): where the tokenizer makes one
# a special, the grammar would refuse it in the free text, so auto stays unconstrained there
K2_FREE_SPECIALS = (*K2_THINK, K2_SECTION_BEGIN[1], K2_SECTION_END[1])


def k2_auto_applies(tokenizer) -> bool:
    return not any(m in tokenizer.special_tokens for m in K2_FREE_SPECIALS)


def k2_auto_tool_choice(tools: list[dict], parallel: bool, eos_token_id: int) -> StructuredOutputs:
    return _grammar([_declared_calls([_k2_call_tag(t) for t in tools], K2_CALL_BEGIN, parallel, [])], eos_token_id)
