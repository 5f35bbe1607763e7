"""Architecture name -> model class, and the one-call `load_model`."""

from __future__ import annotations

from pathlib import Path

import torch

from k3serve.config.bundled import load_model_config
from k3serve.config.model_config import ModelConfig
from k3serve.config.parse import ConfigError
from k3serve.parallel.group import NO_TP, TPGroup
from k3serve.models.kimi import KimiForCausalLM

MODEL_REGISTRY = {
    "KimiK3ForConditionalGeneration": KimiForCausalLM,
    "KimiK3ForCausalLM": KimiForCausalLM,
    "KimiLinearForCausalLM": KimiForCausalLM,
}


def build_model(
    cfg: ModelConfig, dtype: torch.dtype = torch.float32, tp: TPGroup = NO_TP, ep: TPGroup | None = None, pipe=None
) -> KimiForCausalLM:
    """`tp`: the tensor-parallel group this rank's model is built for (its share of the heads,
    channels or experts); `ep`: DP-attention's expert group (routed experts by id over the
    data-parallel ranks); `pipe`: its pipeline stage (parallel/pipe.py); the default is the
    whole single-process model."""
    cls = MODEL_REGISTRY.get(cfg.architecture)
    if cls is None:
        raise ConfigError("architectures", f"{cfg.architecture!r} is not supported; known: {sorted(MODEL_REGISTRY)}")
    return cls(cfg, tp, ep, pipe).to(dtype).eval()


ON_LOAD = ("mxfp4", "nvfp4")  # what --quantization can make of an unquantized checkpoint's experts


def quantized_config(cfg: ModelConfig, quantization: str | None, tp: TPGroup = NO_TP, ep=None) -> ModelConfig:
    """The config a model is built as: the checkpoint's, or with `quantization` on an unquantized
    one, the converted checkpoint's (weights/convert.py writes the same quantization_config)."""
    if quantization not in ON_LOAD or cfg.quant is not None:
        return cfg  # a quantized checkpoint's own format (engine/startup.py check_quantization)
    if quantization == "nvfp4" and tp.size > 1 and not tp.expert_parallel and ep is None:
        raise ValueError(
            "--quantization nvfp4 at load with experts split by channel over the tensor-parallel ranks: "
            "NVFP4's global scale is per whole matrix; add --enable-expert-parallel, or convert the "
            "checkpoint first (k3serve convert --experts nvfp4)"
        )
    import dataclasses

    from k3serve.config.quant_config import mxfp4_quantization_config, nvfp4_quantization_config, parse_quant_config

    raw = mxfp4_quantization_config() if quantization == "mxfp4" else nvfp4_quantization_config()
    return dataclasses.replace(cfg, quant=parse_quant_config(raw))


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    load_format: str = "auto",
    progress: bool = True,
    tp: TPGroup = NO_TP,
    ep: TPGroup | None = None,
    device: str | torch.device = "cpu",
    stats=None,
    pipe=None,
    quantization: str | None = None,
) -> KimiForCausalLM:
    """This rank's model for (`tp`, `ep`) on `device`. The model is built on the meta device
    (nothing allocated) and each weight it keeps is read from the files' mmap, only its slice,
    straight to `device` (parallel/rank_load.py; `stats`: a ReadStats counting the bytes read).
    `load_format` fastsafetensors reads whole files through that library instead, then keeps
    this rank's share. `quantization` "mxfp4" / "nvfp4" on a checkpoint without a
    quantization_config: its routed experts are quantized as they are read (weights/convert.py's
    bytes, without a second copy on disk); the model is built as the converted checkpoint's."""
    from k3serve.parallel.rank_load import rank_weights
    from k3serve.config.stages import on_stage
    from k3serve.parallel.shard import shard_weights
    from k3serve.weights.loader import LOAD_FORMATS, load_weights

    cfg = load_model_config(path)  # what the files hold: the reader's
    model_cfg = quantized_config(cfg, quantization, tp, ep)  # what the model is built as
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_format!r} is not supported; choose one of {LOAD_FORMATS}")
    stage = pipe.stage if pipe is not None else None
    if load_format == "fastsafetensors":
        model = build_model(
            model_cfg, dtype, tp, ep, pipe
        )  # first: its layers name a dimension the TP size does not divide
        weights = load_weights(path, cfg, load_format=load_format, progress=progress)
        weights = {k: w for k, w in weights.items() if on_stage(k, cfg, stage)}
        model.load_weights(shard_weights(weights, cfg, tp, ep))
        return model.to(device)
    with torch.device("meta"):
        model = build_model(model_cfg, dtype, tp, ep, pipe)
    model.load_weights(rank_weights(path, cfg, tp, ep, torch.device(device), stats, progress, stage))
    return model
