#!/usr/bin/env bash
# The GPU checks of issue 15, as one script for whenever a CUDA machine is at hand:
#
#   PYTHON=/path/to/python-with-cuda-torch bench/gpu_check.sh
#
# 1. the device: a CUDA torch build and a visible GPU (the project's pinned CPU wheel has none:
#    install torch==2.13.0 from a CUDA index into PYTHON's environment first);
# 2. the engine's device suites: EngineConfig.device "auto" picks cuda when it is available, so
#    these tests run the model, both caches and the sampler there (the C++ decode kernels are
#    CPU-only; on cuda every layer takes its torch path, the reference the kernels are tested
#    against), plus the device/dtype placement test;
# 3. a short decode benchmark (bench/generate_speed.py: tiny K3, fp32 and bf16, batch 1);
# 4. with TRAIN_DEMO=DIR (issue 22): the retrieval-first demo recipe on cuda into DIR, resumable
#    (checkpointed every 500 steps; rerun the same line to continue), stopped after
#    TRAIN_SECONDS (default 420, so it fits one device call), then the DSpark draft once done.
# Results: bench/results/*.json; the pytest log and a summary under bench/results/gpu_check/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT=bench/results/gpu_check
mkdir -p "$OUT"
"$PY" - <<'PYCODE' | tee "$OUT/device.txt"
import torch
assert torch.cuda.is_available(), f"no CUDA device visible to torch {torch.__version__} (a CPU build?)"
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {p.name}, {p.total_memory / 2**30:.0f} GiB")
PYCODE
"$PY" -m pytest -q -x tests/model/test_device.py tests/engine tests/spec 2>&1 | tee "$OUT/pytest.log"
"$PY" bench/generate_speed.py 2>&1 | tee "$OUT/generate_speed.txt"
if [ -n "${TRAIN_DEMO:-}" ]; then
  "$PY" -m k3serve train-demo "$TRAIN_DEMO" --steps 30000 --drill-steps 6000 --device cuda --checkpoint-every 500 \
      --resume --no-draft --time-limit "${TRAIN_SECONDS:-420}" 2>&1 | tail -n 40 | tee "$OUT/train_demo.txt"
  if "$PY" -c "import sys, torch; sys.exit(torch.load(sys.argv[1], weights_only=False)['step'] < 30000)" \
      "$TRAIN_DEMO/train_state.pt"; then
    "$PY" -m k3serve train-demo "$TRAIN_DEMO" --draft-only 2>&1 | tail -n 5 | tee -a "$OUT/train_demo.txt"
  fi
fi
echo "gpu_check: done ($OUT)"
