"""The bundled demo model behind `k3serve serve` (no model argument), through the official
openai client, with the flags `make serve` uses (DSpark speculation, prefix caching on).

Each task runs 60 held-out prompts (fixed seeds, greedy) and asserts a floor on a success rate.
The floors sit below the rates measured on the shipped weights (README); greedy decoding makes
the rates reproducible, so a drop below a floor means the model, the renderer, the parsers or
the engine changed behaviour. Measured on the shipped weights: arithmetic answered in the
trained form with reasoning 60/60 but right 0/60; tool calls well-formed 60/60, right tool and
arguments 14/60; follow-up answers in the trained form 56/60, using the tool result 3/60.
The model has learned the formats, not yet to copy numbers and names reliably (issue 10 stays
open on that), so only rates that are well above chance are asserted.
"""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from k3serve.cli import build_parser
from k3serve.demo import DEMO_DIR, bundled_demo, default_model
from k3serve.demo.data import TOOLS, arithmetic, tool_case
from k3serve.demo.tools import run_tool
from tests.live import serving

SERVE_FLAGS = [
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "kimi_k3",
    "--reasoning-parser",
    "kimi_k3",
    "--speculative-config",
    '{"method": "dspark", "model": "dspark", "num_speculative_tokens": 4}',
]
N = 60
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# floors (measured rates on the shipped weights, see module docstring)
ARITHMETIC_FORM_FLOOR = 0.90
WELL_FORMED_FLOOR = 0.90
RIGHT_ARGUMENTS_FLOOR = 0.15  # chance is about 1/16 for a city and ~0 for numbers
ANSWER_FORM_FLOOR = 0.90


@pytest.fixture(scope="module")
def client():
    from openai import OpenAI

    from k3serve.server.launch import build_server

    app, _ = build_server(build_parser().parse_args(["serve", *SERVE_FLAGS]))
    with serving(app) as base:
        yield OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat_all(client, requests: list[dict]) -> list:
    model = client.models.list().data[0].id
    with ThreadPoolExecutor(16) as pool:
        return list(
            pool.map(
                lambda kw: client.chat.completions.create(model=model, temperature=0, max_tokens=200, **kw), requests
            )
        )


def schema_problem(arguments: str, schema: dict) -> str | None:
    """None if `arguments` is a JSON object with exactly the schema's required keys, typed right."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return "not JSON"
    if not isinstance(args, dict) or set(args) != set(schema["required"]):
        return f"keys {sorted(args) if isinstance(args, dict) else type(args).__name__}"
    types = {"string": (str,), "number": (int, float)}
    bad = [k for k, v in args.items() if not isinstance(v, types[schema["properties"][k]["type"]])]
    return f"wrong type for {bad}" if bad else None


def test_the_demo_is_bundled_small_and_the_default():
    assert bundled_demo() == DEMO_DIR and default_model() == DEMO_DIR
    assert (DEMO_DIR / "dspark" / "config.json").is_file()
    size = sum(p.stat().st_size for p in DEMO_DIR.rglob("*") if p.is_file())
    assert size <= 30 * 2**20, size


def test_held_out_arithmetic_is_answered_with_reasoning(client):
    rng = random.Random(2024)
    cases = [arithmetic(rng, held_out=True) for _ in range(N)]
    replies = chat_all(client, [{"messages": [{"role": "user", "content": q}]} for q, _, _ in cases])
    formed = right = 0
    for (q, _, answer), r in zip(cases, replies):
        msg = r.choices[0].message
        ok = (
            bool(getattr(msg, "reasoning_content", None))
            and r.choices[0].finish_reason == "stop"
            and re.fullmatch(r"\d+ \+ \d+ = \d+\.", msg.content or "") is not None
        )
        formed += ok
        right += ok and msg.content.endswith(f"= {answer.split('= ')[1]}")
    print(f"held-out arithmetic: reasoning + answer in the trained form {formed}/{N}, right {right}/{N}")
    assert formed / N >= ARITHMETIC_FORM_FLOOR


def _tool_cases(seed: int) -> list[tuple]:
    rng = random.Random(seed)
    return [tool_case(rng) for _ in range(N)]


def test_tool_calls_are_well_formed_and_use_the_request(client):
    cases = _tool_cases(7)
    replies = chat_all(client, [{"messages": [{"role": "user", "content": c[0]}], "tools": TOOLS} for c in cases])
    well_formed = right = 0
    for (user, want, *_), r in zip(cases, replies):
        choice = r.choices[0]
        calls = choice.message.tool_calls or []
        ok = (
            choice.finish_reason == "tool_calls"
            and len(calls) == 1
            and calls[0].function.name in SCHEMAS
            and schema_problem(calls[0].function.arguments, SCHEMAS[calls[0].function.name]) is None
        )
        well_formed += ok
        right += (
            ok
            and calls[0].function.name == want.name
            and json.loads(calls[0].function.arguments) == json.loads(want.arguments)
        )
    print(f"tool calls: well-formed {well_formed}/{N}, right tool and arguments {right}/{N}")
    assert well_formed / N >= WELL_FORMED_FLOOR
    assert right / N >= RIGHT_ARGUMENTS_FLOOR


def test_answers_use_the_tool_result(client):
    """The full loop: the model's own call is executed (demo/tools.py) and the result sent back."""
    cases, rng = _tool_cases(11), random.Random(11)
    first = chat_all(client, [{"messages": [{"role": "user", "content": c[0]}], "tools": TOOLS} for c in cases])
    follow, expected = [], []
    for (user, *_), r in zip(cases, first):
        calls = r.choices[0].message.tool_calls or []
        if not calls:
            continue
        call = calls[0]
        try:
            result = run_tool(call.function.name, call.function.arguments, rng)
        except ValueError:
            continue  # counted as a failure: the loop cannot go on
        history = [
            {"role": "user", "content": user},
            {
                "role": "assistant",
                "content": r.choices[0].message.content,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": call.function.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": result},
        ]
        follow.append({"messages": history, "tools": TOOLS})
        expected.append(_facts(call.function.name, result))
    replies = chat_all(client, follow)
    formed = sum(_answer_form(r) for r in replies)
    used = sum(
        _answer_form(r) and all(f in r.choices[0].message.content for f in facts) for facts, r in zip(expected, replies)
    )
    print(f"answers after the tool result: in the trained form {formed}/{N}, using the result {used}/{N}")
    assert formed / N >= ANSWER_FORM_FLOOR


def _answer_form(r) -> bool:
    """A final answer: reasoning, one sentence of content, no further tool call."""
    msg = r.choices[0].message
    return (
        r.choices[0].finish_reason == "stop"
        and not msg.tool_calls
        and bool(getattr(msg, "reasoning_content", None))
        and (msg.content or "").endswith(".")
    )


def _facts(name: str, result: str) -> list[str]:
    """What an answer must contain to have used the result."""
    if name == "get_weather":
        r = json.loads(result)
        return [r["condition"], f"{r['temp_c']} C"]
    return [result]
