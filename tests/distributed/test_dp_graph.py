"""The graph backend under DP-attention + EP (issue 46 item 6): each DP rank compiles its static
step with the MoE token exchange at a fixed shape (all-gather of the agreed rows, every rank's
experts weighted 0 for another rank's assignments, reduce-scatter), the ranks agree on static
or eager and on those rows before each step, and a rank with nothing scheduled runs a padding
step. Reference: the single-process torch engine's greedy tokens, and the eager exchange's
routed sums."""

from __future__ import annotations

import pytest
import torch

from k3serve import LLM, SamplingParams

KW = dict(cache_memory="32MiB", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4, seed=0)
# different lengths and counts per replica, so one replica is idle or prefilling while the other decodes
PROMPTS = ["hello world, this is", "the quick brown fox jumps over the lazy dog", "a", "Once upon a time", "Zebra"]
COMPILE = {"backend": "aot_eager", "cudagraph_capture_sizes": [1, 2, 4]}


# K pinned: these tests check verify buckets against decode buckets, so every proposal is verified
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "adaptive": False,
}


def dp_graph_outputs(path, prompts, params, **kw) -> tuple[list, list]:
    """The outputs of a DP2-attention + EP2 graph engine, and its replica engines."""
    dp = LLM(path, data_parallel_size=2, enable_expert_parallel=True, kernels="graph", compilation_config=COMPILE, **kw)
    try:
        return dp.generate(prompts, params), list(dp.engine.replicas)
    finally:
        dp.engine.shutdown()


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_live_load(outs, engines, cfg) -> None:
    """The replicas' expert load: every forwarded token's top-k once per MoE layer (each rank
    counts its own live rows: not the padding rows, nor an idle rank's padding step)."""
    forwarded = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    loads = [r.executor.parallel_stats()["expert_tokens_per_rank"] for r in engines]
    assert sum(map(sum, loads)) == forwarded * cfg.moe.top_k * layers


# in-process replicas without speculation: `make test-slow` (mp and threads + ngram cover the suite)
@pytest.mark.parametrize(
    "backend,spec", [pytest.param("threads", None, marks=pytest.mark.slow), ("mp", None), ("threads", NGRAM)]
)
def test_dp2_ep2_graph_engine_equals_the_single_process_engine(backend, spec, tiny_k3_dir):
    """In-process replicas (threads) and worker processes (mp, the default); with ngram
    speculation a replica's verify step (4 positions a sequence) and the other's decode step
    exchange the same agreed rows. Every bucket compiles once (no recompiles, in this process)."""
    path = str(tiny_k3_dir)
    prompts = (
        PROMPTS
        if spec is None
        else ["the quick brown fox, the quick brown fox, the quick brown", "a b c a b c a b c a b", *PROMPTS[-2:]]
    )
    greedy = [SamplingParams(temperature=0, max_tokens=32 - 4 * i, ignore_eos=True) for i in range(len(prompts))]
    want = [o.outputs[0].token_ids for o in LLM(path, kernels="torch", **KW).generate(prompts, greedy)]
    kw = {**KW, "enable_prefix_caching": False}  # every prompt token forwarded: the load below is exact
    with torch._dynamo.config.patch(error_on_recompile=True):
        outs, engines = dp_graph_outputs(
            path, prompts, greedy, data_parallel_backend=backend, speculative_config=spec, **kw
        )
    assert tokens(outs) == want
    assert all(r.runner.static_steps >= 15 for r in engines)  # in the workers too (mp)
    if spec is None:  # (a verify pass forwards rejected drafts too)
        assert_live_load(outs, engines, engines[0].model_info.cfg)
    if backend == "threads":
        graphs = [r.executor.graphs for r in engines]
        assert sum(g.padding_steps for g in graphs) > 0  # one replica finished first and padded
        if spec is not None:  # a verify bucket ran against a decode bucket of the same exchange rows
            buckets = [b for g in graphs for b in g.entries]
            assert any(b.T == 4 for b in buckets) and any(b.T == 1 and b.ep_rows >= 4 for b in buckets)


@pytest.mark.slow
def test_dp2_with_tp2_inside_graph_engine_equals_the_single_process_engine(tiny_k3_dir):
    """DP2 x TP2 worker processes (four ranks): each TP rank sends its share of the agreed rows
    and gathers its DP rank's routed rows back, inside the compiled step."""
    path = str(tiny_k3_dir)
    greedy = [SamplingParams(temperature=0, max_tokens=16 - 2 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    want = [o.outputs[0].token_ids for o in LLM(path, kernels="torch", **KW).generate(PROMPTS, greedy)]
    outs, engines = dp_graph_outputs(path, PROMPTS, greedy, tensor_parallel_size=2, **KW)
    assert tokens(outs) == want
    assert all(r.runner.static_steps >= 10 for r in engines)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("kind", ["k3", "kl"])
def test_the_fixed_shape_exchange_equals_the_eager_gather(kind, compiled, tiny_k3_dir, tiny_kl_dir):
    """Two DP ranks bring 3 and 1 rows (4 agreed): each rank's routed sums from the fixed-shape
    exchange (graph backend's ops; compiled whole with its functional collectives) equal the
    eager gather form's with the reference's row selection, and the expert load counts the
    live rows only (the padding row, and the rows past each rank's own, are not tokens)."""
    from k3serve.backends import TORCH
    from k3serve.layers.moe_dispatch import fixed_gather_routed, gather_routed
    from k3serve.models.registry import load_model
    from k3serve.testing.tp_harness import run_ranks

    def rank(ep):
        path = tiny_k3_dir if kind == "k3" else tiny_kl_dir
        model = load_model(str(path), progress=False, ep=ep, dtype=torch.float32)
        model.use_kernels("graph")
        moe, ops = model.moe_layers()[0], model.model.backend
        n = (3, 1)[ep.rank]
        x = torch.randn(n, model.cfg.hidden_size, generator=torch.Generator().manual_seed(ep.rank))
        want = gather_routed(moe, x, TORCH)
        counted = moe.expert_load.clone()
        live = torch.tensor([True] * (n - 1) + [False])  # the last row a padding row
        fixed = fixed_gather_routed
        if compiled:
            ep.enable_functional()
            fixed = torch.compile(fixed_gather_routed, fullgraph=True, dynamic=False, backend="aot_eager")
        got = fixed(moe, x, 4, live, ops)
        ids, _ = TORCH.moe_route(x[: n - 1], *moe.router_args)
        expect = torch.bincount(ids.reshape(-1), minlength=moe.cfg.num_experts)  # the live rows' assignments
        return want, got, moe.expert_load - counted, expect

    for want, got, load, expect in run_ranks(2, rank, True, all2all="naive"):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(load, expect)


def test_peers_wait_out_a_ranks_compile_past_the_collective_timeout(tiny_k3_dir, monkeypatch):
    """A rank whose first call of a new bucket compiles longer than --distributed-timeout (here
    a 3 s timeout and a build slowed by 5 s on rank 1): the ranks agreed that one of them builds,
    so their gloo groups wait for it in that step, and the answers still equal one engine's."""
    import time

    from k3serve.runner.graph_step import GraphSteps

    build = GraphSteps._build

    def slow_build(self, *key):
        if self.ep.rank == 1 and self.compiles == 0:
            time.sleep(5)
        return build(self, *key)

    monkeypatch.setattr(GraphSteps, "_build", slow_build)
    path = str(tiny_k3_dir)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, kernels="torch", **KW).generate(PROMPTS[:2], greedy)]
    outs, engines = dp_graph_outputs(
        path, PROMPTS[:2], greedy, data_parallel_backend="threads", distributed_timeout=3, **KW
    )
    assert tokens(outs) == want
    assert all(r.runner.static_steps >= 4 for r in engines)
