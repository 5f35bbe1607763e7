"""`--distributed-executor-backend ray` on a local 2-node Ray cluster (a head node with no CPUs
to give, so rank 1 must land on the second node): TP2 output equals the single-process engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3serve import LLM, SamplingParams
from tests.live import free_port

ray = pytest.importorskip("ray")
KW = dict(cache_memory="32MiB", max_model_len=512, max_num_batched_tokens=96, seed=0)
GREEDY = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
PROMPTS = ["hello world, this is", "the quick brown fox jumps over the lazy dog " * 3]


@pytest.fixture()
def two_node_cluster(tmp_path, monkeypatch):
    exe = str(Path(sys.executable).with_name("ray"))
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--disable-usage-stats"]
    # the daemons `ray start` leaves behind keep its output open: never capture it (a pipe never ends)
    quiet = dict(check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    subprocess.run(
        [exe, "start", "--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false", *common], **quiet
    )
    try:
        subprocess.run([exe, "start", f"--address=127.0.0.1:{port}", "--num-cpus=2", *common], **quiet)
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([exe, "stop", "--force"], **{**quiet, "check": False})


@pytest.mark.slow  # 69 s: a two-node Ray cluster starts and stops
def test_ray_backend_on_two_nodes_equals_single_process(two_node_cluster, tiny_kl_dir):
    llm = LLM(str(tiny_kl_dir), tensor_parallel_size=2, distributed_executor_backend="ray", **KW)
    try:
        (rank1,) = llm.engine.executor._procs
        head = [n["NodeID"] for n in ray.nodes() if n["Alive"] and not n["Resources"].get("CPU")]
        assert len(head) == 1 and rank1.node_id() != head[0]  # the head gives no CPUs: the second node runs it
        ref = LLM(str(tiny_kl_dir), **KW)
        for a, b in zip(ref.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY)):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert x.keys() == y.keys() and max(abs(x[k] - y[k]) for k in x) < 1e-4
    finally:
        llm.engine.shutdown()
    assert not rank1.is_alive()
