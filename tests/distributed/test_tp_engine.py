"""The engine under tensor / expert parallelism (worker processes over gloo) answers exactly as
the single-process engine: greedy tokens, logprobs, prefix-cache hits and ngram speculative
decoding; a killed worker fails requests with a clear error instead of a hang."""

from __future__ import annotations

import os
import signal
import time

import pytest

from k3serve import LLM, SamplingParams
from k3serve.executor import WorkerDied
from k3serve.parallel.group import CollectiveError
from tests.distributed.test_gpu_node import SPEC  # ngram, K pinned: every proposal verified

KW = dict(cache_memory="32MiB", max_model_len=512, max_num_batched_tokens=96, seed=0)
SHARED = "Once upon a time, in a land far away, there lived a fox. " * 3  # several latent blocks
PROMPTS = ["hello world, this is", "the quick brown fox jumps over the lazy dog " * 3, "a", SHARED + "The fox"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, logprobs=2)


@pytest.fixture(scope="module", params=["kl-tp2", "k3-ep2"])
def pair(request, tiny_kl_dir, tiny_k3_dir):
    """(single-process engine, TP2 engine with ngram speculation and prefix caching)."""
    path = str(tiny_kl_dir if request.param.startswith("kl") else tiny_k3_dir)
    ref = LLM(path, **KW)
    tp = LLM(
        path,
        tensor_parallel_size=2,
        enable_expert_parallel=request.param.endswith("ep2"),
        speculative_config=SPEC,
        **KW,
    )
    yield ref, tp
    tp.engine.shutdown()


def _same(a, b):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert lx.keys() == ly.keys()
            assert max(abs(lx[k] - ly[k]) for k in lx) < 1e-4


def test_tp2_greedy_equals_single_process(pair):
    ref, tp = pair
    _same(ref.generate(PROMPTS, GREEDY), tp.generate(PROMPTS, GREEDY))
    assert tp.engine.spec.stats.drafts > 0  # the verify path (and its KDA rollback on every rank) ran


def test_tp2_prefix_hit_equals_single_process(pair):
    ref, tp = pair
    first = tp.generate([SHARED + "Where"], GREEDY)
    second = tp.generate([SHARED + "Why"], GREEDY)
    assert first[0].num_cached_tokens == 0 or first[0].num_cached_tokens % 16 == 0
    assert second[0].num_cached_tokens >= 32  # the shared blocks and their KDA checkpoint, on both ranks
    _same(ref.generate([SHARED + "Where", SHARED + "Why"], GREEDY), first + second)


def test_tp_engine_start_up_figures_are_per_rank(pair, tiny_kl_dir):
    ref, tp = pair
    # KDA state is split by heads; the latent is replicated: per-rank slots are half the bytes
    assert tp.engine.plan.slot_bytes * 2 == ref.engine.plan.slot_bytes
    assert tp.engine.plan.token_bytes == ref.engine.plan.token_bytes


def test_killed_worker_fails_requests_clearly(tiny_kl_dir):
    llm = LLM(str(tiny_kl_dir), tensor_parallel_size=2, distributed_timeout=20, **KW)
    try:
        assert llm.generate("hello", GREEDY)[0].outputs[0].token_ids
        worker = llm.engine.executor._procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        began = time.monotonic()
        with pytest.raises((WorkerDied, CollectiveError)):
            llm.generate("hello again", GREEDY)
        assert time.monotonic() - began < 25
        assert not llm.engine.executor.alive
        with pytest.raises(WorkerDied):  # and stays failed, at once
            llm.generate("once more", GREEDY)
    finally:
        llm.engine.shutdown()
    assert not llm.engine.executor._procs


def test_planner_launch_command_starts(tiny_k3_dir):
    """The planner's k3serve line for a TP2/EP2 layout parses and starts an engine of that shape."""
    import shlex

    from k3serve.cli import build_parser
    from k3serve.planner.commands import launch_commands
    from k3serve.planner.layout import Layout
    from k3serve.server.launch import engine_kwargs

    line = launch_commands(str(tiny_k3_dir), Layout(2, tp=2, dp=1, ep=2), 512, 4, 32 * 2**20, 0.9, 0.8, "auto")
    cmd = shlex.split(line["k3serve"].split("#")[0])
    assert cmd[:2] == ["k3serve", "serve"] and "--enable-expert-parallel" in cmd
    llm = LLM(str(tiny_k3_dir), **engine_kwargs(build_parser().parse_args(cmd[1:])))
    try:
        assert llm.engine.executor.size == 2 and llm.engine.executor.model.tp.expert_parallel
        assert llm.generate("The fox", GREEDY)[0].outputs[0].token_ids
    finally:
        llm.engine.shutdown()


def test_tp2_image_prompt_equals_single_process(pair):
    """The vision tower runs on the driver; its rows travel in StepInputs to every rank."""
    from k3serve.chat.k3_xtml import Seg, encode_segments, media_block, message
    from k3serve.multimodal.image import ImageSpec, load_image
    from tests.server.test_multimodal import png

    ref, tp = pair
    if ref.engine.model.cfg.vision is None:
        pytest.skip("Kimi-Linear has no vision tower")
    img = load_image(png(7), ImageSpec(patch_size=ref.engine.model.cfg.vision.patch_size))
    ids = encode_segments(ref.engine.tokenizer, message("user", [Seg("look")] + media_block(img)))
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": [img]}}
    _same(ref.generate([prompt], GREEDY), tp.generate([prompt], GREEDY))


def test_tp2_prompt_logprobs_equal_single_process(pair):
    """Prompt-logprob rows are gathered over the vocabulary shards like the sampling rows."""
    ref, tp = pair
    p = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    a, b = ref.generate([SHARED + "So"], p)[0], tp.generate([SHARED + "So"], p)[0]
    assert len(a.prompt_logprobs) == len(b.prompt_logprobs) > 40
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert (x.token_id, x.rank) == (y.token_id, y.rank) and abs(x.logprob - y.logprob) < 1e-4
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert max(abs(p - q) for (_, p), (_, q) in zip(x.top, y.top)) < 1e-4


def _other_node(tiny_kl_dir, port, extra=(), env=None):
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "k3serve",
        "serve",
        str(tiny_kl_dir),
        "-tp",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-port",
        str(port),
        *extra,
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_two_node_static_launch_equals_single_process(tiny_kl_dir):
    """Node 1 runs `k3serve serve ... --nnodes 2 --node-rank 1` (headless); node 0 is this
    engine. Commands cross over the control group, collectives over gloo (no shared memory)."""
    from tests.live import free_port

    port = free_port()
    node1 = _other_node(tiny_kl_dir, port)
    try:
        llm = LLM(str(tiny_kl_dir), tensor_parallel_size=2, nnodes=2, node_rank=0, master_port=port, **KW)
        try:
            assert llm.engine.model.tp.shm is None  # ranks on other nodes: gloo
            ref = LLM(str(tiny_kl_dir), **KW)
            _same(ref.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY))
        finally:
            llm.engine.shutdown()
        assert node1.wait(30) == 0  # the headless node ends with the driver
    finally:
        if node1.poll() is None:
            node1.kill()


@pytest.mark.slow  # 77 s: two torchrun launchers (test_two_node_static_launch covers the layout in 3 s)
def test_two_torchrun_node_ranks_serve_the_single_process_output(tiny_kl_dir):
    """`torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 1 -m k3serve serve ... -tp 2`: rank 0
    serves HTTP, rank 1 is a headless worker; both read torchrun's environment and agent store."""
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    from tests.live import free_port

    torchrun = str(Path(sys.executable).with_name("torchrun"))
    port, http = free_port(), free_port()

    def node(rank, *extra):
        cmd = [
            torchrun,
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--nproc-per-node",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-m",
            "k3serve",
            "serve",
            str(tiny_kl_dir),
            "-tp",
            "2",
            "--cache-memory",
            "32MiB",
            "--max-model-len",
            "512",
            *extra,
        ]
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    nodes = [node(1), node(0, "--port", str(http))]
    try:
        base = f"http://127.0.0.1:{http}"
        for _ in range(240):
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        ids = [5, 17, 260, 301, 44, 9]
        r = httpx.post(base + "/v1/completions", json={"prompt": ids, "max_tokens": 12, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        ref = (
            LLM(str(tiny_kl_dir), **KW)
            .generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=12))[0]
            .outputs[0]
        )
        assert r.json()["choices"][0]["text"] == ref.text and r.json()["usage"]["completion_tokens"] == 12
    finally:
        os.killpg(nodes[1].pid, signal.SIGTERM)
        for p in nodes:
            try:
                p.wait(30)  # node 1's worker ends once node 0's driver is gone
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                raise


@pytest.mark.slow  # 66 s (ngram and DSpark under DP-attention workers stay in the suite)
def test_dspark_speculation_under_tp2_equals_single_process():
    """The bundled demo (MXFP4 experts, 64 channels: TP2 splits them by whole groups) with its DSpark
    drafter, as `make serve` runs it: the drafter reads tap-layer states, which the all-reduces leave
    whole on rank 0, and runs beside the driver."""
    from k3serve.demo import default_model

    path = str(default_model())
    spec = {"method": "dspark", "model": "dspark", "num_speculative_tokens": 4, "adaptive": False}
    prompts = [
        "<|im_user|>user<|im_middle|>What is 23 + 45?<|im_end|><|im_assistant|>assistant<|im_middle|>",
        "Repeat after me: the quick brown fox",
    ]
    p = SamplingParams(temperature=0, max_tokens=24)
    ref = LLM(path, **KW).generate(prompts, p)
    tp = LLM(path, tensor_parallel_size=2, speculative_config=spec, **KW)
    try:
        out = tp.generate(prompts, p)
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
        assert tp.engine.spec.stats.accepted_tokens > 0
    finally:
        tp.engine.shutdown()
