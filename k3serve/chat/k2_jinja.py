"""Kimi-Linear / K2-family chat rendering from the Jinja `chat_template` in tokenizer_config.json
(k3-model-spec.md §7.4), the way transformers' `apply_chat_template` does it: a sandboxed
jinja2 environment, `messages`, `tools`, `add_generation_prompt` and any chat_template_kwargs.
The rendered text is tokenized once with special tokens recognised.

History tool-call ids are normalised to `functions.NAME:IDX` (IDX counting calls from the start
of the conversation) before rendering, the fix vLLM's K2 audit found necessary
(serving-notes.md §4.2); tool results are re-pointed to the normalised ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from k3serve.chat.messages import ChatInputError, Message


def load_chat_template(model_dir: str | Path) -> str | None:
    """`chat_template.jinja` (transformers' newer layout), else tokenizer_config.json's."""
    jinja = Path(model_dir) / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    cfg = Path(model_dir) / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    template = json.loads(cfg.read_text()).get("chat_template")
    if isinstance(template, list):  # HF allows named templates
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def normalize_tool_ids(messages: list[Message]) -> int:
    """Rewrite history ids to functions.NAME:IDX; returns how many calls the history holds."""
    count, renamed = 0, {}
    for m in messages:
        for call in m.tool_calls:
            new = f"functions.{call.name}:{count}"
            renamed[call.id] = new
            call.id = new
            count += 1
        if m.role == "tool" and m.tool_call_id in renamed:
            m.tool_call_id = renamed[m.tool_call_id]
    return count


def as_template_dicts(messages: list[Message]) -> list[dict]:
    out = []
    for m in messages:
        d = {"role": m.role, "content": m.content}
        if m.name:
            d["name"] = m.name
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in m.tool_calls
            ]
        out.append(d)
    return out


def render_jinja(
    template: str,
    messages: list[Message],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    **kwargs,
) -> str:
    normalize_tool_ids(messages)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(template).render(
            messages=as_template_dicts(messages), tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except TemplateError as e:
        raise ChatInputError(f"chat template failed: {e}") from None


# A K2-style template for checkpoints that ship none (our tiny Kimi-Linear builds); written from
# k3-model-spec.md §7.4, not copied from a release.
K2_STYLE_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif m.role == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif m.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>{{ m.name or 'tool' }}<|im_middle|>## Return of {{ m.tool_call_id }}{{ '\\n' }}"
    "{%- endif -%}"
    "{{ m.content }}"
    "{%- if m.tool_calls -%}<|tool_calls_section_begin|>"
    "{%- for tc in m.tool_calls -%}<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>"
    "{{ tc.function.arguments }}<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
