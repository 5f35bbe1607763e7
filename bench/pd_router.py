"""Benchmark: prefill/decode disaggregation through `k3serve router` vs one colocated server
(issue 17), same machine, same requests.

Four `k3serve serve`/`router` processes on 127.0.0.1, each with the default tiny K3 (MXFP4
experts) and 2 threads: a colocated server (A), and a prefill server + a decode server behind the
router (B). `k3serve bench --ablate A B` replays the same requests on both, alternating, and
reports TTFT, TPOT and their ratios; the decode server's /metrics give the hand-off bytes and
pull time per request. Only one side computes at a time (the replay is sequential per round).
`--connector NixlConnector` (default; the bytes move by a NIXL READ) or `K3HttpConnector` (in the
pull's HTTP answer). Writes bench/results/pd_router_<connector>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

EXE = [sys.executable, "-m", "k3serve"]
COMMON = [
    "--cache-memory",
    "256MiB",
    "--max-model-len",
    "2048",
    "--block-size",
    "16",
    "--disable-log-stats",
    "--uvicorn-log-level",
    "warning",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        EXE + args + ["--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{args[0]} exited with {proc.returncode}")
        time.sleep(0.5)
    raise RuntimeError(f"{args[0]} did not start")


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connector", choices=["NixlConnector", "K3HttpConnector"], default="NixlConnector")
    connector = ap.parse_args().connector
    out = Path(__file__).parent / "results" / f"pd_router_{connector}.json"
    out.parent.mkdir(exist_ok=True)
    kv = '{"kv_connector": "%s", "kv_role": "%%s"}' % connector
    procs = []
    try:
        colo_p, colocated = start(["serve", *COMMON])
        pre_p, prefill = start(["serve", *COMMON, "--kv-transfer-config", kv % "kv_producer"])
        dec_p, decode = start(["serve", *COMMON, "--kv-transfer-config", kv % "kv_consumer"])
        procs += [colo_p, pre_p, dec_p]
        rt_p, router = start(["router", "--prefill", prefill, "--decode", decode, "--uvicorn-log-level", "warning"])
        procs.append(rt_p)
        result_file = out.with_name(f"pd_router_{connector}_ablation.json")
        subprocess.run(
            EXE
            + [
                "bench",
                "--ablate",
                colocated,
                router,
                "--ablate-rounds",
                "2",
                "--num-prompts",
                "12",
                "--random-input-len",
                "512",
                "--random-output-len",
                "32",
                "--max-concurrency",
                "1",
                "--ignore-eos",
                "--no-progress",
                "--save-result",
                "--result-filename",
                str(result_file),
            ],
            check=True,
        )
        ablation = json.loads(result_file.read_text())
        pulls = metric(decode, "k3serve:kv_pulls_total")
        result = {
            "connector": connector,
            "ablation": ablation,
            "pulls": pulls,
            "bytes_per_request": metric(decode, "k3serve:kv_transfer_bytes_total") / max(pulls, 1),
            "pull_ms_per_request": 1000 * metric(decode, "k3serve:kv_pull_seconds_total") / max(pulls, 1),
        }
        out.write_text(json.dumps(result, indent=2))
        print(
            f"hand-off: {result['bytes_per_request'] / 1e6:.2f} MB and {result['pull_ms_per_request']:.1f} ms "
            f"per request ({pulls:.0f} pulls)"
        )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


if __name__ == "__main__":
    main()
