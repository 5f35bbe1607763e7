"""Pick the renderer for a model and return token ids plus what the parsers need to know about
where generation starts. In order:
  1. `--chat-template` (a Jinja template) when given: used for every model;
  2. K3 XTML (Python) for `kimi_k3` whose tokenizer has the four XTML specials;
  3. the checkpoint's own Jinja template (`chat_template.jinja`, else `chat_template` in
     tokenizer_config.json): Kimi-Linear / K2 family, or a K3 checkpoint shipped with a
     Hugging Face tokenizer that lacks the XTML specials;
  4. none: `startup_problem` says why, and the server refuses to start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3serve.chat.k2_jinja import load_chat_template, render_jinja
from k3serve.chat.k3_xtml import CLOSE, EOM, OPEN, SEP, encode_segments, render_k3, segments_text
from k3serve.chat.messages import ChatInputError, normalize


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: list[int]
    text: str
    start_channel: str | None  # "think" / "response" when the prompt pre-opens a channel (K3)
    history_tool_calls: int = 0
    media: tuple = ()  # processed media items, in the order their pad runs appear


@dataclass(frozen=True)
class ChatOptions:
    tools: list[dict] | None = None
    tool_choice: Any = None
    response_format: dict | None = None
    thinking: bool = True
    effort: str | None = None
    add_generation_prompt: bool = True
    template_kwargs: dict | None = None


XTML_SPECIALS = (OPEN, CLOSE, SEP, EOM)


class ChatRenderer:
    def __init__(self, model_type: str, tokenizer, model_dir: str | Path, chat_template: str | None = None):
        self.model_type, self.tokenizer = model_type, tokenizer
        specials = getattr(tokenizer, "special_tokens", {})
        self.missing_xtml = [t for t in XTML_SPECIALS if t not in specials] if model_type == "kimi_k3" else []
        self.xtml = model_type == "kimi_k3" and not self.missing_xtml and chat_template is None
        self.template = (
            chat_template if chat_template is not None else (None if self.xtml else load_chat_template(model_dir))
        )
        self.source = (
            "--chat-template"
            if chat_template is not None
            else "K3 XTML"
            if self.xtml
            else "the checkpoint's chat template"
            if self.template
            else None
        )

    @property
    def available(self) -> bool:
        return self.xtml or self.template is not None

    def startup_problem(self) -> str | None:
        """Why chat cannot be rendered at all (the server refuses to start), or None."""
        if self.available:
            return None
        if self.missing_xtml:
            return (
                f"this K3 checkpoint's tokenizer lacks K3's XTML special tokens ({', '.join(self.missing_xtml)}) "
                f"and ships no chat template (chat_template.jinja or tokenizer_config.json); "
                f"pass --chat-template FILE"
            )
        return None  # a base model without a template serves /v1/completions; chat gets a 400

    def render(self, messages: list[dict], opts: ChatOptions, load_media=None) -> RenderedPrompt:
        msgs = normalize(messages, load_media if self.xtml else None)
        history = sum(len(m.tool_calls) for m in msgs)
        media = tuple(item for m in msgs for item in m.media)
        if self.xtml:
            segs = render_k3(
                msgs,
                opts.tools,
                thinking=opts.thinking,
                effort=opts.effort,
                tool_choice=opts.tool_choice,
                response_format=opts.response_format,
                add_generation_prompt=opts.add_generation_prompt,
            )
            channel = ("think" if opts.thinking else "response") if opts.add_generation_prompt else None
            return RenderedPrompt(encode_segments(self.tokenizer, segs), segments_text(segs), channel, history, media)
        if self.template is None:
            raise ChatInputError("this model ships no chat template; use /v1/completions")
        text = render_jinja(self.template, msgs, opts.tools, opts.add_generation_prompt, **(opts.template_kwargs or {}))
        return RenderedPrompt(self.tokenizer.encode(text, allow_special=True), text, None, history)
