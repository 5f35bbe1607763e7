"""The wheel (issue 51): `pip install k3serve` (not editable) must carry everything its CPU kernels
compile from, or every install silently runs the slow reference paths. The wheel is built from a
copy of the package (setuptools writes build/ beside its sources) and installed with --target;
a fresh interpreter imports k3serve from there. The slow test builds the kernels from that
install and decodes through them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = "k3serve/kernels/cpu/"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "k3serve", src / "k3serve", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
        check=True,
        cwd=src,
    )
    wheel = next(dist.glob("k3serve-*.whl"))
    site = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)], check=True
    )
    return wheel, site


def run_installed(site: Path, code: str, **env) -> str:
    """`code` in a fresh interpreter that imports k3serve from the install (not the checkout)."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=site.parent,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(site), **env},
    )
    return out.stdout


def test_the_wheel_carries_every_file_the_kernels_include(installed):
    wheel, site = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {n for n in names if n.startswith(KERNELS)}
    wanted = {
        KERNELS + str(p.relative_to(ROOT / KERNELS)) for p in (ROOT / KERNELS).rglob("*") if p.suffix in (".cpp", ".h")
    }
    assert wanted <= shipped, sorted(wanted - shipped)
    for name in shipped:  # each quoted include resolves inside the wheel
        text = zipfile.ZipFile(wheel).read(name).decode()
        for inc in re.findall(r'#include\s+"([^"]+)"', text):
            assert KERNELS + inc in names, f"{name} includes {inc}, which the wheel lacks"
    where = run_installed(
        site, "import k3serve.kernels as k; print(k.__file__); print(len(k._SOURCES), len(k._HEADERS))"
    )
    path, counts = where.split("\n")[:2]
    assert path.startswith(str(site)), path
    assert counts.split() == [
        str(sum(n.endswith(".cpp") for n in shipped)),
        str(sum(n.endswith(".h") for n in shipped)),
    ]


@pytest.mark.slow
def test_the_installed_wheel_builds_its_kernels_and_decodes_through_them(installed, tmp_path):
    _, site = installed
    out = run_installed(
        site,
        "\n".join(
            [
                "from k3serve import LLM, SamplingParams",
                "llm = LLM(kernels='cpp', cache_memory='16MiB', max_model_len=128)",
                "print(llm.engine.model.model.backend.name)",
                "print(len(llm.generate('hello', SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids))",
            ]
        ),
        K3SERVE_KERNEL_CACHE=str(tmp_path / "kernels"),
    )
    assert out.split() == ["cpp", "4"]
    assert any((tmp_path / "kernels").glob("*/*.so"))  # built from the install's own sources


WITHOUT_XGRAMMAR = """
import logging, sys
sys.modules["xgrammar"] = None  # the wheel's dependencies without the `structured` extra
logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
from fastapi.testclient import TestClient
from k3serve.cli import build_parser
from k3serve.server.launch import build_server
app, state = build_server(build_parser().parse_args(
    ["serve", sys.argv[1], "--cache-memory", "16MiB", "--max-model-len", "256", "--kernels", "torch"]))
with TestClient(app) as c:
    msgs = [{"role": "user", "content": "hi"}]
    r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "response_format": {"type": "json_object"}})
    print("CONSTRAINED", r.status_code, r.json()["error"]["message"])
    print("PLAIN", c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3}).status_code)
"""


def test_the_installed_wheel_without_xgrammar_answers_501_and_says_so_at_start(installed, tiny_k3_dir):
    """`pip install k3serve` without the `structured` extra: structured outputs are a 501 naming
    what to install (never a 500), said once in the start-up log; plain requests are served."""
    _, site = installed
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_XGRAMMAR, str(tiny_k3_dir)],
        cwd=site.parent,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(site)},
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    constrained = next(line for line in out.stdout.splitlines() if line.startswith("CONSTRAINED"))
    assert constrained.startswith("CONSTRAINED 501") and "pip install" in constrained and "xgrammar" in constrained
    assert "PLAIN 200" in out.stdout
    said = [line for line in out.stderr.splitlines() if line.startswith("LOG") and "xgrammar" in line]
    assert len(said) == 1 and "501" in said[0], out.stderr[-2000:]
