"""Synthetic training conversations in the K3 chat format (spec §7.3), generated from a seed.

Task types (each an assistant turn rendered exactly as the server renders prompts):
  arithmetic  "What is 27 + 45?" -> think: digit-by-digit with carries -> "27 + 45 = 72."
  facts       a small fixed set of capital/colour/count questions
  tools       get_weather / calculator / unit_converter: turn 1 emits a `tools` channel call,
              turn 2 answers from the tool result
  no-think    the same questions with thinking off (the prompt pre-opens `response`)
plus plain text from Python's own standard-library sources for language modelling.
A sample = (prompt ids, completion ids): loss is taken on the completion only.
"""

from __future__ import annotations

import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from k3serve.chat.k3_xtml import assistant_body, encode_segments, message, open_tag, render_k3, segments_text
from k3serve.chat.messages import Message, ToolCall

TOOLS = [  # schemas kept short: every tool prompt carries them
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "unit_converter",
            "parameters": {
                "type": "object",
                "properties": {
                    "value": {"type": "number"},
                    "from_unit": {"type": "string"},
                    "to_unit": {"type": "string"},
                },
                "required": ["value", "from_unit", "to_unit"],
            },
        },
    },
]
CITIES = [
    "Paris",
    "Tokyo",
    "Berlin",
    "Lima",
    "Oslo",
    "Cairo",
    "Delhi",
    "Rome",
    "Quito",
    "Seoul",
    "Madrid",
    "Dublin",
    "Nairobi",
    "Hanoi",
    "Austin",
    "Perth",
]
WEATHER = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]
UNITS = {
    ("km", "miles"): 0.621371,
    ("miles", "km"): 1.609344,
    ("kg", "lb"): 2.204623,
    ("lb", "kg"): 0.453592,
    ("m", "ft"): 3.28084,
    ("ft", "m"): 0.3048,
}
FACTS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Peru?", "Lima"),
    ("What colour is the sky on a clear day?", "Blue"),
    ("How many days are in a week?", "Seven"),
    ("How many legs does a spider have?", "Eight"),
    ("What is the opposite of hot?", "Cold"),
]


@dataclass
class Sample:
    prompt: list[int]
    completion: list[int]
    kind: str


def add_thought(a: int, b: int) -> str:
    """Digit-by-digit addition with carries: the reasoning a tiny model can imitate."""
    da, db = str(a)[::-1], str(b)[::-1]
    carry, digits, steps = 0, [], []
    for i in range(max(len(da), len(db))):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        s = x + y + carry
        steps.append(f"{x} + {y}" + (f" + {carry}" if carry else "") + f" = {s}")
        carry, digits = s // 10, digits + [str(s % 10)]
    if carry:
        digits.append("1")
    return "; ".join(steps) + f". So {a + b}."


def arithmetic(rng: random.Random, held_out: bool = False) -> tuple[str, str, str]:
    while True:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        if ((a * 7 + b * 13) % 10 == 0) == held_out:  # a fixed 10% of pairs never appear in training
            break
    return f"What is {a} + {b}?", add_thought(a, b), f"{a} + {b} = {a + b}."


def tool_case(rng: random.Random) -> tuple[str, ToolCall, str, str, str]:
    """(user text, call, tool result, thought after the result, final answer)."""
    kind = rng.choice(["get_weather", "calculator", "unit_converter"])
    if kind == "get_weather":
        city, w, t = rng.choice(CITIES), rng.choice(WEATHER), rng.randint(-5, 35)
        user = rng.choice(
            [f"What's the weather in {city}?", f"How is the weather in {city} today?", f"Weather for {city}, please."]
        )
        call = ToolCall("", "get_weather", json.dumps({"city": city}))
        result = json.dumps({"city": city, "condition": w, "temp_c": t})
        return user, call, result, f"The tool says {w} and {t} C.", f"It is {w} and {t} C in {city}."
    if kind == "calculator":
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice(["*", "+", "-"])
        expr, val = f"{a} {op} {b}", eval(f"{a} {op} {b}")  # noqa: S307 - two ints and an operator
        user = rng.choice([f"Use the calculator: what is {expr}?", f"Calculate {expr} with the calculator."])
        call = ToolCall("", "calculator", json.dumps({"expression": expr}))
        return user, call, str(val), f"The calculator returned {val}.", f"{expr} = {val}."
    (src, dst), value = rng.choice(list(UNITS)), rng.randint(1, 200)
    out = round(value * UNITS[(src, dst)], 2)
    user = rng.choice([f"Convert {value} {src} to {dst}.", f"How many {dst} is {value} {src}?"])
    call = ToolCall("", "unit_converter", json.dumps({"value": value, "from_unit": src, "to_unit": dst}))
    return user, call, str(out), f"The converter returned {out}.", f"{value} {src} is {out} {dst}."


class Renderer:
    """prompt ids = what the server renders; completion ids = the assistant message after it."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def sample(self, history: list[Message], answer: Message, thinking: bool, tools, kind: str) -> Sample:
        prompt = encode_segments(self.tok, render_k3(history, tools, thinking=thinking))
        full = encode_segments(self.tok, message("assistant", assistant_body(answer, thinking)))
        head = self._generation_prompt(thinking)
        if prompt[-len(head) :] != head or full[: len(head)] != head:
            raise AssertionError("the generation prompt is not a prefix of the rendered assistant message")
        return Sample(prompt, full[len(head) :], kind)

    def _generation_prompt(self, thinking: bool) -> list[int]:
        segs = open_tag("message", [("role", "assistant")]) + open_tag("think" if thinking else "response")
        return encode_segments(self.tok, segs)


def conversations(tokenizer, n: int, seed: int) -> list[Sample]:
    rng, r = random.Random(seed), Renderer(tokenizer)
    out = []
    for _ in range(n):
        u = rng.random()
        if u < 0.12:  # copying drill: the skill tool arguments and answers need
            words = " ".join(rng.choice(CITIES + [str(rng.randint(0, 999))]) for _ in range(rng.randint(1, 4)))
            out.append(
                r.sample(
                    [Message("user", f"Repeat after me: {words}")], Message("assistant", words), False, None, "no-think"
                )
            )
        elif u < 0.47:
            q, thought, ans = arithmetic(rng)
            thinking = rng.random() < 0.8
            out.append(
                r.sample(
                    [Message("user", q)],
                    Message("assistant", ans, thought if thinking else None),
                    thinking,
                    None,
                    "arithmetic" if thinking else "no-think",
                )
            )
        elif u < 0.5:
            q, a = rng.choice(FACTS)
            thinking = rng.random() < 0.5
            out.append(
                r.sample(
                    [Message("user", q)],
                    Message("assistant", f"{a}.", "A known fact."),
                    thinking,
                    None,
                    "facts" if thinking else "no-think",
                )
            )
        else:
            user, call, result, thought2, answer = tool_case(rng)
            call.id = "c1"
            first = Message("assistant", "", f"I should call {call.name}.", [call])
            hist = [Message("user", user)]
            out.append(r.sample(hist, first, True, TOOLS, "tool-call"))
            hist2 = hist + [first, Message("tool", result, tool_call_id="c1")]
            out.append(r.sample(hist2, Message("assistant", answer, thought2), True, TOOLS, "tool-answer"))
    return out


def drills(tokenizer, n: int, seed: int) -> list[Sample]:
    """The retrieval-first phase: tasks whose answer is copied from the prompt (repeat a list,
    look a value up, the first tool call's argument, the digits of a sum), so copying is
    learned before the conversations need it."""
    rng, r = random.Random(seed + 7919), Renderer(tokenizer)
    out = []
    for _ in range(n):
        u = rng.random()
        if u < 0.3:
            words = " ".join(rng.choice(CITIES + [str(rng.randint(0, 999))]) for _ in range(rng.randint(1, 6)))
            out.append(
                r.sample(
                    [Message("user", f"Repeat after me: {words}")], Message("assistant", words), False, None, "copy"
                )
            )
        elif u < 0.55:
            keys = rng.sample(["a", "b", "c", "d", "x", "y", "z", "k"], rng.randint(2, 4))
            vals = {k: rng.choice([str(rng.randint(0, 999)), rng.choice(CITIES)]) for k in keys}
            key = rng.choice(keys)
            facts = ", ".join(f"{k} is {v}" for k, v in vals.items())
            out.append(
                r.sample(
                    [Message("user", f"Remember: {facts}. What is {key}?")],
                    Message("assistant", f"{vals[key]}."),
                    False,
                    None,
                    "lookup",
                )
            )
        elif u < 0.8:
            q, thought, ans = arithmetic(rng)
            out.append(r.sample([Message("user", q)], Message("assistant", ans, thought), True, None, "arithmetic"))
        else:
            user, call, _, _, _ = tool_case(rng)
            call.id = "c1"
            out.append(
                r.sample(
                    [Message("user", user)],
                    Message("assistant", "", f"I should call {call.name}.", [call]),
                    True,
                    TOOLS,
                    "tool-call",
                )
            )
    return out


def stdlib_text(max_chars: int, seed: int) -> str:
    """Plain text for language modelling: Python's own standard-library sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size < 60_000)
    rng = random.Random(seed)
    rng.shuffle(files)
    chunks, total = [], 0
    for f in files:
        text = f.read_text(errors="ignore")
        chunks.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(chunks)[:max_chars]


def tokenizer_corpus(n: int, seed: int, stdlib_chars: int) -> str:
    """Text to train the demo tokenizer on: rendered conversations (specials as names) + stdlib."""
    rng = random.Random(seed)
    parts = []
    for _ in range(n):
        user, call, result, thought2, answer = tool_case(rng)
        q, thought, ans = arithmetic(rng)
        msgs = [
            Message("user", user),
            Message("assistant", "", "I should call.", [call]),
            Message("tool", result, tool_call_id=call.id),
            Message("assistant", answer, thought2),
            Message("user", q),
            Message("assistant", ans, thought),
        ]
        parts.append(segments_text(render_k3(msgs, TOOLS, add_generation_prompt=False)))
    return "".join(parts) + stdlib_text(stdlib_chars, seed)


__all__ = ["Sample", "conversations", "drills", "stdlib_text", "tokenizer_corpus", "arithmetic", "tool_case", "TOOLS"]
