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
    wanted = {KERNELS + p.name for p in (ROOT / KERNELS).iterdir() if p.suffix in (".cpp", ".h")}
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
