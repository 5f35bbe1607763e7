"""Operating the server (issue 20): CORS preflights, request logging, the periodic stats line."""

from __future__ import annotations

import logging

import httpx

from k3serve.engine.stats import EngineStats
from k3serve.server.observability.stats_log import stats_line
from tests.live import serving
from tests.server.conftest import make_app


def test_cors_preflight_is_answered_before_auth(tiny_k3_dir):
    app, _ = make_app(tiny_k3_dir, "--api-key", "k", "--allowed-origins", '["http://ui.test"]')
    with serving(app) as base:
        pre = httpx.options(
            base + "/v1/chat/completions",
            headers={
                "Origin": "http://ui.test",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://ui.test"
        r = httpx.get(base + "/v1/models", headers={"Origin": "http://ui.test", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.test"
        other = httpx.options(
            base + "/v1/models", headers={"Origin": "http://evil.test", "Access-Control-Request-Method": "GET"}
        )
        assert "access-control-allow-origin" not in other.headers


def test_requests_are_logged_with_their_ids(tiny_k3_dir, caplog):
    app, _ = make_app(tiny_k3_dir, "--enable-log-requests")
    with caplog.at_level(logging.INFO, logger="k3serve.server"), serving(app) as base:
        r = httpx.post(base + "/v1/completions", json={"prompt": "log me", "max_tokens": 3}, timeout=60)
    rid = r.json()["id"]
    lines = [rec.getMessage() for rec in caplog.records if rid in rec.getMessage()]
    assert any("prompt tokens" in m and "max_tokens=3" in m for m in lines), lines
    assert any("finished: 3 tokens" in m for m in lines), lines


def test_the_stats_line_reads_like_vllms():
    stats = EngineStats(
        num_running=4,
        num_waiting=1,
        latent_blocks_used=25,
        latent_blocks_total=200,
        state_slots_used=4,
        state_slots_total=16,
        prefix_queries=1000,
        prefix_hits=400,
        spec_drafts=10,
        spec_accepted_tokens=13,
    )
    line = stats_line(
        {"prompt_tokens": 0, "generation_tokens": 0}, {"prompt_tokens": 8124, "generation_tokens": 960}, 10.0, stats
    )
    assert line == (
        "Engine: avg prompt throughput 812.4 tokens/s, avg generation throughput 96.0 tokens/s, "
        "running 4 reqs, waiting 1 reqs, KV cache usage 12.5%, KDA slots 25.0%, "
        "prefix cache hit rate 40.0%, spec acceptance length 2.30"
    )


def test_the_stats_line_is_logged_while_there_is_work(tiny_k3_dir, caplog):
    import time

    app, _ = make_app(tiny_k3_dir, "--stats-log-interval", "0.2")
    with caplog.at_level(logging.INFO, logger="k3serve.stats"), serving(app) as base:
        httpx.post(base + "/v1/completions", json={"prompt": "busy", "max_tokens": 8}, timeout=60)
        time.sleep(0.6)
    lines = [r.getMessage() for r in caplog.records if r.name == "k3serve.stats"]
    assert any(m.startswith("Engine: avg prompt throughput") for m in lines), lines
    assert len(lines) <= 3  # idle intervals log nothing
