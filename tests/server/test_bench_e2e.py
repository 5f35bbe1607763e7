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
    rc = main(["bench", "serve", "--base-url", base, "--num-prompts", "16", "--random-input-len", "24",
               "--random-output-len", "8", "--ignore-eos", "--max-concurrency", "8", "--save-result",
               "--result-filename", str(out), "--plot", str(png), "--no-progress", "--precision", "fp32",
               "--devices", "cpu"])
    assert rc == 0
    r = json.loads(out.read_text())
    run = r["runs"][0]
    assert run["completed"] == 16 and run["failed"] == 0 and run["total_output_tokens"] == 16 * 8
    assert len(run["per_request"]) == 16 and len(r["requests"]) == 16 and r["precision"] == "fp32"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ablation_against_two_servers(live_server, tiny_k3_dir, tmp_path, capsys):
    base_a, _ = live_server
    app_b, _ = make_app(tiny_k3_dir, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    with serving(app_b) as base_b:
        out = tmp_path / "ab.json"
        rc = main(["bench", "--base-url", base_a, "--ablate", base_a, base_b, "--ablate-rounds", "2", "--num-prompts",
                   "4", "--dataset-name", "low-entropy", "--random-input-len", "32", "--random-output-len", "8",
                   "--ignore-eos", "--temperature", "0", "--save-result", "--result-filename", str(out), "--no-progress"])
        assert rc == 0
        ab = json.loads(out.read_text())["ablation"]
        ratio = ab["ratios_B_over_A"]["output_throughput"]
        assert len(ratio["rounds"]) == 2 and ratio["min"] <= ratio["mean"] <= ratio["max"]
        assert "output_throughput" in capsys.readouterr().out
        assert all(s["completed"] == 4 for tag in ("A", "B") for s in ab["summaries"][tag])
