#!/usr/bin/env bash
# The GPU check, for a lent CUDA machine: bench/gpu_check.py (its stages, budget and results), run
# with PYTHON (default .venv/bin/python; on the device image `PYTHON=python3`); docs/benchmarks.md.
#
#   PYTHON=python3 bench/gpu_check.sh [--dry-run] [--only STAGE,...]
#
# K3SERVE_KERNELS=torch (the default here): no stage builds the C++ CPU kernels, which no layer on
# cuda calls; on the H200 image of the first run (torch 2.11.0+cu130, g++ 13.3) any
# torch.utils.cpp_extension module that formats an integer into a stream segfaulted, k3serve's
# among them. Set K3SERVE_KERNELS=auto to test them.
cd "$(dirname "$0")/.." || exit 1
export K3SERVE_KERNELS="${K3SERVE_KERNELS:-torch}"
exec "${PYTHON:-.venv/bin/python}" bench/gpu_check.py "$@"
