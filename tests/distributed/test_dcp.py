"""Decode context parallelism (issue 62 item 2): `--decode-context-parallel-size 2` inside TP2
shards the MLA latent cache by token over the two ranks (parallel/dcp.py); each attends over
its rows and the outputs merge by log-sum-exp (layers/mla_dcp.py). The references are one
process and plain TP2: logits as accurate (model level, ranks as threads), greedy tokens equal
(engine), with prefix hits, ngram speculation, both prefix-cache tiers across a change of DCP
size, and P/D hand-offs both ways; each rank's latent pool holds half the rows TP2's does for
the same blocks, and the engine's plan is the planner's."""

from __future__ import annotations

import pytest
import torch

from k3serve import LLM, SamplingParams
from k3serve.forward import CacheTensors, ForwardBatch
from k3serve.models.registry import load_model
from k3serve.testing.tp_harness import run_ranks
from tests.distributed.test_tp_model import BLOCK, PROMPT, assert_as_accurate, exact_logits, greedy_logits

KW = dict(cache_memory="32MiB", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4, seed=0)
SHARED = "A shared system prompt about foxes and dogs, long enough to fill blocks. " * 3
PROMPTS = [SHARED + f"request {i}: " + "the quick brown fox " * (i % 4) for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}


def _path(kind, tiny_k3_dir, tiny_kl_dir):
    return tiny_k3_dir if kind == "k3" else tiny_kl_dir


def _layout(kind):
    """TP2 for the engine: tiny K3's 32 expert channels split only by whole experts."""
    return dict(tensor_parallel_size=2, enable_expert_parallel=kind == "k3")


# ---- the model, ranks as threads ------------------------------------------------------------


def dcp_decode(path, tp, chunks=(20, 17), steps=3) -> torch.Tensor:
    """A prefill in two chunks (the second attends over the first's rows on both ranks), then
    greedy decode steps, on a cache whose latent rows are this rank's share: [37 + steps, V]."""
    model = load_model(path, dtype=torch.float32, progress=False, tp=tp)
    model.use_kernels("torch")
    cache = CacheTensors.allocate(model.cfg, 2, 8, BLOCK, tp_size=tp.size, latent_shards=tp.dcp)
    assert all(t.shape[0] == 8 * BLOCK // tp.dcp for t in cache.latent if t is not None)
    table, rows, at = list(range(8)), [], 0
    for n in chunks:
        fb = ForwardBatch(torch.tensor(PROMPT[at : at + n]), [n], [at], [1], [table], BLOCK)
        rows.append(model.compute_logits(model(fb, cache).hidden))
        at += n
    for t in range(steps):
        nxt = int(rows[-1][-1].argmax())
        fb = ForwardBatch(torch.tensor([nxt]), [1], [at + t], [1], [table], BLOCK)
        rows.append(model.compute_logits(model(fb, cache).hidden))
    return torch.cat(rows)


@pytest.mark.parametrize("interleave", [1, 2])
@pytest.mark.parametrize("kind", ["kl", "k3"])
def test_dcp2_logits_are_as_accurate_as_one_process(kind, interleave, tiny_k3_dir, tiny_kl_dir):
    path = _path(kind, tiny_k3_dir, tiny_kl_dir)
    ref, exact = greedy_logits(path, kernels="torch"), exact_logits(path)
    outs = run_ranks(2, lambda tp: dcp_decode(path, tp), kind == "k3", dcp=2, dcp_interleave=interleave)
    for got in outs:
        assert_as_accurate(got, ref, exact)
    assert torch.equal(outs[0].argmax(-1), ref.argmax(-1))


def test_dcp2_inside_tp4_logits_are_as_accurate_as_one_process(tiny_kl_dir):
    """DCP below TP: ranks {0, 1} and {2, 3} each share one latent cache by token (their
    sub-groups gather queries and merge outputs); their heads are consecutive."""
    from dataclasses import replace

    from k3serve.parallel.expert_group import thread_process_groups
    from k3serve.parallel.group import TPGroup

    subs = [thread_process_groups(2), thread_process_groups(2)]

    def rank(tp):
        g, t = divmod(tp.rank, 2)
        return dcp_decode(tiny_kl_dir, replace(tp, dcp_group=TPGroup(t, 2, pg=subs[g][t])))

    ref, exact = greedy_logits(tiny_kl_dir, kernels="torch"), exact_logits(tiny_kl_dir)
    outs = run_ranks(4, rank, dcp=2)
    for got in outs:
        assert_as_accurate(got, ref, exact)
    assert torch.equal(outs[0].argmax(-1), ref.argmax(-1))


# ---- the engine, worker processes -----------------------------------------------------------


def twice(path, **kw):
    """The prompts twice (the second pass hits the prefix cache): both passes' tokens, the
    engine's plan and rank 0's latent rows per MLA layer."""
    llm = LLM(path, **KW, **kw)
    try:
        first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        second = llm.generate(PROMPTS, GREEDY)
        assert all(o.num_cached_tokens >= 32 for o in second)  # the shared blocks, on both ranks
        rows = next((t.shape[0] for t in llm.engine.executor.cache.latent if t is not None), None)
        return (first, [o.outputs[0].token_ids for o in second]), llm.engine.plan, rows
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("kind", ["k3", "kl"])
def test_dcp2_equals_tp2_and_one_process_with_prefix_hits(kind, tiny_k3_dir, tiny_kl_dir):
    path = _path(kind, tiny_k3_dir, tiny_kl_dir)
    one, _, _ = twice(path, kernels="torch")
    tp2, tp_plan, tp_rows = twice(path, **_layout(kind))
    dcp2, dcp_plan, dcp_rows = twice(path, decode_context_parallel_size=2, **_layout(kind))
    assert dcp2 == tp2 == one
    # the same cache memory: twice the blocks, each rank's pool as many rows (half TP2's per block)
    assert dcp_plan.num_blocks >= 2 * tp_plan.num_blocks - 1 and dcp_plan.block_bytes * 2 == tp_plan.block_bytes
    assert dcp_rows == dcp_plan.num_blocks * dcp_plan.block_size // 2
    assert tp_rows == tp_plan.num_blocks * tp_plan.block_size


def test_dcp2_with_interleave_and_ngram_speculation_equals_one_process(tiny_k3_dir):
    """Verify passes attend over the sharded rows (and roll back KDA on both ranks); interleave 2."""
    one, _, _ = twice(tiny_k3_dir, kernels="torch", speculative_config=NGRAM)
    dcp2, _, _ = twice(
        tiny_k3_dir,
        decode_context_parallel_size=2,
        cp_kv_cache_interleave_size=2,
        speculative_config=NGRAM,
        **_layout("k3"),
    )
    assert dcp2 == one


@pytest.mark.slow  # four worker ranks
def test_dcp2_inside_tp4_equals_one_process(tiny_kl_dir):
    one, _, _ = twice(tiny_kl_dir, kernels="torch")
    got, plan, rows = twice(tiny_kl_dir, tensor_parallel_size=4, decode_context_parallel_size=2)
    assert got == one and rows == plan.num_blocks * plan.block_size // 2


@pytest.mark.slow  # four worker ranks
def test_dcp2_inside_each_of_two_pipeline_stages_equals_one_process(tiny_kl_dir):
    """TP2 x PP2 with DCP2: each stage's two ranks share its MLA layers' rows by token."""
    one, _, _ = twice(tiny_kl_dir, kernels="torch")
    got, _, _ = twice(tiny_kl_dir, tensor_parallel_size=2, pipeline_parallel_size=2, decode_context_parallel_size=2)
    assert got == one


def test_tiers_written_under_dcp2_are_read_under_tp2_and_back(tiny_k3_dir, tmp_path):
    """An entry holds whole blocks (each rank's rows gathered on write, split on load), so a TP2
    engine without DCP restarts from a DCP2 engine's directory and the reverse, each equal to a
    cold recompute; the host tier sits in front of both."""
    prefix = torch.randint(1, 500, (80,), generator=torch.Generator().manual_seed(41)).tolist()
    kw = dict(cache_memory="32MiB", max_model_len=512, seed=0, **_layout("k3"))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run(llm, ids):
        out = llm.generate([{"prompt_token_ids": ids}], params)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    cold = LLM(tiny_k3_dir, enable_prefix_caching=False, cache_memory="32MiB", max_model_len=512, seed=0)
    disk = str(tmp_path / "tiers")
    tiers = dict(kv_offloading_dir=disk, kv_offloading_size=0.01)
    for i, (writer, reader) in enumerate([(2, 1), (1, 2)]):
        suffix = [7 + i, 8, 9, 10, 11]
        want, _ = run(cold, prefix + [i] + suffix)
        first = LLM(tiny_k3_dir, decode_context_parallel_size=writer, **tiers, **kw)
        try:
            run(first, prefix + [i])
        finally:
            first.engine.shutdown()
        again = LLM(tiny_k3_dir, decode_context_parallel_size=reader, **tiers, **kw)
        try:
            got, cached = run(again, prefix + [i] + suffix)
            assert cached == 80 and got == want, (writer, reader)
            assert again.engine.tiers.index.stats["disk"].hits >= 5
        finally:
            again.engine.shutdown()


def test_dcp2_prefill_hands_off_to_one_process_decode_and_back(tiny_k3_dir):
    """A hand-off gathers the latent rows of both ranks; one into DCP2 splits them again."""
    from tests.engine.test_handoff import both_ways

    kw = dict(cache_memory="32MiB", max_model_len=512, block_size=16)
    colocated, one = LLM(tiny_k3_dir, **kw), LLM(tiny_k3_dir, **kw)
    dcp2 = LLM(tiny_k3_dir, decode_context_parallel_size=2, **_layout("k3"), **kw)
    try:
        both_ways(colocated, one, dcp2, "dcp")
    finally:
        dcp2.engine.shutdown()


def test_dcp2_engine_and_planner_agree(tiny_k3_dir):
    """The planner's DCP2 layout sizes the engine's cache: the same slots, tokens and
    checkpoints for the same bytes, and more requests of max_model_len than without DCP."""
    from k3serve.planner.hardware import get_gpu
    from k3serve.planner.memory import Workload
    from k3serve.planner.search import plan
    from k3serve.planner.weights import weight_split

    kw = dict(cache_memory="8MiB", max_model_len=1024, max_num_seqs=64, seed=0, **_layout("k3"))
    llm = LLM(tiny_k3_dir, decode_context_parallel_size=2, **kw)
    try:
        cfg, want = llm.engine.model.cfg, llm.engine.plan
    finally:
        llm.engine.shutdown()
    w = Workload(context=1024, max_num_seqs=64, kv_dtype="float32", memory_fraction=0.92)
    rep = plan(
        cfg, str(tiny_k3_dir), "schema", [get_gpu("H100")], weight_split(cfg, tiny_k3_dir), w,
        num_gpus=2, tp=2, ep=2, dcp=2, cache_bytes=8 * 2**20,
    )  # fmt: skip
    got = rep.results[0]
    assert got.layout.label.endswith("/DCP2")
    assert (got.rank.plan.num_slots, got.rank.plan.kv_tokens, got.rank.plan.num_checkpoints) == (
        want.num_slots,
        want.kv_tokens,
        want.num_checkpoints,
    )
    assert got.capacity > got.capacity_without_dcp
    assert "--decode-context-parallel-size 2" in got.commands["k3serve"]
    assert "--decode-context-parallel-size 2" in got.commands["vllm"]


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(tensor_parallel_size=2, decode_context_parallel_size=4), "must divide --tensor-parallel-size 2"),
        (dict(tensor_parallel_size=2, decode_context_parallel_size=2, block_size=9), "--block-size 9"),
        (
            dict(tensor_parallel_size=2, decode_context_parallel_size=2, cp_kv_cache_interleave_size=16),
            "--cp-kv-cache-interleave-size 16",
        ),
        (dict(tensor_parallel_size=2, decode_context_parallel_size=2, kernels="cpp"), "--kernels cpp"),
    ],
)
def test_what_dcp_does_not_run_is_refused_by_name(kw, needle, tiny_k3_dir):
    with pytest.raises(ValueError, match=needle.replace("-", r"\-")):
        LLM(tiny_k3_dir, **kw)


def test_dcp_with_dp_attention_is_refused_by_name(tiny_k3_dir):
    from k3serve.engine.dp_llm_engine import DataParallelEngine

    with pytest.raises(ValueError, match="decode-context-parallel-size with DP-attention"):
        DataParallelEngine(
            str(tiny_k3_dir),
            2,
            tensor_parallel_size=2,
            enable_expert_parallel=True,
            decode_context_parallel_size=2,
        )
