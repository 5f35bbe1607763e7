"""A prefill server (--kv-transfer-config kv_producer) hands a request to a decode engine over
HTTP (issue 17): the completion answers with the first token and a pull id, POST /v1/kv/pull
returns the latent rows + KDA state as one safetensors blob, and a decode engine that installs it
continues with the same greedy tokens as one colocated engine. Bad uses are 400 / 404; the
prefill server's pools return to zero; /metrics counts the bytes."""

from __future__ import annotations

import httpx
import pytest

from k3serve import LLM, SamplingParams
from k3serve.engine.handoff import from_bytes
from tests.live import serving
from tests.server.conftest import make_app

PRODUCER = ["--kv-transfer-config", '{"kv_connector": "K3HttpConnector", "kv_role": "kv_producer"}', "--block-size",
            "16"]


@pytest.fixture(scope="module")
def prefill_server(tiny_k3_dir):
    app, state = make_app(tiny_k3_dir, *PRODUCER)
    with serving(app) as base:
        yield base, state


def test_prefill_server_hands_off_to_a_decode_engine(prefill_server, tiny_k3_dir):
    base, state = prefill_server
    prompt = list(range(3, 40))  # 37 tokens: across two block boundaries
    r = httpx.post(base + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}})
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


@pytest.mark.parametrize("body, says", [
    ({"prompt": [1, 2, 3], "n": 2, "kv_transfer_params": {"do_remote_decode": True}}, "n = 1"),
    ({"prompt": [1, 2, 3], "stream": True, "kv_transfer_params": {"do_remote_decode": True}}, "not streamed"),
    ({"prompt": [1, 2, 3], "kv_transfer_params": {"remote_host": "x"}}, "unsupported keys"),
])
def test_bad_handoff_requests_are_400s(prefill_server, body, says):
    r = httpx.post(prefill_server[0] + "/v1/completions", json={"max_tokens": 1, **body})
    assert r.status_code == 400 and says in r.json()["error"]["message"]


def test_a_server_without_the_producer_role_refuses_handoffs(live_server, capsys):
    from k3serve.cli import main

    base, _ = live_server
    r = httpx.post(base + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1,
                                                   "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "--kv-transfer-config" in r.json()["error"]["message"]
    assert httpx.post(base + "/v1/kv/pull", json={"request_id": "x"}).status_code == 404
    chat = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "kv_transfer_params": {"do_remote_decode": True}})
    assert chat.status_code == 400 and "/v1/completions only" in chat.json()["error"]["message"]
    for cfg, says in (('{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}', "kv_connector must be"),
                      ('{"kv_connector": "K3HttpConnector", "kv_role": "kv_consumer"}', "not built yet")):
        assert main(["serve", "--cache-memory", "16MiB", "--kv-transfer-config", cfg]) == 2
        assert says in capsys.readouterr().err
