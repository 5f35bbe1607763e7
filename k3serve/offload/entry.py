"""Tier entries on disk: a safetensors file (a *pack*: the blocks one step published, or one KDA
state) whose metadata carries the format version, the model fingerprint, the kind and keys of
its entries and a SHA-256 over its tensors' bytes; entry `k`'s tensors are named `{k}.{name}`. A file that is torn
or truncated (no parse), bit-flipped (checksum), from another model or cache layout
(fingerprint), or whose tensors are not the ones the cache expects (names, shapes, dtypes) is
refused with an `EntryError` naming the file and the tensor: it is dropped and recomputed,
never served. Writes go to a temporary file renamed into place, so a reader never sees a
partial one under the final name.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from k3serve.cache.tiers import Key

FORMAT = "k3serve-prefix-pack-1"


class EntryError(ValueError):
    pass


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).reshape(-1).numpy().data)
    return h.hexdigest()


def write_pack(path: Path, kind: str, entries: dict[str, dict[str, torch.Tensor]], fingerprint: str) -> int:
    """Write entries {key hex: {name: tensor}} as one file, atomically; its size in bytes."""
    cpu = {f"{k}.{n}": t.contiguous().cpu() for k, named in entries.items() for n, t in named.items()}
    meta = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "kind": kind,
        "keys": ",".join(entries),
        "sha256": checksum(cpu),
    }
    data = st_save(cpu, metadata=meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:  # a full disk: no partial file stays behind (414 once filled a tier)
        tmp.unlink(missing_ok=True)
        raise
    return len(data)


def pack_bytes(tensors: list[torch.Tensor]) -> int:
    """At least the size of the pack `write_pack` makes of these tensors: their bytes, the
    safetensors header's entry per tensor (name, dtype, shape, offsets: under 256 bytes for
    our names) and the metadata (64 hex digits of sha256, 33 characters a key)."""
    return sum(t.numel() * t.element_size() for t in tensors) + 256 * len(tensors) + 512 + 40 * len(tensors)


def pack_keys(path: Path) -> tuple[str, list[str]]:
    """(kind, key hexes) from a pack's header alone; ("", []) when it cannot be read."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            meta = json.loads(f.read(min(n, 1 << 24))).get("__metadata__") or {}
        keys = [k for k in meta.get("keys", "").split(",") if k]
        return str(meta.get("kind", "")), keys
    except (OSError, ValueError, struct.error):
        return "", []


def read_pack(
    path: Path, fingerprint: str, kind: str, keys: list[str], expect: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> dict[str, dict[str, torch.Tensor]]:
    """The pack's entries {key hex: {name: tensor}}, checked against everything above (each
    entry holding exactly `expect`'s tensors); EntryError otherwise."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise EntryError(f"{path}: unreadable ({e})") from e
    try:
        (n,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
        tensors = st_load(data)
    except Exception as e:  # noqa: BLE001 - any parse failure is a torn or foreign file
        raise EntryError(f"{path}: not a complete safetensors file ({type(e).__name__}: {e})") from e
    if meta.get("format") != FORMAT or meta.get("fingerprint") != fingerprint or meta.get("kind") != kind:
        raise EntryError(
            f"{path}: written for another model, cache layout or format "
            f"(fingerprint {meta.get('fingerprint')!r}, this engine's {fingerprint!r})"
        )
    if meta.get("keys", "").split(",") != keys:
        raise EntryError(f"{path}: holds other entries than its header said")
    want = {f"{k}.{name}": spec for k in keys for name, spec in expect.items()}
    for name, (shape, dtype) in want.items():
        t = tensors.get(name)
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            got = "missing" if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise EntryError(f"{path}: tensor {name!r} is {got}, the cache needs {tuple(shape)} {dtype}")
    if set(tensors) != set(want):
        raise EntryError(f"{path}: unexpected tensors {sorted(set(tensors) - set(want))[:3]}")
    if checksum(tensors) != meta.get("sha256"):
        raise EntryError(f"{path}: checksum mismatch (a flipped bit or a partial write)")
    return {k: {name: tensors[f"{k}.{name}"] for name in expect} for k in keys}


def model_fingerprint(model_dir: str | Path, **layout) -> str:
    """What an entry must match to be served: the checkpoint (config, every shard's size and
    header, and 64 KiB samples of its data at the start, middle and end: a retrained model of
    the same shapes differs there) and the cache layout (dtype, cache dtype, block size, tensor
    parallel size, ...). 16 hex digits."""
    root = Path(model_dir)
    h = hashlib.sha256(FORMAT.encode())
    h.update(json.dumps(layout, sort_keys=True, default=str).encode())
    cfg = root / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for shard in sorted(root.glob("*.safetensors")):
        size = shard.stat().st_size
        h.update(f"{shard.name}:{size}".encode())
        with open(shard, "rb") as f:
            head = f.read(8)
            h.update(head)
            if len(head) == 8:
                (n,) = struct.unpack("<Q", head)
                h.update(f.read(min(n, 1 << 24)))
            for at in (0.0, 0.5, 1.0):
                f.seek(max(0, int((size - 65536) * at)))
                h.update(f.read(65536))
    return h.hexdigest()[:16]


def pack_index_keys(path: Path, kind: str) -> list[Key]:
    """The keys a pack's header names; a pack whose header cannot be read is indexed under its
    name (its first key), so the lookup that reaches it rejects and deletes it; a file that is
    neither is not ours: []."""
    got, keys = pack_keys(path)
    for names in (keys if got == kind else [], [path.stem]):
        try:
            out = [(kind, bytes.fromhex(k)) for k in names]
        except ValueError:
            continue
        if out and all(len(h) == 16 for _, h in out):
            return out
    return []
