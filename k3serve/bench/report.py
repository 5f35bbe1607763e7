"""Readable summary, JSON result file (settings, per-request timings, the token ids sent) and
PNG plots (latency CDFs; throughput vs concurrency for sweeps)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from k3serve.bench.metrics import RequestResult


def format_summary(title: str, s: dict, server: dict) -> str:
    lines = [
        f"{'=' * 18} {title} {'=' * 18}",
        f"Successful requests:                     {s['completed']}",
        f"Failed requests:                         {s['failed']}",
        f"Benchmark duration (s):                  {s['duration_s']:.2f}",
        f"Total input tokens:                      {s['total_input_tokens']}",
        f"Total generated tokens:                  {s['total_output_tokens']}",
        f"Request throughput (req/s):              {s['request_throughput']:.2f}",
        f"Output token throughput (tok/s):         {s['output_throughput']:.2f}",
        f"Peak output token throughput (tok/s):    {s['peak_output_throughput']:.2f}",
        f"Total token throughput (tok/s):          {s['total_token_throughput']:.2f}",
    ]
    if "request_goodput" in s:
        lines.append(f"Request goodput (req/s):                 {s['request_goodput']:.2f}")
    for m in ("ttft", "tpot", "itl", "e2el"):
        if f"mean_{m}_ms" in s:
            lines.append(f"{'-' * 12} {m.upper()} (ms) {'-' * 12}")
            for k in sorted(k for k in s if k.endswith(f"_{m}_ms")):
                lines.append(f"{k:<40} {s[k]:.2f}")
    for k, v in server.items():
        lines.append(f"{k:<40} {v:.3f}")
    return "\n".join(lines)


def per_request(results: list[RequestResult]) -> list[dict]:
    return [
        {
            "index": r.index,
            "success": r.success,
            "error": r.error,
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens,
            "start_s": r.start,
            "ttft_s": r.ttft,
            "tpot_s": r.tpot,
            "e2el_s": r.latency,
            "itl_s": r.itl,
        }
        for r in results
    ]


def save_result(path: str | Path, payload: dict) -> None:
    """Strict JSON (no NaN/Infinity, which JSON.parse and jq reject): non-finite numbers -> null."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_finite(payload), indent=2, allow_nan=False))


def _finite(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


# --save-detailed only: vLLM's per-request arrays, and each request's end-to-end seconds
DETAILED = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "generated_texts", "errors")


def vllm_result(summary: dict, results: list[RequestResult], info: dict, detailed: bool = True) -> dict:
    """One run in `vllm bench serve --save-result`'s flat layout and key names
    (vllm/benchmarks/serve.py): settings, totals, the mean/median/std/pNN metric keys, and with
    `detailed` (--save-detailed) the per-request arrays; `info` carries date, backend, label,
    model_id, tokenizer_id, num_prompts, request_rate, burstiness, max_concurrency and
    --metadata pairs."""
    rate = info.get("request_rate")
    out = {
        **info,
        "request_rate": "inf" if rate is None or rate == float("inf") else rate,
        "duration": summary["duration_s"],
        "completed": summary["completed"],
        "failed": summary["failed"],
        "total_input_tokens": summary["total_input_tokens"],
        "total_output_tokens": summary["total_output_tokens"],
        "request_throughput": summary["request_throughput"],
        "request_goodput": summary.get("request_goodput"),
        "output_throughput": summary["output_throughput"],
        "total_token_throughput": summary["total_token_throughput"],
        "max_output_tokens_per_s": summary["peak_output_throughput"],
        "max_concurrent_requests": max_concurrent(results),
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [list(r.itl) for r in results],
        "latencies": [r.latency for r in results],
        "generated_texts": ["" for _ in results],
        "errors": [r.error for r in results],
    }
    out.update(
        {k: v for k, v in summary.items() if k.startswith(("mean_", "median_", "std_", "p")) and k.endswith("_ms")}
    )
    if not detailed:
        for key in DETAILED:
            del out[key]
    return out


def max_concurrent(results: list[RequestResult]) -> int:
    """Most requests in flight at once (vLLM reports it beside max_concurrency)."""
    events = sorted([(r.start, 1) for r in results] + [(r.start + r.latency, -1) for r in results])
    live = best = 0
    for _, d in events:
        live += d
        best = max(best, live)
    return best


def plot_title(model: str | None, devices: str, engine: str, dataset: str, date: str) -> str:
    """Model, hardware and run on the figure, so a PNG read alone says what it measured."""
    return f"{model or 'model ?'} on {devices or 'hardware not given (--devices)'} · {engine} · {dataset} · {date}"


def plot(path: str | Path, runs: list[dict], title: str = "") -> None:
    """runs: [{"label", "concurrency", "results": [RequestResult], "summary": {...}}]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4 if len(runs) > 1 else 3, figsize=(16 if len(runs) > 1 else 12, 3.6))
    for ax, (metric, getter) in zip(
        axes, [("TTFT", lambda r: r.ttft), ("TPOT", lambda r: r.tpot), ("E2EL", lambda r: r.latency)]
    ):
        for run in runs:
            vals = sorted(getter(r) * 1000 for r in run["results"] if r.success and getter(r) is not None)
            if vals:
                ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], label=run["label"])
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylabel("CDF")
        ax.legend(fontsize=7)
    if len(runs) > 1:
        ax = axes[3]
        xs = [r["concurrency"] or 0 for r in runs]
        ax.plot(xs, [r["summary"]["output_throughput"] for r in runs], marker="o")
        ax.set_xlabel("max concurrency")
        ax.set_ylabel("output tok/s")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
