"""EPLB through the server (issue 62): the planner's EPLB line starts as printed, the flags reach
every rank, rebalances show on /metrics, and requests under rebalancing all complete."""

from __future__ import annotations

import asyncio
import json
import shlex

import httpx

from tests.live import serving
from tests.server.conftest import make_app


def test_the_planners_eplb_line_starts_and_counts_the_redundant_bytes(tiny_k3_dir):
    """Layout DP2 / EP2 with 2 redundant experts: the k3serve line turns EPLB on, the server it
    starts holds 5 expert slots a rank (8 + 2 over 2), and each rank's weight bytes equal the
    planner's per-rank figure with the redundant experts counted."""
    from k3serve.config.bundled import load_model_config
    from k3serve.planner.commands import launch_commands
    from k3serve.planner.layout import Layout
    from k3serve.planner.weights import weight_split
    from k3serve.weights.schema import model_tensor_specs

    line = launch_commands(
        str(tiny_k3_dir), Layout(2, tp=1, dp=2, ep=2), 512, 4, 32 * 2**20, 0.9, 0.8, "auto", redundant_experts=2
    )["k3serve"]
    assert "--enable-eplb" in line and "not yet" not in line.replace("not built yet", "")
    cmd = shlex.split(line.split("#")[0])
    _, state = make_app(*cmd[2:], "--data-parallel-backend", "threads", "--dtype", "bfloat16")  # the checkpoint's bytes
    try:
        cfg = load_model_config(tiny_k3_dir)
        vision = sum(s.nbytes for s in model_tensor_specs(cfg) if s.vision)
        want = weight_split(cfg, tiny_k3_dir).per_rank(tp=1, ep=2, redundant=2) - vision
        for r in state.engine.replicas:
            moe = r.engine.executor.model.moe_layers()[0]
            assert moe.w1.shape[0] == 5 and moe.expert_map is not None
            assert r.engine.executor.info.weight_bytes == want
    finally:
        asyncio.run(state.engine.shutdown())


def test_rebalances_show_on_metrics_and_every_request_completes(tiny_k3_dir):
    eplb = {"window_size": 2, "step_interval": 3, "num_redundant_experts": 2, "log_balancedness": True}
    app, state = make_app(
        tiny_k3_dir,
        "--data-parallel-size",
        "2",
        "--enable-expert-parallel",
        "--data-parallel-backend",
        "threads",
        "--enable-eplb",
        "--eplb-config",
        json.dumps(eplb),
    )
    with serving(app, start_timeout=60) as base:

        async def one(client, i):
            r = await client.post(
                "/v1/completions", json={"prompt": f"story {i}:", "max_tokens": 12, "ignore_eos": True}
            )
            return r.status_code, r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else r.text

        async def main():
            async with httpx.AsyncClient(base_url=base, timeout=120) as client:
                return await asyncio.gather(*(one(client, i) for i in range(8)))

        assert asyncio.run(main()) == [(200, "length")] * 8
        text = httpx.get(base + "/metrics").text
        runs = [float(x.split()[-1]) for x in text.splitlines() if x.startswith("k3serve:eplb_rebalances_total{")]
        assert runs and runs[0] >= 3, runs
        assert "k3serve:eplb_imbalance{" in text and 'placement="after"' in text
