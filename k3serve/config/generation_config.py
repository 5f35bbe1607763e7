"""Request defaults from a checkpoint's `generation_config.json` (`--generation-config`).

vLLM's meaning: with 'auto' the model's file supplies the sampling defaults a request does not
set (temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens becomes the default
max_tokens); 'vllm' uses none; a folder reads that folder's file. A request's own value
always wins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FIELDS = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "max_new_tokens": int,
}


def load_generation_defaults(spec: str, model_dir: str | Path | None) -> dict[str, Any]:
    if spec == "vllm":
        return {}
    if spec == "auto":
        path = Path(model_dir) / "generation_config.json" if model_dir is not None else None
        if path is None or not path.is_file():
            return {}
    else:
        path = Path(spec) / "generation_config.json"
        if not path.is_file():
            raise ValueError(
                f"--generation-config {spec!r}: expected 'auto', 'vllm' or a folder holding generation_config.json"
            )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    out = {}
    for key, kind in FIELDS.items():
        if raw.get(key) is None:
            continue
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise ValueError(f"{path}: {key} must be a number, got {value!r}")
        out["max_tokens" if key == "max_new_tokens" else key] = kind(value)
    if raw.get("do_sample") is False:  # transformers' greedy switch
        out["temperature"] = 0.0
    return out
