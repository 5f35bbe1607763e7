#!/usr/bin/env bash
# The GPU checks of issue 15, as one script for whenever a CUDA machine is at hand:
#
#   PYTHON=/path/to/python-with-cuda-torch bench/gpu_check.sh
#
# 1. the device: a CUDA torch build and a visible GPU (the project's pinned CPU wheel has none:
#    install torch==2.13.0 from a CUDA index into PYTHON's environment first, or use the
#    machine's own CUDA torch with the project's other dependencies installed beside it: the
#    first run used torch 2.11.0+cu130 with fastapi, pydantic, uvicorn, compressed-tensors,
#    xgrammar and fla-core carried as wheels, k3serve itself from the checkout on PYTHONPATH);
# 2. the engine's device suites: EngineConfig.device "auto" picks cuda when it is available, so
#    these tests run the model, both caches and the sampler there (the C++ decode kernels are
#    CPU-only; on cuda every layer takes its torch path, the reference the kernels are tested
#    against), plus the device/dtype placement test; engines take bf16 there (dtype "auto"),
#    K3SERVE_TEST_DTYPE=float32 runs the suites' engines in fp32 instead (tests/conftest.py);
#    and tests/model/test_kda_cuda.py: KDA's torch path on cuda against fla's Triton kernels
#    (chunk_kda, fused_recurrent_kda; needs fla-core);
# 3. decode benchmarks: bench/gpu_decode.py (vs_llamacpp's k3serve cells on cuda: 400 M
#    Kimi-Linear bf16 and MXFP4, tiny K3) and bench/generate_speed.py (tiny K3, fp32 and bf16);
#    bench/step_profile.py: one decode step's ops by module, top ops by device time, and its
#    host/device waits (the first run's ~20 ms a step is what that should explain);
#    bench/graph_decode.py (issue 46): the graph backend's captured decode against its eager
#    static step (greedy tokens equal at buckets 1, 4, 16, 64), tok/s at 1, 16, 64 streams against
#    the torch path, host waits a step; the graph tests (static step, custom ops, engine greedy
#    equality) run on cuda too, where their engines capture CUDA graphs. The other suites run
#    with K3SERVE_TEST_KERNELS=torch (tests/conftest.py), so their engines do not compile.
#    Issue 52: graph_decode also measures kernels="triton"; bench/triton_kernels.py times each
#    Triton kernel against the bytes it must read (the fraction of the device's bandwidth) at
#    the tiny, 400 M and Kimi-Linear-48B / K3 layer shapes; test_triton_engine.py's engines
#    compile the kernels for real on cuda (greedy equal to torch), and tests/kernels checks the
#    kernels' arithmetic under the interpreter there as here. test_nccl_group.py: a captured
#    NCCL group of one (the functional collectives of a compiled step replayed in a CUDA graph).
# 4. with TRAIN_DEMO=DIR (issue 22): the retrieval-first demo recipe on cuda into DIR, resumable
#    (checkpointed every 500 steps; rerun the same line to continue), stopped after
#    TRAIN_SECONDS (default 420, so it fits one device call), then the DSpark draft once done.
# K3SERVE_KERNELS=torch (the default here): no process of the check builds the CPU kernels, which
# no layer on cuda calls. On the H200 image this was first run on (2026-12-04: torch
# 2.11.0+cu130, g++ 13.3, Python 3.12) any torch.utils.cpp_extension module that formats an
# integer into a stream segfaults, k3serve's and a three-line load_inline one alike, whatever the
# flags; k3serve's kernels do that in their argument checks. Set K3SERVE_KERNELS=auto to test them.
# Durations on the first run (one H200, 16 cores): engine-tests 156 s (to the crash then fixed),
# kda-vs-fla 201 s (fla's Triton kernels compile and autotune), gpu-decode 74 s (builds the two
# 400 M checkpoints), generate-speed 16 s: one device call of ~8-9 minutes for all of it.
# Every stage runs even when one before it fails (one device call should say all it can);
# the script exits non-zero if any failed. Results: bench/results/*.json; the pytest logs and
# each stage's exit status (status.txt) under bench/results/gpu_check/.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
export K3SERVE_KERNELS="${K3SERVE_KERNELS:-torch}"
OUT=bench/results/gpu_check
mkdir -p "$OUT"
: >"$OUT/status.txt"
stage() {  # stage NAME LOG CMD...: run it into $OUT/LOG, note its exit status, carry on
  local name=$1 log=$2 t0=$SECONDS; shift 2
  "$@" 2>&1 | tee "$OUT/$log"
  local rc=${PIPESTATUS[0]}
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/status.txt"
}
"$PY" - <<'PYCODE' | tee "$OUT/device.txt" || exit 1
import torch
assert torch.cuda.is_available(), f"no CUDA device visible to torch {torch.__version__} (a CPU build?)"
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {p.name}, {p.total_memory / 2**30:.0f} GiB")
PYCODE
stage graph-decode graph_decode.txt "$PY" bench/graph_decode.py --kernels graph,triton
stage triton-kernels triton_kernels.txt "$PY" bench/triton_kernels.py
stage graph-tests graph_tests.log "$PY" -m pytest -q -p no:cacheprovider --durations=10 \
    tests/model/test_graph.py tests/model/test_graph_ops.py tests/engine/test_graph_engine.py \
    tests/engine/test_triton_engine.py tests/distributed/test_nccl_group.py
stage triton-interpreter triton_interpreter.log env TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider \
    tests/kernels
stage engine-tests pytest.log env K3SERVE_TEST_KERNELS=torch "$PY" -m pytest -q -p no:cacheprovider --durations=15 \
    --ignore=tests/engine/test_graph_engine.py tests/model/test_device.py tests/engine tests/spec
stage kda-vs-fla kda_cuda.log "$PY" -m pytest -q -s -p no:cacheprovider tests/model/test_kda_cuda.py
stage gpu-decode gpu_decode.txt "$PY" bench/gpu_decode.py ${GPU_DECODE_ONLY:+--only "$GPU_DECODE_ONLY"}
stage generate-speed generate_speed.txt "$PY" bench/generate_speed.py
stage step-profile step_profile.txt "$PY" bench/step_profile.py --kernels torch,graph
if [ -n "${TRAIN_DEMO:-}" ]; then
  "$PY" -m k3serve train-demo "$TRAIN_DEMO" --steps 30000 --drill-steps 6000 --device cuda --checkpoint-every 500 \
      --resume --no-draft --time-limit "${TRAIN_SECONDS:-420}" 2>&1 | tail -n 40 | tee "$OUT/train_demo.txt"
  if "$PY" -c "import sys, torch; sys.exit(torch.load(sys.argv[1], weights_only=False)['step'] < 30000)" \
      "$TRAIN_DEMO/train_state.pt"; then
    "$PY" -m k3serve train-demo "$TRAIN_DEMO" --draft-only 2>&1 | tail -n 5 | tee -a "$OUT/train_demo.txt"
  fi
fi
echo "gpu_check: done ($OUT)"
! grep -qv " rc=0 " "$OUT/status.txt"
