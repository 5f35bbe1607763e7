"""Pick the renderer for a model: K3 XTML (Python) for `kimi_k3`, the checkpoint's Jinja
template otherwise (Kimi-Linear / K2 family). Returns token ids plus what the parsers need to
know about where generation starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3serve.chat.k2_jinja import load_chat_template, render_jinja
from k3serve.chat.k3_xtml import encode_segments, render_k3, segments_text
from k3serve.chat.messages import ChatInputError, normalize


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: list[int]
    text: str
    start_channel: str | None  # "think" / "response" when the prompt pre-opens a channel (K3)
    history_tool_calls: int = 0


@dataclass(frozen=True)
class ChatOptions:
    tools: list[dict] | None = None
    tool_choice: Any = None
    response_format: dict | None = None
    thinking: bool = True
    effort: str | None = None
    add_generation_prompt: bool = True
    template_kwargs: dict | None = None


class ChatRenderer:
    def __init__(self, model_type: str, tokenizer, model_dir: str | Path):
        self.model_type, self.tokenizer = model_type, tokenizer
        self.template = None if model_type == "kimi_k3" else load_chat_template(model_dir)

    @property
    def available(self) -> bool:
        return self.model_type == "kimi_k3" or self.template is not None

    def render(self, messages: list[dict], opts: ChatOptions) -> RenderedPrompt:
        msgs = normalize(messages)
        history = sum(len(m.tool_calls) for m in msgs)
        if self.model_type == "kimi_k3":
            segs = render_k3(msgs, opts.tools, thinking=opts.thinking, effort=opts.effort,
                             tool_choice=opts.tool_choice, response_format=opts.response_format,
                             add_generation_prompt=opts.add_generation_prompt)
            channel = ("think" if opts.thinking else "response") if opts.add_generation_prompt else None
            return RenderedPrompt(encode_segments(self.tokenizer, segs), segments_text(segs), channel, history)
        if self.template is None:
            raise ChatInputError("this model ships no chat template; use /v1/completions")
        text = render_jinja(self.template, msgs, opts.tools, opts.add_generation_prompt,
                            **(opts.template_kwargs or {}))
        return RenderedPrompt(self.tokenizer.encode(text, allow_special=True), text, None, history)
