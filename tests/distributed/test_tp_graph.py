"""The graph backend under tensor parallelism (issue 46 item 6): each rank compiles the same
static step with its all-reduces and all-gathers as functional collectives (graph nodes over
gloo here); the TP2 engines' greedy tokens, experts split by channel (Kimi-Linear) or by id
(tiny K3, expert parallelism), equal the single-process torch engine's over 32 steps, and
their decode steps ran compiled on every rank."""

from __future__ import annotations


from k3serve import LLM, SamplingParams

KW = dict(cache_memory="32MiB", max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4, seed=0)
PROMPTS = ["hello world, this is", "the quick brown fox jumps over the lazy dog", "a", "Once upon a time"]


def test_tp2_graph_engine_equals_the_single_process_engine(tiny_kl_dir):
    # Kimi-Linear: its bf16 experts split by channel (tiny K3's MXFP4 experts split by id only,
    # which is expert parallelism, refused below)
    path = str(tiny_kl_dir)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, kernels="torch", **KW).generate(PROMPTS, greedy)]
    tp = LLM(
        path,
        tensor_parallel_size=2,
        kernels="graph",
        compilation_config={"backend": "aot_eager", "cudagraph_capture_sizes": [1, 4]},
        **KW,
    )
    try:
        got = [o.outputs[0].token_ids for o in tp.generate(PROMPTS, greedy)]
        graphs = tp.engine.executor.graphs
        assert got == want
        assert graphs.steps >= 31 and graphs.compiles >= 1
    finally:
        tp.engine.shutdown()


def test_tp2_ep2_graph_engine_equals_the_single_process_engine(tiny_k3_dir):
    """Tiny K3's MXFP4 experts split by id over the two ranks; each rank's share of a token's
    routed sum keeps its shape (other ranks' assignments weigh 0) and the all-reduce adds them."""
    path = str(tiny_k3_dir)
    # sequences finishing after 8, 16, 24 tokens leave padding rows in the bucket of 4
    greedy = [SamplingParams(temperature=0, max_tokens=32 - 8 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    want = [o.outputs[0].token_ids for o in LLM(path, kernels="torch", **KW).generate(PROMPTS, greedy)]
    tp = LLM(
        path,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        kernels="graph",
        compilation_config={"backend": "aot_eager", "cudagraph_capture_sizes": [1, 4]},
        **{**KW, "enable_prefix_caching": False},
    )
    try:
        outs = tp.generate(PROMPTS, greedy)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert tp.engine.executor.graphs.steps >= 31
        # load counted on the device, of live rows only: every forwarded token's top-k once per MoE layer
        cfg = tp.engine.model.cfg
        forwarded = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)
        layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        loads = tp.engine.executor.parallel_stats()["expert_tokens_per_rank"]
        assert sum(loads) == forwarded * cfg.moe.top_k * layers
    finally:
        tp.engine.shutdown()
