"""Benchmark client: metric arithmetic against hand-computed values, and timing against an
in-test HTTP server that streams with known delays (plus failures that are counted)."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from k3serve.bench.datasets import BenchRequest, entropy_requests, random_requests, shared_prefix_requests
from k3serve.bench.metrics import RequestResult, is_good, summarize
from k3serve.bench.runner import LoadSettings, arrival_gaps, run_load
from tests.live import serving


def test_metric_arithmetic_by_hand():
    # request 0: sent at 0, chunks at 0.2, 0.3, 0.6 (the last carries 2 tokens) -> 4 tokens
    r0 = RequestResult(
        0, True, prompt_tokens=10, output_tokens=4, ttft=0.2, itl=[0.1, 0.3], latency=0.6, chunk_times=[0.2, 0.3, 0.6]
    )
    # request 1: one token only: no TPOT
    r1 = RequestResult(1, True, prompt_tokens=6, output_tokens=1, ttft=0.5, itl=[], latency=0.5, chunk_times=[0.5])
    r2 = RequestResult(2, False, error="HTTP 500")
    s = summarize(
        [r0, r1, r2],
        duration=2.0,
        metrics=["ttft", "tpot", "itl", "e2el"],
        ps=[50, 90],
        goodput={"ttft": 300, "tpot": 150},
    )
    assert r0.tpot == pytest.approx((0.6 - 0.2) / 3) and r1.tpot is None
    assert (s["completed"], s["failed"]) == (2, 1) and s["success_rate"] == pytest.approx(2 / 3)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.5) and s["total_token_throughput"] == pytest.approx(10.5)
    assert s["mean_ttft_ms"] == pytest.approx(350) and s["p50_ttft_ms"] == pytest.approx(350)
    assert s["p90_ttft_ms"] == pytest.approx(200 + 0.9 * 300)  # numpy linear interpolation
    assert s["mean_tpot_ms"] == pytest.approx(400 / 3)  # only request 0 has a TPOT
    assert s["mean_itl_ms"] == pytest.approx(200) and s["median_itl_ms"] == pytest.approx(200)
    # goodput: r0 ttft 200 <= 300 and tpot 133 <= 150 -> good; r1 ttft 500 > 300 -> not; r2 failed
    assert s["good_requests"] == 1 and s["request_goodput"] == pytest.approx(0.5)
    assert is_good(r1, {"tpot": 1})  # 1-token outputs count TPOT as 0
    assert s["peak_output_throughput"] == 4.0  # chunk arrivals 0.2, 0.3, 0.5, 0.6 s share one 1-s bucket


def test_datasets_are_reproducible_and_shaped():
    a = random_requests(5, 20, 7, 0.5, (1, 100), seed=3)
    assert a == random_requests(5, 20, 7, 0.5, (1, 100), seed=3)
    assert all(10 <= r.prompt_len <= 30 and 3 <= r.output_len <= 10 for r in a)
    sp = shared_prefix_requests(10, 16, 0.8, 4, 5, (1, 100), seed=0)
    assert sum(r.prompt_token_ids[:16] == sp[0].prompt_token_ids[:16] for r in sp) == 8
    low = entropy_requests(2, 32, 4, True, (1, 100), 0)[0].prompt_token_ids
    assert len(set(low)) <= 4 and len(low) == 32
    gaps = arrival_gaps(2000, rate=10.0, burstiness=1.0, seed=0)
    assert abs(sum(gaps) / len(gaps) - 0.1) < 0.01  # Poisson arrivals at 10 req/s


TTFT, GAP = 0.15, 0.05


def delayed_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if body["prompt"][0] == 13:  # requests starting with token 13 fail
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)

        async def stream():
            await asyncio.sleep(TTFT)
            for i in range(5):
                if i:
                    await asyncio.sleep(GAP)
                chunk = {"choices": [{"index": 0, "text": "ab" if i == 4 else "a"}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 6}}
            yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def delayed_server():
    with serving(delayed_app()) as base:
        yield base


def test_timing_matches_injected_delays_and_failures_are_counted(delayed_server):
    reqs = [BenchRequest([13 if i % 4 == 0 else 7] * 5, None, 6) for i in range(8)]
    results, duration, _ = asyncio.run(run_load(reqs, LoadSettings(delayed_server, max_concurrency=4, progress=False)))
    ok = [r for r in results if r.success]
    assert len(ok) == 6 and all("injected failure" in r.error for r in results if not r.success)
    for r in ok:
        assert abs(r.ttft - TTFT) < 0.06
        assert len(r.itl) == 4 and all(abs(g - GAP) < 0.04 for g in r.itl)
        assert r.output_tokens == 6 and r.tpot == pytest.approx((r.latency - r.ttft) / 5)
    s = summarize(results, duration, ["ttft", "itl"], [50])
    assert s["failed"] == 2 and abs(s["mean_itl_ms"] - 1000 * GAP) < 25
