"""Structure-aware fuzzing of the request bodies (issue 18 item 5): messages, content parts, tools,
tool_calls and sampling fields, valid, odd and wrong-typed. Every answer is below 500 with an
OpenAI error body when it is an error, no stream carries a 5xx event, the keep-alive connection
is never dropped, and the server is idle again afterwards. Bounded: a few hundred examples."""

from __future__ import annotations

import http.client
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.live import metric

SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
GARBAGE = st.recursive(
    SCALAR,
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=6), kids, max_size=3)),
    max_leaves=8,
)
TEXT = st.text(max_size=40)


def odd(*valid):
    """Mostly one of `valid`, sometimes anything at all (1 in 16): deep paths get reached."""
    return st.integers(0, 15).flatmap(lambda i: GARBAGE if i == 0 else st.one_of(*valid))


DEEP = st.integers(1, 3000).map(lambda d: "[" * d + "]" * d)  # JSON text nested d deep
NAME = st.one_of(st.sampled_from(["get_weather", "calc", "f"]), TEXT)

ARGS = odd(st.just('{"city": "Paris"}'), DEEP, TEXT, st.dictionaries(st.text(max_size=5), SCALAR, max_size=3))
FUNCTION_CALL = st.fixed_dictionaries({}, optional={"name": odd(NAME), "arguments": ARGS})
TOOL_CALL = odd(
    st.fixed_dictionaries({"function": odd(FUNCTION_CALL)}, optional={"id": odd(TEXT), "type": st.just("function")})
)
PART = odd(
    st.fixed_dictionaries({"type": st.just("text"), "text": odd(TEXT)}),
    st.fixed_dictionaries(
        {"type": odd(st.sampled_from(["image_url", "input_audio", "text"]))}, optional={"image_url": GARBAGE}
    ),
)
MESSAGE = odd(
    st.fixed_dictionaries(
        {"role": odd(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))},
        optional={
            "content": odd(TEXT, st.lists(PART, max_size=3)),
            "tool_calls": odd(st.lists(TOOL_CALL, max_size=2)),
            "tool_call_id": odd(TEXT),
            "name": odd(NAME),
            "reasoning_content": odd(TEXT),
            "reasoning": odd(TEXT),
        },
    )
)
USER = st.fixed_dictionaries({"role": st.just("user"), "content": TEXT})
MESSAGES = odd(
    st.lists(MESSAGE, min_size=1, max_size=4).map(lambda ms: [*ms, {"role": "user", "content": "x"}]),
    st.lists(USER, min_size=1, max_size=2),
    st.lists(USER, min_size=1, max_size=2),
    st.lists(MESSAGE, max_size=4),
)
TOOL = odd(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": odd(NAME)},
                optional={
                    "parameters": odd(st.just({"type": "object", "properties": {"city": {"type": "string"}}})),
                    "description": odd(TEXT),
                },
            ),
        }
    )
)
NUMBER = odd(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1e-45, 1e-300, 1e300, -1, 0.5, 2]),
)
TOKEN_ID = st.one_of(st.integers(-5, 2000), st.integers(-(2**70), 2**70))
SAMPLING = {
    "temperature": NUMBER,
    "top_p": NUMBER,
    "top_k": odd(st.integers(-3, 2**70)),
    "min_p": NUMBER,
    "repetition_penalty": NUMBER,
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "seed": odd(st.integers(-(2**70), 2**70)),
    "n": odd(st.integers(1, 3)),
    "logit_bias": odd(st.dictionaries(st.one_of(TOKEN_ID.map(str), TEXT), NUMBER, max_size=3)),
    "stop": odd(TEXT, st.lists(TEXT, max_size=3)),
    "stop_token_ids": odd(st.lists(TOKEN_ID, max_size=3)),
    "min_tokens": odd(st.integers(-2, 2**70)),
    "ignore_eos": odd(st.booleans()),
    "stream": st.booleans(),
    "priority": odd(st.integers(-(2**70), 2**70)),
    "model": odd(st.just("tiny-k3")),
}
CHAT = st.fixed_dictionaries(
    {"messages": MESSAGES, "max_tokens": st.deferred(lambda: MAX_TOKENS)},
    optional={
        **SAMPLING,
        "tools": odd(st.lists(TOOL, max_size=2)),
        "tool_choice": odd(
            st.sampled_from(["auto", "none", "required"]),
            st.fixed_dictionaries(
                {"type": st.just("function"), "function": odd(st.fixed_dictionaries({"name": NAME}))}
            ),
        ),
        "logprobs": odd(st.booleans()),
        "top_logprobs": odd(st.integers(-1, 25)),
        "response_format": odd(st.none(), st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})),
        "chat_template_kwargs": odd(st.none(), st.fixed_dictionaries({}, optional={"thinking": st.booleans()})),
        "reasoning_effort": odd(TEXT),
        "parallel_tool_calls": odd(st.booleans()),
        "add_generation_prompt": odd(st.booleans()),
    },
)
PROMPT = odd(
    TEXT,
    st.lists(TOKEN_ID, max_size=6),
    st.lists(st.lists(TOKEN_ID, max_size=4), max_size=2),
    st.lists(TEXT, max_size=2),
)
COMPLETION = st.fixed_dictionaries(
    {"prompt": PROMPT, "max_tokens": st.deferred(lambda: MAX_TOKENS)},
    optional={
        **SAMPLING,
        "logprobs": odd(st.integers(-1, 25)),
        "echo": odd(st.booleans()),
        "suffix": odd(TEXT),
        "best_of": odd(st.integers(-1, 3)),
    },
)
TOKENIZE = st.fixed_dictionaries(
    {},
    optional={
        "prompt": odd(TEXT),
        "messages": MESSAGES,
        "add_generation_prompt": odd(st.booleans()),
        "model": odd(st.just("tiny-k3"), st.none()),
    },
)
# never None (that would generate up to max_model_len): small, or wrong in every other way
MAX_TOKENS = st.integers(0, 15).flatmap(
    lambda i: (
        st.integers(1, 3)
        if i
        else st.one_of(
            st.integers(-1, 0), st.just(2**70), st.floats(-5, 1e300), st.text(max_size=3), st.lists(st.integers())
        )
    )
)
# well-formed bodies with extreme but well-typed sampling values: these reach the engine
FLOAT = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, 1e-45, 1e-300, 1e300, 0.5, 2]))
VALUES = st.fixed_dictionaries(
    {},
    optional={
        "temperature": FLOAT,
        "top_p": FLOAT,
        "min_p": FLOAT,
        "repetition_penalty": FLOAT,
        "presence_penalty": FLOAT,
        "frequency_penalty": FLOAT,
        "top_k": st.integers(-2, 2**70),
        "seed": st.integers(-(2**70), 2**70),
        "n": st.integers(1, 3),
        "logit_bias": st.dictionaries(TOKEN_ID.map(str), FLOAT, max_size=3),
        "stop": st.lists(TEXT, max_size=2),
        "stop_token_ids": st.lists(TOKEN_ID, max_size=3),
        "min_tokens": st.integers(0, 2**70),
        "ignore_eos": st.booleans(),
        "stream": st.booleans(),
        "priority": st.integers(-(2**70), 2**70),
    },
)
GOOD_IDS = st.lists(st.integers(0, 767), min_size=1, max_size=8)
CHAT_VALUES = st.tuples(
    st.lists(USER, min_size=1, max_size=2),
    st.integers(1, 3),
    VALUES,
    st.fixed_dictionaries({}, optional={"logprobs": st.booleans(), "top_logprobs": st.integers(-1, 25)}),
).map(lambda t: {"messages": t[0], "max_tokens": t[1], **t[2], **t[3]})
COMPLETION_VALUES = st.tuples(
    st.one_of(st.text(min_size=1, max_size=30), GOOD_IDS),
    st.integers(1, 3),
    VALUES,
    st.fixed_dictionaries({}, optional={"logprobs": st.integers(-1, 25), "echo": st.booleans()}),
).map(lambda t: {"prompt": t[0], "max_tokens": t[1], **t[2], **t[3]})
TOKENIZE_VALUES = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(max_size=200)}),
    st.fixed_dictionaries({"messages": st.lists(USER, min_size=1, max_size=3)}),
)
ENDPOINTS = [
    ("/v1/chat/completions", st.one_of(CHAT, CHAT_VALUES, CHAT_VALUES)),
    ("/v1/completions", st.one_of(COMPLETION, COMPLETION_VALUES, COMPLETION_VALUES)),
    ("/tokenize", st.one_of(TOKENIZE, TOKENIZE_VALUES)),
]


class Client:
    """One keep-alive connection; remembers its socket to prove the server never dropped it."""

    def __init__(self, base: str):
        host, port = base.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=60)
        self.conn.connect()
        self.sock = self.conn.sock

    def post(self, path: str, body) -> tuple[int, bytes]:
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()  # NaN/Infinity included
        self.conn.request("POST", path, body=payload, headers={"content-type": "application/json"})
        r = self.conn.getresponse()
        data = r.read()
        assert self.conn.sock is self.sock, "the server closed the keep-alive connection"
        return r.status, data


def check(status: int, data: bytes) -> None:
    assert status < 500, data[:500]
    if status >= 400:
        err = json.loads(data)["error"]
        assert err["code"] == status and isinstance(err["message"], str) and "Traceback" not in err["message"]
    elif data.startswith(b"data: "):
        for line in data.split(b"\n"):
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                assert event.get("error", {}).get("code", 0) < 500, event


@pytest.fixture(scope="module")
def client(live_server):
    return Client(live_server[0])


@pytest.mark.parametrize("path, bodies", ENDPOINTS, ids=[p for p, _ in ENDPOINTS])
def test_fuzzed_bodies_never_get_a_5xx(live_server, client, path, bodies):
    @settings(
        max_examples=300,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(body=bodies)
    def run(body):
        status, data = client.post(path, body)
        seen[status] = seen.get(status, 0) + 1
        check(status, data)

    seen: dict[int, int] = {}
    run()
    print(path, dict(sorted(seen.items())))
    assert seen.get(200, 0) >= 10 and seen.get(400, 0) >= 5 and seen.get(422, 0) >= 5  # every layer was reached
    base, state = live_server
    assert client.post("/tokenize", {"prompt": "still here"})[0] == 200
    assert metric(base, "k3serve:num_requests_running") == 0 and metric(base, "k3serve:state_slots_used") == 0


@pytest.mark.parametrize("where", ["arguments", "parameters", "content"])
def test_50k_deep_json_is_refused_cleanly(client, where):
    deep = "[" * 50_000 + "]" * 50_000
    call = '{"id": "c1", "type": "function", "function": {"name": "f", "arguments": %s}}'
    msgs = {
        "arguments": '[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [%s]},'
        ' {"role": "user", "content": "y"}]' % (call % deep),
        "parameters": '[{"role": "user", "content": "x"}]',
        "content": '[{"role": "user", "content": %s}]' % deep,
    }[where]
    tools = (
        ', "tools": [{"type": "function", "function": {"name": "f", "parameters": {"a": %s}}}]' % deep
        if where == "parameters"
        else ""
    )
    status, data = client.post("/v1/chat/completions", f'{{"messages": {msgs}{tools}, "max_tokens": 1}}'.encode())
    check(status, data)
    assert status in (400, 422)
