"""Two patches fla-core's `chunk_kda` needs to run under Triton's interpreter on a CPU, applied
in the tests only (gpu-design.md, "fla under TRITON_INTERPRET=1"); nothing in k3serve needs them
on a GPU:

- autotune benchmarks each config on a device, and the interpreter has no driver to benchmark
  with: every config scores alike, so the first is kept;
- fla/ops/common/chunk_delta_h.py calls `i_t.to(tl.int64)` on its loop variable, which the
  interpreter makes a Python int: a copy of that module with `tl.cast(i_t, tl.int64)` replaces
  it where chunk_kda's forward imports it (fla 0.6.0; fla HEAD still has the line).
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

_done = False


def apply() -> None:
    global _done
    if _done:
        return
    import triton.runtime.autotuner as autotuner

    def same_score(self, *args, config, **meta):
        return [0.0, 0.0, 0.0]

    autotuner.Autotuner._bench = same_score
    import fla.ops.common.chunk_delta_h as original
    import fla.ops.kda.chunk_fwd as chunk_fwd

    src = Path(original.__file__).read_text().replace("i_t.to(tl.int64)", "tl.cast(i_t, tl.int64)")
    path = Path(tempfile.mkdtemp(prefix="k3serve-fla-")) / "chunk_delta_h_interpreted.py"
    path.write_text(src)  # a file: triton.jit reads its kernels' source
    spec = importlib.util.spec_from_file_location("fla.ops.common.chunk_delta_h_interpreted", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    chunk_fwd.chunk_gated_delta_rule_fwd_h = module.chunk_gated_delta_rule_fwd_h
    _done = True
