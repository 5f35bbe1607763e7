"""The compiled-kernel cache: one build directory per install and source version (two installs
on one host never rebuild each other's library), a stale lock left by a killed build is
recovered, and a lock held too long fails naming the lock instead of hanging the start."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import time
from pathlib import Path

from k3serve import kernels
from k3serve.kernels import build_dir

ROOT = Path(__file__).resolve().parents[2]


def _get_cpp(env_extra: dict, timeout: float) -> subprocess.CompletedProcess:
    code = "from k3serve import kernels; m = kernels.get('cpp'); print('built', m is not None)"
    env = {**__import__("os").environ, **env_extra}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_each_install_builds_in_its_own_directory(tmp_path):
    here = build_dir("native")
    assert here == build_dir("native") and here.name.startswith("k3serve_cpu_kernels-")
    other = build_dir("native", install=tmp_path / "site-packages" / "k3serve" / "kernels")
    assert other != here and other.parent == here.parent
    assert build_dir("x86-64-v2") != here


def test_a_stale_lock_from_a_killed_build_is_recovered():
    """torch's `lock` file, left when a build is killed midway, made every later start wait
    forever after "loading shards 100%"; now it is removed under our flock and the start goes on."""
    assert kernels.get("cpp") is not None  # built (or already built) in this install's directory
    directory = build_dir("native")
    (directory / "lock").write_text("")  # what a build killed midway leaves
    t0 = time.monotonic()
    done = _get_cpp({}, timeout=300)
    assert "built True" in done.stdout, done.stderr[-2000:]
    assert not (directory / "lock").exists() and time.monotonic() - t0 < 120
    assert "left by a kernel build that was killed" in done.stderr


def test_a_lock_held_too_long_fails_naming_it():
    directory = build_dir("native")
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "k3serve.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process "building"
        t0 = time.monotonic()
        done = _get_cpp({"K3SERVE_KERNEL_LOCK_TIMEOUT": "1"}, timeout=120)
        fcntl.flock(held, fcntl.LOCK_UN)
    assert done.returncode != 0 and time.monotonic() - t0 < 60
    assert "k3serve.lock" in done.stderr and "K3SERVE_KERNEL_LOCK_TIMEOUT" in done.stderr, done.stderr[-2000:]
