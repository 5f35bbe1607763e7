"""One test per error status; disconnects free the request's cache; bad input never crashes."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.live import metric
from tests.server.conftest import make_app

MSGS = [{"role": "user", "content": "hi"}]


def asgi(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def err(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["code"] == status
    assert "Traceback" not in body["message"]
    return body


def test_400_bad_params_and_prompt_too_long(client, live_server):
    base, _ = live_server
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny-k3", messages=MSGS, temperature=-1)
    body = err(httpx.post(base + "/v1/completions", json={"prompt": [1] * 1000, "max_tokens": 100}), 400)
    assert "1024" in body["message"] and "1100" in body["message"]  # both numbers
    err(httpx.post(base + "/v1/completions", json={"prompt": [1] * 1024}), 400)
    body = err(
        httpx.post(
            base + "/v1/chat/completions",
            json={
                "messages": MSGS,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
        ),
        400,
    )
    assert body["param"] == "tool_choice"


def test_401_bad_key(tiny_k3_dir):
    app, _ = make_app(tiny_k3_dir, "--api-key", "sekret")
    err(asgi(app, "GET", "/v1/models"), 401)
    err(asgi(app, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert asgi(app, "GET", "/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert asgi(app, "GET", "/health").status_code == 200  # only /v1 is protected


def test_404_unknown_model_and_route(client, live_server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=MSGS)
    err(httpx.get(live_server[0] + "/v2/nothing"), 404)


def test_413_body_too_large(live_server):
    big = {"prompt": "x" * (33 * 2**20)}
    err(httpx.post(live_server[0] + "/v1/completions", json=big, timeout=60), 413)


def test_422_schema_errors_are_clean(live_server):
    body = err(httpx.post(live_server[0] + "/v1/chat/completions", json={"messages": "not a list"}), 422)
    assert body["param"] == "messages"
    err(
        httpx.post(
            live_server[0] + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        ),
        400,
    )


def test_503_when_the_queue_is_full(tiny_k3_dir):
    app, _ = make_app(tiny_k3_dir, "--max-waiting", "0")
    err(asgi(app, "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 503)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": {"weird": 1}}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"messages": MSGS, "n": 100000},
        {"messages": MSGS, "max_tokens": -5},
        {"messages": MSGS, "top_logprobs": 5},
        {"messages": MSGS, "logprobs": True, "top_logprobs": 99},
        {"messages": MSGS, "logit_bias": {"abc": 1}},
        {"messages": MSGS, "stop": [""] * 3, "seed": -1, "max_tokens": 1},
        {"messages": [{"role": "tool", "content": "x"}]},
        {"messages": MSGS, "reasoning_effort": "ultra"},
    ],
)
def test_garbage_never_crashes(live_server, body):
    r = httpx.post(live_server[0] + "/v1/chat/completions", json=body)
    assert r.status_code in (200, 400, 422), r.text
    if r.status_code != 200:
        err(r, r.status_code)
    assert httpx.get(live_server[0] + "/health").status_code == 200


def test_disconnect_aborts_and_frees_cache(live_server):
    base, state = live_server
    before = state.engine.engine.counters["generation_tokens"]
    with httpx.stream(
        "POST",
        base + "/v1/completions",
        json={"prompt": "hello", "max_tokens": 900, "stream": True, "ignore_eos": True},
    ) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.monotonic() + 15
    while metric(base, "k3serve:num_requests_running") or metric(base, "k3serve:latent_blocks_used"):
        assert time.monotonic() < deadline, "request was not aborted"
        time.sleep(0.05)
    assert metric(base, "k3serve:state_slots_used") == 0
    assert state.engine.engine.counters["generation_tokens"] - before < 900  # it stopped early
