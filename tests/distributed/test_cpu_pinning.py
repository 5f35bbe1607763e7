"""A TP2 engine with its CPU ranks pinned one per physical core (`--numa none` on this one-node
host: rank 0 in the driver on the first core, rank 1's worker on the second; issue 64 item 3)
answers exactly as one process; the driver's own affinity comes back at shutdown. DP-attention's
worker ranks are placed the same way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from k3serve import LLM, SamplingParams
from k3serve.executor.cpu_topology import read_topology


def _allowed(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split()[1]
    return ""


@pytest.mark.skipif(read_topology().cores < 2, reason="two physical cores to pin two ranks to")
def test_tp2_pinned_one_rank_per_core_equals_one_process(tiny_kl_dir):
    kw = dict(cache_memory="32MiB", max_model_len=256, seed=0)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["the quick brown fox", "hello world, this is"]
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_kl_dir), **kw).generate(prompts, greedy)]
    before = os.sched_getaffinity(0)
    cores = read_topology().nodes
    first, second = [core[0] for n in sorted(cores) for core in cores[n]][:2]
    tp = LLM(str(tiny_kl_dir), tensor_parallel_size=2, numa="none", **kw)
    try:
        assert os.sched_getaffinity(0) == {first}  # the driver runs rank 0 on the first core
        assert _allowed(tp.engine.executor._procs[0].pid) == str(second)
        assert [o.outputs[0].token_ids for o in tp.generate(prompts, greedy)] == want
    finally:
        tp.engine.shutdown()
    assert os.sched_getaffinity(0) == before


@pytest.mark.skipif(read_topology().cores < 2, reason="two physical cores to pin two ranks to")
def test_dp2_attention_workers_pinned_one_per_core_equal_one_process(tiny_k3_dir):
    """DP-attention's worker ranks take the same placement as TP's (`--numa none`: one rank a
    physical core); the driver, which holds the replicas' schedulers and no rank, stays as it was."""
    kw = dict(cache_memory="32MiB", max_model_len=256, seed=0)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["the quick brown fox", "hello world, this is", "a", "Zebra"]
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_k3_dir), **kw).generate(prompts, greedy)]
    before = os.sched_getaffinity(0)
    cores = read_topology().nodes
    first, second = [core[0] for n in sorted(cores) for core in cores[n]][:2]
    dp = LLM(str(tiny_k3_dir), data_parallel_size=2, enable_expert_parallel=True, numa="none", **kw)
    try:
        workers = dp.engine.replicas[0].executor.workers
        assert [_allowed(p.pid) for p in workers._procs] == [str(first), str(second)]
        assert os.sched_getaffinity(0) == before
        assert [o.outputs[0].token_ids for o in dp.generate(prompts, greedy)] == want
    finally:
        dp.engine.shutdown()
