"""Capacity planner: K3 / Kimi-Linear numbers, fit verdicts per platform, smallest counts,
DP-attention replication, engine == planner on the tiny model, output formats."""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from k3serve.cli import main
from k3serve.config.bundled import load_model_config
from k3serve.planner.hardware import get_gpu
from k3serve.planner.layout import Layout
from k3serve.planner.memory import Workload
from k3serve.planner.search import evaluate, plan
from k3serve.planner.weights import weight_split

K3 = "moonshotai/Kimi-K3"
KL = "moonshotai/Kimi-Linear-48B-A3B-Instruct"


@pytest.fixture(scope="module")
def k3():
    cfg = load_model_config(K3)
    return cfg, weight_split(cfg)


def full_tp(n: int) -> Layout:
    return Layout(n, n, 1, n)


def test_k3_model_numbers(k3):
    cfg, w = k3
    assert abs(w.total - 1_560_936_091_448) / 1_560_936_091_448 < 0.005
    rep = plan(cfg, K3, "schema", [get_gpu("B300")], w, Workload(), num_gpus=8, tp=8)
    assert (rep.token_bytes, rep.token_bytes_fp8, rep.state_bytes) == (27_648, 13_824, 464_633_856)
    assert abs(w.active_params / 1e9 - 104) < 1


@pytest.mark.parametrize("gpu, n, fits", [
    ("GB300", 8, True), ("B300", 8, True), ("MI355X", 8, True), ("MI350X", 8, True), ("B200", 16, True),
    ("H200", 8, False), ("B200", 8, False), ("H100", 8, False), ("H100", 16, False)])
def test_k3_fit_per_platform(k3, gpu, n, fits):
    cfg, w = k3
    rep = plan(cfg, K3, "schema", [get_gpu(gpu)], w, Workload(context=8192), num_gpus=n)
    best = rep.results[0]  # the best of every TP x DP layout of n GPUs
    assert best.fits is fits, (best.rank.why_not, best.problems, best.rank.weights / 1e9)
    if fits:
        assert best.rank.headroom > 0 and best.capacity >= 1


def test_smallest_h100_count_is_32(k3):
    cfg, w = k3
    rep = plan(cfg, K3, "schema", [get_gpu("H100")], w, Workload(context=8192))
    assert rep.smallest["H100"] == 32
    best = rep.results[0]
    assert best.layout.num_gpus == 32 and best.layout.tp <= 8  # TP stays inside the NVLink domain


def test_dp_attention_replicates_non_expert_weights(k3):
    cfg, w = k3
    for gpu in ("B300", "GB300"):
        ep8 = evaluate(cfg, K3, get_gpu(gpu), Layout(8, 1, 8, 8), w, Workload(context=8192))
        ep16 = evaluate(cfg, K3, get_gpu(gpu), Layout(16, 1, 16, 16), w, Workload(context=8192))
        assert not ep8.fits and ep8.rank.weights > 288e9  # ~294 GB per rank
        assert ep16.fits and 195e9 < ep16.rank.weights < 215e9
    tp8 = evaluate(cfg, K3, get_gpu("B300"), full_tp(8), w, Workload(context=8192))
    assert ep8.rank.weights - tp8.rank.weights > 90e9  # the ~113 GB trunk is no longer split 8 ways


def test_divisibility_is_checked(k3):
    cfg, w = k3
    r = evaluate(cfg, K3, get_gpu("GB300"), Layout(72, 8, 9, 72), w, Workload())
    assert any("896 routed experts" in p for p in r.problems)
    r = evaluate(cfg, K3, get_gpu("H100"), Layout(64, 64, 1, 64), w, Workload())
    assert any("heads 96 do not divide by TP 64" in p for p in r.problems)


def test_kimi_linear_numbers():
    cfg = load_model_config(KL)
    w = weight_split(cfg)
    assert abs(w.params / 1e9 - 49.1) < 0.1
    rep = plan(cfg, KL, "schema", [get_gpu("H100")], w, Workload(), num_gpus=2, tp=2)
    assert (rep.token_bytes, rep.state_bytes) == (8_064, 44_892_160)


def test_engine_and_planner_agree_on_the_tiny_model(tiny_k3_dir):
    """Same cache size -> the planner predicts exactly the engine's start-up slots and tokens."""
    from k3serve import LLM

    llm = LLM(str(tiny_k3_dir), cache_memory="8MiB", max_model_len=1024, max_num_seqs=16)
    cfg = llm.engine.model.cfg
    rep = plan(cfg, str(tiny_k3_dir), "schema", [get_gpu("H100")], weight_split(cfg, tiny_k3_dir),
               Workload(context=1024, max_num_seqs=16, kv_dtype="float32", memory_fraction=0.92),
               num_gpus=1, tp=1, cache_bytes=8 * 2**20)
    got, want = rep.results[0].rank.plan, llm.engine.plan
    assert (got.num_slots, got.kv_tokens, got.num_checkpoints) == (want.num_slots, want.kv_tokens, want.num_checkpoints)
    line = next(x for x in llm.engine.startup_log if "latent KV" in x)
    assert f"{got.kv_tokens:,} tokens" in line and f"{got.num_slots} slots" in line


def test_cli_json_markdown_and_search(capsys):
    assert main(["plan", "--gpu", "B300", "--num-gpus", "8", "--tp", "8", "--context", "32768",
                 "--concurrency", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    lay = out["layouts"][0]
    assert lay["fits"] and lay["max_concurrency_at_context"] >= 16 and "vllm serve" in lay["launch"]["vllm"]
    assert out["kda_state_bytes_per_request"] == 464_633_856
    assert main(["plan", "--gpu", "B200", "--markdown", "--context", "8192"]) == 0
    md = capsys.readouterr().out
    assert "smallest B200 count that serves it: 16" in md and "| GPUs |" in md
    assert main(["plan", "--gpu", "NOPE"]) == 2


class _Checker(HTMLParser):
    VOID = {"meta", "br", "hr", "img", "input", "link"}

    def __init__(self):
        super().__init__()
        self.stack, self.errors, self.text = [], [], []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def test_html_is_well_formed_with_the_numbers(tmp_path):
    out = tmp_path / "plan.html"
    assert main(["plan", "--gpu", "B300", "--num-gpus", "8", "--context", "32768", "--html", str(out)]) == 0
    c = _Checker()
    c.feed(out.read_text())
    assert not c.errors and not c.stack
    text = "".join(c.text)
    assert "27,648 B/token" in text and "464,633,856 B/request" in text and "8xB300" in text
    assert out.read_text().count("<svg") >= 1 and "<script" not in out.read_text()


@pytest.mark.slow
def test_html_renders_in_headless_chromium(tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on this machine (the well-formedness test covers the page)")
    out = tmp_path / "plan.html"
    main(["plan", "--gpu", "B300", "--num-gpus", "8", "--html", str(out)])
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--dump-dom", out.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "8xB300" in proc.stdout
