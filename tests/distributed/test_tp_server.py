"""`k3serve serve --tensor-parallel-size 2 --enable-expert-parallel`: the server answers as a
single-process one, and when a worker dies, requests fail with a clear 503 and /health
turns unhealthy, within a bounded time."""

from __future__ import annotations

import os
import signal
import time

import httpx

from tests.live import serving
from tests.server.conftest import make_app


def test_tp_server_serves_then_reports_a_dead_worker(tiny_k3_dir):
    body = {"model": "tiny-k3", "prompt": "The fox", "max_tokens": 12, "temperature": 0}
    ref_app, _ = make_app(tiny_k3_dir)
    with serving(ref_app, start_timeout=30) as base:
        want = httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    app, state = make_app(
        tiny_k3_dir, "--tensor-parallel-size", "2", "--enable-expert-parallel", "--distributed-timeout", "20"
    )
    with serving(app, start_timeout=60) as base:
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        # expert load per rank: every forwarded token routes top_k assignments in each MoE layer
        usage = r.json()["usage"]
        cfg = state.engine.engine.model.cfg
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        forwarded = usage["prompt_tokens"] + usage["completion_tokens"] - 1  # the last token is never input
        text = httpx.get(base + "/metrics", timeout=10).text
        per_rank = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("k3serve:expert_parallel_tokens_total{")
        ]
        assert len(per_rank) == 2 and sum(per_rank) == forwarded * cfg.moe.top_k * moe_layers
        assert "k3serve:tp_collective_seconds_total{" in text and 'kind="all_reduce"' in text
        worker = state.engine.engine.executor._procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        began = time.monotonic()
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert time.monotonic() - began < 25
        assert r.status_code == 503, r.text
        assert "tensor-parallel" in r.json()["error"]["message"] and r.headers["retry-after"] == "5"
        h = httpx.get(base + "/health", timeout=10)
        assert h.status_code == 503 and "tensor-parallel worker" in h.text
