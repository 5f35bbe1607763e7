"""EPLB in running engines (issue 62): on the skewed-router checkpoint (test_eplb.py), engines
with `--enable-eplb` rebalance every few steps while a batch of requests decodes, moving
experts between the ranks under load; every request finishes, and the greedy tokens equal the
single-process engine's (the reference for every multi-rank engine), across every rebalance.
DP-attention replicas (threads, the graph backend's static step and the kernels) and TP + EP
ranks (worker processes, with ngram speculation)."""

from __future__ import annotations

import pytest

from k3serve import LLM, SamplingParams
from k3serve.testing.builder import build_tiny_checkpoint
from tests.distributed.test_eplb import skew


@pytest.fixture(scope="module")
def skewed_dir(tmp_path_factory):
    """Tiny K3 with the skewed router (test_eplb.py runs both architectures at the model level)."""
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("skewed_k3_engine"), kind="k3", seed=0)
    skew(path)
    return path


KW = dict(cache_memory="32MiB", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4, seed=0)
PROMPTS = [f"request {i}: " + "the quick brown fox " * (i % 4) for i in range(12)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
EPLB = {"window_size": 3, "step_interval": 4, "num_redundant_experts": 2}
COMPILE = {"backend": "aot_eager", "cudagraph_capture_sizes": [1, 2, 4]}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def generate(path, **kw):
    llm = LLM(path, **KW, **kw)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        engines = getattr(llm.engine, "replicas", [llm.engine])
        stats = engines[0].executor.parallel_stats()  # rank 0's: every rank ran the same rebalances
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].finish_reason for o in outs], stats
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def reference(skewed_dir):
    return generate(skewed_dir, kernels="torch")[0]


@pytest.mark.parametrize("backend,kernels", [("threads", "auto"), ("threads", "graph"), ("mp", "auto")])
def test_dp2_ep2_engine_rebalancing_under_load_equals_one_process(skewed_dir, reference, backend, kernels):
    """Threads (in this process) and mp (worker processes: the redundant slots reach them in
    their WorkerSpec, the rebalances run in each worker)."""
    extra = {"compilation_config": COMPILE} if kernels == "graph" else {}
    got, finish, stats = generate(
        skewed_dir,
        data_parallel_size=2,
        enable_expert_parallel=True,
        data_parallel_backend=backend,
        kernels=kernels,
        enable_eplb=True,
        eplb_config=EPLB,
        **extra,
    )
    assert finish == ["length"] * len(PROMPTS)
    assert got == reference
    assert stats["eplb_rebalances"] >= 3, stats
    before, after = stats["eplb_balance"]
    print(
        f"EPLB DP2+EP2 {backend} ({kernels}): {stats['eplb_rebalances']} rebalances, window {before:.3f} -> {after:.3f}"
    )


def test_tp2_ep_engine_rebalancing_under_load_with_ngram_equals_one_process(skewed_dir, reference):
    got, finish, stats = generate(
        skewed_dir,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        enable_eplb=True,
        eplb_config=EPLB,
        speculative_config=NGRAM,
    )
    assert finish == ["length"] * len(PROMPTS)
    assert got == reference
    assert stats["eplb_rebalances"] >= 3, stats


def test_eplb_without_expert_parallelism_is_refused_by_name(tiny_k3_dir):
    with pytest.raises(ValueError, match="--enable-expert-parallel"):
        LLM(tiny_k3_dir, tensor_parallel_size=2, enable_eplb=True, **KW)
    with pytest.raises(ValueError, match="not divisible by --tensor-parallel-size 2"):
        LLM(
            tiny_k3_dir,
            tensor_parallel_size=2,
            enable_expert_parallel=True,
            enable_eplb=True,
            eplb_config={"num_redundant_experts": 1},
            **KW,
        )
