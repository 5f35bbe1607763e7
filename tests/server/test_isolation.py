"""Issue 18 item 1 over HTTP: each request that used to fail every in-flight request now gets a
400 (or is served), while a victim stream started before it completes with its tokens alone."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

VICTIM = {"prompt": "the victim", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 0}
MSGS = [{"role": "user", "content": "hi"}]

TRIGGERS = [  # (body fields, expected status): 200 where the value is valid and clamped (as vLLM does)
    ({"temperature": 1e-45}, 200),
    ({"temperature": float("inf"), "min_tokens": 3}, 400),
    ({"repetition_penalty": 1e-300}, 400),
    ({"top_k": 2**63}, 200),
    ({"top_k": 2**70}, 200),
    ({"seed": 2**64}, 400),
    ({"seed": 2**64 - 1, "n": 2}, 200),
    ({"logit_bias": {"999999": 5}}, 400),
    ({"logit_bias": {"-1": 5}}, 400),
    ({"stop_token_ids": [999999], "min_tokens": 3}, 400),
    ({"temperature": float("nan")}, 400),
    ({"presence_penalty": float("-inf")}, 400),
]


def stream_tokens(base: str, body: dict, started: threading.Event | None = None) -> list[int]:
    """Token ids of a streamed completion (one logprob entry per token)."""
    toks = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                toks += (choice.get("logprobs") or {}).get("tokens", [])
            if started is not None and toks:
                started.set()
    return toks


@pytest.fixture(scope="module")
def victim_alone(live_server):
    return stream_tokens(live_server[0], VICTIM)


@pytest.mark.parametrize("fields, status", TRIGGERS, ids=[json.dumps(t[0]) for t in TRIGGERS])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_request_does_not_hurt_a_running_one(live_server, victim_alone, route, fields, status):
    base, state = live_server
    started, result = threading.Event(), {}
    victim = threading.Thread(target=lambda: result.setdefault("toks", stream_tokens(base, VICTIM, started)))
    victim.start()
    assert started.wait(30), "the victim never started"
    body = {"prompt": "bad"} if route == "/v1/completions" else {"messages": MSGS}
    payload = json.dumps({**body, "max_tokens": 6, **fields})  # Infinity/NaN as Python's json writes them
    r = httpx.post(base + route, content=payload, headers={"content-type": "application/json"}, timeout=60)
    victim.join(60)
    assert r.status_code == status, r.text
    if status == 400:
        err = r.json()["error"]
        assert err["code"] == 400 and err["param"] is not None and "Traceback" not in err["message"]
        assert err["param"].split(".")[0] in json.dumps(fields), err  # it names the offending field
    assert result["toks"] == victim_alone
    assert not state.engine.engine.has_unfinished_requests()
