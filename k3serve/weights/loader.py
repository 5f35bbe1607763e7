"""Validate a checkpoint against its config, then stream it shard by shard (mmap).

Name rules (k3-model-spec.md §1.6, §3.1, §8): the `language_model.` prefix of K3 is dropped
so both models share canonical names (`model.layers.{i}...`, `lm_head.weight`);
`<module>.weight_packed` + `<module>.weight_scale` become one `PackedMXFP4` under
`<module>.weight` (with `<module>.weight_global_scale`, one `PackedNVFP4`); `A_log` keeps its
first `num_heads` entries (K3 pads it to 128).
All validation runs on headers before any data is read, so a bad checkpoint fails before
serving and no partial model is ever returned.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Union

import torch
from safetensors import safe_open
from tqdm import tqdm

from k3serve.config.model_config import ModelConfig
from k3serve.weights.checkpoint import CheckpointIndex, TensorInfo
from k3serve.weights.errors import (
    DtypeMismatchError,
    MissingTensorError,
    NonFiniteWeightError,
    ShapeMismatchError,
    UnexpectedTensorError,
)
from k3serve.weights.mxfp4 import PackedMXFP4
from k3serve.weights.nvfp4 import PackedNVFP4
from k3serve.weights.schema import FLOAT_DTYPES, TensorSpec, model_tensor_specs

logger = logging.getLogger(__name__)
# auto / safetensors: safetensors' mmap reader; fastsafetensors: the fastsafetensors library's
# threaded reader (GPUDirect Storage where cuFile is present, its no-GDS path otherwise)
LOAD_FORMATS = ("auto", "safetensors", "fastsafetensors")
FASTSAFETENSORS_PIN = "fastsafetensors==0.5.0"
Weight = Union[torch.Tensor, PackedMXFP4, PackedNVFP4]


def validate_checkpoint(index: CheckpointIndex, cfg: ModelConfig) -> list[TensorSpec]:
    """Check names, shapes and dtypes; return the specs of the tensors present."""
    specs = {s.name: s for s in model_tensor_specs(cfg, optional=True)}
    for name, info in index.tensors.items():
        if name not in specs:
            raise UnexpectedTensorError(_unexpected_hint(name, cfg), tensor=name, file=str(info.file))
    present = []
    for name, spec in specs.items():
        info = index.tensors.get(name)
        if info is None:
            if spec.vision or spec.optional:
                continue  # text-only exports may drop the tower; the text engine never reads it
            raise MissingTensorError(
                f"required by the config ({spec.dtype}{list(spec.shape)})", tensor=name, file=str(index.root)
            )
        _check_tensor(spec, info, cfg)
        present.append(spec)
    return present


def _unexpected_hint(name: str, cfg: ModelConfig) -> str:
    if cfg.tensor_prefix and not name.startswith(cfg.tensor_prefix) and name.startswith("model."):
        return f"not described by the config (kimi_k3 checkpoints prefix text tensors with '{cfg.tensor_prefix}')"
    return "not described by the config (wrong model or config?)"


def _check_tensor(spec: TensorSpec, info: TensorInfo, cfg: ModelConfig) -> None:
    where = dict(tensor=info.name, file=str(info.file))
    if spec.role in ("packed", "scale"):
        if info.dtype != spec.dtype:
            fmt = cfg.quant.scheme.upper() if cfg.quant is not None else "packed"
            raise DtypeMismatchError(f"{fmt} {spec.role} tensor must be {spec.dtype}, found {info.dtype}", **where)
    elif info.dtype not in FLOAT_DTYPES:
        raise DtypeMismatchError(f"expected a float tensor ({spec.dtype}), found {info.dtype}", **where)
    elif info.dtype == "F16" and spec.dtype != "F16":
        # float16 holds at most 65504 and loses bf16's range: a silent cast would turn large
        # weights to inf at load or serve them rounded; BF16 and F32 stay interchangeable
        raise DtypeMismatchError(
            f"stored as F16 where the config's dtype gives {spec.dtype}: float16 is not "
            "cast silently (re-export the tensor as BF16 or F32, or declare torch_dtype "
            "float16 in config.json)",
            **where,
        )
    if spec.name.endswith(".A_log"):
        ok = _a_log_ok(info.shape, cfg.kda.num_heads)
    elif spec.optional:  # a scalar scale: [1] as compressed-tensors writes it, or []
        ok = info.shape in ((), (1,))
    else:
        ok = info.shape == spec.shape
    if not ok:
        raise ShapeMismatchError(f"shape {list(info.shape)} but the config implies {list(spec.shape)}", **where)


def _a_log_ok(shape: tuple[int, ...], heads: int) -> bool:
    return (len(shape) == 1 and shape[0] >= heads) or shape == (1, 1, heads, 1)


def load_weights(
    path: str | Path,
    cfg: ModelConfig,
    *,
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    include_vision: bool = False,
    progress: bool = True,
) -> dict[str, Weight]:
    """Canonical name -> tensor (stored dtype) or PackedMXFP4."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format {load_format!r} is not supported; choose one of {LOAD_FORMATS}")
    index = CheckpointIndex.open(path)
    specs = validate_checkpoint(index, cfg)
    wanted = {s.name for s in specs if include_vision or not s.vision}
    by_file: dict[Path, list[str]] = {}
    for name in sorted(wanted):
        by_file.setdefault(index.tensors[name].file, []).append(name)
    files = sorted(by_file)
    shards = tqdm(files, desc="loading shards", unit="shard", disable=not progress or len(files) < 2)
    read = _read_fastsafetensors if load_format == "fastsafetensors" else _read_mmap
    raw: dict[str, torch.Tensor] = {}
    for f, name, t in read(shards, by_file, str(device)):
        check_finite(t, name, f)
        raw[name] = t
    return canonicalize(raw, cfg)


def _read_mmap(files, by_file: dict[Path, list[str]], device: str):
    """(file, name, tensor) through safetensors' mmap reader, a shard at a time."""
    for f in files:
        with safe_open(str(f), framework="pt", device=device) as fh:
            for name in by_file[f]:
                yield f, name, fh.get_tensor(name)


def _read_fastsafetensors(files, by_file: dict[Path, list[str]], device: str):
    """(file, name, tensor) through fastsafetensors, a shard at a time: its reader threads fill
    one buffer on `device` per shard (GPUDirect Storage on CUDA with cuFile, else its no-GDS
    path), and each wanted tensor is copied out before the buffer is freed."""
    try:
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup
        from fastsafetensors import cpp as fst_cpp
    except ImportError:
        raise ValueError(
            f"--load-format fastsafetensors needs the fastsafetensors library: pip install "
            f"{FASTSAFETENSORS_PIN} (or use --load-format safetensors)"
        ) from None
    dev = torch.device(device)
    gds = dev.type == "cuda" and bool(fst_cpp.is_cufile_found())
    loader = SafeTensorsFileLoader(
        SingleGroup(), str(dev) if dev.type != "cuda" else f"cuda:{dev.index or 0}", nogds=not gds, set_numa=False
    )
    try:
        for f in files:
            loader.add_filenames({0: [str(f)]})
            buf = loader.copy_files_to_device()
            try:
                for name in by_file[f]:
                    yield f, name, buf.get_tensor(name).clone()
            finally:
                buf.close()
                loader.reset()
    finally:
        loader.close()


E8M0_NAN = 0xFF
_SCALES = ("global_scale", "self_attn.k_scale", "self_attn.v_scale")  # float scales that divide


def check_finite(t: torch.Tensor, name: str, file: Path) -> None:
    """One reduction per tensor at load: NaN/Inf weights would poison every request's logits
    (and used to trip the sampler for all of them), so they stop start-up, named."""
    if t.dtype == torch.uint8:
        bad = name.endswith(".weight_scale") and bool((t == E8M0_NAN).any())
    elif t.dtype == torch.float8_e4m3fn:  # E4M3 has NaN (0x7F / 0xFF) and no Inf
        bad = bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    elif name.endswith(_SCALES):  # divides values: zero or negative is as bad as NaN
        bad = not bool((torch.isfinite(t) & (t > 0)).all())
    else:
        bad = t.is_floating_point() and not bool(torch.isfinite(t).all())
    if bad:
        what = "a scale must be finite and > 0" if name.endswith(_SCALES) else "weight holds NaN or Inf values"
        raise NonFiniteWeightError(what, tensor=name, file=str(file))


def canonicalize(raw: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, Weight]:
    prefix = cfg.tensor_prefix
    out: dict[str, Weight] = {}
    for name, t in raw.items():
        key = name[len(prefix) :] if prefix and name.startswith(prefix) else name
        if key.endswith((".weight_scale", ".weight_global_scale", ".input_global_scale")):
            continue  # read with their weight_packed (activation scales: W4A16, config/quant_config.py)
        if key.endswith(".weight_packed"):
            module = name[: -len(".weight_packed")]
            scale = raw[module + ".weight_scale"]
            if scale.dtype == torch.float8_e4m3fn:
                out[key[: -len("_packed")]] = PackedNVFP4(t, scale, raw[module + ".weight_global_scale"])
            else:
                out[key[: -len("_packed")]] = PackedMXFP4(t, scale)
        elif key.endswith(".A_log"):
            out[key] = t.reshape(-1)[: cfg.kda.num_heads].float().contiguous()
        else:
            out[key] = t
    return out
