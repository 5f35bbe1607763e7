"""Capacity planner: K3 / Kimi-Linear numbers, fit verdicts per platform, smallest counts,
DP-attention replication, engine == planner on the tiny model, output formats."""

from __future__ import annotations

import dataclasses
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
from k3serve.planner.perf import estimate
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


@pytest.mark.parametrize(
    "gpu, n, fits",
    [
        ("GB300", 8, True),
        ("B300", 8, True),
        ("MI355X", 8, True),
        ("MI350X", 8, True),
        ("B200", 16, True),
        ("H200", 8, False),
        ("B200", 8, False),
        ("H100", 8, False),
        ("H100", 16, False),
    ],
)
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


@pytest.mark.parametrize("state", ["float32", "bfloat16"])
def test_engine_and_planner_agree_on_the_tiny_model(tiny_k3_dir, state):
    """Same cache size -> the planner predicts exactly the engine's start-up slots and tokens,
    with either KDA state dtype (--mamba-ssm-cache-dtype)."""
    from k3serve import LLM

    llm = LLM(str(tiny_k3_dir), cache_memory="8MiB", max_model_len=1024, max_num_seqs=16, mamba_ssm_cache_dtype=state)
    cfg = llm.engine.model.cfg
    rep = plan(
        cfg,
        str(tiny_k3_dir),
        "schema",
        [get_gpu("H100")],
        weight_split(cfg, tiny_k3_dir),
        Workload(context=1024, max_num_seqs=16, kv_dtype="float32", memory_fraction=0.92, state_dtype=state),
        num_gpus=1,
        tp=1,
        cache_bytes=8 * 2**20,
    )
    got, want = rep.results[0].rank.plan, llm.engine.plan
    assert (got.num_slots, got.kv_tokens, got.num_checkpoints) == (want.num_slots, want.kv_tokens, want.num_checkpoints)
    cache = llm.engine.executor.cache  # the bytes one slot really takes in the engine's tensors
    held = sum(t[0].nbytes for t in cache.recurrent + cache.conv if t is not None)
    assert got.slot_bytes == want.slot_bytes == held
    line = next(x for x in llm.engine.startup_log if "latent KV" in x)
    assert f"{got.kv_tokens:,} tokens" in line and f"{got.num_slots} slots" in line


def test_cli_json_markdown_and_search(capsys):
    assert (
        main(
            [
                "plan",
                "--gpu",
                "B300",
                "--num-gpus",
                "8",
                "--tp",
                "8",
                "--context",
                "32768",
                "--concurrency",
                "16",
                "--json",
            ]
        )
        == 0
    )
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


CHROMIUM = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]
MEASURE = (
    "<script>addEventListener('load', () => { const e = document.documentElement;"
    " document.title = 'scroll=' + e.scrollWidth + ' client=' + e.clientWidth; });</script>"
)


@pytest.mark.slow
def test_html_fits_1280px_in_headless_chromium(tmp_path):
    """The page of every asked GPU type renders at 1,280 px with no horizontal overflow:
    Chromium lays it out, a measuring script (added to a copy; the page has none) reports the
    document's scroll width, and a screenshot is taken."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on this machine: apt-get install chromium (the well-formedness test covers the page)")
    out = tmp_path / "plan.html"
    args = ["plan", "--context", "131072", "--concurrency", "64", "--optimize", "cost", "--html", str(out)]
    for gpu in ("H100", "H200", "B200", "B300"):
        args += ["--gpu", gpu]
    assert main(args) == 0
    probe = tmp_path / "probe.html"
    probe.write_text(out.read_text().replace("</body>", MEASURE + "</body>"))
    user = tmp_path / "profile"
    proc = subprocess.run(
        [
            browser,
            *CHROMIUM,
            f"--user-data-dir={user}",
            "--window-size=1280,900",
            "--virtual-time-budget=2000",
            "--dump-dom",
            probe.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    title = proc.stdout.split("<title>")[1].split("</title>")[0]
    scroll, client = (int(x.split("=")[1]) for x in title.split())
    assert client <= 1280 and scroll <= client, title
    for gpu in ("H100", "H200", "B200", "B300"):
        assert f"x{gpu}</td>" in proc.stdout
    shot = tmp_path / "plan.png"
    proc = subprocess.run(
        [browser, *CHROMIUM, f"--user-data-dir={user}", "--window-size=1280,900", f"--screenshot={shot}", out.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smallest_count_is_the_same_with_and_without_num_gpus(k3):
    cfg, ws = k3
    gpu = get_gpu("H200")
    searched = plan(cfg, K3, "schema", [gpu], ws, Workload())
    pinned = plan(cfg, K3, "schema", [gpu], ws, Workload(), num_gpus=8)
    assert searched.smallest == pinned.smallest == {"H200": 16}
    assert all(r.layout.num_gpus == 8 and not r.fits for r in pinned.results)
    assert searched.best().layout.num_gpus == 16


def test_fits_means_the_requested_concurrency_fits(k3, capsys):
    cfg, ws = k3
    w = Workload(context=131072, concurrency=64)
    rep = plan(cfg, K3, "schema", [get_gpu("B300")], ws, w, num_gpus=8, pp=1)
    loaded = [r for r in rep.results if r.loads]
    assert len(loaded) == 3
    for r in loaded:  # each holds fewer than 64: never "fits", and its perf is for what it holds
        assert 0 < r.capacity < 64 and not r.fits and r.verdict == f"holds {r.capacity} of 64"
        assert r.perf.concurrency == r.capacity and f"holds {r.capacity} of the 64 requested" in r.why_not
    assert rep.best() is None
    assert (
        main(
            [
                "plan",
                "--gpu",
                "B300",
                "--num-gpus",
                "8",
                "--pp",
                "1",
                "--context",
                "131072",
                "--concurrency",
                "64",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert not any(lay["fits"] for lay in out["layouts"]) and any(lay["loads"] for lay in out["layouts"])


def test_cross_node_all_to_all_is_timed_on_the_nic(k3):
    cfg, ws = k3
    h200 = get_gpu("H200")
    lay = Layout(16, 1, 16, 16)
    assert lay.links(h200.scaleup_domain) == {"ep_alltoall": "NIC"}
    assert Layout(8, 1, 8, 8).links(h200.scaleup_domain) == {"ep_alltoall": "scale-up"}
    one_domain = dataclasses.replace(h200, scaleup_domain=16)  # the same part in a 16-GPU domain
    cross = estimate(cfg, h200, lay, ws, 32, 8192).comm_s["ep_alltoall"]
    inside = estimate(cfg, one_domain, lay, ws, 32, 8192).comm_s["ep_alltoall"]
    nvl, nic = h200.scaleup_bw / 2, h200.nic_bw  # per direction; efficiency cancels in the ratio
    assert cross / inside == pytest.approx((0.5 / nvl + 0.5 / nic) / (1 / nvl), rel=1e-9)
    assert cross == pytest.approx(5 * inside)  # half the peers over a 50 GB/s NIC, half over 450 GB/s
    assert any("NIC" in w for w in evaluate(cfg, K3, h200, lay, ws, Workload()).warnings)


def test_pipeline_stages_hold_their_layers_only(k3):
    cfg, ws = k3
    gpu, w = get_gpu("B300"), Workload(context=32768)
    flat, staged = (
        evaluate(cfg, K3, gpu, Layout(8, 4, 1, 4), ws, w),
        evaluate(cfg, K3, gpu, Layout(8, 4, 1, 4, 2), ws, w),
    )
    assert staged.layout.label == "TP4/EP4/PP2"
    # 93 layers -> stages of 47 + 46: the first stage holds 47/93 of the dense weights
    assert staged.rank.weights == pytest.approx(flat.rank.weights * 47 / 93, rel=0.02)
    kda_first = sum(1 for i in cfg.kda_layers if i < 47)
    assert (
        staged.rank.plan.slot_bytes == -(-464_633_856 * kda_first // len(cfg.kda_layers) // 4)
        or abs(staged.rank.plan.slot_bytes - 464_633_856 * kda_first / len(cfg.kda_layers) / 4) <= 1
    )
    assert Layout(16, 8, 1, 8, 2).links(8) == {"tp_allreduce": "scale-up", "ep_alltoall": "scale-up", "pp_send": "NIC"}
    assert "--pipeline-parallel-size 2" in staged.commands["vllm"] and "--pp-size 2" in staged.commands["sglang"]


def test_cost_ranking_shows_its_number_and_takes_prices(capsys):
    assert (
        main(
            [
                "plan",
                "--gpu",
                "B300",
                "--gpu",
                "H200",
                "--optimize",
                "cost",
                "--concurrency",
                "32",
                "--markdown",
                "--top",
                "30",
            ]
        )
        == 0
    )
    md = capsys.readouterr().out
    lines = [x for x in md.splitlines() if x.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    col = head.index("$/Mtok")
    assert "GPU-h/Mtok" in head and "price per GPU-hour: B300 $6.5, H200 $3.5" in md
    ranked = [r for r in lines[1:] if "fits" in r][:10]
    costs = [float(r.strip("|").split("|")[col].replace(",", "")) for r in ranked]
    assert costs == sorted(costs) and len(costs) >= 3
    assert (
        main(["plan", "--gpu", "B300", "--optimize", "cost", "--concurrency", "32", "--price", "B300=13", "--json"])
        == 0
    )
    best = json.loads(capsys.readouterr().out)["layouts"][0]
    assert best["perf"]["usd_per_mtok"] == pytest.approx(best["perf"]["gpu_hours_per_mtok"] * 13)
    assert main(["plan", "--gpu", "B300", "--price", "B300=cheap"]) == 2


def test_unasked_questions_are_stated_in_every_format(tmp_path, capsys):
    said = "context not given: assuming 32,768 tokens per request"
    for fmt in (["--json"], ["--markdown"], []):
        assert main(["plan", "--gpu", "B300", "--num-gpus", "8", *fmt]) == 0
        out = capsys.readouterr().out
        assert said in out and "concurrency not given" in out and "Decode step time per GPU" in out
    assert (
        main(
            [
                "plan",
                "--gpu",
                "B300",
                "--num-gpus",
                "8",
                "--context",
                "8192",
                "--concurrency",
                "4",
                "--optimize",
                "cost",
                "--no-latency-sensitive",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["assumed"] == []
    page = tmp_path / "p.html"
    assert main(["plan", "--gpu", "B300", "--num-gpus", "8", "--html", str(page)]) == 0
    assert said in page.read_text() and "Decode step time per GPU" in page.read_text()


def test_every_asked_gpu_type_gets_its_best_row(tmp_path, capsys):
    assert (
        main(["plan", "--gpu", "B300", "--gpu", "H100", "--gpu", "H200", "--gpu", "B200", "--top", "3", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert [r["gpu"] for r in out["best_per_gpu"]] == ["B300", "B200", "H200", "H100"]
    assert {r["gpu"] for r in out["layouts"]} == {"B300", "B200", "H200", "H100"}
    page = tmp_path / "p.html"
    assert (
        main(
            [
                "plan",
                "--gpu",
                "B300",
                "--gpu",
                "H100",
                "--gpu",
                "H200",
                "--gpu",
                "B200",
                "--top",
                "3",
                "--html",
                str(page),
            ]
        )
        == 0
    )
    for gpu in ("B300", "H100", "H200", "B200"):
        assert f"x{gpu}</td>" in page.read_text()


def test_the_vision_encoder_cache_is_counted_per_rank(k3):
    cfg, ws = k3
    gpu, lay = get_gpu("B300"), Layout(8, 8, 1, 8)
    with_cache = evaluate(cfg, K3, gpu, lay, ws, Workload())
    without = evaluate(cfg, K3, gpu, lay, ws, Workload(encoder_cache_bytes=0))
    assert with_cache.rank.encoder_cache == 256 * 2**20 and without.rank.encoder_cache == 0
    assert without.rank.cache_budget - with_cache.rank.cache_budget == 256 * 2**20


def test_pd_handoff_is_latent_rows_not_held_plus_the_kda_state():
    """Issue 17's accounting: latent bytes x tokens not already on the decode side (whole
    blocks) + the KDA state the sizing module predicts (464,633,856 B for K3 in fp32)."""
    from k3serve.cache.sizing import kda_state_bytes_per_request, mla_cache_bytes_per_token
    from k3serve.config.bundled import load_model_config
    from k3serve.planner.disagg import handoff

    k3 = load_model_config("moonshotai/Kimi-K3")
    per_token = 24 * 576 * 2  # 24 MLA layers x (512 + 64) values x bf16
    assert mla_cache_bytes_per_token(k3) == per_token and kda_state_bytes_per_request(k3) == 464_633_856
    first = handoff(k3, 1000)
    assert first.latent_bytes == 1000 * per_token and first.total_bytes == 1000 * per_token + 464_633_856
    shared = handoff(k3, 1000, cached_tokens=999)  # 62 whole blocks of 16 held; the partly filled one is resent
    assert shared.sent_tokens == 1000 - 62 * 16 and shared.state_bytes == 464_633_856
    assert handoff(k3, 1000, "fp8").latent_bytes == 1000 * per_token // 2
    with pytest.raises(ValueError, match="cached_tokens"):
        handoff(k3, 10, cached_tokens=11)


def test_pd_layout_times_the_handoff_over_nvlink_inside_a_domain_and_rdma_beyond():
    from k3serve.config.bundled import load_model_config
    from k3serve.planner.disagg import parse_pd, pd_layout
    from k3serve.planner.hardware import get_gpu

    k3, b300 = load_model_config("moonshotai/Kimi-K3"), get_gpu("B300")
    inside = pd_layout(k3, b300, 4, 1, 1, 8192)  # 8 GPUs: one NVLink domain
    beyond = pd_layout(k3, b300, 8, 1, 1, 8192)  # 16 GPUs: two nodes, RDMA
    assert (inside.link, beyond.link) == ("NVLink", "RDMA") and inside.num_gpus == 8 and beyond.num_gpus == 16
    assert inside.seconds == pytest.approx(inside.handoff.total_bytes / (b300.scaleup_bw / 2 * 4))
    assert beyond.seconds == pytest.approx(beyond.handoff.total_bytes / (b300.nic_bw * 8))
    assert parse_pd("2:3") == (2, 3)
    for bad in ("2", "0:1", "a:b"):
        with pytest.raises(ValueError, match="--pd"):
            parse_pd(bad)


def test_plan_cli_reports_the_pd_layout(capsys):
    from k3serve.cli import main

    assert main(["plan", "--gpu", "B300", "--context", "8192", "--pd", "1:1", "--json"]) == 0
    pd = json.loads(capsys.readouterr().out)["disaggregation"]
    assert pd["prefill_instances"] == pd["decode_instances"] == 1 and pd["kda_state_bytes"] == 464_633_856
    assert pd["transfer_bytes"] == pd["latent_bytes"] + pd["kda_state_bytes"] and pd["transfer_seconds"] > 0
    assert main(["plan", "--gpu", "B300", "--context", "8192", "--pd", "1:1"]) == 0
    assert "P/D 1:1" in capsys.readouterr().out
    assert main(["plan", "--gpu", "B300", "--pd", "x"]) == 2


def test_k3serves_launch_line_is_a_layout_it_runs(capsys):
    """16 x B200 ranks DP-attention inside pipeline stages first; k3serve runs TP x PP stages but
    not DP-attention inside them yet, so its launch line is the best fitting layout it runs (TP8
    stages over two nodes), and vLLM's and SGLang's lines stay the best layout's."""
    cfg = load_model_config(K3)
    rep = plan(cfg, K3, "bundled", [get_gpu("B200")], weight_split(cfg), Workload(context=32768), num_gpus=16)
    best = rep.best()
    assert best.layout.pp == 2 and best.layout.dp > 1
    line = rep.launch()["k3serve"]
    runs = next(r for r in rep.results if r.fits and (r.layout.pp == 1 or r.layout.dp == 1))
    assert line.split("  #")[0] == runs.commands["k3serve"].split("  #")[0]
    assert "--pipeline-parallel-size 2" in line and "DP-attention inside pipeline stages" in line
    assert "--enable-expert-parallel" in line and "--nnodes 2" in line
    assert rep.launch()["vllm"] == best.commands["vllm"]


def test_tier_capacity_counts_the_bytes_the_engine_stores(tiny_k3_dir, capsys):
    """The planner's bytes per conversation == what an engine's host tier holds after one
    (4 blocks of latent rows + 1 KDA checkpoint), and the CLI reports the tiers."""
    from k3serve import LLM, SamplingParams
    from k3serve.planner.tiers import tier_capacity

    llm = LLM(str(tiny_k3_dir), kernels="torch", cache_memory="8MiB", max_model_len=256, kv_offloading_size=0.01)
    llm.generate([{"prompt_token_ids": list(range(1, 66))}], SamplingParams(temperature=0, max_tokens=1))
    plan = llm.engine.plan
    cap = tier_capacity(plan.token_bytes, plan.slot_bytes, 64, 1, 0.01, 0.0)
    assert cap.bytes_per_conversation == llm.engine.tiers.index.cpu.used
    assert (
        main(
            [
                "plan",
                "--gpu",
                "H200",
                "--num-gpus",
                "16",
                "--context",
                "32768",
                "--kv-offloading-size",
                "512",
                "--kv-offloading-dir-size",
                "4096",
                "--json",
            ]
        )
        == 0
    )
    tiers = json.loads(capsys.readouterr().out)["prefix_cache_tiers"]
    assert tiers["host_conversations"] == 512 * 2**30 // tiers["bytes_per_conversation"] > 0


def test_speculative_records_are_one_formula_in_the_engine_and_the_planner(tiny_k3_dir):
    """Speculative decoding's verify records (1 + k KDA states per running sequence) come out of
    the memory left for the cache by one function (cache/sizing.py spec_records_bytes): the
    engine's budget under --gpu-memory-utilization and the planner's rank budget shrink by the
    same bytes; an explicit --cache-memory is the cache's alone."""
    import torch

    from k3serve import LLM
    from k3serve.cache.sizing import kda_state_bytes_per_request, spec_records_bytes
    from k3serve.config.engine_config import EngineConfig
    from k3serve.engine.startup import cache_budget
    from k3serve.planner.memory import rank_memory

    model = LLM(str(tiny_k3_dir), cache_memory="16MiB", max_model_len=256).engine.model_info
    cfg = model.cfg
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    records = spec_records_bytes(cfg, 3, 16)
    assert records == 4 * kda_state_bytes_per_request(cfg) * 16
    plain, specd = (
        EngineConfig.from_kwargs(str(tiny_k3_dir), gpu_memory_utilization=0.05, max_num_seqs=16, **extra)
        for extra in ({}, {"speculative_config": spec})
    )
    cpu = torch.device("cpu")
    assert cache_budget(plain, cpu, model) - cache_budget(specd, cpu, model) == records
    fixed = EngineConfig.from_kwargs(str(tiny_k3_dir), cache_memory="16MiB", speculative_config=spec)
    assert cache_budget(fixed, cpu, model) == 16 << 20
    layout = next(
        r.layout
        for r in plan(
            cfg,
            str(tiny_k3_dir),
            "schema",
            [get_gpu("H100")],
            weight_split(cfg, tiny_k3_dir),
            Workload(context=256, max_num_seqs=16),
            num_gpus=1,
            tp=1,
        ).results
    )
    budgets = [
        rank_memory(
            cfg,
            get_gpu("H100"),
            layout,
            weight_split(cfg, tiny_k3_dir),
            Workload(context=256, max_num_seqs=16, spec_tokens=k),
        ).cache_budget
        for k in (0, 3)
    ]
    assert budgets[0] - budgets[1] == records


def test_a_draft_models_weights_and_cache_are_one_formula_in_the_engine_and_the_planner(tiny_k3_dir, tiny_kl_dir):
    """A `draft_model` drafter's float32 weights and its own cache (a slot and max_model_len + 16
    rows per sequence) come out of a derived cache budget by the formulas the planner uses
    (weights/schema.py loaded_weight_bytes, cache/sizing.py draft_cache_bytes), and the drafter
    the engine then loads holds exactly those bytes."""
    import argparse

    import torch

    from k3serve import LLM
    from k3serve.cache.sizing import draft_cache_bytes, spec_records_bytes
    from k3serve.config.bundled import load_model_config
    from k3serve.config.engine_config import EngineConfig
    from k3serve.engine.startup import cache_budget
    from k3serve.planner.cli import _draft
    from k3serve.planner.memory import rank_memory
    from k3serve.weights.schema import loaded_weight_bytes
    from k3serve.runner.rank_step import weight_bytes

    spec = {"method": "draft_model", "model": str(tiny_kl_dir), "num_speculative_tokens": 3}
    llm = LLM(str(tiny_k3_dir), cache_memory="16MiB", max_model_len=256, max_num_seqs=16, speculative_config=spec)
    model, drafter = llm.engine.model_info, llm.engine.spec.proposer
    draft = load_model_config(tiny_kl_dir)
    weights, own = loaded_weight_bytes(draft), draft_cache_bytes(draft, 16, 256)
    held = drafter.cache.recurrent + drafter.cache.conv + drafter.cache.latent
    assert weight_bytes(drafter.model) == weights and sum(t.nbytes for t in held if t is not None) == own
    cpu, kw = torch.device("cpu"), dict(gpu_memory_utilization=0.05, max_num_seqs=16, max_model_len=256)
    plain = EngineConfig.from_kwargs(str(tiny_k3_dir), **kw)
    specd = EngineConfig.from_kwargs(str(tiny_k3_dir), speculative_config=spec, **kw)
    records = spec_records_bytes(model.cfg, 3, 16)
    assert cache_budget(plain, cpu, model) - cache_budget(specd, cpu, model) == records + weights + own
    args = argparse.Namespace(draft_model=str(tiny_kl_dir), draft_params=0.0, max_num_seqs=16, context=256)
    assert _draft(args) == dict(draft_bytes=weights, draft_cache_bytes=own)
    cfg = model.cfg
    layout = next(
        r.layout
        for r in plan(
            cfg, str(tiny_k3_dir), "schema", [get_gpu("H100")], weight_split(cfg, tiny_k3_dir),
            Workload(context=256, max_num_seqs=16), num_gpus=1, tp=1,
        ).results
    )  # fmt: skip
    ranks = [
        rank_memory(cfg, get_gpu("H100"), layout, weight_split(cfg, tiny_k3_dir), Workload(context=256, max_num_seqs=16, **extra))
        for extra in ({}, dict(spec_tokens=3, **_draft(args)))
    ]  # fmt: skip
    assert ranks[0].cache_budget - ranks[1].cache_budget == records + weights + own
    assert ranks[1].draft_cache == own


def test_the_engine_reserves_the_planners_activations():
    """One activation formula (cache/sizing.py activation_bytes): an engine's
    --gpu-memory-utilization reserve for bf16 K3 at TP8 + EP equals the planner's for the same
    chunk, batch and layout (they used two formulas before: 16 fp32 rows against 12 bf16 rows,
    AttnRes snapshots and experts)."""
    import torch

    from k3serve.config.engine_config import EngineConfig
    from k3serve.engine.startup import activation_reserve
    from k3serve.executor.base import ModelInfo
    from k3serve.planner.memory import Workload, activation_bytes

    cfg = load_model_config(K3)
    config = EngineConfig(
        max_num_batched_tokens=4096, max_num_seqs=64, tensor_parallel_size=8, enable_expert_parallel=True
    )
    engine = activation_reserve(config, ModelInfo(cfg, torch.bfloat16, 0))
    planner = activation_bytes(cfg, Workload(max_num_batched_tokens=4096, max_num_seqs=64), Layout(8, 8, 1, 8))
    assert engine == planner > 4096 * cfg.hidden_size * 2 * 12
