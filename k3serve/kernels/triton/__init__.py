"""GPU kernels in Triton (issue 52): KDA decode/verify (fla-core's `fused_recurrent_kda` and a
short-convolution update of our own), paged MLA decode over the 576-wide latent rows, and the
MXFP4/bf16 MoE grouped GEMM. `ops.py` registers them as `torch.library` custom ops with fakes;
the `triton` backend (backends/triton.py) runs the graph step with them.

On CUDA they compile; on a CPU only Triton's interpreter runs them (`TRITON_INTERPRET=1`, read
when a kernel is decorated, so before these modules are imported): that is how the suite
checks them against the torch references on this machine.
"""

from __future__ import annotations

import os

TRITON_PIN = "triton==3.8.0"


def unavailable(device_type: str) -> str | None:
    """Why the Triton kernels cannot run for tensors on `device_type`, or None when they can."""
    try:
        import triton  # noqa: F401
        import fla  # noqa: F401
    except ImportError as e:
        return f"kernels='triton' needs Triton and fla-core ({e.name} is missing): pip install {TRITON_PIN} fla-core==0.6.0"
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        return (
            "kernels='triton' runs on a CPU only under Triton's interpreter (TRITON_INTERPRET=1, slow: "
            "for testing); use kernels='graph' or 'cpp' here"
        )
    return None
