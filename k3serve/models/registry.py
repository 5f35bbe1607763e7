"""Architecture name -> model class, and the one-call `load_model`."""

from __future__ import annotations

from pathlib import Path

import torch

from k3serve.config.bundled import load_model_config
from k3serve.config.model_config import ModelConfig
from k3serve.config.parse import ConfigError
from k3serve.models.kimi import KimiForCausalLM

MODEL_REGISTRY = {
    "KimiK3ForConditionalGeneration": KimiForCausalLM,
    "KimiK3ForCausalLM": KimiForCausalLM,
    "KimiLinearForCausalLM": KimiForCausalLM,
}


def build_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> KimiForCausalLM:
    cls = MODEL_REGISTRY.get(cfg.architecture)
    if cls is None:
        raise ConfigError("architectures", f"{cfg.architecture!r} is not supported; known: {sorted(MODEL_REGISTRY)}")
    return cls(cfg).to(dtype).eval()


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, load_format: str = "auto",
               progress: bool = True) -> KimiForCausalLM:
    from k3serve.weights.loader import load_weights

    cfg = load_model_config(path)
    weights = load_weights(path, cfg, load_format=load_format, progress=progress)
    model = build_model(cfg, dtype)
    model.load_weights(weights)
    return model
