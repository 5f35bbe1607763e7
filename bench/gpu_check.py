"""The GPU check (issue 67): one run on a lent CUDA machine, inside a time budget, the most
valuable stage first, every figure kept as it comes; `--dry-run` rehearses each stage on a CPU at
the smallest sizes (tests/bench/test_gpu_check.py runs it in the suite). docs/benchmarks.md says
what each stage's figure means.

    PYTHON=python3 bench/gpu_check.sh [--dry-run] [--only check,speed] [--results DIR]

GPU_CHECK_BUDGET_S (default 480): a stage whose cap is more than the budget left is skipped; one
that runs past its cap is killed (its process group) and recorded as timed out; the run goes on.
The preflight stage (bench/gpu_preflight.py) comes first and ends the run when something the
stages import is missing. Results in bench/results/gpu_check/: each stage's log and figures
(STAGE.log, STAGE.json), and summary.txt, results.json, logs.txt, status.json rewritten as the
stages run (a running stage's every REFRESH_S), also into $OUT when it is set (the device tool
returns that folder: a few files, so only these four). Exits 1 if a stage failed or timed out
(skips do not fail). Stdlib only: the driver runs whatever the stages lack.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG_TAIL = 256 << 10  # bytes of each stage's log that logs.txt keeps
REFRESH_S = 15  # a running stage's log and figures so far reach the outputs this often


@dataclass(frozen=True)
class Stage:
    name: str
    cap_s: int  # killed past it; skipped when the budget left is less
    device: str  # shell command on the device: {py} the Python, {json} the stage's figures file
    dry: str | None  # appended to `device` for the dry run (CPU, smallest sizes); None: not rehearsed
    gpus: int = 1  # on a device with fewer GPUs the stage is skipped
    env: str = ""  # the stage runs only when this variable is set


PYTEST = "{py} -m pytest -q -p no:cacheprovider"
CPU = "--device cpu --compile-backend eager"
GRAPH_TESTS = (
    "tests/model/test_graph.py tests/model/test_graph_ops.py tests/engine/test_graph_engine.py "
    "tests/engine/test_triton_engine.py tests/distributed/test_nccl_group.py"
)
ENGINE_TESTS = (  # the torch engine on cuda (tests/conftest.py: K3SERVE_TEST_KERNELS)
    "--ignore=tests/engine/test_graph_engine.py --ignore=tests/engine/test_triton_engine.py "
    "tests/model/test_device.py tests/engine tests/spec"
)
TRAIN = (  # issue 22: resumable, stopped after TRAIN_SECONDS; the DSpark draft once all steps are done
    '{py} -m k3serve train-demo "$TRAIN_DEMO" --steps 30000 --drill-steps 6000 --device cuda --checkpoint-every 500 '
    '--resume --no-draft --time-limit "${TRAIN_SECONDS:-420}" && if {py} -c "import sys, torch; '
    'sys.exit(torch.load(sys.argv[1], weights_only=False)[\'step\'] < 30000)" "$TRAIN_DEMO/train_state.pt"; '
    'then {py} -m k3serve train-demo "$TRAIN_DEMO" --draft-only; fi'
)
STAGES = (  # by value: what the first minutes must answer comes first
    Stage("preflight", 60, "{py} bench/gpu_preflight.py --json {json}", "--cpu"),
    Stage(
        "check",
        210,
        "{py} bench/graph_decode.py --check --only k3-mxfp4,kl-bf16 --kernels graph,triton --buckets 1,4,16,64 "
        "--json {json}",
        f"--only kl-bf16 --kernels graph --buckets 1 --new 2 {CPU}",
    ),
    Stage(
        "speed",
        210,
        "{py} bench/graph_decode.py --speed --only k3-mxfp4,kl-400m --kernels torch,graph,triton --streams 1,16,64 "
        "--json {json}",
        f"--only kl-bf16 --kernels graph --streams 1 --new 2 --dtype float32 {CPU}",
    ),
    Stage(
        "multi-gpu",
        240,
        "{py} bench/multi_gpu.py --only k3-mxfp4,kl-400m --streams 1,16,64 --json {json}",
        "--only kl-bf16 --tp 2 --streams 1 --new 2 --device cpu --compile-backend eager",
        gpus=2,
    ),
    Stage(
        "kernels",
        60,
        "{py} bench/triton_kernels.py --json {json}",
        "--shapes tiny --batches 1 --context 64 --device cpu",
    ),
    Stage(
        "profile",
        90,
        "{py} bench/step_profile.py --kernels torch,graph --json {json}",
        f"--model kl-bf16 --kernels graph --dtype float32 --steps 1 {CPU}",
    ),
    Stage("kda-vs-fla", 210, f"{PYTEST} -s tests/model/test_kda_cuda.py", "--collect-only"),
    Stage("graph-tests", 180, f"{PYTEST} --durations=10 {GRAPH_TESTS}", "--collect-only"),
    Stage("engine-tests", 300, f"K3SERVE_TEST_KERNELS=torch {PYTEST} --durations=15 {ENGINE_TESTS}", "--collect-only"),
    Stage("train-demo", int(os.environ.get("TRAIN_SECONDS", 420)) + 120, TRAIN, None, env="TRAIN_DEMO"),
)


def run(cmd: str, cap_s: float, log: Path, refresh, env: dict) -> int | None:
    """The command in its own session, its output to the console and `log`; its exit status, or
    None when it ran past cap_s (its whole process group is killed then)."""
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, shell=True, executable="/bin/bash", cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True,
        )  # fmt: skip

        def copy() -> None:
            for line in proc.stdout:
                f.write(line)
                f.flush()
                sys.stdout.write(line)
                sys.stdout.flush()

        pump = threading.Thread(target=copy, daemon=True)
        pump.start()
        end = time.monotonic() + cap_s
        try:
            while True:
                try:
                    rc = proc.wait(timeout=max(0.0, min(REFRESH_S, end - time.monotonic())))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= end:
                        rc = None
                        break
                    refresh()
        finally:  # past its cap, or the driver interrupted: nothing of the stage outlives it
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        pump.join(timeout=5)
    return rc


def read_json(path: Path) -> dict | None:
    """A stage's figures: None when not written (or cut mid-write by a kill)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def headline(log: Path) -> str:
    """A stage's figure for the summary: the last line it printed (pytest's counts, a script's summary)."""
    lines = [s.strip(" =") for s in log.read_text(errors="replace").splitlines() if s.strip(" =")]
    return lines[-1] if lines else ""


class Record:
    """What the run measured so far, written after each change into each folder given."""

    def __init__(self, folders: list[Path], dry: bool, budget: float):
        self.folders, self.dry, self.budget, self.t0 = folders, dry, budget, time.monotonic()
        self.started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        self.stages: dict[str, dict] = {}
        self.logs: dict[str, Path] = {}

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def set(self, name: str, **row) -> None:
        self.stages.setdefault(name, {}).update(row)
        self.write()

    def write(self) -> None:
        mode = "dry run on the CPU" if self.dry else "device run"
        rows = [f"GPU check {self.started}, {mode}: {self.elapsed():.0f} s of a {self.budget:.0f} s budget"]
        rows.append(f"{'stage':13s} {'status':10s} {'s':>4s} {'cap':>4s}  figure")
        for name, r in self.stages.items():
            secs = f"{r['seconds']:4.0f}" if "seconds" in r else "   -"
            rows.append(f"{name:13s} {r['status']:10s} {secs} {r['cap_s']:4d}  {r.get('headline', '')[:100]}")
        logs = []
        for name, path in self.logs.items():
            with path.open("rb") as f:
                f.seek(max(0, path.stat().st_size - LOG_TAIL))
                logs.append(f"==== {name}: {self.stages[name]['status']} ====\n{f.read().decode(errors='replace')}")
        files = {
            "summary.txt": "\n".join(rows) + "\n",
            "results.json": json.dumps({"dry_run": self.dry, "budget_s": self.budget, "stages": self.stages}, indent=2),
            "logs.txt": "\n".join(logs),
            "status.json": json.dumps(
                {
                    "elapsed_s": round(self.elapsed()),
                    "running": next((n for n, r in self.stages.items() if r["status"] == "running"), None),
                    "statuses": {n: r["status"] for n, r in self.stages.items()},
                }
            ),
        }
        for folder in self.folders:
            for name, text in files.items():  # whole files only: a run killed mid-write keeps the last
                tmp = folder / f".{name}.tmp"
                tmp.write_text(text)
                tmp.replace(folder / name)


def skip_reason(stage: Stage, args, record: Record, facts: dict, left: float) -> str | None:
    if args.only and stage.name not in args.only.split(",") + ["preflight"]:
        return "not in --only"
    if record.stages.get("preflight", {}).get("status", "ok") != "ok":
        return "the preflight failed"
    if stage.env and not os.environ.get(stage.env):
        return f"{stage.env} not set"
    if args.dry_run and stage.dry is None:
        return "no dry-run form"
    if not args.dry_run and facts.get("count", 1) < stage.gpus:
        return f"needs {stage.gpus} GPUs"
    if stage.name != "preflight" and left < stage.cap_s:  # the preflight is the gate: never skipped
        return f"cap {stage.cap_s} s > {left:.0f} s left"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="every stage on the CPU at the smallest sizes")
    p.add_argument("--only", help="stages to run (comma-separated names; the preflight always runs)")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "gpu_check")
    args = p.parse_args(argv)
    if args.only and (unknown := set(args.only.split(",")) - {s.name for s in STAGES}):
        p.error(f"no stage {', '.join(sorted(unknown))}: the stages are {', '.join(s.name for s in STAGES)}")
    args.results.mkdir(parents=True, exist_ok=True)
    folders = [args.results] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
    record = Record(folders, args.dry_run, float(os.environ.get("GPU_CHECK_BUDGET_S", 480)))
    env = {  # the checkout's k3serve first (the device's PYTHONPATH names only the carried wheels)
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    if args.dry_run:  # tiny sizes gain nothing from threads, and on a busy CPU their spin-waits made steps 30x slower
        env.setdefault("OMP_NUM_THREADS", "1")
    facts = {}
    for stage in STAGES:
        figures = args.results / f"{stage.name}.json"
        figures.unlink(missing_ok=True)
        left = record.budget - record.elapsed()
        why = skip_reason(stage, args, record, facts, left)
        if why:
            print(f"== {stage.name}: skipped ({why})", flush=True)
            record.set(stage.name, status="skipped", cap_s=stage.cap_s, headline=why)
            continue
        py = shlex.quote(sys.executable)
        cmd = stage.device.replace("{py}", py).replace("{json}", shlex.quote(str(figures)))
        cmd += f" {stage.dry}" if args.dry_run else ""
        print(f"== {stage.name} (cap {stage.cap_s} s, {left:.0f} s of the budget left): {cmd}", flush=True)
        log = record.logs[stage.name] = args.results / f"{stage.name}.log"
        log.write_text("")
        record.set(stage.name, status="running", cap_s=stage.cap_s, command=cmd)
        t = time.monotonic()
        rc = run(cmd, stage.cap_s, log, lambda: record.set(stage.name, figures=read_json(figures)), env)
        status = "timed out" if rc is None else "ok" if rc == 0 else "FAILED"
        result = read_json(figures)
        facts = result if stage.name == "preflight" and result else facts
        record.set(
            stage.name, status=status, rc=rc, seconds=time.monotonic() - t, headline=headline(log), figures=result
        )
    print((args.results / "summary.txt").read_text(), end="")
    return int(any(r["status"] in ("FAILED", "timed out") for r in record.stages.values()))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run()'s cleanup then kills the stage
    sys.exit(main())
