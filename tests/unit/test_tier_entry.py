"""offload/entry.py packs on disk: a write that fails leaves no file; their size is bounded
by `pack_bytes`, which the directory's budget reserves before each write."""

import errno

import pytest
import torch

from k3serve.offload import entry
from k3serve.offload.entry import pack_bytes, read_pack, write_pack

ENTRIES = {
    f"{i:032x}": {"latent.1": torch.randn(16, 576), "recurrent.0": torch.randn(2, 8, 8).bfloat16()} for i in range(33)
}


def test_a_pack_is_never_larger_than_what_was_reserved(tmp_path):
    for n in (1, 2, 33):
        some = dict(list(ENTRIES.items())[:n])
        size = write_pack(tmp_path / "p.safetensors", "block", some, "f" * 16)
        assert size == (tmp_path / "p.safetensors").stat().st_size
        assert size <= pack_bytes([t for e in some.values() for t in e.values()])
        expect = {name: (tuple(t.shape), t.dtype) for name, t in ENTRIES[f"{0:032x}"].items()}
        assert read_pack(tmp_path / "p.safetensors", "f" * 16, "block", list(some), expect).keys() == some.keys()


def test_a_full_disk_leaves_no_temporary_file(tmp_path, monkeypatch):
    real_open = open

    class Full:  # writes half, then the disk is full
        def __init__(self, path, mode):
            self.f = real_open(path, mode)

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(entry, "open", Full, raising=False)  # the module's `open`, not the builtin
    with pytest.raises(OSError, match="No space"):
        write_pack(tmp_path / "p.safetensors", "block", ENTRIES, "f" * 16)
    assert list(tmp_path.iterdir()) == []
