"""The GPU check's first stage (bench/gpu_check.py): the versions found, the device's facts, and
what the stages import but this Python lacks, with the two lines that carry its wheels to a
machine without network. Exits 2 when the check cannot run: something missing, or no CUDA device
(unless --cpu, the dry run's). Module level is stdlib only, so that it runs, and reports,
whatever is missing.

    python bench/gpu_preflight.py [--json PATH] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# what the stages import, tried for real (xgrammar's own imports by name: a --no-deps install lacks
# them); fla's package only: fla.ops imports every op of fla's, 4-5 s, which the stages that use it pay
NEEDED = (
    "torch triton k3serve.engine.llm fla einops xgrammar tvm_ffi pydantic pydantic_core annotated_types "
    "typing_inspection pytest hypothesis jsonschema"
).split()
PIP = {"fla": "fla-core", "tvm_ffi": "apache-tvm-ffi"}  # else the module's name, "_" as "-"
# pins of pydantic's own dependencies, which pyproject.toml does not name (pydantic 2.14.4 pins its core)
PINS = {"pydantic-core": "2.50.5", "annotated-types": "0.8.0", "typing-inspection": "0.4.5"}
WITH_TORCH = ("torch", "triton")  # a CUDA build of torch brings its own Triton: never a carried wheel


def pins() -> dict[str, str]:
    found = re.findall(r'"([A-Za-z0-9_.\-]+)==([^";\s]+)"', (ROOT / "pyproject.toml").read_text())
    return {**PINS, **{name.lower().replace("_", "-"): version for name, version in found}}


def preflight(path: Path, cpu: bool) -> int:
    """2 when the check cannot run, else 0; the facts into `path`. A module installed but failing
    to import is reported, not a stop: the stages that need it fail and say why."""
    import importlib
    import importlib.metadata as md
    import platform

    missing, broken = {}, []
    for module in NEEDED:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:  # e.name: the module actually absent (a dependency of `module`?)
            top = (e.name or module).split(".")[0]
            missing.setdefault(PIP.get(top, top.replace("_", "-")), module)
        except Exception as e:  # installed but failing (a CUDA library, a Triton version): no wheel fixes it
            broken.append(f"{module}: {type(e).__name__}: {e}")
    facts = {"python": platform.python_version()}
    for dist in ("torch", "triton", "fla-core", "xgrammar"):
        try:
            facts[dist] = md.version(dist)
        except md.PackageNotFoundError:
            facts[dist] = None
    if "torch" in sys.modules:
        import torch

        facts.update(cuda=torch.version.cuda, count=torch.cuda.device_count())
        facts["gpus"] = [
            f"{p.name} ({p.total_memory / 2**30:.0f} GiB)"
            for p in map(torch.cuda.get_device_properties, range(facts["count"]))
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**facts, "missing": missing, "broken": broken}, indent=2))
    gpus = ", ".join(facts.get("gpus", [])) or "no GPU"
    print(
        f"{gpus}; torch {facts['torch']} (CUDA {facts.get('cuda')}), triton {facts['triton']}, "
        f"fla-core {facts['fla-core']}, xgrammar {facts['xgrammar']}, Python {facts['python']}",
        flush=True,
    )
    for line in broken:
        print(f"preflight: broken import, {line}")
    if missing:
        print("preflight: missing " + ", ".join(f"{pip} (import {mod})" for pip, mod in missing.items()))
        carried = [p for p in missing if p not in WITH_TORCH]
        if carried:
            pinned = pins()
            wheels = " ".join(f"{p}=={pinned[p]}" if p in pinned else p for p in carried)
            print(
                "  on the dev machine: python3 -m pip download --no-deps --only-binary=:all: "
                f"--python-version {sys.version_info.major}.{sys.version_info.minor} --implementation cp "
                "--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "
                f"-d .whl {wheels}\n"
                "  on the device: python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "
                ".whl/*.whl && export PYTHONPATH=/tmp/site"
            )
        if any(p in missing for p in WITH_TORCH):
            print("  torch / triton: a CUDA build of torch (it brings its Triton) installed on the device itself")
    if not cpu and not facts.get("count"):
        print(f"preflight: no CUDA device visible to torch {facts['torch']} (a CPU build?)")
    if missing or not (cpu or facts.get("count")):
        print("preflight: the check cannot run")
        return 2
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "gpu_preflight.json")
    p.add_argument("--cpu", action="store_true", help="no CUDA device needed (the dry run)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.exit(preflight(args.json, args.cpu))
