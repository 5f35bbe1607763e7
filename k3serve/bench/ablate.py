"""Matched A/B ablation: the same recorded token ids and sampling parameters replayed against
two servers, alternating A B A B over rounds; per-metric paired ratios B/A with their spread."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np

from k3serve.bench.datasets import BenchRequest
from k3serve.bench.metrics import summarize
from k3serve.bench.runner import LoadSettings, run_load

RATIO_KEYS = ("output_throughput", "request_throughput", "mean_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms")


def ablate(
    requests: list[BenchRequest],
    settings: LoadSettings,
    url_a: str,
    url_b: str,
    rounds: int,
    metrics: list[str],
    ps: list[float],
) -> dict:
    per_round = {"A": [], "B": []}
    for _ in range(rounds):
        for tag, url in (("A", url_a), ("B", url_b)):
            res, dur, server = asyncio.run(run_load(requests, replace(settings, base_url=url, progress=False)))
            per_round[tag].append({**summarize(res, dur, metrics, ps), **{f"server_{k}": v for k, v in server.items()}})
    ratios = {}
    for key in RATIO_KEYS:
        pairs = [b[key] / a[key] for a, b in zip(per_round["A"], per_round["B"]) if a.get(key)]
        if pairs:
            ratios[key] = {
                "mean": float(np.mean(pairs)),
                "min": float(min(pairs)),
                "max": float(max(pairs)),
                "rounds": pairs,
            }
    return {"A": url_a, "B": url_b, "rounds": rounds, "summaries": per_round, "ratios_B_over_A": ratios}
