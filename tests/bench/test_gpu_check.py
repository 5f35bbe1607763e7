"""bench/gpu_check.sh rehearsed on every CI (issue 67): its dry run runs each stage's own command
on the CPU at the smallest sizes (the device's scripts and flags with smaller ones appended, so
a renamed flag or a missing test file fails here); the budget skips what does not fit, a stage
past its cap is killed with its process group, and the outputs the device tool returns stay a
few files; the preflight names what is missing with the lines that carry its wheels."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT_FILES = ["logs.txt", "results.json", "status.json", "summary.txt"]


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # the dataclass looks itself up
    spec.loader.exec_module(module)
    return module


def dry_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRAIN_DEMO", "GPU_CHECK_BUDGET_S")}
    return subprocess.run(
        [str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--results", str(tmp_path / "results")],
        env={**base, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_dry_run_runs_every_stage_and_leaves_its_figures(tmp_path):
    t = time.monotonic()
    proc = dry_run(tmp_path)
    took = time.monotonic() - t
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == OUT_FILES  # the device tool returns 8 files at most
    stages = json.loads((out / "results.json").read_text())["stages"]
    failed = {n: (r["status"], r["headline"]) for n, r in stages.items() if r["status"] != "ok"}
    assert failed == {"train-demo": ("skipped", "TRAIN_DEMO not set")}, (out / "summary.txt").read_text()
    assert proc.returncode == 0
    assert stages["check"]["figures"]["results"]["kl-bf16"]["graph"] == {
        "vs_torch": {"1": None},
        "vs_eager": {"1": None},
        "compiles": 1,
    }
    assert stages["speed"]["figures"]["results"]["kl-bf16"]["graph"]["tok_s"]["1"] > 0
    assert stages["kernels"]["figures"]["results"]["tiny/moe_experts/B1"]["us"] > 0
    assert stages["profile"]["figures"]["graph"]["ops_per_layer"] > 0
    assert stages["preflight"]["figures"]["missing"] == {}
    assert "tests collected" in stages["engine-tests"]["headline"]
    summary = (out / "summary.txt").read_text()
    assert summary == (tmp_path / "results" / "summary.txt").read_text() and len(summary.splitlines()) < 25
    assert all(f"==== {s.name}: ok ====" in (out / "logs.txt").read_text() for s in gpu_check().STAGES[:-1])
    assert took < 180, took  # under a minute on an idle 2-core machine; the slack is for a busy one


def test_a_missing_import_stops_the_run_at_the_preflight_with_the_carry_lines(tmp_path):
    shadow = tmp_path / "shadow"
    for module in ("xgrammar", "fla"):  # as on the device image: not installed
        (shadow / module).mkdir(parents=True)
        (shadow / module / "__init__.py").write_text(f"raise ModuleNotFoundError('no {module}', name='{module}')")
    proc = dry_run(tmp_path, PYTHONPATH=str(shadow))
    assert proc.returncode == 1
    logs = (tmp_path / "out" / "logs.txt").read_text()
    assert "preflight: missing fla-core (import fla), xgrammar (import xgrammar)" in logs
    assert "--python-version 3." in logs and "-d .whl fla-core==0.6.0 xgrammar==0.2.9\n" in logs
    assert "--no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site" in logs
    stages = json.loads((tmp_path / "out" / "results.json").read_text())["stages"]
    assert stages["preflight"]["status"] == "FAILED"
    assert {r["headline"] for n, r in stages.items() if n != "preflight"} <= {
        "the preflight failed",
        "TRAIN_DEMO not set",
    }


def test_budget_skips_and_caps_kill_the_stage_process_group(tmp_path, monkeypatch, capsys):
    m = gpu_check()
    pid = tmp_path / "pid"
    monkeypatch.setattr(
        m,
        "STAGES",
        (
            m.Stage("first", 1, f"sleep 60 & echo $! > {pid}; wait", "--x"),  # a child in the stage's group
            m.Stage("figures", 5, "echo '{\"tok_s\": 7}' > {json}; echo 7 tok/s", None),
            m.Stage("too-long", 60, "true", None),
            m.Stage("two-gpus", 1, "true", None, gpus=2),
        ),
    )
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("GPU_CHECK_BUDGET_S", "30")
    assert m.main(["--results", str(tmp_path / "results")]) == 1  # a stage timed out
    stages = json.loads((tmp_path / "out" / "results.json").read_text())["stages"]
    assert {n: r["status"] for n, r in stages.items()} == {
        "first": "timed out",
        "figures": "ok",
        "too-long": "skipped",
        "two-gpus": "skipped",
    }
    assert stages["figures"]["figures"] == {"tok_s": 7} and stages["figures"]["headline"] == "7 tok/s"
    assert stages["too-long"]["headline"].startswith("cap 60 s > ")
    assert stages["two-gpus"]["headline"] == "needs 2 GPUs"
    stat = Path(f"/proc/{pid.read_text().strip()}/stat")
    assert not stat.exists() or stat.read_text().split(")")[1].split()[0] == "Z"  # the stage's child died with it
    assert "first         timed out" in (tmp_path / "out" / "summary.txt").read_text()
