"""`k3serve bench`: flags spelled like `vllm bench serve` so existing scripts carry over."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from k3serve.bench import datasets as ds

VLLM_DATE = "%Y%m%d-%H%M%S"  # vLLM's result `date` and file-name stamp
BACKENDS = ("openai", "vllm", "k3serve", "openai-chat")  # openai-chat: /v1/chat/completions, as vLLM


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("mode", nargs="?", default="serve", choices=("serve",), help="(vLLM spelling) serve")
    p.add_argument("--base-url", help="default: http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--backend",
        default="openai",
        choices=BACKENDS,
        help="openai / vllm / k3serve: /v1/completions; openai-chat: /v1/chat/completions, token-id prompts "
        "sent as their text (the server's /detokenize) (recorded as backend and endpoint_type)",
    )
    p.add_argument("--endpoint", help="default: /v1/chat/completions for openai-chat, else /v1/completions")
    p.add_argument("--tokenizer", help="recorded as tokenizer_id (prompts are sent as token ids)")
    p.add_argument("--label", help="recorded in the result (default: the backend)")
    p.add_argument("--metadata", nargs="*", default=[], help="KEY=VALUE pairs recorded in the result")
    p.add_argument("--result-dir", help="folder for --result-filename")
    p.add_argument("--extra-body", type=json.loads, help="JSON merged into every request body")
    p.add_argument("--model", help="model name sent in requests (default: the server's)")
    p.add_argument(
        "--dataset-name",
        default="random",
        choices=("random", "shared-prefix", "low-entropy", "high-entropy", "jsonl", "sharegpt", "sonnet", "random-mm"),
    )
    p.add_argument("--dataset-path", help="local file for jsonl, sharegpt (JSON) and sonnet (text lines)")
    p.add_argument("--sharegpt-output-len", type=int, help="fixed output length (default: the reply's tokens)")
    p.add_argument("--random-mm-images-per-request", type=int, default=1)
    p.add_argument("--random-mm-image-size", default="224x224", help="WxH of the random images (random-mm)")
    p.add_argument("--sonnet-input-len", type=int, default=550)
    p.add_argument("--sonnet-output-len", type=int, default=150)
    p.add_argument("--sonnet-prefix-len", type=int, default=200)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    # vLLM's dataset-independent lengths: they set the random, shared-prefix and sonnet lengths
    p.add_argument("--input-len", type=int, help="prompt tokens (random, shared-prefix, entropy, sonnet datasets)")
    p.add_argument("--output-len", type=int, help="output tokens (every dataset)")
    p.add_argument("--shared-prefix-len", type=int, default=256)
    p.add_argument("--shared-prefix-ratio", type=float, default=0.9)
    p.add_argument("--vocab-range", default="1,500", help="token ids drawn from [lo, hi) for synthetic prompts")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--sweep-max-concurrency", help="comma list, e.g. 1,4,16: one run per value")
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0, help="sent with every request (vLLM's default 0)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="50,90,99")
    p.add_argument("--goodput", nargs="*", help="SLOs in ms: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--ablate", nargs=2, metavar=("A_URL", "B_URL"), help="paired A/B replay of the same requests")
    p.add_argument("--ablate-rounds", type=int, default=2)
    p.add_argument("--api-key")
    p.add_argument("--save-result", action="store_true")
    p.add_argument(
        "--save-detailed",
        action="store_true",
        help="with --save-result: also the per-request arrays (input_lens, output_lens, ttfts, itls, "
        "generated_texts, errors), as vLLM",
    )
    p.add_argument(
        "--result-filename",
        help="default, as vLLM names it: {label or backend}-{request_rate}qps[-concurrency{N}]-{model}-"
        "{YYYYmmdd-HHMMSS}.json",
    )
    p.add_argument("--plot", help="PNG file: latency CDFs (+ throughput vs concurrency for sweeps)")
    p.add_argument("--precision", default="", help="recorded in the result (e.g. bf16, mxfp4-w4a8)")
    p.add_argument("--engine", default="k3serve", help="recorded in the result")
    p.add_argument("--devices", default="", help="recorded in the result (e.g. 1xH200)")
    p.add_argument("--interconnect", default="", help="recorded in the result")
    p.add_argument("--no-progress", action="store_true")


def resolve_lengths(a: argparse.Namespace) -> None:
    """--backend openai-chat's endpoint, and --input-len / --output-len over the per-dataset lengths."""
    if a.endpoint is None:
        a.endpoint = "/v1/chat/completions" if a.backend == "openai-chat" else "/v1/completions"
    if a.input_len is not None:
        a.random_input_len = a.sonnet_input_len = a.input_len
    if a.output_len is not None:
        a.random_output_len = a.sonnet_output_len = a.sharegpt_output_len = a.output_len


def build_requests(a: argparse.Namespace) -> list[ds.BenchRequest]:
    resolve_lengths(a)
    requests = _dataset_requests(a)
    if a.endpoint.endswith("/chat/completions") and any(r.prompt is None for r in requests):
        from k3serve.bench.text_datasets import as_text

        requests = as_text(requests, a.tokenizer, a.base_url, a.api_key)
    return requests


def _dataset_requests(a: argparse.Namespace) -> list[ds.BenchRequest]:
    lo, hi = (int(x) for x in a.vocab_range.split(","))
    n, seed = a.num_prompts, a.seed
    if a.dataset_name == "random":
        return ds.random_requests(n, a.random_input_len, a.random_output_len, a.random_range_ratio, (lo, hi), seed)
    if a.dataset_name == "shared-prefix":
        return ds.shared_prefix_requests(
            n, a.shared_prefix_len, a.shared_prefix_ratio, a.random_input_len, a.random_output_len, (lo, hi), seed
        )
    if a.dataset_name in ("low-entropy", "high-entropy"):
        return ds.entropy_requests(
            n, a.random_input_len, a.random_output_len, a.dataset_name == "low-entropy", (lo, hi), seed
        )
    if a.dataset_name == "random-mm":
        if not a.endpoint.endswith("/chat/completions"):
            raise ValueError("--dataset-name random-mm sends images: use --endpoint /v1/chat/completions")
        w, _, h = a.random_mm_image_size.partition("x")
        return ds.random_mm_requests(
            n,
            max(1, a.random_input_len // 2),
            a.random_output_len,
            a.random_mm_images_per_request,
            (int(w), int(h)),
            seed,
        )
    if not a.dataset_path:
        raise ValueError(f"--dataset-name {a.dataset_name} needs --dataset-path (a local file)")
    if a.dataset_name == "jsonl":
        return ds.jsonl_requests(a.dataset_path, n, a.random_output_len)
    from k3serve.bench import text_datasets as td

    count = td.token_counter(a.tokenizer, a.base_url, a.api_key)
    if a.dataset_name == "sharegpt":
        return td.sharegpt_requests(a.dataset_path, n, count, seed, a.sharegpt_output_len)
    return td.sonnet_requests(
        a.dataset_path, n, count, seed, a.sonnet_input_len, a.sonnet_output_len, a.sonnet_prefix_len
    )


def served_model(base_url: str, api_key: str | None) -> str | None:
    """The first model id the server lists (what it answered as), for model_id."""
    import httpx

    try:
        r = httpx.get(
            base_url + "/v1/models", timeout=10, headers={"Authorization": f"Bearer {api_key}"} if api_key else None
        )
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


def metadata(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--metadata takes KEY=VALUE pairs, got {item!r}")
        out[key] = value
    return out


def result_path(
    a: argparse.Namespace, concurrency: int | None, sweep: bool = False, model_id: str | None = None, date: str = ""
) -> Path:
    """vLLM's name (benchmarks/serve.py): {label or backend}-{request_rate}qps[-concurrency{N}]-
    {the model id's last part}-{date}.json, the rate as Python prints a float (inf, 10.0)."""
    conc = f"-concurrency{concurrency}" if concurrency is not None else ""
    base_model = (model_id or a.model or "model").rstrip("/").split("/")[-1]
    name = a.result_filename or (
        f"{a.label or a.backend}-{float(a.request_rate)}qps{conc}-{base_model}-{date or time.strftime(VLLM_DATE)}.json"
    )
    if sweep and a.result_filename:
        name = f"{Path(name).stem}-c{concurrency or 'inf'}{Path(name).suffix or '.json'}"
    return Path(a.result_dir or ".") / name


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    if not items:
        return None
    out = {}
    for item in items:
        key, _, val = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not val:
            raise ValueError(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        out[key] = float(val)
    return out


def run_bench(a: argparse.Namespace) -> int:
    from k3serve.bench.ablate import ablate
    from k3serve.bench.metrics import summarize
    from k3serve.bench.report import format_summary, plot, plot_title, save_result, vllm_result
    from k3serve.bench.runner import LoadSettings, run_load

    a.base_url = a.base_url or f"http://{a.host}:{a.port}"
    requests = build_requests(a)
    metrics = [m for m in a.percentile_metrics.split(",") if m]
    ps = [float(x) for x in a.metric_percentiles.split(",")]
    goodput = parse_goodput(a.goodput)
    sampling = {
        k: v for k, v in (("temperature", a.temperature), ("top_p", a.top_p), ("seed", a.seed)) if v is not None
    }
    sampling.update(a.extra_body or {})
    settings = LoadSettings(
        a.base_url,
        a.endpoint,
        a.model,
        a.request_rate,
        a.burstiness,
        a.max_concurrency,
        a.num_warmups,
        a.ignore_eos,
        a.seed,
        sampling,
        a.api_key,
        progress=not a.no_progress,
    )
    meta = {
        "engine": a.engine,
        "precision": a.precision,
        "devices": a.devices,
        "interconnect": a.interconnect,
        "model": a.model,
        "base_url": a.base_url,
        "endpoint": a.endpoint,
        "dataset": a.dataset_name,
        "num_prompts": len(requests),
        "input_len": a.random_input_len,
        "output_len": a.random_output_len,
        "request_rate": a.request_rate,
        "burstiness": a.burstiness,
        "sampling": sampling,
        "ignore_eos": a.ignore_eos,
        "seed": a.seed,
        "date": time.strftime(VLLM_DATE),
    }
    if a.ablate:
        result = ablate(requests, settings, a.ablate[0], a.ablate[1], a.ablate_rounds, metrics, ps)
        for key, r in result["ratios_B_over_A"].items():
            print(f"{key:<24} B/A {r['mean']:.3f}  (min {r['min']:.3f}, max {r['max']:.3f}, {len(r['rounds'])} rounds)")
        payload = {
            **meta,
            "max_concurrency": a.max_concurrency,
            "ablation": result,
            "requests": [r.to_dict() for r in requests],
        }
        if a.save_result:
            save_result(result_path(a, a.max_concurrency), payload)
        return 0
    concurrencies = (
        [int(x) for x in a.sweep_max_concurrency.split(",")] if a.sweep_max_concurrency else [a.max_concurrency]
    )
    runs = []
    for c in concurrencies:
        s = settings if c == a.max_concurrency else type(settings)(**{**settings.__dict__, "max_concurrency": c})
        results, duration, server = asyncio.run(run_load(requests, s))
        summary = summarize(results, duration, metrics, ps, goodput)
        print(format_summary(f"Serving Benchmark Result (max concurrency {c or 'inf'})", summary, server))
        runs.append(
            {
                "label": f"concurrency {c or 'inf'}",
                "concurrency": c,
                "results": results,
                "summary": summary,
                "server": server,
            }
        )
    model_id = a.model or served_model(a.base_url, a.api_key)
    if a.save_result:  # vLLM's flat layout, one file per run
        for r in runs:
            info = {
                "date": meta["date"],
                "endpoint_type": a.backend,
                "backend": a.backend,
                "label": a.label or a.backend,
                "model_id": model_id,
                "tokenizer_id": a.tokenizer or model_id,
                "num_prompts": len(requests),
                "request_rate": a.request_rate,
                "burstiness": a.burstiness,
                "max_concurrency": r["concurrency"],
                **metadata(a.metadata),
                "k3serve": {**meta, "server": r["server"]},
            }
            path = result_path(a, r["concurrency"], len(runs) > 1, model_id, meta["date"])
            save_result(path, vllm_result(r["summary"], r["results"], info, detailed=a.save_detailed))
    if a.plot:
        plot(a.plot, runs, plot_title(model_id, a.devices, a.engine, a.dataset_name, meta["date"]))
    failed = sum(r["summary"]["failed"] for r in runs)
    return 0 if failed == 0 else 1
