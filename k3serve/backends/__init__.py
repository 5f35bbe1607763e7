"""Execution backends: *how* the layers' math runs, chosen once per engine (style-anchors §7).

A layer holds parameters and says what it computes; its forward hands itself to the backend
the model was given (`KimiForCausalLM.use_kernels`), which runs it:

- `torch` (`Backend`, this module): each layer's `reference` body, plain torch; the reference
  every other backend is tested against;
- `cpp` (backends/cpu.py `CpuKernels`): the compiled CPU kernels (k3serve.kernels) for the rows
  they take, each layer's reference for the rest (training with grad, tensors off the CPU).

Adding a backend is one subclass here; no layer changes.
"""

from __future__ import annotations

import torch

BACKENDS = ("torch", "cpp")


class Backend:
    """The torch reference: every method runs the layer's own `reference` body."""

    name = "torch"
    kernels = None  # the compiled module of a kernel backend

    def kda(self, layer, x: torch.Tensor, batch, cache) -> torch.Tensor:
        return layer.reference(x, batch, cache)

    def mla(self, layer, x: torch.Tensor, batch, cache) -> torch.Tensor:
        return layer.reference(x, batch, cache)

    def reset(self) -> None:
        """Forget cached weight packs (after a load or a move of the model's weights)."""


TORCH = Backend()


def select(mode: str) -> Backend:
    """The backend for a kernels mode ("auto": the compiled kernels if they build, "cpp": or
    raise, "torch": the reference). Engine placement has already turned "auto" on a GPU into
    "torch" (engine/setup.py kernel_mode)."""
    from k3serve import kernels

    module = kernels.get(mode)
    if module is None:
        return TORCH
    from k3serve.backends.cpu import CpuKernels

    return CpuKernels(module)
