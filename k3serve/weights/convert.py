"""`k3serve convert SRC DST`: a bf16 / fp32 checkpoint (a folder or a hub id) with its routed
experts packed 4-bit, MXFP4 (K3's own compressed-tensors `mxfp4-pack-quantized`: E2M1 + an
E8M0 scale per 32) or NVFP4 (`nvfp4-pack-quantized`: E2M1 + E4M3 per 16 + a global scale), and
every other tensor as it was: the layout vLLM and k3serve load (issue 64 item 1; the 8-bit
dense weights are not built yet). Kimi-Linear-48B-A3B in bf16 is ~98 GB; its routed experts
are ~96% of it (47.1 B params), so MXFP4 makes it ~29 GB, what a 48-64 GB workstation holds.

Streaming, one tensor at a time, so resident memory stays a small multiple of the largest
expert matrix whatever the checkpoint's size: each output shard mirrors a source shard; its
safetensors header is written first (the packed shapes follow from the source's), then each
tensor's bytes as they are made. Tensors passed through are copied in 64 MiB chunks with
plain reads (no mmap: mapped pages would count as resident), an expert matrix is read,
quantized (weights/mxfp4.py, weights/nvfp4.py: bit-exact with compressed-tensors' own rules)
and written, and nothing is kept.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from k3serve.config.model_config import ModelConfig
from k3serve.config.quant_config import mxfp4_quantization_config, nvfp4_quantization_config
from k3serve.weights.checkpoint import INDEX_NAME, CheckpointIndex, TensorInfo
from k3serve.weights.schema import model_tensor_specs

CHUNK = 64 * 2**20  # bytes copied at a time for a tensor passed through
_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
SCHEMES = ("mxfp4", "nvfp4")


@dataclass
class Entry:
    """One output tensor: its header fields and what writes its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    write: Callable  # (file) -> None


@dataclass
class Report:
    tensors: int
    quantized: int
    bytes_in: int
    bytes_out: int
    seconds: float


def convert(src: str | Path, dst: str | Path, scheme: str = "mxfp4", progress: bool = True) -> Report:
    """Write `src`'s checkpoint to `dst` with its routed experts packed `scheme`."""
    if scheme not in SCHEMES:
        raise ValueError(f"--experts must be one of {SCHEMES}, got {scheme!r}")
    src, dst = Path(src), Path(dst)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst} exists and is not empty: convert writes a new checkpoint folder")
    raw = json.loads((src / "config.json").read_text())
    text = raw.get("text_config", raw)
    if text.get("quantization_config") is not None:
        raise ValueError(
            f"{src / 'config.json'} already has a quantization_config: convert takes bf16 / fp32 checkpoints"
        )
    text["quantization_config"] = mxfp4_quantization_config() if scheme == "mxfp4" else nvfp4_quantization_config()
    cfg = ModelConfig.from_dict(raw)
    experts = {s.name[: -len("_packed")] for s in model_tensor_specs(cfg) if s.role == "packed"}  # "<module>.weight"
    index = CheckpointIndex.open(src)
    missing = sorted(experts - index.tensors.keys())
    if missing:
        raise ValueError(
            f"{src}: routed expert weight {missing[0]} (and {len(missing) - 1} more) not in the checkpoint"
        )
    for name in experts:
        info = index.tensors[name]
        if info.dtype not in _TORCH:
            raise ValueError(f"{info.file.name}: {name} is {info.dtype}; convert packs BF16 / F16 / F32 weights")
    dst.mkdir(parents=True, exist_ok=True)
    started, done, total = time.perf_counter(), 0, index.total_bytes
    weight_map, out_bytes, quantized = {}, 0, 0
    for f in index.files:
        entries = list(
            _entries(
                sorted((t for t in index.tensors.values() if t.file == f), key=lambda t: t.offset), experts, scheme
            )
        )
        _write_shard(dst / f.name, entries)
        for e in entries:
            weight_map[e.name] = f.name
            out_bytes += e.nbytes
        quantized += sum(1 for e in entries if e.name.endswith(".weight_packed"))
        done += sum(t.nbytes for t in index.tensors.values() if t.file == f)
        if progress:
            _progress(done, total, started)
    index_doc = {"metadata": {"total_size": out_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / INDEX_NAME).write_text(json.dumps(index_doc, indent=2))
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    for extra in sorted(src.iterdir()):  # tokenizer, generation config, chat template ...
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json", INDEX_NAME):
            shutil.copyfile(extra, dst / extra.name)
    if progress:
        print(file=sys.stderr)
    return Report(len(weight_map), quantized, total, out_bytes, time.perf_counter() - started)


def _entries(infos: list[TensorInfo], experts: set[str], scheme: str) -> Iterator[Entry]:
    for info in infos:
        if info.name not in experts:
            yield Entry(info.name, info.dtype, info.shape, info.nbytes, lambda fh, i=info: _copy(i, fh))
            continue
        module = info.name[: -len(".weight")]
        out, inp = info.shape
        made: dict[str, torch.Tensor] = {}  # the packed matrix's parts, made by the first of them

        def part(key, i=info, made=made):
            if not made:
                made.update(_pack(_read(i), scheme))
            return made.pop(key)

        yield Entry(module + ".weight_packed", "U8", (out, inp // 2), out * inp // 2, _writer(part, "packed"))
        if scheme == "mxfp4":
            yield Entry(module + ".weight_scale", "U8", (out, inp // 32), out * inp // 32, _writer(part, "scale"))
        else:
            yield Entry(module + ".weight_scale", "F8_E4M3", (out, inp // 16), out * inp // 16, _writer(part, "scale"))
            yield Entry(module + ".weight_global_scale", "F32", (1,), 4, _writer(part, "global_scale"))


def _writer(part: Callable, key: str) -> Callable:
    return lambda fh: fh.write(part(key).contiguous().view(torch.uint8).numpy().tobytes())


def _pack(w: torch.Tensor, scheme: str) -> dict[str, torch.Tensor]:
    """w [out, in] float -> the packed parts, as the checkpoint stores them."""
    if scheme == "mxfp4":
        from k3serve.weights.mxfp4 import PackedMXFP4

        p = PackedMXFP4.quantize(w.float())
        return {"packed": p.packed, "scale": p.scale}
    from k3serve.weights.nvfp4 import PackedNVFP4

    p = PackedNVFP4.quantize(w.float())
    return {"packed": p.packed, "scale": p.scale, "global_scale": p.global_scale.reshape(1).float()}


def _read(info: TensorInfo) -> torch.Tensor:
    """One tensor from its file's bytes (a plain read, no mmap)."""
    with info.file.open("rb") as fh:
        fh.seek(info.offset)
        data = bytearray(fh.read(info.nbytes))
    return torch.frombuffer(data, dtype=_TORCH[info.dtype]).reshape(info.shape)


def _copy(info: TensorInfo, out) -> None:
    with info.file.open("rb") as fh:
        fh.seek(info.offset)
        left = info.nbytes
        while left:
            chunk = fh.read(min(CHUNK, left))
            if not chunk:
                raise ValueError(f"{info.file.name}: {info.name} is cut short")
            out.write(chunk)
            left -= len(chunk)


def _write_shard(path: Path, entries: list[Entry]) -> None:
    """The header from the entries' shapes, then each one's bytes in order; `path` appears
    whole (written beside it, then renamed)."""
    header, at = {"__metadata__": {"format": "pt"}}, 0
    for e in entries:
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [at, at + e.nbytes]}
        at += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data to 8 bytes
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as fh:
            fh.write(struct.pack("<Q", len(blob)))
            fh.write(blob)
            for e in entries:
                start = fh.tell()
                e.write(fh)
                if fh.tell() - start != e.nbytes:
                    raise RuntimeError(f"{e.name}: wrote {fh.tell() - start} bytes, its header says {e.nbytes}")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _progress(done: int, total: int, started: float) -> None:
    rate = done / max(time.perf_counter() - started, 1e-9) / 2**20
    print(
        f"\rconverting: {done / 2**30:.2f} / {total / 2**30:.2f} GiB ({100 * done / max(total, 1):.0f}%, {rate:.0f} MiB/s)",
        end="",
        file=sys.stderr,
    )
