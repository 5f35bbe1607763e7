"""vLLM-compatible metrics (issue 20): the shipped Grafana dashboard's every series is in a scrape
with the right type and the model_name label, counters never decrease; /health turns 503 when
the engine loop dies or a step hangs."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.live import serving
from tests.server.conftest import make_app

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana-k3serve.json"


def scrape(base: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(base + "/metrics").text)}


def dashboard_series() -> set[str]:
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    return {m for e in exprs for m in re.findall(r"\b((?:vllm|k3serve):[a-zA-Z0-9_]+)", e)}


def family_and_type(series: str) -> tuple[str, str]:
    """A queried series name -> (family name as the parser reports it, its type)."""
    for suffix, kind in (
        ("_bucket", "histogram"),
        ("_sum", "histogram"),
        ("_count", "histogram"),
        ("_total", "counter"),
    ):
        if series.endswith(suffix):
            return series[: -len(suffix)], kind
    return series, "gauge"


def work(base: str) -> None:
    for i in range(3):
        r = httpx.post(
            base + "/v1/completions",
            json={"prompt": f"metrics {i} " * 8, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )
        assert r.status_code == 200


def test_every_dashboard_series_is_scraped_with_its_type(live_server):
    base, state = live_server
    work(base)
    families = scrape(base)
    wanted = dashboard_series()
    assert len(wanted) >= 15
    for series in sorted(wanted):
        name, kind = family_and_type(series)
        assert name in families, f"dashboard queries {series}, the scrape has no {name}"
        fam = families[name]
        assert fam.type == kind, (series, fam.type)
        labelled = [s for s in fam.samples if s.labels.get("model_name") == state.served_model_name]
        assert labelled, f"{name} has no sample labelled model_name={state.served_model_name}"
    run = families["vllm:num_requests_running"].samples[0]
    assert run.labels == {"model_name": state.served_model_name, "engine": "0"}


def counters(base: str) -> dict[tuple, float]:
    out = {}
    for fam in scrape(base).values():
        if fam.type in ("counter", "histogram"):
            for s in fam.samples:
                if s.name.endswith(("_total", "_count", "_sum", "_bucket")):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_counters_never_decrease_across_requests(live_server):
    base, _ = live_server
    before = counters(base)
    work(base)
    after = counters(base)
    assert all(after.get(k, 0) >= v for k, v in before.items()), [k for k, v in before.items() if after.get(k, 0) < v]
    gen = [k for k in after if k[0] == "vllm:generation_tokens_total"]
    assert gen and all(after[k] >= before.get(k, 0) + 18 for k in gen)  # 3 requests x 6 tokens
    queue = [k for k in after if k[0] == "vllm:request_queue_time_seconds_count"]
    assert queue and all(after[k] >= before.get(k, 0) + 3 for k in queue)


def test_the_series_vllms_dashboard_adds(live_server):
    """vllm:iteration_tokens_total (tokens a step), vllm:request_max_num_generation_tokens (each
    finished request's max_tokens) and vllm:cache_config_info (the cache's configuration)."""
    base, state = live_server
    before = counters(base)
    work(base)  # 3 requests of max_tokens 6, ignoring EOS: 3 x 6 generated tokens, each in some step
    after = counters(base)

    def grew(name: str) -> float:
        return sum(v - before.get(k, 0) for k, v in after.items() if k[0] == name)

    assert grew("vllm:request_max_num_generation_tokens_count") == 3
    assert grew("vllm:request_max_num_generation_tokens_sum") == 18
    assert grew("vllm:iteration_tokens_total_count") >= 6  # at least one step a generated token of each
    assert grew("vllm:iteration_tokens_total_sum") >= 18 + 3 * 8  # every generated and prompt token scheduled
    families = scrape(base)
    assert families["vllm:iteration_tokens_total"].type == "histogram"
    info = families["vllm:cache_config_info"].samples[0]
    plan = state.engine.engine.plan
    assert info.value == 1 and info.labels["block_size"] == str(plan.block_size)
    assert info.labels["num_gpu_blocks"] == str(plan.num_blocks) and info.labels["enable_prefix_caching"] == "True"
    card = httpx.get(base + "/v1/models").json()["data"][0]
    assert card["parent"] is None and card["permission"][0]["object"] == "model_permission"


def test_health_is_503_once_the_engine_loop_dies(tiny_k3_dir):
    app, state = make_app(tiny_k3_dir)
    with serving(app) as base:
        work(base)
        assert httpx.get(base + "/health").status_code == 200
        task = state.engine._task
        task.get_loop().call_soon_threadsafe(task.cancel)  # a fault that kills the loop
        deadline = time.monotonic() + 10
        while httpx.get(base + "/health").status_code != 503:
            assert time.monotonic() < deadline, "/health stayed 200 with a dead engine"
            time.sleep(0.05)
        body = httpx.get(base + "/health").json()["error"]
        assert "engine loop stopped" in body["message"]


def test_health_is_503_while_a_step_hangs(tiny_k3_dir):
    app, state = make_app(tiny_k3_dir)
    state.wedged_after_s = 0.3
    eng = state.engine.engine
    real = eng.step
    hang = threading.Event()

    def step():
        if hang.is_set():
            time.sleep(1.5)
            hang.clear()
        return real()

    eng.step = step
    with serving(app) as base:
        work(base)
        hang.set()
        slow = threading.Thread(target=work, args=(base,))
        slow.start()
        deadline = time.monotonic() + 10
        while httpx.get(base + "/health").status_code != 503:
            assert time.monotonic() < deadline, "/health stayed 200 while a step hung"
            time.sleep(0.05)
        assert "running for" in httpx.get(base + "/health").json()["error"]["message"]
        slow.join(60)
        assert httpx.get(base + "/health").status_code == 200  # the step came back: healthy again
