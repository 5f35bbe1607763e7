"""CheckpointIndex: tensor metadata from safetensors headers, without loading any data.

A safetensors file is an 8-byte little-endian header length, a JSON header
`{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`, then the data.
Sharded checkpoints add `model.safetensors.index.json` = `{metadata.total_size, weight_map}`
(HF convention; K3 ships 96 shards, k3-model-spec.md §8.1). Every structural problem is
reported with the tensor and the file it concerns, before any weight is read.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from k3serve.weights.errors import BadIndexError, CheckpointError, TruncatedShardError
from k3serve.weights.schema import DTYPE_BYTES

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_MAX_HEADER = 256 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in `file`
    nbytes: int


@dataclass(frozen=True)
class CheckpointIndex:
    root: Path
    tensors: dict[str, TensorInfo]

    @property
    def files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors.values()})

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @classmethod
    def open(cls, root: str | Path) -> "CheckpointIndex":
        root = Path(root)
        if (root / INDEX_NAME).is_file():
            return cls(root, _read_sharded(root))
        if (root / SINGLE_NAME).is_file():
            return cls(root, read_header(root / SINGLE_NAME))
        shards = sorted(root.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"no {INDEX_NAME}, {SINGLE_NAME} or *.safetensors in {root}", file=str(root))
        tensors: dict[str, TensorInfo] = {}
        for f in shards:
            for name, info in read_header(f).items():
                if name in tensors:
                    raise BadIndexError(
                        f"tensor stored twice ({tensors[name].file.name} and {f.name})", tensor=name, file=str(f)
                    )
                tensors[name] = info
        return cls(root, tensors)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and bounds-check one safetensors header."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise TruncatedShardError("file is shorter than the 8-byte header length", file=str(path))
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise TruncatedShardError(f"header length {n} exceeds the file size {size}", file=str(path))
            raw = fh.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read shard: {e}", file=str(path)) from e
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"safetensors header is not valid JSON: {e}", file=str(path)) from e
    header.pop("__metadata__", None)
    data_start = 8 + n
    return {name: _tensor_info(name, meta, path, data_start, size) for name, meta in header.items()}


def _tensor_info(name: str, meta: dict, path: Path, data_start: int, size: int) -> TensorInfo:
    try:
        dtype, shape = meta["dtype"], tuple(int(s) for s in meta["shape"])
        begin, end = (int(x) for x in meta["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"malformed header entry: {e}", tensor=name, file=str(path)) from e
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"unknown dtype {dtype}", tensor=name, file=str(path))
    want = DTYPE_BYTES[dtype]
    for s in shape:
        want *= s
    if end - begin != want:
        raise CheckpointError(
            f"data_offsets span {end - begin} B but {dtype}{list(shape)} needs {want} B", tensor=name, file=str(path)
        )
    if data_start + end > size:
        raise TruncatedShardError(
            f"data ends at byte {data_start + end} but the file has {size} B (truncated download?)",
            tensor=name,
            file=str(path),
        )
    return TensorInfo(name, path, dtype, shape, data_start + begin, want)


def check_shard_name(fname, index_path: Path | str, tensor: str | None = None) -> None:
    """A weight_map entry must name a file inside the checkpoint's folder: the index comes with
    the checkpoint (a download, a hub repo), and `../x` or `/abs/x` would have the server read
    and serve any safetensors file it can open. Checked on the name, not on the resolved path:
    a hub snapshot's shards are symlinks into the cache's blobs folder, outside the snapshot.
    Any `..` is refused, even one that looks as if it stayed inside: after a symlinked folder
    (`sub/../x`) the system resolves it elsewhere than the string says."""
    path = PurePosixPath(fname) if isinstance(fname, str) else None
    if path is None or not fname or "\0" in fname:
        raise BadIndexError(
            f"weight_map names the shard {fname!r}: not a file name", tensor=tensor, file=str(index_path)
        )
    if path.is_absolute() or ".." in path.parts:
        raise BadIndexError(
            f"weight_map names the shard {fname!r}, outside the checkpoint's folder (absolute or through "
            "'..'): refused; shards must sit in the checkpoint's folder",
            tensor=tensor,
            file=str(index_path),
        )


def _read_sharded(root: Path) -> dict[str, TensorInfo]:
    index_path = root / INDEX_NAME
    try:
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise BadIndexError(f"unreadable index: {e}", file=str(index_path)) from e
    by_file: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        check_shard_name(fname, index_path, tensor=name)
        by_file.setdefault(fname, []).append(name)
    for fname, names in sorted(by_file.items()):
        if not (root / fname).is_file():
            raise BadIndexError(
                f"index maps {len(names)} tensors to a missing shard", tensor=names[0], file=str(root / fname)
            )
    tensors: dict[str, TensorInfo] = {}
    for fname, names in sorted(by_file.items()):
        shard = root / fname
        header = read_header(shard)
        for name in names:
            if name not in header:
                raise BadIndexError(
                    "index says the tensor is in this shard but its header lacks it", tensor=name, file=str(shard)
                )
            tensors[name] = header[name]
        extra = sorted(set(header) - set(names))
        if extra:
            raise BadIndexError("shard holds a tensor the index does not list", tensor=extra[0], file=str(shard))
    return tensors
