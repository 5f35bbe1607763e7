"""Metric arithmetic exactly as `vllm bench serve` defines it (serving-notes.md §5).

Per request (streaming): TTFT = first chunk - send; ITL = gaps between consecutive chunks
(one entry per chunk, so a multi-token chunk yields one long gap); E2EL = end - send;
TPOT = (E2EL - TTFT) / (output_tokens - 1) for outputs longer than one token.
Run: request / output / total token throughput over the run's duration; percentiles by
numpy's default (linear) interpolation; goodput = requests meeting every given SLO (ms) per
second, TPOT counted as 0 for one-token outputs; peak output tokens/s over 1 s buckets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    index: int
    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # s
    itl: list[float] = field(default_factory=list)  # s, one per chunk after the first
    latency: float = 0.0  # E2EL, s
    start: float = 0.0  # send time, s since the run began
    chunk_times: list[float] = field(default_factory=list)  # absolute chunk arrival times (run clock)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentiles(values: list[float], ps: list[float]) -> dict[str, float]:
    if not values:
        return {f"p{_fmt(p)}": 0.0 for p in ps}
    arr = np.asarray(values, dtype=float)
    return {f"p{_fmt(p)}": float(np.percentile(arr, p)) for p in ps}


def _fmt(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def is_good(r: RequestResult, slo_ms: dict[str, float]) -> bool:
    vals = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return r.success and all(vals[k] * 1000 <= v for k, v in slo_ms.items())


def summarize(
    results: list[RequestResult],
    duration: float,
    metrics: list[str],
    ps: list[float],
    goodput: dict[str, float] | None = None,
) -> dict:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    per_metric = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "success_rate": len(ok) / len(results) if results else 0.0,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "peak_output_throughput": peak_per_second(
            [t for r in ok for t in r.chunk_times[1:]] + [r.chunk_times[0] for r in ok if r.chunk_times]
        ),
    }
    for m in metrics:
        vals = [v * 1000 for v in per_metric[m]]  # ms, as vLLM prints
        summary[f"mean_{m}_ms"] = float(np.mean(vals)) if vals else 0.0
        summary[f"median_{m}_ms"] = float(np.median(vals)) if vals else 0.0
        summary[f"std_{m}_ms"] = float(np.std(vals)) if vals else 0.0
        summary.update({f"{k}_{m}_ms": v for k, v in percentiles(vals, ps).items()})
    if goodput:
        good = sum(is_good(r, goodput) for r in results)
        summary["good_requests"] = good
        summary["request_goodput"] = good / duration if duration > 0 else 0.0
    return summary


def peak_per_second(times: list[float]) -> float:
    """Largest number of chunk arrivals in one 1-second bucket (tokens/s when chunks are tokens)."""
    if not times:
        return 0.0
    counts = np.bincount(np.floor(np.asarray(times) - min(times)).astype(int))
    return float(counts.max())
