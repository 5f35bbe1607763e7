"""OpenTelemetry traces (issue 47, server/observability/tracing.py) at a real OTLP/HTTP receiver started by the
test (k3serve/testing/otlp_receiver.py, the protocol's own protobuf types): a request to the
server with a W3C traceparent arrives as one `llm_request` span whose parent is the caller's
span, with vLLM's attribute names and the usage the response reported; a request through the
P/D router arrives as a `router_request` span (the caller's child) parenting the prefill's and
the decode server's `llm_request` spans, all in one trace."""

from __future__ import annotations

import time

import httpx
import pytest

from k3serve.testing.otlp_receiver import OTLPReceiver
from tests.live import serving
from tests.server.conftest import make_app

pytest.importorskip("opentelemetry.sdk", reason="tracing needs opentelemetry-sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="tracing needs the OTLP/HTTP exporter")

TRACE, CALLER = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
HEADERS = {"traceparent": f"00-{TRACE}-{CALLER}-01"}
BODY = {"prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0, "ignore_eos": True}


@pytest.fixture()
def receiver():
    r = OTLPReceiver()
    yield r
    r.close()


def wait_for(receiver, name, n=1, timeout=15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end and len(receiver.named(name)) < n:
        time.sleep(0.05)
    return receiver.named(name)


def test_a_request_arrives_as_an_llm_request_span_under_its_caller(tiny_k3_dir, receiver):
    app, state = make_app(tiny_k3_dir, "--otlp-traces-endpoint", receiver.url)
    with serving(app) as base:
        r = httpx.post(base + "/v1/completions", json=BODY, headers=HEADERS, timeout=60).json()
        httpx.post(base + "/v1/completions", json=BODY, timeout=60)  # no traceparent: a root span
        state.tracing.flush()
    spans = wait_for(receiver, "llm_request", 2)
    mine = next(s for s in spans if s.trace_id == TRACE)
    root = next(s for s in spans if s.trace_id != TRACE)
    assert mine.parent_span_id == CALLER and root.parent_span_id == "" and mine.kind == 2  # SERVER
    a = mine.attributes
    assert a["gen_ai.usage.prompt_tokens"] == r["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == r["usage"]["completion_tokens"] == 5
    assert a["gen_ai.response.model"] == "tiny-k3" and a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.request.id"].startswith("cmpl-") and mine.service == "k3serve"
    lat = {k.rsplit(".", 1)[1]: v for k, v in a.items() if k.startswith("gen_ai.latency.")}
    assert 0 <= lat["time_in_queue"] <= lat["time_to_first_token"] <= lat["e2e"]
    assert abs((mine.end_ns - mine.start_ns) / 1e9 - lat["e2e"]) < 0.05


def test_a_speculating_request_carries_its_draft_and_accepted_counts(tiny_k3_dir, receiver):
    """With n-gram speculation the span adds gen_ai.usage.spec_draft_tokens / spec_accepted_tokens,
    the request's own share of the engine's counters (one request here: all of them)."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    app, state = make_app(tiny_k3_dir, "--otlp-traces-endpoint", receiver.url, "--speculative-config", spec)
    body = {**BODY, "prompt": "a b a b a b a b a b a b", "max_tokens": 12, "logit_bias": {"11": 8, "22": 8}}
    with serving(app) as base:
        httpx.post(base + "/v1/completions", json=body, headers=HEADERS, timeout=60).raise_for_status()
        state.tracing.flush()
    (span,) = wait_for(receiver, "llm_request")
    stats = state.engine.engine.spec.stats
    a = span.attributes
    assert a["gen_ai.usage.spec_draft_tokens"] == stats.draft_tokens > 0
    assert a["gen_ai.usage.spec_accepted_tokens"] == stats.accepted_tokens <= stats.draft_tokens


def test_the_router_span_parents_the_prefill_and_decode_spans(tiny_k3_dir, receiver):
    from k3serve.server.launch import tracing
    from k3serve.server.pd.proxy import build_router

    kv = '{"kv_connector": "K3HttpConnector", "kv_role": "%s"}'
    flags = ("--otlp-traces-endpoint", receiver.url, "--block-size", "16", "--kv-transfer-config")
    p_app, p_state = make_app(tiny_k3_dir, *flags, kv % "kv_producer")
    d_app, d_state = make_app(tiny_k3_dir, *flags, kv % "kv_consumer")
    router_tracing = tracing(receiver.url, "k3serve-router")
    with serving(p_app) as prefill, serving(d_app) as decode:
        with serving(build_router([prefill], [decode], tracing=router_tracing)) as router:
            r = httpx.post(router + "/v1/completions", json=BODY, headers=HEADERS, timeout=120)
            assert r.status_code == 200, r.text
        for t in (router_tracing, p_state.tracing, d_state.tracing):
            t.flush()
    (routed,) = wait_for(receiver, "router_request")
    served = wait_for(receiver, "llm_request", 2)
    assert routed.trace_id == TRACE and routed.parent_span_id == CALLER and routed.service == "k3serve-router"
    assert len(served) == 2 and all(s.trace_id == TRACE and s.parent_span_id == routed.span_id for s in served)
    assert sorted(s.attributes["gen_ai.usage.completion_tokens"] for s in served) == [1, 5]  # prefill, decode
