"""DP-attention across nodes (issue 16): node 0 runs the server's driver (every replica's
scheduler) and its share of the DP-attention ranks; node 1 runs `k3serve serve ... --nnodes 2
--node-rank 1` headless, whose ranks dial node 0's driver for their commands and meet the
others over gloo. Both nodes are processes of this machine on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from k3serve import LLM, SamplingParams
from tests.live import free_port

KW = dict(cache_memory="32MiB", max_model_len=512, enable_prefix_caching=False)
PROMPTS = ["The fox jumps", "A long time ago, in a place far away,", [5, 6, 7, 8, 9], "Zebra"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _node1(path, port, tp):
    cmd = [
        sys.executable,
        "-m",
        "k3serve",
        "serve",
        str(path),
        "--data-parallel-size",
        "2",
        "--enable-expert-parallel",
        "--tensor-parallel-size",
        str(tp),
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-port",
        str(port),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def _node0(path, port, tp, **kw):
    return LLM(
        str(path),
        data_parallel_size=2,
        enable_expert_parallel=True,
        tensor_parallel_size=tp,
        nnodes=2,
        node_rank=0,
        master_port=port,
        **KW,
        **kw,
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_dp_attention_over_two_nodes_equals_one_engine(tp, tiny_k3_dir):
    """DP2 (x TP2) over two nodes: replica 0's ranks on node 0, replica 1's on node 1; greedy
    tokens equal one engine's, and node 1 exits cleanly once the driver shuts down."""
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_k3_dir), **KW).generate(PROMPTS, GREEDY)]
    port = free_port()
    node1 = _node1(tiny_k3_dir, port, tp)
    try:
        llm = _node0(tiny_k3_dir, port, tp)
        try:
            workers = llm.engine.replicas[0].executor.workers
            assert sorted(workers._proc_of) == list(range(tp))  # node 0's ranks; the rest dialled in
            assert workers._shm_path is None  # the expert group spans nodes: gloo
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
            assert llm.engine.routed == [2, 2]
        finally:
            llm.engine.shutdown()
        assert node1.wait(30) == 0, node1.stderr.read().decode()[-2000:]
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)


def test_a_dead_node_fails_the_step_and_health(tiny_k3_dir):
    """Node 1 killed (its launcher and worker): the next step fails within a bounded time
    (node 0's worker finds its gloo peer gone), the replicas report dead, and shutdown returns."""
    port = free_port()
    node1 = _node1(tiny_k3_dir, port, 1)
    try:
        llm = _node0(tiny_k3_dir, port, 1, distributed_timeout=20)
        try:
            assert llm.generate("The fox", GREEDY)[0].outputs[0].token_ids
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait(10)
            began = time.monotonic()
            outs = None
            try:
                outs = llm.generate(["Zebra", "The fox"], GREEDY)
            except Exception as e:  # noqa: BLE001 - the step's failure may surface either way
                assert "DP-attention" in str(e)
            if outs is not None:
                assert all(o.outputs[0].finish_reason == "error" for o in outs)
            assert time.monotonic() - began < 15
            workers = llm.engine.replicas[0].executor.workers
            assert not workers.alive and "DP-attention" in workers.error
        finally:
            began = time.monotonic()
            llm.engine.shutdown()
            assert time.monotonic() - began < 15
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)


def test_layouts_the_nodes_cannot_hold_are_refused_by_name(tiny_k3_dir):
    from k3serve.distributed.dp_workers import check_dp_nodes
    from k3serve.distributed.multinode import NodeLayout

    with pytest.raises(ValueError, match="a DP rank's TP ranks must share a node"):
        check_dp_nodes(NodeLayout(nnodes=4, master_port=29500), world=4, tp_size=2)
    check_dp_nodes(NodeLayout(nnodes=2, master_port=29500), world=4, tp_size=2)
    with pytest.raises(ValueError, match="plain replicas run on one node"):
        LLM(str(tiny_k3_dir), data_parallel_size=2, nnodes=2, master_port=29500, **KW)
