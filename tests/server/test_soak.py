"""Soak (issue 18): 64 concurrent streams for a bounded time, 30% of them cancelled part-way by
the client. Nothing may fail, every finished stream ends properly, and every pool is back at
zero afterwards. `make test` runs it for 60 s; `make test-slow` runs the 10-minute version and a
30-minute one at 48 streams that also holds the process's resident memory: under 1% growth over
its last 25 minutes (`.venv/bin/python -m pytest -q -s -m slow -k thirty tests/server/test_soak.py`),
and issue 63's 30 minutes of 32 streams with DSpark, both tiers under write_back and the graph
backend, whose greedy subset must equal a cache-off server's."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from tests.live import free_port, metric, serving
from tests.server.conftest import FLAGS, make_app

STREAMS = 64
CANCEL = 0.3


async def worker(base: str, deadline: float, rng: random.Random, stats: dict, prefixes=("",)) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        while time.monotonic() < deadline:
            chat = rng.random() < 0.5
            text = f"{rng.choice(prefixes)}soak {rng.random()}"  # a shared prefix: the prefix cache's tiers serve it
            body = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
            body.update(
                max_tokens=rng.randint(4, 40),
                temperature=rng.choice([0, 0.7, 1.0]),
                stream=True,
                seed=rng.randint(0, 2**32),
                ignore_eos=rng.random() < 0.5,
            )
            cancel_after = rng.randint(1, 6) if rng.random() < CANCEL else None
            path = "/v1/chat/completions" if chat else "/v1/completions"
            async with client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    stats["errors"].append(f"{r.status_code} {await r.aread()}")
                    continue
                events, done, finish = 0, False, None
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    event = json.loads(line[6:])
                    if "error" in event:
                        stats["errors"].append(str(event))
                    for c in event.get("choices", []):
                        finish = c.get("finish_reason") or finish
                    events += 1
                    if cancel_after is not None and events >= cancel_after:
                        break  # leaving the block closes the connection: the server must abort
                if cancel_after is not None and not done:
                    stats["cancelled"] += 1
                elif not done or finish not in ("stop", "length"):
                    stats["errors"].append(f"stream ended without [DONE]/finish_reason ({finish})")
                else:
                    stats["completed"] += 1


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident set: this one's (an in-process server runs on uvicorn's thread), or
    a server process's."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def in_process(tiny_k3_dir, flags):
    """(base URL, its resident-set reader, a check after the run) of a server in this process."""
    app, state = make_app(tiny_k3_dir, "--max-num-seqs", "16", *flags)
    with serving(app) as base:
        yield base, rss_bytes, lambda: not state.engine.engine.has_unfinished_requests()


# where a server process writes its log (K3SERVE_SOAK_LOG): the soak prints the graph buckets it
# compiled beside the resident set, to tell a compile's step from a creep
SERVER_LOG = os.environ.get("K3SERVE_SOAK_LOG")


@contextmanager
def server_process(tiny_k3_dir, flags):
    """The same server as `k3serve serve` runs it, in its own process: its resident set is the
    server's alone (this process's holds the 32-48 clients' buffers too, which grew 6 MB over
    20 minutes in issue 63's soak: most of a 1% bound)."""
    port = free_port()
    cmd = [sys.executable, "-m", "k3serve", "serve", str(tiny_k3_dir), *FLAGS, "--max-num-seqs", "16", *flags]
    log = open(SERVER_LOG, "w") if SERVER_LOG else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server process did not start"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield base, lambda: rss_bytes(proc.pid), lambda: proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(30)
        if SERVER_LOG:
            log.close()


def soak(
    seconds: float, tiny_k3_dir, streams: int = STREAMS, flags=(), prefixes=("",), after=None, server=in_process
) -> dict:
    """`after(base)`: checks on the soaked server before it stops; `server`: in this process
    (the engine's state checked directly) or `server_process` (its resident set apart)."""
    stats = {"errors": [], "cancelled": 0, "completed": 0, "rss": []}
    with server(tiny_k3_dir, flags) as (base, rss, healthy):
        start = time.monotonic()
        deadline = start + seconds
        stop = threading.Event()

        def sample():  # (seconds since start, resident bytes) every 5 s
            while not stop.wait(5):
                stats["rss"].append((time.monotonic() - start, rss()))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        async def main():
            await asyncio.gather(*(worker(base, deadline, random.Random(i), stats, prefixes) for i in range(streams)))

        asyncio.run(main())
        stop.set()
        sampler.join()
        t0 = time.monotonic()
        while any(
            metric(base, m)
            for m in (
                "k3serve:num_requests_running",
                "k3serve:num_requests_waiting",
                "k3serve:state_slots_used",
                "k3serve:latent_blocks_used",
            )
        ):
            assert time.monotonic() - t0 < 10, "pools did not return to zero"
            time.sleep(0.05)
        if after is not None:
            after(base)
        five = [
            line
            for line in httpx.get(base + "/metrics").text.splitlines()
            if line.startswith("k3serve:http_requests_total") and 'status="5' in line
        ]
        assert healthy()
    assert not five, five
    return stats


def check(stats: dict) -> None:
    assert not stats["errors"], stats["errors"][:5]
    assert stats["completed"] > 50 and stats["cancelled"] > 10, stats
    print(f"soak: {stats['completed']} completed, {stats['cancelled']} cancelled, 0 errors")


def test_short_soak(tiny_k3_dir):
    check(soak(60, tiny_k3_dir))


@pytest.mark.slow
def test_ten_minute_soak(tiny_k3_dir):
    check(soak(600, tiny_k3_dir))


def rss_growth(samples: list[tuple[float, int]], after_s: float, window_s: float = 120.0) -> float:
    """Resident-memory growth from the warm-up's end (`after_s`) to the run's end: the lowest
    sample of the first `window_s` after it against the lowest of the last `window_s`. The
    server returns freed heap to the OS every 30 s (server/heap.py), so single samples swing
    with the heap between trims (about 8 MB here); each window's floor is the baseline, and a
    leak raises it."""
    later = [(t, b) for t, b in samples if t >= after_s]
    first = min(b for t, b in later if t <= later[0][0] + window_s)
    last = min(b for t, b in later if t >= later[-1][0] - window_s)
    return (last - first) / first


@pytest.mark.slow
def test_thirty_minute_soak(tiny_k3_dir):
    stats = soak(1800, tiny_k3_dir, streams=48)
    check(stats)
    growth = rss_growth(stats["rss"], after_s=300)
    print(
        f"soak: RSS {stats['rss'][0][1] / 2**20:.0f} MiB at 5 s, {stats['rss'][-1][1] / 2**20:.0f} MiB at the end; "
        f"growth over the last 25 minutes {growth * 100:.2f}%"
    )
    assert growth < 0.01, stats["rss"][::12]


# eight long shared prefixes (~100-450 tokens): the device pool below cannot hold them all
PREFIXES = tuple(f"Document {i}: " + " ".join(f"w{i}x{j}" for j in range(20 + 10 * i)) + ". " for i in range(8))


def greedy_replies(base: str) -> list[list[str]]:
    """A fixed greedy subset: each prefix with a fixed question, as completions and chats."""
    out = []
    for p in PREFIXES:
        body = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
        a = httpx.post(base + "/v1/completions", json={**body, "prompt": p + "fixed"}, timeout=120)
        msgs = [{"role": "user", "content": p + "fixed"}]
        b = httpx.post(base + "/v1/chat/completions", json={**body, "messages": msgs}, timeout=120)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        out.append([a.json()["choices"][0]["text"], b.json()["choices"][0]["message"]["content"]])
    return out


def tiers_soak(seconds: float, tiny_k3_dir, drafter: str, tier_dir) -> dict:
    """32 mixed streams with DSpark, both prefix-cache tiers under write_back (a host tier small
    enough to evict) and the graph backend; the greedy subset equals a cache-off, speculation-off
    server's."""
    graph = ["--kernels", "graph", "--compilation-config", '{"backend": "eager"}']
    spec = json.dumps({"method": "dspark", "model": drafter, "num_speculative_tokens": 4})
    tiers = ["--kv-offloading-size", "0.002", "--kv-offloading-dir", str(tier_dir), "--kv-offloading-dir-size", "0.02"]
    flags = [*graph, "--speculative-config", spec, *tiers, "--kv-offloading-write-policy", "write_back"]
    ref_app, _ = make_app(tiny_k3_dir, *graph, "--no-enable-prefix-caching")
    with serving(ref_app) as ref:
        want = greedy_replies(ref)
    got, hits = [], {}

    def after(base: str) -> None:
        got.append(greedy_replies(base))
        for line in httpx.get(base + "/metrics").text.splitlines():  # what each tier served
            if line.startswith("k3serve:prefix_cache_tier_hits_total{"):
                hits[line.split('tier="')[1].split('"')[0]] = float(line.split()[-1])

    stats = soak(seconds, tiny_k3_dir, 32, [*flags, "--cache-memory", "4MiB"], PREFIXES, after, server_process)
    assert got == [want] and hits.get("cpu", 0) > 0, hits
    print(f"soak: tier hits {hits}")
    return stats


@pytest.mark.slow
def test_thirty_minute_soak_with_dspark_tiers_and_the_graph_backend(tiny_k3_dir, random_dspark, tmp_path):
    """Issue 63's soak (`.venv/bin/python -m pytest -q -s -m slow -k dspark_tiers tests/server/test_soak.py`):
    0 errors, the greedy subset equal to a cache-off server, resident memory flat."""
    stats = tiers_soak(1800, tiny_k3_dir, random_dspark, tmp_path)
    check(stats)
    per_minute = [(round(t), b // 2**20) for t, b in stats["rss"][::12]]
    print(f"soak: RSS (s, MiB) every minute {per_minute}")
    assert rss_growth(stats["rss"], after_s=300) < 0.01, per_minute
