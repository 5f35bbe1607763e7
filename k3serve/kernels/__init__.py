"""CPU kernels where torch is slow (issue 15), built once with torch.utils.cpp_extension.

`get()` compiles `cpu/**/*.cpp` on first use (about a minute on 2 cores, said in the log) and
returns the module, or None with one warning when it cannot be built: every caller then takes
its plain torch path, which stays beside each kernel as its reference. `--kernels torch`
(EngineConfig.kernels) asks for the torch path outright; so does K3SERVE_KERNELS=torch for
every `get("auto")` of the process (tests, workers: callers without an engine config). An
engine on a GPU builds none (the kernels are CPU-only; executor/placement.py).

Each install and source version builds in a directory of its own (`build_dir`: keyed by the
install path, the sources, the ISA and torch's version, under $K3SERVE_KERNEL_CACHE, else
$TORCH_EXTENSIONS_DIR, else ~/.cache/k3serve/kernels), so two installs on one host never
rebuild each other's library. A build holds an flock on `k3serve.lock` there, which the OS
drops when a build is killed; a stale torch `lock` file found under it is such a build's and is
removed; waiting longer than $K3SERVE_KERNEL_LOCK_TIMEOUT (600 s) fails naming the lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("k3serve.kernels")
MODES = ("auto", "cpp", "torch")
# cpu/: module.cpp + registry.cpp (the bindings and the op schemas), ops.h + packs.h (the ops'
# entry points and weight packs), core/ (shared headers: checks, SIMD, panel forms), ops/ (one
# computation each), fused/ (whole blocks, the decode stack, the drafter), comm/ (shared-memory
# collectives). Sources include headers by their path under cpu/.
_CPU = Path(__file__).parent / "cpu"
_SOURCES = sorted(str(p) for p in _CPU.rglob("*.cpp"))
_HEADERS = sorted(str(p) for p in _CPU.rglob("*.h"))
_lock = threading.Lock()
_state: dict[str, object] = {}


class KernelLib:
    """The built CPU kernels. Each op of cpu/registry.cpp is an attribute holding its
    torch.library overload (`torch.ops.<namespace>.<op>.default`: schema, fake, one node to
    torch.compile); DecodeStack, the panel forms, `simd` and the shared-memory collectives come
    from the module's bindings (cpu/module.cpp). `ops`: the op names, as registry.cpp defines them."""

    def __init__(self, module, namespace: str):
        import torch

        from k3serve.kernels import fakes

        self.module, self.namespace = module, namespace
        ns = getattr(torch.ops, namespace)
        prefix = namespace + "::"
        self.ops = tuple(
            sorted(n[len(prefix) :] for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix))
        )
        fakes.register(namespace)
        for name in self.ops:
            setattr(self, name, getattr(ns, name).default)
        for name in dir(module):
            if not name.startswith("_"):
                setattr(self, name, getattr(module, name))


def get(mode: str = "auto"):
    """The compiled kernel module for `mode` ("auto": if it builds; "cpp": or raise; "torch": None)."""
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {MODES}, got {mode!r}")
    if mode == "torch" or (mode == "auto" and os.environ.get("K3SERVE_KERNELS") == "torch"):
        return None
    with _lock:
        if "module" not in _state:
            _state["module"], _state["error"] = _build()
    if _state["module"] is None and mode == "cpp":
        raise RuntimeError(f"the CPU kernels did not build: {_state['error']}")
    return _state["module"]


def build_dir(arch: str, install: Path | None = None) -> Path:
    """Where this install's kernels build: one directory per install path and source version."""
    import torch

    install = (install or Path(__file__).parent).resolve()
    h = hashlib.sha256(str(install).encode())
    for src in _SOURCES + _HEADERS:
        h.update(str(Path(src).relative_to(_CPU)).encode() + Path(src).read_bytes())
    h.update(f"{arch} {torch.__version__} {sys.version_info[:2]}".encode())
    root = os.environ.get("K3SERVE_KERNEL_CACHE") or os.environ.get("TORCH_EXTENSIONS_DIR")
    root = Path(root) if root else Path.home() / ".cache" / "k3serve" / "kernels"
    return root / f"{_module_name(arch)}-{h.hexdigest()[:16]}"


def _module_name(arch: str) -> str:
    return "k3serve_cpu_kernels" + ("" if arch == "native" else "_" + arch.replace("-", "_").replace(".", "_"))


@contextmanager
def build_lock(directory: Path, timeout_s: float):
    """Hold `directory`/k3serve.lock (an flock: the OS releases it when its holder dies)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "k3serve.lock"
    with open(path, "a+") as f:
        deadline, said = time.monotonic() + timeout_s, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another process has held the CPU kernel build lock {path} for "
                        f"{timeout_s:.0f} s (K3SERVE_KERNEL_LOCK_TIMEOUT); if no build is "
                        "running, remove the file"
                    ) from None
                if not said:
                    log.info("waiting for another process building the CPU kernels (lock %s)", path)
                    said = True
                time.sleep(0.2)
        stale = directory / "lock"  # torch's own baton: only a builder holding our lock makes one
        if stale.exists():
            log.warning("removing %s, left by a kernel build that was killed", stale)
            stale.unlink()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build():
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + path  # the pinned pip `ninja`
    try:
        from torch.utils.cpp_extension import load

        # K3SERVE_KERNEL_ARCH (default native): x86-64-v2 builds the portable scalar paths,
        # x86-64-v3 the AVX2 ones, to test them on a machine that has AVX-512 (each built apart,
        # in its own directory); the module's simd() names the route a build took
        arch = os.environ.get("K3SERVE_KERNEL_ARCH", "native")
        name, directory = _module_name(arch), build_dir(arch)
        with build_lock(directory, float(os.environ.get("K3SERVE_KERNEL_LOCK_TIMEOUT", "600"))):
            if not (directory / f"{name}.so").exists():
                log.warning("building the CPU kernels in %s (about a minute on 2 cores, once per install)", directory)
            module = load(
                name=name,
                sources=_SOURCES,
                verbose=False,
                build_directory=str(directory),
                extra_include_paths=[str(_CPU)],
                extra_cflags=[
                    f"-DK3K_NS={name}",  # the ops' namespace (cpu/registry.cpp): one per ISA build
                    "-O3",
                    f"-march={arch}",
                    "-fopenmp",
                    "-fvisibility=hidden",
                    "-fvisibility-inlines-hidden",
                ],
                extra_ldflags=["-fopenmp"],
            )
        return KernelLib(module, name), None
    except Exception as e:  # noqa: BLE001 - no compiler, no headers, an unknown ISA: use torch
        log.warning(
            "CPU kernels unavailable (%s: %s); using the torch reference paths",
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        return None, e
    finally:
        os.environ["PATH"] = path
