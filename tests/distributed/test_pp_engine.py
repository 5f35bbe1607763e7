"""Pipeline stages (issue 62 item 1): `--pipeline-parallel-size 2` splits the layers over two
worker ranks (AttnRes blocks kept whole, config/stages.py); each holds only its layers'
weights, KDA states and latent rows, and hands its hidden state and block vectors to the next.
The reference is the single-process engine: greedy tokens equal, on both tiny architectures,
with the kernels and torch, prefix-cache hits, ngram and DSpark speculation (the tap layers'
states come back from the stage holding them), and TP inside the stages with experts split by
id (slow)."""

from __future__ import annotations

import time

import pytest

from k3serve import LLM, SamplingParams
from k3serve.config.bundled import load_model_config
from k3serve.config.stages import stage_layers

KW = dict(cache_memory="32MiB", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4, seed=0)
SHARED = "A shared system prompt about foxes and dogs, long enough to fill blocks. " * 3
PROMPTS = [SHARED + f"request {i}: " + "the quick brown fox " * (i % 4) for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def twice(path, **kw):
    """The prompts twice (the second pass hits the prefix cache): both passes' tokens."""
    llm = LLM(path, **KW, **kw)
    try:
        first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        return first, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def references(tiny_k3_dir, tiny_kl_dir):
    return {kind: twice(path, kernels="torch") for kind, path in (("k3", tiny_k3_dir), ("kl", tiny_kl_dir))}


def _path(kind, tiny_k3_dir, tiny_kl_dir):
    return tiny_k3_dir if kind == "k3" else tiny_kl_dir


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("kind", ["k3", "kl"])
def test_pp2_equals_one_process_with_prefix_hits(kind, kernels, references, tiny_k3_dir, tiny_kl_dir):
    first, second = twice(_path(kind, tiny_k3_dir, tiny_kl_dir), pipeline_parallel_size=2, kernels=kernels)
    assert (first, second) == references[kind]


def test_pp2_prefix_cache_hits_and_stage_caches(tiny_k3_dir):
    """The second pass is served from the prefix cache; each stage's cache holds its layers only."""
    from k3serve.engine.stats import snapshot

    llm = LLM(tiny_k3_dir, pipeline_parallel_size=2, **KW)
    try:
        llm.generate(PROMPTS, GREEDY)
        before = snapshot(llm.engine).prefix_hits
        llm.generate(PROMPTS, GREEDY)
        assert snapshot(llm.engine).prefix_hits > before
        cache = llm.engine.executor.cache  # rank 0: stage 0
        held = [i for i, t in enumerate(cache.recurrent) if t is not None] + [
            i for i, t in enumerate(cache.latent) if t is not None
        ]
        cfg = load_model_config(tiny_k3_dir)
        assert sorted(held) == list(stage_layers(cfg, 2)[0])
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("spec", ["ngram", "dspark"])
def test_pp2_with_speculation_equals_one_process(spec, references, tiny_k3_dir, random_dspark):
    """Two steps in flight with speculation too: a verify pass's rollback then follows the next
    step's forward on every stage, so each rank keeps two passes' records (by their slots) and
    the CPU kernels rotate two record stores (one store held the next pass's states: wrong
    text). K pinned, so that every proposal is verified."""
    config = NGRAM if spec == "ngram" else {"method": "dspark", "model": random_dspark, "num_speculative_tokens": 4}
    llm = LLM(tiny_k3_dir, pipeline_parallel_size=2, speculative_config={**config, "adaptive": False}, **KW)
    try:
        engine, overlapped = llm.engine, []
        launch = engine.core.launch

        def spy(batch, **kw):
            overlapped.append(bool(engine.scheduler.in_flight) and any(s.drafts for s in batch.seqs))
            return launch(batch, **kw)

        engine.core.launch = spy
        first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        second = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        drafts = engine.spec.stats.drafts
    finally:
        llm.engine.shutdown()
    assert (first, second) == references["k3"]
    assert sum(overlapped) >= 3 and drafts > 0  # verify passes launched while another step was in flight


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["k3", "kl"])
def test_tp2_x_pp2_with_expert_parallel_and_ngram_equals_one_process(kind, references, tiny_k3_dir, tiny_kl_dir):
    path = _path(kind, tiny_k3_dir, tiny_kl_dir)
    got = twice(path, pipeline_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    assert got == references[kind]
    got = twice(
        path, pipeline_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True, speculative_config=NGRAM
    )
    assert got == references[kind]
    got = twice(path, pipeline_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True, kernels="graph")
    assert got == references[kind]  # each stage's static step with its TP collectives compiled in


def test_pp2_with_expert_parallel_equals_one_process(references, tiny_kl_dir):
    """PP2 x TP2 with the experts split by id inside each stage (4 ranks)."""
    got = twice(tiny_kl_dir, pipeline_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    assert got == references["kl"]


@pytest.mark.parametrize("kind, spec", [("k3", None), ("kl", None), ("k3", "dspark")])
def test_pp2_graph_steps_equal_one_process(kind, spec, references, tiny_k3_dir, tiny_kl_dir, random_dspark):
    """`--kernels graph` under stages: each stage runs its layers as a compiled static step (its
    bucket's input buffer filled from the previous stage between the calls); decode steps two
    in flight, prefix hits, and DSpark's verify buckets with tap layers on both stages."""
    config = {"method": "dspark", "model": random_dspark, "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(
        _path(kind, tiny_k3_dir, tiny_kl_dir),
        pipeline_parallel_size=2,
        kernels="graph",
        speculative_config=config if spec else None,
        **KW,
    )
    try:
        first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        second = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        graphs = llm.engine.executor.rank0.rank_runner.graphs
        steps, eager = graphs.steps, graphs.eager_steps
        stages = llm.engine.executor.call("graph_steps")  # stage 1's (steps, compiles)
    finally:
        llm.engine.shutdown()
    assert (first, second) == references[kind]
    assert steps >= 20 and eager == 0 and stages == [(steps, graphs.compiles)]


def test_what_stages_do_not_run_yet_is_refused_by_name(tiny_k3_dir):
    with pytest.raises(ValueError, match="--pipeline-parallel-size with DP-attention"):
        LLM(tiny_k3_dir, pipeline_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True, **KW)


def test_stages_keep_attnres_blocks_whole_and_balance_weight():
    k3 = load_model_config("moonshotai/Kimi-K3")
    for pp in (2, 4, 8):
        stages = stage_layers(k3, pp)
        assert [s.start for s in stages][0] == 0 and stages[-1].stop == k3.num_layers
        assert all(s.start % k3.attn_res_block_size == 0 for s in stages)
    kl = load_model_config("moonshotai/Kimi-Linear-48B-A3B-Instruct")
    sizes = [len(s) for s in stage_layers(kl, 4)]
    assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="--pipeline-parallel-size 16 exceeds the 8 AttnRes blocks"):
        stage_layers(k3, 16)


@pytest.mark.slow  # 16 ranks on two "nodes" of this machine
def test_the_planners_16_h200_k3_line_with_stages_starts(tmp_path):
    """`k3serve plan` for K3 on 16 x H200 prints a TP8 x PP2 line over two nodes; pointed at a
    tiny K3 with 8 heads (the same layout flags; cache and length sized for this CPU), node 1 runs
    headless and node 0's engine serves the single-process tokens."""
    import shlex
    import subprocess
    import sys

    from k3serve.cli import build_parser
    from k3serve.planner.hardware import get_gpu
    from k3serve.planner.memory import Workload
    from k3serve.planner.search import plan
    from k3serve.planner.weights import weight_split
    from k3serve.server.launch import engine_kwargs
    from k3serve.testing.builder import build_tiny_checkpoint
    from k3serve.testing.tiny_configs import tiny_k3_config
    from tests.live import free_port

    k3 = load_model_config("moonshotai/Kimi-K3")
    rep = plan(k3, "moonshotai/Kimi-K3", "bundled", [get_gpu("H200")], weight_split(k3), Workload(), num_gpus=16)
    line = rep.launch()["k3serve"].split("  #")[0]
    assert "--pipeline-parallel-size 2" in line and "--tensor-parallel-size 8" in line, line
    raw = tiny_k3_config()
    raw["text_config"].update(num_attention_heads=8, num_key_value_heads=8)
    raw["text_config"]["linear_attn_config"].update(num_heads=8)
    path = build_tiny_checkpoint(tmp_path / "k3h8", config=raw)
    port = free_port()
    cmd = shlex.split(line.replace("moonshotai/Kimi-K3", str(path)))
    cmd = [c.replace("$HEAD_IP", "127.0.0.1").replace("29500", str(port)) for c in cmd]
    small = ["--cache-memory", "16MiB", "--max-model-len", "256", "--max-num-seqs", "4"]
    node1 = [c if c != "$NODE_RANK" else "1" for c in cmd[1:]] + small
    headless = subprocess.Popen(
        [sys.executable, "-m", "k3serve", *node1], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        args = build_parser().parse_args([c if c != "$NODE_RANK" else "0" for c in cmd[1:]] + small)
        llm = LLM(str(path), **engine_kwargs(args))
        try:
            ref = LLM(
                str(path),
                **{
                    **engine_kwargs(args),
                    **dict(tensor_parallel_size=1, pipeline_parallel_size=1, nnodes=1, master_port=0),
                },
            )
            try:
                want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS[:2], GREEDY)]
            finally:
                ref.engine.shutdown()
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == want
        finally:
            llm.engine.shutdown()
        assert headless.wait(60) == 0, headless.stderr.read()[-2000:]
    finally:
        if headless.poll() is None:
            headless.kill()


def test_pp2_tiers_across_a_restart_equal_a_cold_recompute(tiny_k3_dir, tmp_path):
    """Both prefix-cache tiers under stages: a state entry holds every stage's layers (read from
    each stage's rank and joined), a block entry every MLA layer's rows; a restarted PP2 engine
    on the same directory loads the prefix into both stages and decodes the cold tokens."""
    import torch

    prefix = torch.randint(1, 500, (80,), generator=torch.Generator().manual_seed(41)).tolist()
    suffix = [7, 8, 9, 10, 11]
    kw = dict(cache_memory="32MiB", max_model_len=512, seed=0)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run(llm, ids):
        out = llm.generate([{"prompt_token_ids": ids}], params)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    cold = LLM(tiny_k3_dir, enable_prefix_caching=False, **kw)
    want, _ = run(cold, prefix + suffix)
    disk = str(tmp_path / "tiers")
    first = LLM(tiny_k3_dir, pipeline_parallel_size=2, kv_offloading_dir=disk, **kw)
    try:
        run(first, prefix)
    finally:
        first.engine.shutdown()
    again = LLM(tiny_k3_dir, pipeline_parallel_size=2, kv_offloading_dir=disk, **kw)
    try:
        got, cached = run(again, prefix + suffix)
        assert cached == 80 and got == want
        assert again.engine.tiers.index.stats["disk"].hits >= 6
    finally:
        again.engine.shutdown()


def test_pp2_prefill_hands_off_to_one_process_decode_and_back(tiny_k3_dir):
    """A hand-off from a PP2 engine carries every stage's layers (state and latent rows), and
    one into a PP2 engine reaches every stage: both decode the colocated engine's tokens."""
    from tests.engine.test_handoff import both_ways

    kw = dict(cache_memory="32MiB", max_model_len=512, block_size=16)
    colocated, one, pp2 = (
        LLM(tiny_k3_dir, **kw),
        LLM(tiny_k3_dir, **kw),
        LLM(tiny_k3_dir, pipeline_parallel_size=2, **kw),
    )
    try:
        both_ways(colocated, one, pp2, "pp")
    finally:
        pp2.engine.shutdown()


def test_pp2_engine_and_planner_agree_on_a_stage_cache(tiny_k3_dir):
    """A stage caches only its layers, so the same budget holds more requests: the engine's
    plan under PP2 is the planner's for a PP2 layout (the busiest stage's shares), each
    stage's allocated bytes fit in it, and it holds more slots or tokens than PP1's."""
    from k3serve.planner.hardware import get_gpu
    from k3serve.planner.memory import Workload
    from k3serve.planner.search import plan
    from k3serve.planner.weights import weight_split

    kw = dict(cache_memory="8MiB", max_model_len=1024, max_num_seqs=16)
    llm = LLM(tiny_k3_dir, pipeline_parallel_size=2, **kw)
    try:
        cfg = llm.engine.model.cfg
        w = Workload(context=1024, max_num_seqs=16, kv_dtype="float32", memory_fraction=0.92)
        rep = plan(
            cfg, str(tiny_k3_dir), "schema", [get_gpu("H100")], weight_split(cfg, tiny_k3_dir), w,
            num_gpus=2, tp=1, pp=2, cache_bytes=8 * 2**20,
        )  # fmt: skip
        got, want = rep.results[0].rank.plan, llm.engine.plan
        assert (got.num_slots, got.kv_tokens, got.num_checkpoints) == (
            want.num_slots,
            want.kv_tokens,
            want.num_checkpoints,
        )
        cache = llm.engine.executor.cache  # stage 0's tensors
        held = sum(t.nbytes for t in cache.recurrent + cache.conv + cache.latent if t is not None)
        assert held <= 8 * 2**20
    finally:
        llm.engine.shutdown()
    one = LLM(tiny_k3_dir, **kw).engine.plan
    assert (want.num_slots, want.kv_tokens) > (one.num_slots, one.kv_tokens)


def test_pp2_runs_two_steps_in_flight_and_equals_one_process(references, tiny_k3_dir):
    """Without speculation the engine launches the next batch (requests not in flight) before
    completing the one in flight, so stage 0 works while stage 1 finishes the other
    (engine/llm_engine.py `_overlapped_step`); the tokens are those of one process, and of the
    same engine with the overlap off. A request aborted while its step is in flight ends alone
    and frees its cache; the others go on."""
    llm = LLM(tiny_k3_dir, pipeline_parallel_size=2, **KW)
    try:
        engine, overlapped = llm.engine, []
        launch = engine.core.launch

        def spy(batch, **kw):
            overlapped.append(bool(engine.scheduler.in_flight))
            return launch(batch, **kw)

        engine.core.launch = spy
        assert engine.core.pipelined
        first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        second = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert (first, second) == references["k3"]
        assert sum(overlapped) >= 10  # a launch while another step was in flight, most steps
        engine.core.overlap = False
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == second
        engine.core.overlap = True
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{i}", p, GREEDY)
        while not engine._in_flight:
            engine.step()
        gone = next(iter(engine.scheduler.in_flight))
        engine.abort(gone)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        assert gone not in done and [done[f"r{i}"] for i in range(len(PROMPTS)) if f"r{i}" != gone] == [
            t for i, t in enumerate(second) if f"r{i}" != gone
        ]
        assert engine.cache.num_requests == 0
        for i, p in enumerate(PROMPTS):  # shut down with a step in flight: received first, no hang
            engine.add_request(f"s{i}", p, GREEDY)
        while not engine._in_flight:
            engine.step()
        began = time.perf_counter()
        engine.shutdown()
        assert time.perf_counter() - began < 10 and engine._in_flight is None
    finally:
        llm.engine.shutdown()
