"""`vllm serve` flags a K3 user's launch script is likely to pass, beyond the ones k3serve
implements under the same name (launch.py).

Each is either accepted because it already holds here (a no-op, logged once at start-up) or
refused with the reason, so a vLLM launch line never dies with "unrecognized arguments" and
never silently means something else. Reference: `vllm serve --help` (EngineArgs,
FrontendArgs), vLLM 0.11-0.13.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class VllmFlag:
    flag: str
    takes_value: bool
    note: str  # why it is a no-op here, or why it is refused
    refuse: bool = False
    allowed: tuple[str, ...] = ()  # values that are fine (the rest refused); empty: any value
    secret: bool = False  # its value is never logged


FLAGS = [
    VllmFlag(
        "--disable-custom-all-reduce",
        False,
        "tensor parallelism all-reduces through the process group "
        "(gloo); there is no custom all-reduce kernel to turn off",
    ),
    VllmFlag("--swap-space", True, "k3serve preempts by recompute and never swaps to CPU"),
    VllmFlag("--cpu-offload-gb", True, "weight offloading is not built", refuse=True, allowed=("0",)),
    VllmFlag(
        "--mm-processor-kwargs",
        True,
        "images and video are processed as the checkpoint's own processor "
        "does (MoonViT patches, 2 fps video chunks); its settings cannot be overridden",
        refuse=True,
    ),
    VllmFlag(
        "--tokenizer-revision",
        True,
        "the tokenizer is read from the model's own revision (--revision): a separate one is not supported",
        refuse=True,
    ),
    VllmFlag(
        "--async-scheduling",
        False,
        "the engine schedules between steps on its own thread; nothing "
        "overlaps the forward, so the flag changes nothing",
    ),
    VllmFlag(
        "--max-num-partial-prefills",
        True,
        "several requests' prefill chunks share a step within "
        "--max-num-batched-tokens; there is no separate cap on how many",
        refuse=True,
        allowed=(),
    ),
    VllmFlag(
        "--tokenizer-mode",
        True,
        "the tokenizer is read from the checkpoint (tiktoken or tokenizer.json)",
        allowed=("auto", "slow", "fast"),
    ),
    VllmFlag("--disable-frontend-multiprocessing", False, "the API server and engine share one process"),
    VllmFlag("--enable-prompt-tokens-details", False, "usage always reports cached prompt tokens"),
    VllmFlag("--disable-fastapi-docs", False, "k3serve never serves /docs or /redoc"),
    VllmFlag("--lora-modules", True, "LoRA adapters are not supported", refuse=True),
    VllmFlag("--enable-lora", False, "LoRA adapters are not supported", refuse=True),
    VllmFlag(
        "--rope-scaling", True, "context length comes from the checkpoint's config; no rope override", refuse=True
    ),
    VllmFlag("--hf-overrides", True, "config overrides are not supported: edit config.json", refuse=True),
]
BY_FLAG = {f.flag: f for f in FLAGS}


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    for f in FLAGS:
        dest = "vllm_" + f.flag.lstrip("-").replace("-", "_")
        if f.takes_value:
            p.add_argument(f.flag, dest=dest, help=argparse.SUPPRESS)
        else:
            p.add_argument(f.flag, dest=dest, action="store_true", default=None, help=argparse.SUPPRESS)


def check_vllm_flags(args: argparse.Namespace) -> list[str]:
    """Raise ValueError for a refused flag; return one line per accepted no-op (for the log)."""
    notes = []
    for f in FLAGS:
        value = getattr(args, "vllm_" + f.flag.lstrip("-").replace("-", "_"), None)
        if value is None:
            continue
        shown = f"{f.flag} {'***' if f.secret else value}" if f.takes_value else f.flag
        if f.allowed and str(value) in f.allowed:
            notes.append(f"{shown}: accepted, {f.note}")
        elif f.refuse or f.allowed:
            raise ValueError(f"{shown}: not supported: {f.note}")
        else:
            notes.append(f"{shown}: accepted, {f.note}")
    return notes
