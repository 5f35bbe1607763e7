"""`k3serve serve --data-parallel-size 2`: two engine replicas behind one server. A request goes
to the replica holding its longest cached prefix, else to the least loaded one; the proof is
`usage.prompt_tokens_details.cached_tokens` of follow-up requests, and the router's counts."""

from __future__ import annotations

import threading

import httpx

from tests.live import serving
from tests.server.conftest import make_app

A = "Alpha beta gamma delta, the first story of the day. " * 4
B = "Zulu yankee xray whiskey, another tale entirely here. " * 4


def _complete(base, prompt, max_tokens=8):
    r = httpx.post(
        base + "/v1/completions",
        json={"model": "tiny-k3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_dp2_routes_by_cached_prefix_then_by_load(tiny_k3_dir):
    app, state = make_app(tiny_k3_dir, "--data-parallel-size", "2")
    dp = state.engine
    with serving(app, start_timeout=60) as base:
        # replica 0 is busy with A (a long generation) when B arrives: B goes to replica 1
        busy = threading.Thread(target=_complete, args=(base, A + "one", 300))
        busy.start()
        while dp.replicas[0].stats.num_running == 0:
            threading.Event().wait(0.01)
        first_b = _complete(base, B + "one")
        busy.join(120)
        assert dp.routed == [1, 1] and dp.routed_by_prefix == 0
        assert first_b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # follow-ups land where their prefix is cached, though both replicas are idle now
        a2, b2 = _complete(base, A + "two"), _complete(base, B + "two")
        assert dp.routed == [2, 2] and dp.routed_by_prefix == 2
        assert a2["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
        assert b2["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
        # /metrics and /health speak for both replicas
        text = httpx.get(base + "/metrics", timeout=10).text
        total = [float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith("k3serve:latent_blocks_total ")]
        assert total == [2 * dp.replicas[0].engine.plan.num_blocks]
        assert httpx.get(base + "/health", timeout=10).status_code == 200
