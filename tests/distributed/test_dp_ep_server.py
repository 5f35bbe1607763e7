"""`k3serve serve --data-parallel-size 2 --enable-expert-parallel`: DP-attention + EP (issue 16).
Two replicas, each with its own scheduler, cache and whole attention, hold half the routed
experts each and step together (engine/lockstep.py): greedy output equals a single-process
server for one request (the other replica runs idle forwards for it) and for two at once on
different replicas, on tiny K3 and Kimi-Linear, with either token exchange (--all2all-backend);
/metrics shows each rank's expert load."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest
from safetensors import safe_open

from tests.live import serving
from tests.server.conftest import make_app

LONG = "Alpha beta gamma delta, the first story of the day. " * 3
SHORT = "Zulu yankee xray whiskey, another tale."
OTHER = "Quite a different prompt, cached nowhere yet."


def _complete(base, prompt, max_tokens, out=None):
    r = httpx.post(
        base + "/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    if out is not None:
        out.append(text)
    return text


def _half_experts_bytes(model) -> int:
    """A DP-attention rank's weight bytes: the whole model with half its routed experts."""
    from k3serve.runner.rank_step import weight_bytes

    routed = sum(
        t.numel() * t.element_size() for m in model.moe_layers() for w in (m.w1, m.w2, m.w3) for t in w.buffers()
    )
    return weight_bytes(model) - routed // 2


@pytest.mark.parametrize(
    "kind,all2all,backend",
    [
        ("k3", "auto", "mp"),
        ("kl", "auto", "mp"),  # auto: gather here
        ("k3", "alltoall", "mp"),
        ("kl", "alltoall", "mp"),
        ("k3", "auto", "threads"),
    ],
)
def test_dp2_attention_with_ep_equals_a_single_process_server(kind, all2all, backend, tiny_k3_dir, tiny_kl_dir):
    path = tiny_k3_dir if kind == "k3" else tiny_kl_dir
    ref_app, ref_state = make_app(path)
    app, state = make_app(
        path,
        "--data-parallel-size",
        "2",
        "--enable-expert-parallel",
        "--all2all-backend",
        all2all,
        "--data-parallel-backend",
        backend,
    )
    dp = state.engine
    assert [r.engine.ep.all2all for r in dp.replicas] == [all2all] * 2
    if backend == "mp":  # each replica's model is in its own worker process, holding half the experts
        assert [r.engine.executor.workers.weight_bytes(i) for i, r in enumerate(dp.replicas)] == [
            _half_experts_bytes(ref_state.engine.engine.model)
        ] * 2
    else:
        experts = [r.engine.model.moe_layers()[0].w1.shape[0] for r in dp.replicas]
        assert experts == [dp.replicas[0].engine.model.cfg.moe.num_experts // 2] * 2  # half on each replica
    with serving(ref_app) as ref, serving(app, start_timeout=60) as base:
        want_long, want_short, want_other = (
            _complete(ref, LONG, 40),
            _complete(ref, SHORT, 12),
            _complete(ref, OTHER, 12),
        )
        assert _complete(base, SHORT, 12) == want_short  # replica 1 idles through it in lockstep
        got: list[str] = []
        busy = threading.Thread(target=_complete, args=(base, LONG, 40, got))
        busy.start()
        while sum(r.stats.num_running for r in dp.replicas) == 0:
            threading.Event().wait(0.01)
        assert _complete(base, OTHER, 12) == want_other  # on the other replica, alongside
        busy.join(120)
        assert got == [want_long]
        assert sorted(dp.routed) == [1, 2]  # the two at once went to different replicas
        text = httpx.get(base + "/metrics", timeout=10).text
        load = [
            float(l.rsplit(" ", 1)[1])
            for l in text.splitlines()
            if l.startswith("k3serve:expert_parallel_tokens_total{")
        ]
        cfg = dp.replicas[0].engine.model_info.cfg
        assert len(load) == 2 and all(v > 0 for v in load)
        assert sum(load) % (cfg.moe.top_k * len(ref_state.engine.engine.model.moe_layers())) == 0
    for r in dp.replicas:
        assert r.engine.cache.num_requests == 0


def test_dp2_attention_with_tp2_inside_equals_a_single_process_server(tiny_k3_dir):
    """`-dp 2 -tp 2 --enable-expert-parallel`: four worker processes, each replica's model split
    over two of them; one request alone and two at once serve the single-process text."""
    ref_app, _ = make_app(tiny_k3_dir)
    app, state = make_app(
        tiny_k3_dir, "--data-parallel-size", "2", "--enable-expert-parallel", "--tensor-parallel-size", "2"
    )
    workers = state.engine.replicas[0].engine.executor.workers
    assert (workers.size, workers.tp_size) == (4, 2)
    with serving(ref_app) as ref, serving(app, start_timeout=60) as base:
        want_short, want_other = _complete(ref, SHORT, 12), _complete(ref, OTHER, 12)
        assert _complete(base, SHORT, 12) == want_short
        got: list[str] = []
        threads = [threading.Thread(target=_complete, args=(base, p, 12, got)) for p in (SHORT, OTHER)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(got) == sorted([want_short, want_other])
    asyncio.run(state.engine.shutdown())


def test_tp_inside_dp_attention_needs_the_worker_process_backend(tiny_kl_dir):
    with pytest.raises(ValueError, match="TP inside the DP ranks and several nodes need --data-parallel-backend mp"):
        make_app(
            tiny_kl_dir,
            "--data-parallel-size",
            "2",
            "--enable-expert-parallel",
            "--tensor-parallel-size",
            "2",
            "--data-parallel-backend",
            "threads",
        )


@pytest.mark.parametrize("gpus,tp", [(2, 1), (4, 2)])
def test_the_planners_dp_attention_line_starts(gpus, tp, tiny_kl_dir):
    """The planner's k3serve line for DP2/EP2 (and DP2 x TP2 / EP4, TP inside the DP ranks)
    parses and starts two lockstep replicas over `gpus` worker processes."""
    import shlex

    from k3serve.planner.commands import launch_commands
    from k3serve.planner.layout import Layout

    line = launch_commands(str(tiny_kl_dir), Layout(gpus, tp=tp, dp=2, ep=gpus), 512, 4, 32 * 2**20, 0.9, 0.8, "auto")
    assert "not yet" not in line["k3serve"].replace("the NCCL group for GPUs is not built yet", "")
    cmd = shlex.split(line["k3serve"].split("#")[0])
    assert "--data-parallel-size" in cmd and "--enable-expert-parallel" in cmd
    _, state = make_app(*cmd[2:])
    assert state.engine.lockstep is not None and [r.engine.ep.rank for r in state.engine.replicas] == [0, 1]
    assert state.engine.replicas[0].engine.executor.workers.size == gpus
    asyncio.run(state.engine.shutdown())  # its worker processes


def test_a_dead_dp_attention_worker_fails_the_stream_and_health(tiny_k3_dir):
    """Worker 1 killed mid-stream: the client's stream ends in an error within a bounded time
    (replica 0's worker finds its peer's pid gone in the next MoE collective, well before the
    20 s collective timeout), new requests get 503, /health turns unhealthy, and shutdown
    returns with no worker left."""
    app, state = make_app(
        tiny_k3_dir, "--data-parallel-size", "2", "--enable-expert-parallel", "--distributed-timeout", "20"
    )
    workers = state.engine.replicas[0].engine.executor.workers
    with serving(app, start_timeout=60) as base:
        assert _complete(base, SHORT, 4)
        began, lines = None, []
        with httpx.stream(
            "POST",
            base + "/v1/completions",
            timeout=60,
            json={"prompt": LONG, "max_tokens": 400, "ignore_eos": True, "stream": True},
        ) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 3:
                    os.kill(workers._procs[1].pid, signal.SIGKILL)
                    began = time.monotonic()
        assert began is not None, lines
        assert time.monotonic() - began < 10
        assert any('"error"' in line for line in lines[3:]), lines[-3:]
        r = httpx.post(base + "/v1/completions", json={"prompt": SHORT, "max_tokens": 4}, timeout=60)
        assert r.status_code == 503 and "DP-attention worker" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "5"
        assert "k3serve-tp" not in r.json()["error"]["message"]  # a DP-attention rank is k3serve-dpN
        h = httpx.get(base + "/health", timeout=10)
        assert h.status_code == 503 and "DP-attention worker" in h.text
    procs, began = list(workers._procs), time.monotonic()
    state.engine.replicas[1].engine.shutdown()  # what the driver runs at exit: it returns, no worker left
    assert time.monotonic() - began < 15 and not any(p.is_alive() for p in procs)


def test_a_client_leaving_a_lockstep_stream_frees_its_replica(tiny_kl_dir):
    import time

    app, state = make_app(tiny_kl_dir, "--data-parallel-size", "2", "--enable-expert-parallel")
    with serving(app, start_timeout=60) as base:
        with httpx.stream(
            "POST",
            base + "/v1/completions",
            timeout=60,
            json={"prompt": LONG, "max_tokens": 400, "ignore_eos": True, "stream": True},
        ) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 4:
                    break  # leaves mid-stream: the request is aborted on its replica
        deadline = time.monotonic() + 30
        while any(rep.engine.has_unfinished_requests() for rep in state.engine.replicas):
            assert time.monotonic() < deadline, "the aborted request still runs"
            time.sleep(0.05)
        assert _complete(base, SHORT, 4)  # the lockstep loop still serves
    for rep in state.engine.replicas:
        assert rep.engine.cache.num_requests == 0


def test_a_dp_attention_worker_that_cannot_load_names_itself_and_the_tensor(tmp_path):
    """A checkpoint missing one of rank 1's routed experts: start-up fails with the worker's
    kind and the tensor's name, and no worker process outlives it."""
    import multiprocessing

    from safetensors.torch import load_file, save_file

    from k3serve.testing.builder import build_tiny_checkpoint

    d = build_tiny_checkpoint(tmp_path / "kl", kind="kimi_linear", seed=0, num_shards=1)
    tensors = load_file(str(d / "model.safetensors"))
    last = max(int(k.split(".experts.")[1].split(".")[0]) for k in tensors if ".experts." in k)
    name = f"model.layers.1.block_sparse_moe.experts.{last}.w1.weight"  # rank 1 owns the last half
    del tensors[name]
    save_file(tensors, str(d / "model.safetensors"))
    before = set(multiprocessing.active_children())  # other tests' servers may still hold workers
    with pytest.raises(RuntimeError, match=rf"DP-attention worker failed to start: .*{name.replace('.', '[.]')}"):
        make_app(d, "--data-parallel-size", "2", "--enable-expert-parallel")
    assert not [p for p in set(multiprocessing.active_children()) - before if p.name.startswith("k3serve-")]


@pytest.mark.parametrize("tp", [1, 2])
def test_dp_attention_replicas_share_prefix_tiers_across_a_restart(tp, tiny_k3_dir, tmp_path):
    """`-dp 2 --enable-expert-parallel --kv-offloading-dir D` (and `-tp 2` inside each replica):
    each replica's tiers read and write the cache in its worker processes over the pipes
    (offload/ports.py RemotePort: blocks from the replica's rank 0, each rank its KDA heads); a
    restarted server serves the long prompt's prefix from the directory (cached_tokens counts
    it) with the single-process server's text."""
    disk = str(tmp_path / "tiers")
    ref_app, _ = make_app(tiny_k3_dir)
    flags = ("--data-parallel-size", "2", "--enable-expert-parallel", "--kv-offloading-dir", disk)
    flags += ("--tensor-parallel-size", str(tp))
    with serving(ref_app) as ref:
        want = _complete(ref, LONG, 12)
    app, state = make_app(tiny_k3_dir, *flags)
    with serving(app, start_timeout=60) as base:
        assert _complete(base, LONG, 12) == want
    asyncio.run(state.engine.shutdown())  # queued writes reach the directory
    states = list((tmp_path / "tiers").glob("*/state/*/*.safetensors"))
    assert states
    with safe_open(str(states[0]), "pt") as f:
        names = {n.split(".", 1)[1] for n in f.keys()}  # "{key hex}.{name}"
    assert any(n.startswith("recurrent.") for n in names)
    assert any(n.endswith(".r1") for n in names) == (tp == 2)  # rank 1's heads beside rank 0's
    app, state = make_app(tiny_k3_dir, *flags)
    with serving(app, start_timeout=60) as base:
        r = httpx.post(
            base + "/v1/completions",
            json={"prompt": LONG, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
        hits = sum(rep.engine.tiers.index.stats["disk"].hits for rep in state.engine.replicas)
        assert hits > 0
    asyncio.run(state.engine.shutdown())
