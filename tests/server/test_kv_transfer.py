"""Prefill/decode disaggregation over HTTP (issue 17). A prefill server (kv_producer) answers
with the first token and a pull id, POST /v1/kv/pull returns the latent rows + KDA state as one
safetensors blob (K3HttpConnector) or a NIXL offer to READ (NixlConnector), and a decode engine
that installs it continues with the same tokens as one colocated engine. Through `k3serve router`
with a prefill and a decode server (kv_consumer): greedy output == a colocated server, streaming
== non-streaming, seeded sampling, logprobs, a grammar and an image prompt carry across, a shared
prefix moves only its new rows, the prefill server holding a prefix gets it, a dead decode server
gets the request retried on another (or a 503) and its unpulled state released. Bad uses are
400 / 404; pools return to zero; /metrics counts the bytes."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from k3serve import LLM, SamplingParams
from k3serve.engine.handoff import from_bytes
from tests.live import serving
from tests.server.conftest import make_app

PRODUCER = [
    "--kv-transfer-config",
    '{"kv_connector": "K3HttpConnector", "kv_role": "kv_producer"}',
    "--block-size",
    "16",
]


@pytest.fixture(scope="module")
def prefill_server(tiny_k3_dir):
    app, state = make_app(tiny_k3_dir, *PRODUCER)
    with serving(app) as base:
        yield base, state


def test_prefill_server_hands_off_to_a_decode_engine(prefill_server, tiny_k3_dir):
    base, state = prefill_server
    prompt = list(range(3, 40))  # 37 tokens: across two block boundaries
    r = httpx.post(
        base + "/v1/completions",
        timeout=60,
        json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["remote_block_size"] == 16
    decode = LLM(str(tiny_k3_dir), cache_memory="32MiB", max_model_len=1024, block_size=16)
    held = decode.engine.held_tokens(prompt)
    blob = httpx.post(base + "/v1/kv/pull", json={"request_id": params["remote_request_id"], "held_tokens": held})
    assert blob.status_code == 200 and blob.headers["content-type"] == "application/octet-stream"
    h = from_bytes(blob.content)
    assert h.prompt_token_ids == prompt and h.start == 0
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    decode.engine.add_prefilled(h, greedy)
    got = None
    while decode.engine.has_unfinished_requests():
        for out in decode.engine.step():
            got = out.outputs[0].token_ids
    colocated = LLM(str(tiny_k3_dir), cache_memory="32MiB", max_model_len=1024, block_size=16)
    want = colocated.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0].token_ids
    assert got == want
    assert state.engine.engine.cache.num_requests == 0 and not state.engine.engine.handoffs.held
    metrics = httpx.get(base + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("k3serve:kv_transfer_bytes_total"))
    assert float(line.split()[-1]) >= len(blob.content)
    again = httpx.post(base + "/v1/kv/pull", json={"request_id": params["remote_request_id"]})
    assert again.status_code == 404 and "no prefilled request" in again.json()["error"]["message"]


@pytest.mark.parametrize(
    "body, says",
    [
        ({"prompt": [1, 2, 3], "n": 2, "kv_transfer_params": {"do_remote_decode": True}}, "n = 1"),
        ({"prompt": [1, 2, 3], "stream": True, "kv_transfer_params": {"do_remote_decode": True}}, "not streamed"),
        ({"prompt": [1, 2, 3], "kv_transfer_params": {"remote_host": "x"}}, "unsupported keys"),
        (
            {"prompt": [1, 2, 3], "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": True}},
            "exclude each other",
        ),
    ],
)
def test_bad_handoff_requests_are_400s(prefill_server, body, says):
    r = httpx.post(prefill_server[0] + "/v1/completions", json={"max_tokens": 1, **body})
    assert r.status_code == 400 and says in r.json()["error"]["message"]


def test_pull_release_and_held_endpoints_check_their_input(prefill_server):
    base, state = prefill_server
    r = httpx.post(
        base + "/v1/completions",
        timeout=60,
        json={"prompt": "Hello", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    rid = r.json()["kv_transfer_params"]["remote_request_id"]
    wrong = httpx.post(base + "/v1/kv/pull", json={"request_id": rid, "transport": "nixl"})
    assert wrong.status_code == 400 and "does not match this server's kv_connector" in wrong.json()["error"]["message"]
    assert httpx.post(base + "/v1/kv/release", json={"request_id": rid}).json()["released"] is True
    assert httpx.post(base + "/v1/kv/release", json={"request_id": rid}).json()["released"] is False
    assert not state.engine.engine.handoffs.held
    both = httpx.post(base + "/v1/kv/held", json={"chat": {}, "completion": {}})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
    probe = httpx.post(base + "/v1/kv/held", json={"completion": {"prompt": "Hello"}}).json()
    assert probe["prompt_tokens"] >= 1 and probe["held_tokens"] % 16 == 0


def test_a_server_without_the_producer_role_refuses_handoffs(live_server, capsys):
    from k3serve.cli import main

    base, _ = live_server
    r = httpx.post(
        base + "/v1/completions",
        json={"prompt": [1, 2], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert r.status_code == 400 and "--kv-transfer-config" in r.json()["error"]["message"]
    assert httpx.post(base + "/v1/kv/pull", json={"request_id": "x"}).status_code == 404
    chat = httpx.post(
        base + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert chat.status_code == 400 and "--kv-transfer-config" in chat.json()["error"]["message"]
    for cfg, says in (
        ('{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_producer"}', "kv_connector must be"),
        (
            '{"kv_connector": "K3HttpConnector", "kv_role": "kv_consumer", "kv_producers": "x"}',
            "kv_producers must be a list",
        ),
    ):
        assert main(["serve", "--cache-memory", "16MiB", "--kv-transfer-config", cfg]) == 2
        assert says in capsys.readouterr().err


CONSUMER = [
    "--kv-transfer-config",
    '{"kv_connector": "K3HttpConnector", "kv_role": "kv_consumer"}',
    "--block-size",
    "16",
]


@pytest.fixture(scope="module")
def disaggregated(tiny_k3_dir, prefill_server):
    from k3serve.server.pd.proxy import build_router

    decode_app, decode_state = make_app(tiny_k3_dir, *CONSUMER)
    colocated_app, _ = make_app(tiny_k3_dir, "--block-size", "16")
    with serving(decode_app) as decode, serving(colocated_app) as colocated:
        with serving(build_router([prefill_server[0]], [decode])) as router:
            yield SimpleNamespace(
                router=router,
                colocated=colocated,
                decode=decode,
                decode_state=decode_state,
                prefill_state=prefill_server[1],
            )


def _completion(base: str, **body) -> dict:
    r = httpx.post(
        base + "/v1/completions", timeout=120, json={"max_tokens": 12, "temperature": 0, "ignore_eos": True, **body}
    )
    assert r.status_code == 200, r.text
    return r.json()


def _streamed_text(base: str, **body) -> str:
    import json

    text = ""
    with httpx.stream(
        "POST",
        base + "/v1/completions",
        timeout=120,
        json={"max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True, **body},
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


def test_router_output_equals_a_colocated_server(disaggregated):
    router, colocated = disaggregated.router, disaggregated.colocated
    decode_state, prefill_state = disaggregated.decode_state, disaggregated.prefill_state
    for prompt in ("Hi", "The quick brown fox jumps over the lazy dog, then runs far away into the hills " * 2):
        want = _completion(colocated, prompt=prompt)["choices"][0]
        got = _completion(router, prompt=prompt)["choices"][0]
        assert got["text"] == want["text"] and got["finish_reason"] == want["finish_reason"]
        assert _streamed_text(router, prompt=prompt) == want["text"]  # streaming == non-streaming
    for state in (decode_state, prefill_state):  # both pools back to zero
        assert state.engine.engine.cache.num_requests == 0
    assert not prefill_state.engine.engine.handoffs.held


def test_chat_through_the_router_equals_a_colocated_server(disaggregated):
    msgs = [{"role": "user", "content": "Tell me about the weather in Oslo."}]
    body = {
        "messages": msgs,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "chat_template_kwargs": {"thinking": False},
    }
    want = httpx.post(disaggregated.colocated + "/v1/chat/completions", timeout=120, json=body).json()
    got = httpx.post(disaggregated.router + "/v1/chat/completions", timeout=120, json=body)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"] == want["choices"][0]["message"]
    assert got.json()["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    import json

    text = ""
    with httpx.stream(
        "POST", disaggregated.router + "/v1/chat/completions", timeout=120, json={**body, "stream": True}
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
    assert text == (want["choices"][0]["message"]["content"] or "")


def test_a_shared_prefix_moves_only_its_new_rows(disaggregated):
    router, decode_state = disaggregated.router, disaggregated.decode_state
    shared = list(range(10, 58))  # 48 tokens: three whole blocks
    before = _pulled(decode_state)
    _completion(router, prompt=shared + [3, 4, 5])
    first = _pulled(decode_state) - before
    _completion(router, prompt=shared + [6, 7, 8, 9])  # its first 48 tokens are cached on the decode server
    second = _pulled(decode_state) - before - first
    assert second < first - 40 * per_token_bytes(decode_state)


def _pulled(state) -> float:
    return state.metrics.kv_transfer_bytes._value.get()


def per_token_bytes(state) -> int:
    return sum(t.shape[1] * t.element_size() for t in state.engine.engine.executor.cache.latent if t is not None)


def test_a_dead_decode_server_is_retried_elsewhere_then_503(prefill_server, disaggregated):
    from k3serve.server.pd.proxy import build_router

    dead = "http://127.0.0.1:9"  # nothing listens there
    with serving(build_router([prefill_server[0]], [dead, disaggregated.decode])) as router:
        want = _completion(disaggregated.colocated, prompt="Hello there")["choices"][0]["text"]
        for _ in range(2):  # whichever decode server comes first, the answer is the live one's
            assert _completion(router, prompt="Hello there")["choices"][0]["text"] == want
    with serving(build_router([prefill_server[0]], [dead])) as router:
        r = httpx.post(router + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 503 and "no decode server" in r.json()["error"]["message"]
    assert disaggregated.decode_state.engine.engine.cache.num_requests == 0
    assert not prefill_server[1].engine.engine.handoffs.held  # the router released what nobody pulled


def test_a_prefill_server_that_dies_before_the_pull_is_named_not_the_decode_server(disaggregated):
    """The prefill answered, then its state could not be pulled (the process died): the decode
    server says 502 naming it; the router used to retry and then blame the decode server ("no
    decode server could serve the request"). Now the 503 names the prefill server."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from k3serve.server.pd.proxy import build_router

    fake = FastAPI()

    @fake.post("/v1/completions")
    async def prefilled():  # a first token and a pull id, as a prefill server answers
        return {
            "id": "cmpl-x",
            "object": "text_completion",
            "model": "m",
            "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
            "kv_transfer_params": {"remote_request_id": "gone", "remote_block_size": 16},
        }

    @fake.post("/v1/kv/pull")
    async def pull():  # ... and then it is gone
        return JSONResponse({"error": {"message": "no such request"}}, status_code=500)

    with serving(fake) as dead_prefill, serving(build_router([dead_prefill], [disaggregated.decode])) as router:
        r = httpx.post(router + "/v1/completions", timeout=120, json={"prompt": "Hello there", "max_tokens": 4})
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert f"prefill server {dead_prefill}" in message and "no decode server" not in message, message
        ok = httpx.post(disaggregated.router + "/v1/completions", timeout=120, json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200  # the decode server was never the problem
    assert disaggregated.decode_state.engine.engine.cache.num_requests == 0


def test_a_decode_server_dying_mid_request_gets_a_retry_with_the_full_answer(prefill_server, disaggregated):
    """A 'decode server' that reads the request and drops the connection (as a killed process
    does): the router retries on the live one, the client gets the whole answer."""
    import socket
    import threading

    from k3serve.server.pd.proxy import build_router

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)

    def drop_all():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.close()  # dies mid-request: no status line, no bytes

    threading.Thread(target=drop_all, daemon=True).start()
    dying = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        with serving(build_router([prefill_server[0]], [dying, disaggregated.decode])) as router:
            want = _completion(disaggregated.colocated, prompt="A story about a cat")["choices"][0]["text"]
            for stream in (False, True):
                for _ in range(2):  # the dying server is tried first whenever it is the least loaded
                    got = (
                        _streamed_text(router, prompt="A story about a cat")
                        if stream
                        else _completion(router, prompt="A story about a cat")["choices"][0]["text"]
                    )
                    assert got == want
    finally:
        sock.close()
    assert disaggregated.decode_state.engine.engine.cache.num_requests == 0


def test_a_speculating_decode_server_behind_the_router(tiny_k3_dir, prefill_server, disaggregated):
    """ngram speculative decoding on the decode server (greedy verification is exact) and prefix
    caching on both sides: the router's answer is still the colocated one."""
    from k3serve.server.pd.proxy import build_router

    app, state = make_app(
        tiny_k3_dir, *CONSUMER, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'
    )
    prompt = "one two three one two three one two three one two three"
    want = _completion(disaggregated.colocated, prompt=prompt)["choices"][0]["text"]
    with serving(app) as decode, serving(build_router([prefill_server[0]], [decode])) as router:
        for _ in range(2):  # the second time the prompt's blocks are cached on both servers
            assert _completion(router, prompt=prompt)["choices"][0]["text"] == want
            assert _streamed_text(router, prompt=prompt) == want
    assert state.engine.engine.cache.num_requests == 0


def test_sampling_logprobs_and_grammars_cross_the_router(disaggregated):
    """A seeded temperature-1 request continues its random stream on the decode server; logprobs
    (the first token's from the prefill side), prompt logprobs and a JSON grammar (replayed over
    the first token) all come out as the colocated server's."""
    for body in (
        {"prompt": "Once upon a time", "temperature": 1.0, "seed": 99, "logprobs": 2, "prompt_logprobs": 1},
        {
            "prompt": "A person:",
            "temperature": 1.0,
            "seed": 3,
            "ignore_eos": False,
            "max_tokens": 40,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "p",
                    "schema": {
                        "type": "object",
                        "properties": {"age": {"type": "integer"}},
                        "required": ["age"],
                        "additionalProperties": False,
                    },
                },
            },
        },
    ):
        want = _completion(disaggregated.colocated, **body)["choices"][0]
        got = _completion(disaggregated.router, **body)["choices"][0]
        assert (got["text"], got["logprobs"], got.get("prompt_logprobs")) == (
            want["text"],
            want["logprobs"],
            want.get("prompt_logprobs"),
        )
    assert '"age"' in got["text"] and got["finish_reason"] == "stop"


def test_the_router_sends_a_prompt_to_the_prefill_server_that_caches_it(tiny_k3_dir, prefill_server, disaggregated):
    """Two prefill servers: the one whose prefix cache holds the prompt's blocks gets it, though
    the hash choice would pick the other."""
    from k3serve.server.pd.proxy import Pool, build_router

    other_app, other_state = make_app(tiny_k3_dir, *PRODUCER)
    prompt = list(range(100, 148))  # three whole blocks
    with serving(other_app) as other:
        servers = [prefill_server[0], other]
        body = {"prompt": prompt + [5, 6], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        cold = Pool(servers, []).by_hash(body)
        warm_url, warm_state = (other, other_state) if cold == prefill_server[0] else prefill_server
        assert _completion(warm_url, prompt=prompt + [1, 2], max_tokens=1)  # warm the one hashing does not pick
        before = _prefix_hits(warm_state)
        with serving(build_router(servers, [disaggregated.decode])) as router:
            got = _completion(router, **body)["choices"][0]["text"]
        assert _prefix_hits(warm_state) - before >= 32  # its cache served the prompt's prefix
        assert got == _completion(disaggregated.colocated, **body)["choices"][0]["text"]


def _prefix_hits(state) -> int:
    return state.engine.engine.cache.checkpoints.stats.hit_tokens


NIXL = ('{"kv_connector": "NixlConnector", "kv_role": "%s"}',)


@pytest.mark.parametrize("kind", ["k3", "kl"])
def test_nixl_connector_moves_the_handoff_by_a_nixl_read(kind, tiny_k3_dir, tiny_kl_dir):
    """kv_connector NixlConnector on both sides: the pull answers a NIXL offer (no tensor bytes
    over HTTP), the decode server READs the hand-off out of the prefill server's memory over UCX,
    and the answers are the colocated ones, on tiny K3 and Kimi-Linear; the lent buffer is
    dropped after the read."""
    import time

    from k3serve.server.pd.proxy import build_router

    pytest.importorskip("nixl", reason="NIXL is installed by `make` (the [nixl] extra)")
    path = tiny_k3_dir if kind == "k3" else tiny_kl_dir
    p_app, p_state = make_app(path, "--kv-transfer-config", NIXL[0] % "kv_producer", "--block-size", "16")
    d_app, d_state = make_app(path, "--kv-transfer-config", NIXL[0] % "kv_consumer", "--block-size", "16")
    c_app, _ = make_app(path, "--block-size", "16")
    assert p_state.nixl is not None and d_state.nixl is not None
    with (
        serving(p_app) as prefill,
        serving(d_app) as decode,
        serving(c_app) as colocated,
        serving(build_router([prefill], [decode])) as router,
    ):
        for prompt in ("Hi", "The quick brown fox jumps over the lazy dog, then runs far away " * 2):
            want = _completion(colocated, prompt=prompt)["choices"][0]["text"]
            assert _completion(router, prompt=prompt)["choices"][0]["text"] == want
            assert _streamed_text(router, prompt=prompt) == want
        offer = httpx.post(
            prefill + "/v1/completions",
            timeout=60,
            json={"prompt": "Hello", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        ).json()
        rid = offer["kv_transfer_params"]["remote_request_id"]
        wrong = httpx.post(prefill + "/v1/kv/pull", json={"request_id": rid, "transport": "http"})
        assert wrong.status_code == 400
        assert httpx.post(prefill + "/v1/kv/release", json={"request_id": rid}).json()["released"]
        deadline = time.monotonic() + 10
        while p_state.nixl.lent and time.monotonic() < deadline:  # the READs' notifications free them
            time.sleep(0.05)
        assert not p_state.nixl.lent and not p_state.engine.engine.handoffs.held
        assert d_state.metrics.kv_pulls._value.get() == 4
        assert "k3serve:kv_nixl_lent_bytes 0.0" in httpx.get(prefill + "/metrics").text
    for state in (p_state, d_state):
        assert state.engine.engine.cache.num_requests == 0


def test_a_nixl_read_of_memory_the_prefill_agent_never_lent_is_a_connection_error():
    pytest.importorskip("nixl", reason="NIXL is installed by `make` (the [nixl] extra)")
    from k3serve.server.pd.nixl import NixlTransport

    lender, reader = NixlTransport(), NixlTransport()
    offer = lender.lend("r", b"state" * 1000)
    assert reader.read(offer) == b"state" * 1000
    with pytest.raises(ConnectionError, match="NIXL could not start the read"):
        reader.read({**offer, "addr": offer["addr"] + (1 << 30)})
    with pytest.raises(ConnectionError, match="malformed"):
        reader.read({"addr": 1})


def test_an_image_chat_crosses_the_router(disaggregated):
    """The decode server keys the image's pads by content (it encodes nothing): the answer is
    the colocated one, and the same image asked again moves only the rows past its held blocks."""
    from tests.server.test_multimodal import data_url, png

    def ask(base, text):
        parts = [{"type": "image_url", "image_url": {"url": data_url(png(11))}}, {"type": "text", "text": text}]
        r = httpx.post(
            base + "/v1/chat/completions",
            timeout=120,
            json={
                "messages": [{"role": "user", "content": parts}],
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "chat_template_kwargs": {"thinking": False},
            },
        )
        assert r.status_code == 200, r.text
        return r.json()

    for text in ("What is this?", "And its colours?"):
        want = ask(disaggregated.colocated, text)
        before = _pulled(disaggregated.decode_state)
        got = ask(disaggregated.router, text)
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # the image's blocks were held
    assert (
        _pulled(disaggregated.decode_state) - before
        < got["usage"]["prompt_tokens"] * per_token_bytes(disaggregated.decode_state) + 1
    )  # not every row again


def test_a_decode_server_serves_a_prefix_from_the_tier_directory_it_shares_with_the_prefill_server(
    tiny_k3_dir, tmp_path
):
    """P/D with one prefix-tier directory (issue 49): the prefill server's tier writes what it
    computed; with --decode-prefill-tokens the router asks the decode server first, which
    finds the prefix in the shared directory (written after its start-up scan), reads it and
    prefills only the rest itself; no prefill server is involved and the text is a colocated
    server's."""
    from k3serve.server.pd.proxy import build_router

    shared = ["--kv-offloading-dir", str(tmp_path / "shared"), "--kv-offloading-size", "0.05"]
    prefill_app, prefill_state = make_app(tiny_k3_dir, *PRODUCER, *shared)
    decode_app, decode_state = make_app(tiny_k3_dir, *CONSUMER, *shared)
    colocated_app, _ = make_app(tiny_k3_dir, "--block-size", "16")
    prompt = list(range(100, 180))  # five whole blocks
    longer = prompt + [7, 8, 9]
    with serving(prefill_app) as p, serving(decode_app) as d, serving(colocated_app) as c:
        router_app = build_router([p], [d], decode_prefill_tokens=16)
        with serving(router_app) as router:
            _completion(p, prompt=prompt, max_tokens=1)  # the prefill server computes the prefix once
            prefill_state.engine.engine.tiers.flush()
            asked = prefill_state.engine.engine.counters["requests_finished"]
            want = _completion(c, prompt=longer)["choices"][0]
            got = _completion(router, prompt=longer)["choices"][0]
            assert got["text"] == want["text"] and got["finish_reason"] == want["finish_reason"]
            assert prefill_state.engine.engine.counters["requests_finished"] == asked  # not asked again
            assert router_app.state.pool.local == 1
            disk = decode_state.engine.engine.tiers.index.stats["disk"]
            assert disk.hits >= 6  # five blocks and the state, from the prefill server's files
            # a prompt the decode server cannot mostly reuse takes the usual prefill -> decode path
            other = list(range(300, 340))
            assert (
                _completion(router, prompt=other)["choices"][0]["text"]
                == _completion(c, prompt=other)["choices"][0]["text"]
            )
            assert router_app.state.pool.local == 1
            assert prefill_state.engine.engine.counters["requests_finished"] == asked + 1
