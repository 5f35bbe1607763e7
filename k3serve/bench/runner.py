"""The load generator: readiness probe, warm-ups, Poisson / gamma arrivals (`--request-rate`,
`--burstiness`), a `--max-concurrency` semaphore, a progress bar, and server counters scraped
from /metrics before and after (prefix-cache hit rate, speculative acceptance length)."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from k3serve.bench.client import request_body, send
from k3serve.bench.datasets import BenchRequest
from k3serve.bench.metrics import RequestResult


@dataclass
class LoadSettings:
    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    ignore_eos: bool = False
    seed: int = 0
    sampling: dict = field(default_factory=dict)
    api_key: str | None = None
    timeout_s: float = 600.0
    progress: bool = True


COUNTERS = {  # ours and vLLM's names
    "prefix_hit_tokens": ("k3serve:prefix_cache_hit_tokens", "vllm:prefix_cache_hits_total"),
    "prefix_query_tokens": ("k3serve:prefix_cache_query_tokens", "vllm:prefix_cache_queries_total"),
    "spec_drafts": ("k3serve:spec_decode_num_drafts", "vllm:spec_decode_num_drafts_total"),
    "spec_accepted": ("k3serve:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_total"),
}


async def scrape(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    try:
        r = await client.get(base_url + "/metrics", timeout=10)
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    out = {}
    for key, names in COUNTERS.items():
        for name in names:
            m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", r.text, re.M)
            if m:
                out[key] = float(m.group(1))
                break
    return out


def server_side(before: dict, after: dict) -> dict:
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    out = {}
    if d.get("prefix_query_tokens"):
        out["prefix_cache_hit_rate"] = d.get("prefix_hit_tokens", 0.0) / d["prefix_query_tokens"]
    if d.get("spec_drafts"):
        out["spec_mean_acceptance_length"] = 1 + d.get("spec_accepted", 0.0) / d["spec_drafts"]
    return out


async def wait_ready(client: httpx.AsyncClient, base_url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if (await client.get(base_url + "/health", timeout=5)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{base_url} is not ready after {timeout:.0f}s (GET /health)")
        await asyncio.sleep(0.5)


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    if rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n).tolist()


async def run_load(requests: list[BenchRequest], s: LoadSettings) -> tuple[list[RequestResult], float, dict]:
    headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
    url = s.base_url.rstrip("/") + s.endpoint
    limits = httpx.Limits(max_connections=max(s.max_concurrency or len(requests), 1) + 4)
    async with httpx.AsyncClient(timeout=s.timeout_s, limits=limits) as client:
        await wait_ready(client, s.base_url)
        bodies = [request_body(s.endpoint, s.model, r, s.sampling, s.ignore_eos) for r in requests]
        for i in range(s.num_warmups):
            await send(client, url, bodies[i % len(bodies)], -1, time.perf_counter(), headers)
        before = await scrape(client, s.base_url)
        sem = asyncio.Semaphore(s.max_concurrency) if s.max_concurrency else None
        bar = None
        if s.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(bodies), desc="requests")
        clock0 = time.perf_counter()

        async def one(i: int) -> RequestResult:
            if sem is None:
                res = await send(client, url, bodies[i], i, clock0, headers)
            else:
                async with sem:
                    res = await send(client, url, bodies[i], i, clock0, headers)
            if bar is not None:
                bar.update(1)
            return res

        tasks = []
        for i, gap in enumerate(arrival_gaps(len(bodies), s.request_rate, s.burstiness, s.seed)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(i)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - clock0
        if bar is not None:
            bar.close()
        after = await scrape(client, s.base_url)
    for r, req in zip(results, requests):
        r.prompt_tokens = r.prompt_tokens or req.prompt_len
    return list(results), duration, server_side(before, after)
