"""CPU kernels where torch is slow (issue 15), built once with torch.utils.cpp_extension.

`get()` compiles `cpu/*.cpp` on first use (about a minute on 2 cores; cached by torch under
$TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) and returns the module, or None
with one warning when it cannot be built: every caller then takes its plain torch path, which
stays beside each kernel as its reference. `--kernels torch` (EngineConfig.kernels) asks for
the torch path outright; so does K3SERVE_KERNELS=torch for every `get("auto")` of the process
(tests, workers: callers without an engine config). An engine on a GPU builds none (the kernels
are CPU-only; engine/setup.py kernel_mode).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

log = logging.getLogger("k3serve.kernels")
MODES = ("auto", "cpp", "torch")
_SOURCES = sorted(str(p) for p in (Path(__file__).parent / "cpu").glob("*.cpp"))
_lock = threading.Lock()
_state: dict[str, object] = {}


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


def _build():
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + path  # the pinned pip `ninja`
    try:
        from torch.utils.cpp_extension import load

        # K3SERVE_KERNEL_ARCH (default native): x86-64-v2 builds the portable scalar paths,
        # x86-64-v3 the AVX2 ones, to test them on a machine that has AVX-512 (each cached apart,
        # under its own name); the module's simd() names the route a build took
        arch = os.environ.get("K3SERVE_KERNEL_ARCH", "native")
        name = "k3serve_cpu_kernels" + ("" if arch == "native" else "_" + arch.replace("-", "_").replace(".", "_"))
        module = load(name=name, sources=_SOURCES, verbose=False,
                      extra_cflags=["-O3", f"-march={arch}", "-fopenmp", "-fvisibility=hidden", "-fvisibility-inlines-hidden"], extra_ldflags=["-fopenmp"])
        return module, None
    except Exception as e:  # noqa: BLE001 - no compiler, no headers, an unknown ISA: use torch
        log.warning("CPU kernels unavailable (%s: %s); using the torch reference paths", type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "")
        return None, e
    finally:
        os.environ["PATH"] = path
