"""Checkpoint reading: bit-exact round trip from the builder, and one test per failure mode."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3serve.config import load_model_config
from k3serve.testing.builder import build_tiny_checkpoint, random_weights
from k3serve.weights.checkpoint import CheckpointIndex
from k3serve.weights.errors import (
    BadIndexError,
    DtypeMismatchError,
    MissingTensorError,
    ShapeMismatchError,
    TruncatedShardError,
    UnexpectedTensorError,
)
from k3serve.weights.loader import load_weights
from k3serve.weights.mxfp4 import PackedMXFP4


def test_tiny_k3_loads_back_bit_exactly(tiny_k3_dir):
    cfg = load_model_config(tiny_k3_dir)
    loaded = load_weights(tiny_k3_dir, cfg, progress=False)
    written = random_weights(cfg, seed=0)
    text = {k: v for k, v in written.items() if k.startswith("language_model.")}
    n_checked = 0
    for name, t in text.items():
        key = name[len("language_model.") :]
        if key.endswith(".weight_scale"):
            continue
        if key.endswith(".weight_packed"):
            p = loaded[key.replace(".weight_packed", ".weight")]
            assert isinstance(p, PackedMXFP4)
            assert torch.equal(p.packed, t)
            assert torch.equal(p.scale, text[name.replace("_packed", "_scale")])
        elif key.endswith("A_log"):
            assert torch.equal(loaded[key], t[: cfg.kda.num_heads])
            assert torch.all(t[cfg.kda.num_heads :] == 0)
        else:
            assert loaded[key].dtype == t.dtype and torch.equal(loaded[key], t)
        n_checked += 1
    assert not any(k.startswith(("vision_tower", "mm_projector")) for k in loaded)
    assert len(loaded) == n_checked


def test_layout_is_the_real_one(tiny_k3_dir):
    files = sorted(p.name for p in tiny_k3_dir.glob("*.safetensors"))
    assert files[0] == "model-00001-of-000011.safetensors"  # 5-digit index, 6-digit total
    index = CheckpointIndex.open(tiny_k3_dir)
    assert index.tensors["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"].dtype == "U8"
    assert index.tensors["language_model.model.layers.0.self_attn.A_log"].shape == (16,)
    assert index.tensors["language_model.model.layers.0.self_attn.dt_bias"].dtype == "F32"
    assert index.tensors["language_model.lm_head.weight"].dtype == "BF16"
    cfg = json.loads((tiny_k3_dir / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and "quantization_config" in cfg["text_config"]


def test_kimi_linear_single_file(tmp_path):
    d = build_tiny_checkpoint(tmp_path / "kl", kind="kimi_linear", seed=3, num_shards=1)
    cfg = load_model_config(d)
    w = load_weights(d, cfg, progress=False)
    assert (d / "model.safetensors").is_file() and not (d / "model.safetensors.index.json").exists()
    assert w["model.layers.0.self_attn.A_log"].shape == (4,)
    assert w["model.layers.1.block_sparse_moe.experts.0.w1.weight"].dtype == torch.bfloat16


@pytest.fixture
def ckpt(tmp_path, tiny_k3_dir):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_k3_dir, d)
    return d, load_model_config(d)


def _edit_shard(d, tensor, edit):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    fname = index["weight_map"][tensor]
    tensors = load_file(str(d / fname))
    edit(tensors, index)
    save_file(tensors, str(d / fname))
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return fname


NAME = "language_model.model.layers.2.self_attn.q_proj.weight"


def test_missing_tensor(ckpt):
    d, cfg = ckpt
    _edit_shard(d, NAME, lambda t, i: (t.pop(NAME), i["weight_map"].pop(NAME)))
    with pytest.raises(MissingTensorError, match=NAME.replace(".", r"\.")):
        load_weights(d, cfg, progress=False)


def test_unexpected_tensor(ckpt):
    d, cfg = ckpt
    extra = "language_model.model.layers.2.self_attn.rotary_emb.inv_freq"

    def add(t, i):
        t[extra] = torch.zeros(4)
        i["weight_map"][extra] = i["weight_map"][NAME]

    fname = _edit_shard(d, NAME, add)
    with pytest.raises(UnexpectedTensorError) as e:
        load_weights(d, cfg, progress=False)
    assert extra in str(e.value) and fname in str(e.value)


def test_wrong_shape(ckpt):
    d, cfg = ckpt
    fname = _edit_shard(d, NAME, lambda t, i: t.update({NAME: t[NAME][:-1].clone()}))
    with pytest.raises(ShapeMismatchError) as e:
        load_weights(d, cfg, progress=False)
    assert NAME in str(e.value) and fname in str(e.value) and "[63, 64]" in str(e.value)


def test_wrong_dtype(ckpt):
    d, cfg = ckpt
    packed = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed"
    _edit_shard(d, packed, lambda t, i: t.update({packed: t[packed].to(torch.bfloat16)}))
    with pytest.raises(DtypeMismatchError, match="must be U8"):
        load_weights(d, cfg, progress=False)
    _edit_shard(d, packed, lambda t, i: t.update({packed: t[packed].to(torch.uint8)}))
    _edit_shard(d, NAME, lambda t, i: t.update({NAME: t[NAME].to(torch.int32)}))
    with pytest.raises(DtypeMismatchError, match="found I32"):
        load_weights(d, cfg, progress=False)


def test_float16_where_the_config_gives_bf16_or_f32_is_refused(ckpt):
    """A float16 tensor in a bf16 / fp32 checkpoint was cast silently (a value past 65504 is
    already inf in the file, bf16's range is gone): refused, naming the tensor and the file.
    BF16 and F32 stay interchangeable (the spec keeps some KDA tensors in F32)."""
    d, cfg = ckpt
    dt = "language_model.model.layers.0.self_attn.dt_bias"
    for name, dtype in ((NAME, torch.float16), (dt, torch.float16)):
        fname = _edit_shard(d, name, lambda t, i, name=name, dtype=dtype: t.update({name: t[name].to(dtype)}))
        with pytest.raises(DtypeMismatchError, match="stored as F16") as e:
            load_weights(d, cfg, progress=False)
        assert name in str(e.value) and fname in str(e.value)
        _edit_shard(d, name, lambda t, i, name=name: t.update({name: t[name].to(torch.float32)}))
    loaded = load_weights(d, cfg, progress=False)  # canonical names drop the language_model. prefix
    assert loaded[dt.removeprefix("language_model.")].dtype == torch.float32  # F32 where F32: as stored


def test_truncated_shard(ckpt):
    d, cfg = ckpt
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = d / index["weight_map"][NAME]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(TruncatedShardError) as e:
        load_weights(d, cfg, progress=False)
    assert shard.name in str(e.value) and "tensor" in str(e.value)


def test_bad_index_missing_shard_and_unlisted_tensor(ckpt):
    d, cfg = ckpt
    index_path = d / "model.safetensors.index.json"
    good = index_path.read_text()
    index = json.loads(good)
    index["weight_map"][NAME] = "model-00099-of-000011.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(BadIndexError, match="missing shard"):
        load_weights(d, cfg, progress=False)
    index = json.loads(good)
    index["weight_map"].pop(NAME)
    index_path.write_text(json.dumps(index))
    with pytest.raises(BadIndexError, match="does not list"):
        load_weights(d, cfg, progress=False)
    index_path.write_text("{not json")
    with pytest.raises(BadIndexError, match="unreadable index"):
        load_weights(d, cfg, progress=False)


def test_bad_load_format(tiny_k3_dir):
    with pytest.raises(ValueError, match="load-format"):
        load_weights(tiny_k3_dir, load_model_config(tiny_k3_dir), load_format="gguf")


def test_fastsafetensors_reads_the_same_bytes_through_its_own_reader(tiny_k3_dir, monkeypatch):
    """--load-format fastsafetensors is the fastsafetensors library (its no-GDS path here), not an
    alias: every tensor equal to the mmap reader's, read by its loader; without the library, a
    clear error saying what to install."""
    pytest.importorskip("fastsafetensors")
    import fastsafetensors

    cfg = load_model_config(tiny_k3_dir)
    want = load_weights(tiny_k3_dir, cfg, progress=False)
    calls = []
    real = fastsafetensors.SafeTensorsFileLoader.copy_files_to_device
    monkeypatch.setattr(
        fastsafetensors.SafeTensorsFileLoader, "copy_files_to_device", lambda self: calls.append(1) or real(self)
    )
    got = load_weights(tiny_k3_dir, cfg, load_format="fastsafetensors", progress=False)
    assert set(got) == set(want) and len(calls) > 1  # a buffer per shard holding text tensors
    for k, w in want.items():
        g = got[k]
        assert (
            (torch.equal(g.packed, w.packed) and torch.equal(g.scale, w.scale))
            if isinstance(w, PackedMXFP4)
            else torch.equal(g, w)
        )
    monkeypatch.setitem(__import__("sys").modules, "fastsafetensors", None)  # as if not installed
    with pytest.raises(ValueError, match="pip install fastsafetensors=="):
        load_weights(tiny_k3_dir, cfg, load_format="fastsafetensors", progress=False)


def test_loaded_experts_stay_packed(tiny_k3_dir):
    w = load_weights(tiny_k3_dir, load_model_config(tiny_k3_dir), progress=False)
    experts = [v for v in w.values() if isinstance(v, PackedMXFP4)]
    assert experts and sum(p.nbytes for p in experts) / sum(p.numel for p in experts) <= 0.54
