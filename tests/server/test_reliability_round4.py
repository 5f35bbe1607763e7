"""Issue 63: one bad line of a batch file fails alone (NaN, a bad UTF-8 byte); numbers and flags
are strict types (a bool is no integer, an integer no bool); temperature is bounded; POST /ping
answers as GET; media pad ids in a completion prompt are the prompt's fault."""

from __future__ import annotations

import json

import httpx
import pytest

from k3serve.cli import main

MSGS = [{"role": "user", "content": "hi"}]


# ---- run-batch ---------------------------------------------------------------------------------
def _request(cid: str, prompt: str = "a b") -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, "max_tokens": 2}}


def _run_batch(model_dir, tmp_path, lines: list[bytes]) -> list[dict]:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    flags = ["--cache-memory", "32MiB", "--max-model-len", "256", "--max-num-seqs", "4"]
    assert main(["run-batch", "-i", str(src), "-o", str(dst), str(model_dir), *flags]) == 0
    return [json.loads(line) for line in dst.read_text(encoding="utf-8").splitlines()]


def _ok(record: dict, cid: str) -> None:
    assert record["custom_id"] == cid and record["error"] is None, record
    assert record["response"]["status_code"] == 200


def test_run_batch_a_nan_line_fails_alone(tiny_k3_dir, tmp_path):
    """`"temperature": NaN` (Python's json reads it) made the client raise on sending it, and
    that ended the whole batch with no output file."""
    nan = '{"custom_id": "nan", "url": "/v1/completions", "body": {"prompt": "a", "temperature": NaN}}'
    inf = '{"custom_id": "inf", "url": "/v1/completions", "body": {"prompt": "a", "top_p": -Infinity}}'
    out = _run_batch(
        tiny_k3_dir,
        tmp_path,
        [json.dumps(_request("a")).encode(), nan.encode(), inf.encode(), json.dumps(_request("b")).encode()],
    )
    assert len(out) == 4
    _ok(out[0], "a")
    _ok(out[3], "b")
    for k, word in ((1, "NaN"), (2, "-Infinity")):
        assert out[k]["response"] is None and out[k]["error"]["code"] == "invalid_request", out[k]
        assert out[k]["error"]["message"].startswith(f"line {k + 1}: not JSON") and word in out[k]["error"]["message"]


def test_run_batch_a_bad_utf8_byte_fails_its_line_only(tiny_k3_dir, tmp_path):
    """One byte that is not UTF-8 refused the whole file (UnicodeDecodeError); and a raw U+2028
    or U+0085 inside a JSON string, which str.splitlines() takes for a line break, is no break."""
    bad = json.dumps(_request("latin-1", "caf\u00e9"), ensure_ascii=False).encode("latin-1")  # é as the lone byte 0xe9
    odd = json.dumps(_request("separators", "a\u2028b\u0085c"), ensure_ascii=False).encode()
    out = _run_batch(tiny_k3_dir, tmp_path, [json.dumps(_request("a")).encode(), bad, odd])
    assert len(out) == 3
    _ok(out[0], "a")
    assert out[1]["response"] is None and out[1]["error"]["code"] == "invalid_request", out[1]
    assert out[1]["error"]["message"].startswith("line 2: not UTF-8") and "0xe9" in out[1]["error"]["message"]
    _ok(out[2], "separators")


# ---- strict types ----------------------------------------------------------------------------
INTEGER_FIELDS = [
    ("/v1/completions", {"prompt": "a", "max_tokens": 2}, "best_of", True),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2}, "n", True),
    ("/v1/completions", {"prompt": "a"}, "max_tokens", True),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2}, "logprobs", True),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2}, "seed", False),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2}, "max_tokens", 2.0),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "logprobs": True}, "top_logprobs", True),
    ("/v1/chat/completions", {"messages": MSGS}, "max_completion_tokens", True),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2}, "seed", True),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2}, "n", "1"),
]


def _ids(cases) -> list[str]:
    return [f"{path.removeprefix('/v1/')} {field}={value!r}" for path, _, field, value in cases]


@pytest.mark.parametrize("path, body, field, value", INTEGER_FIELDS, ids=_ids(INTEGER_FIELDS))
def test_integer_fields_refuse_booleans(live_server, path, body, field, value):
    """`best_of: true` ran as best_of 1: lax pydantic coerced the bool (and 2.0, and "1")."""
    base, _ = live_server
    r = httpx.post(base + path, json={**body, field: value}, timeout=60)
    assert r.status_code == 422 and r.json()["error"]["param"] == field, r.text  # a schema mismatch (errors.py)


BOOLEAN_FIELDS = [
    ("/v1/responses", {"input": "x", "max_output_tokens": 2}, "background", 0),
    ("/v1/responses", {"input": "x", "max_output_tokens": 2}, "stream", 1),
    ("/v1/responses", {"input": "x", "max_output_tokens": 2}, "store", 0),
    ("/v1/responses", {"input": "x"}, "max_output_tokens", True),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2}, "logprobs", 1),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2}, "echo", 0),
]


@pytest.mark.parametrize("path, body, field, value", BOOLEAN_FIELDS, ids=_ids(BOOLEAN_FIELDS))
def test_boolean_fields_refuse_integers(live_server, path, body, field, value):
    """`background: 0` was read as false and the response served."""
    base, _ = live_server
    r = httpx.post(base + path, json={**body, field: value}, timeout=60)
    assert r.status_code == 422 and r.json()["error"]["param"] == field, r.text


def test_booleans_and_integers_of_the_right_type_still_serve(live_server):
    base, _ = live_server
    for path, body in (
        ("/v1/responses", {"input": "x", "max_output_tokens": 2, "background": False, "store": False}),
        ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "best_of": 1, "n": 1, "seed": 3, "logprobs": 0}),
        ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}),
    ):
        r = httpx.post(base + path, json=body, timeout=60)
        assert r.status_code == 200, r.text


# ---- temperature --------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["1e300", "2.5", "Infinity", "NaN", "-1"])
def test_temperature_out_of_range_is_a_400(live_server, value):
    """`temperature: 1e300` was served (any t >= 0 passed); OpenAI's range is [0, 2]."""
    base, _ = live_server
    bodies = (
        ("/v1/completions", '{"prompt": "a", "max_tokens": 2, "temperature": %s}'),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": %s}',
        ),
        ("/v1/responses", '{"input": "hi", "max_output_tokens": 2, "temperature": %s}'),
    )
    for path, body in bodies:
        r = httpx.post(
            base + path, content=body % value, headers={"content-type": "application/json"}, timeout=60
        )  # NaN and Infinity as Python's json writes them
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", (path, r.text)
    r = httpx.post(base + "/v1/completions", json={"prompt": "a", "max_tokens": 2, "temperature": 2}, timeout=60)
    assert r.status_code == 200, r.text


# ---- /ping ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [{}, {"content": b"hello"}, {"content": b"{"}, {"data": {"a": "b"}}, {"json": {"a": 1}}],
    ids=["no body", "body, no content type", "bad json", "form", "json"],
)
def test_post_ping_answers_as_get(live_server, kw):
    """vLLM takes POST /ping as a health check (SageMaker): whatever the body or its type."""
    base, _ = live_server
    got = httpx.post(base + "/ping", timeout=60, **kw)
    want = httpx.get(base + "/ping", timeout=60)
    assert (got.status_code, got.content) == (want.status_code, want.content) == (200, b"")


# ---- media pads in a completion prompt ------------------------------------------------------------
def test_media_pad_ids_in_a_completion_prompt_name_the_prompt(live_server):
    """The engine names the field `messages` (chat's); /v1/completions has none: it is `prompt`."""
    base, state = live_server
    pad = state.tokenizer.special_tokens["<|media_pad|>"]
    for prompt in ([5, pad, 6], [[5, 6], [5, pad]], "a <|media_pad|> b"):
        for stream in (False, True):
            r = httpx.post(
                base + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "stream": stream}, timeout=60
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            assert "media pad" in r.json()["error"]["message"]
    assert state.engine.info().vision is not None  # the check under test: tiny K3 has a vision tower
