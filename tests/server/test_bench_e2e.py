"""`k3serve bench` end to end against live k3serve servers (tiny K3): a 16-request run with
0 errors writing JSON + PNG, and an A/B ablation producing paired ratios."""

from __future__ import annotations

import json

from k3serve.cli import main
from tests.live import serving
from tests.server.conftest import make_app


def test_sixteen_requests_json_and_png(live_server, tmp_path):
    base, _ = live_server
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            base,
            "--num-prompts",
            "16",
            "--random-input-len",
            "24",
            "--random-output-len",
            "8",
            "--ignore-eos",
            "--max-concurrency",
            "8",
            "--save-result",
            "--save-detailed",
            "--result-filename",
            str(out),
            "--plot",
            str(png),
            "--no-progress",
            "--precision",
            "fp32",
            "--devices",
            "cpu",
        ]
    )
    assert rc == 0
    r = json.loads(out.read_text(), parse_constant=_reject)  # strict JSON: no NaN / Infinity
    assert r["completed"] == 16 and r["failed"] == 0 and r["total_output_tokens"] == 16 * 8
    assert r["k3serve"]["precision"] == "fp32" and r["model_id"] == "tiny-k3"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _read_like_vllm(r, 16, 8)


VLLM_KEYS = (
    "date",
    "endpoint_type",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "generated_texts",
    "errors",
)


def _reject(name):
    raise ValueError(f"non-standard JSON constant {name}")


def _read_like_vllm(r: dict, n: int, concurrency: int | None = None) -> None:
    """Key by key as vLLM's result readers (benchmarks/*) read a `vllm bench serve` file."""
    for key in VLLM_KEYS:
        assert key in r, key
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert isinstance(r[f"{stat}_{m}_ms"], float), f"{stat}_{m}_ms"
    assert all(
        len(r[k]) == n for k in ("input_lens", "output_lens", "ttfts", "itls", "latencies", "generated_texts", "errors")
    )
    assert all(t <= e for t, e in zip(r["ttfts"], r["latencies"]) if t is not None)
    assert r["request_rate"] == "inf" and r["max_concurrency"] == concurrency
    assert 1 <= r["max_concurrent_requests"] <= (concurrency or n)
    assert r["duration"] > 0 and r["output_throughput"] == r["total_output_tokens"] / r["duration"]


def test_vllm_flags_are_accepted_and_recorded(live_server, tmp_path):
    base, _ = live_server
    host, port = base.removeprefix("http://").split(":")
    rc = main(
        [
            "bench",
            "serve",
            "--backend",
            "vllm",
            "--host",
            host,
            "--port",
            port,
            "--label",
            "nightly",
            "--metadata",
            "gpu=none",
            "commit=abc",
            "--result-dir",
            str(tmp_path / "out"),
            "--tokenizer",
            "tok",
            "--extra-body",
            '{"top_k": 5}',
            "--num-prompts",
            "4",
            "--random-input-len",
            "16",
            "--random-output-len",
            "4",
            "--ignore-eos",
            "--save-result",
            "--save-detailed",
            "--no-progress",
        ]
    )
    assert rc == 0
    files = list((tmp_path / "out").glob("nightly-infqps-tiny-k3-*.json"))  # vLLM's name: the label first
    assert len(files) == 1
    r = json.loads(files[0].read_text(), parse_constant=_reject)
    assert (r["backend"], r["label"], r["tokenizer_id"], r["gpu"], r["commit"]) == (
        "vllm",
        "nightly",
        "tok",
        "none",
        "abc",
    )
    assert r["k3serve"]["sampling"] == {"temperature": 0.0, "seed": 0, "top_k": 5}  # vLLM's default temperature 0
    _read_like_vllm(r, 4)


def test_ablation_against_two_servers(live_server, tiny_k3_dir, tmp_path, capsys):
    base_a, _ = live_server
    app_b, _ = make_app(tiny_k3_dir, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    with serving(app_b) as base_b:
        out = tmp_path / "ab.json"
        rc = main(
            [
                "bench",
                "--base-url",
                base_a,
                "--ablate",
                base_a,
                base_b,
                "--ablate-rounds",
                "2",
                "--num-prompts",
                "4",
                "--dataset-name",
                "low-entropy",
                "--random-input-len",
                "32",
                "--random-output-len",
                "8",
                "--ignore-eos",
                "--temperature",
                "0",
                "--save-result",
                "--save-detailed",
                "--result-filename",
                str(out),
                "--no-progress",
            ]
        )
        assert rc == 0
        ab = json.loads(out.read_text())["ablation"]
        ratio = ab["ratios_B_over_A"]["output_throughput"]
        assert len(ratio["rounds"]) == 2 and ratio["min"] <= ratio["mean"] <= ratio["max"]
        assert "output_throughput" in capsys.readouterr().out
        assert all(s["completed"] == 4 for tag in ("A", "B") for s in ab["summaries"][tag])


def test_sharegpt_and_sonnet_files_against_a_live_server(live_server, tmp_path):
    """Lengths counted by the server's own /tokenize; the run sends the text and gets exactly
    the sampled output lengths back (ignore_eos)."""
    import httpx

    base, _ = live_server
    convs = [
        {
            "conversations": [
                {"from": "human", "value": f"Question {i}: what is {i} plus {i}? Explain."},
                {"from": "gpt", "value": f"The answer is {2 * i}, because {i} and {i} make {2 * i}."},
            ]
        }
        for i in range(6)
    ]
    sg = tmp_path / "sharegpt.json"
    sg.write_text(json.dumps(convs))
    out = tmp_path / "sg.json"
    assert (
        main(
            [
                "bench",
                "--base-url",
                base,
                "--dataset-name",
                "sharegpt",
                "--dataset-path",
                str(sg),
                "--num-prompts",
                "4",
                "--ignore-eos",
                "--save-result",
                "--save-detailed",
                "--result-filename",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    r = json.loads(out.read_text(), parse_constant=_reject)
    count = lambda text: httpx.post(base + "/tokenize", json={"prompt": text}).json()["count"]  # noqa: E731
    by_len = sorted((count(c["conversations"][0]["value"]), count(c["conversations"][1]["value"])) for c in convs)
    got = sorted(zip(r["input_lens"], r["output_lens"]))
    assert r["failed"] == 0 and len(got) == 4 and all(pair in by_len for pair in got)
    sonnet = tmp_path / "sonnet.txt"
    sonnet.write_text("\n".join(f"Line {i}: thy eternal summer shall not fade" for i in range(40)))
    out2 = tmp_path / "so.json"
    assert (
        main(
            [
                "bench",
                "--base-url",
                base,
                "--dataset-name",
                "sonnet",
                "--dataset-path",
                str(sonnet),
                "--sonnet-input-len",
                "90",
                "--sonnet-prefix-len",
                "40",
                "--sonnet-output-len",
                "6",
                "--num-prompts",
                "3",
                "--ignore-eos",
                "--save-result",
                "--save-detailed",
                "--result-filename",
                str(out2),
                "--no-progress",
            ]
        )
        == 0
    )
    r2 = json.loads(out2.read_text(), parse_constant=_reject)
    assert r2["failed"] == 0 and r2["output_lens"] == [6, 6, 6] and all(60 <= n <= 120 for n in r2["input_lens"])


def test_openai_chat_backend_vllm_lengths_and_the_default_file_name(live_server, tmp_path):
    """`--backend openai-chat` sends the random prompts' text to /v1/chat/completions (the server's
    /detokenize); --input-len / --output-len set the lengths; without --save-detailed the file
    has vLLM's summary keys only, under vLLM's default name."""
    import re

    base, _ = live_server
    rc = main(
        [
            "bench",
            "serve",
            "--backend",
            "openai-chat",
            "--base-url",
            base,
            "--input-len",
            "20",
            "--output-len",
            "5",
            "--num-prompts",
            "3",
            "--max-concurrency",
            "2",
            "--ignore-eos",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert rc == 0
    (path,) = tmp_path.glob("*.json")
    assert re.fullmatch(r"openai-chat-infqps-concurrency2-tiny-k3-\d{8}-\d{6}\.json", path.name), path.name
    r = json.loads(path.read_text(), parse_constant=_reject)
    assert r["completed"] == 3 and r["failed"] == 0 and r["total_output_tokens"] == 15
    assert r["k3serve"]["endpoint"] == "/v1/chat/completions" and r["backend"] == "openai-chat"
    assert re.fullmatch(r"\d{8}-\d{6}", r["date"]) and path.name.endswith(f"-{r['date']}.json")
    assert not any(
        k in r for k in ("input_lens", "output_lens", "ttfts", "itls", "latencies", "generated_texts", "errors")
    )
