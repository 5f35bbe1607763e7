"""The Triton kernels' tests: skipped where Triton or fla-core is missing; on a CPU they run
under Triton's interpreter, which tests/conftest.py switches on before anything imports a
kernel (TRITON_INTERPRET is read when a kernel is decorated)."""

import pytest

pytest.importorskip("triton", reason="the Triton kernels need triton (pip install triton==3.8.0)")
pytest.importorskip("fla", reason="the KDA kernels need fla-core")
