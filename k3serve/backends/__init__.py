"""Execution backends: *how* the layers' math runs, chosen once per engine (style-anchors §7).

A layer holds parameters and says what it computes; its forward hands itself to the backend
the model was given (`KimiForCausalLM.use_kernels`), which runs it:

- `torch` (`Backend`, layers/backend.py: below the layers that hold it): each layer's `reference`
  body, plain torch; the reference every other backend is tested against;
- `cpp` (backends/cpu.py `CpuKernels`): the compiled CPU kernels (k3serve.kernels) for the rows
  they take, each layer's reference for the rest (training with grad, tensors off the CPU);
- `graph` (backends/graph.py `GraphBackend`): fixed-shape, sync-free torch for the static decode
  step (forward/static.py) that runner/graph_step.py compiles and captures per batch bucket; the
  reference for every other step;
- `triton` (backends/triton.py `TritonBackend`): the graph step with the Triton kernels of
  k3serve/kernels/triton (KDA, paged MLA, MoE grouped GEMMs) in it.

Adding a backend is one subclass here; no layer changes.
"""

from __future__ import annotations

from k3serve.layers.backend import TORCH, Backend

__all__ = ["BACKENDS", "STATIC", "TORCH", "Backend", "select"]

BACKENDS = ("torch", "cpp", "graph", "triton")
STATIC = ("graph", "triton")  # the backends whose decode runs as the static step (runner/graph_step.py)


def select(mode: str) -> Backend:
    """The backend for a kernels mode ("auto": the compiled kernels if they build, "cpp": or
    raise, "torch": the reference, "graph": the compiled static decode, "triton": the same with
    the Triton kernels). Engine placement has already turned "auto" on a GPU into "triton",
    "graph" or "torch" (executor/placement.py)."""
    from k3serve import kernels

    if mode == "graph":
        from k3serve.backends.graph import GraphBackend

        return GraphBackend()
    if mode == "triton":
        from k3serve.backends.triton import TritonBackend

        return TritonBackend()

    module = kernels.get(mode)
    if module is None:
        return TORCH
    from k3serve.backends.cpu import CpuKernels

    return CpuKernels(module)
