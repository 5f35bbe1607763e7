"""NVFP4 (compressed-tensors `nvfp4-pack-quantized`): the codec against compressed-tensors' own
compressor and dequantization (bit for bit) and ml_dtypes' E4M3; every packed path (the fast
torch decode, the C++ grouped kernel, the graph op, the Triton grouped GEMM) against
`experts_reference` over the reference dequantization, on ragged routings; a malformed
checkpoint names the tensor and the file.

Tolerances: the decoded values are equal bit for bit (each path forms e2m1 x (e4m3 / global)
in float32, the reference's order); after the matmuls, fp32 sums in another order: 1e-5 of the
largest |output|."""

from __future__ import annotations

import json
from functools import partial

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from k3serve import kernels
from k3serve.layers.activation import situ_and_mul
from k3serve.layers.experts import experts_forward, experts_reference
from k3serve.weights.nvfp4 import PackedNVFP4, decode_nvfp4, e4m3_values, scale_tables

E, D, I, K = 8, 64, 96, 3
ACT = partial(situ_and_mul, beta=4.0, linear_beta=25.0)


def ct_nvfp4(w: torch.Tensor):
    """One matrix [out, in] fp32 -> compressed-tensors' compressed state dict and its float32
    dequantization, all by the library (NVFP4A16's scheme, its observer's global and group scales)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    g = generate_gparam(w.min(), w.max())
    groups = w.reshape(w.shape[0], -1, 16)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=g)
    sd = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": g}, scheme)
    values = unpack_fp4_from_uint8(sd["weight_packed"], w.shape[0], w.shape[1], dtype=torch.float32)
    deq = dequantize(
        x_q=values,
        scale=sd["weight_scale"].float(),
        args=scheme.weights,
        global_scale=sd["weight_global_scale"],
        dtype=torch.float32,
    )
    return sd, deq


def _weights(seed, rows=16, cols=128):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w = w * torch.exp2(torch.randint(-6, 6, (rows, cols // 16, 1), generator=g).float()).repeat_interleave(16, -1).view(
        rows, cols
    )
    w[0, :16] = 0.0  # an all-zero group: the library's eps scale
    w[1, :4] = torch.tensor([-0.0, 0.0, -1e-30, 1e-30])
    return w


@pytest.mark.parametrize("seed", range(4))
def test_quantize_and_dequantize_equal_compressed_tensors(seed):
    w = _weights(seed)
    sd, deq = ct_nvfp4(w)
    ours = PackedNVFP4.quantize(w)
    assert torch.equal(ours.packed, sd["weight_packed"])
    assert torch.equal(ours.scale, sd["weight_scale"].view(torch.uint8))
    assert torch.equal(ours.global_scale.reshape(1), sd["weight_global_scale"])
    loaded = PackedNVFP4(sd["weight_packed"], sd["weight_scale"], sd["weight_global_scale"])
    assert torch.equal(loaded.dequantize(), deq)


def test_e4m3_table_matches_ml_dtypes():
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(e4m3_values().numpy(), want)  # NaN at 0x7F and 0xFF on both sides


def _stacked(seed, shape=(E, I, D)):
    g = torch.Generator().manual_seed(seed)
    return PackedNVFP4.quantize(torch.randn(*shape, generator=g) * 0.2)


def test_fast_decode_equals_the_reference():
    w = _stacked(0)
    idx = torch.tensor([5, 0, 5, 3])
    got = decode_nvfp4(w.packed[idx], w.scale[idx], scale_tables(w.global_scale)[idx], torch.float32)
    assert torch.equal(got, w.dequantize()[idx])
    assert torch.equal(decode_nvfp4(w.packed, w.scale, w.tables(), torch.bfloat16), w.dequantize(torch.bfloat16))


def _routing(N, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E - 2, generator=g)[:K] for _ in range(N)])  # experts 6, 7 unused
    ids[: N // 2, 0] = 2
    return ids, torch.rand(N, K, generator=g)


def _experts(seed):
    return _stacked(seed), _stacked(seed + 1, (E, D, I)), _stacked(seed + 2)


@pytest.mark.parametrize("N", [1, 5, 40])
def test_packed_paths_equal_the_reference(N):
    w1, w2, w3 = _experts(N)
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(N))
    ids, weights = _routing(N, N)
    want = experts_reference(x, ids, weights, w1, w2, w3, ACT)
    dense = [w.dequantize() for w in (w1, w2, w3)]
    assert torch.equal(want, experts_reference(x, ids, weights, *dense, ACT))  # the reference reads the codec

    def close(got):
        assert (got - want).abs().max() / want.abs().max() < 1e-5

    close(experts_forward(x, ids, weights, w1, w2, w3, ACT))  # fast torch decode of the selected experts
    close(experts_forward(x, ids, weights, w1, w2, w3, ACT, kernels=kernels.get("cpp")))  # C++ grouped kernel

    from k3serve.backends.graph_ops import BODIES
    from k3serve.weights.mxfp4 import decode_tables

    pair, _ = decode_tables(x.device, x.dtype)
    tables = torch.stack([w.tables() for w in (w1, w2, w3)])
    packs = (w1.packed, w2.packed, w3.packed, w1.scale, w2.scale, w3.scale)
    close(BODIES.moe_experts(x, ids, weights, *packs, pair, tables, True, 4.0, 25.0))  # gathered or every expert

    from k3serve.kernels.triton import moe

    close(moe.moe_experts(x, ids, weights, *packs, True, 4.0, 25.0, False, tables))  # TRITON_INTERPRET=1


def test_cpp_kernel_decodes_a_trailing_odd_group_and_checks_its_table():
    """K = 48: the vector decode takes groups in pairs, the third by the scalar tail."""
    w = _stacked(7, (E, 24, 48))
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(7))
    offsets = torch.tensor([0, 2, 2, 5] + [5] * (E - 3))
    got = kernels.get("cpp").nvfp4_grouped_matmul(x, offsets, w.packed, w.scale, w.tables())
    dense = w.dequantize()
    want = torch.cat([x[:2] @ dense[0].t(), x[2:] @ dense[2].t()])
    assert (got - want).abs().max() / want.abs().max() < 1e-6
    w = _stacked(0)
    offsets = torch.tensor([0] * E + [1])
    with pytest.raises(RuntimeError, match="table must be"):
        kernels.get("cpp").nvfp4_grouped_matmul(torch.zeros(1, D), offsets, w.packed, w.scale, w.tables()[:, :16])


@pytest.fixture(scope="module")
def nvfp4_dir(tmp_path_factory):
    from k3serve.cli import main

    out = tmp_path_factory.mktemp("nv") / "k3"
    assert main(["build-tiny", str(out), "--nvfp4", "--no-vision"]) == 0
    return out


def _respoil(src, dst, fn):
    """A copy of the checkpoint with fn(tensors) applied to the shard holding layer 1."""
    import shutil

    shutil.copytree(src, dst)
    shard = next(p for p in sorted(dst.glob("*.safetensors")) if any(".layers.1." in k for k in load_file(p)))
    tensors = load_file(shard)
    name = next(k for k in tensors if k.endswith("experts.0.w1.weight_scale"))
    fn(tensors, name[: -len(".weight_scale")])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    idx = json.loads(index.read_text())
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if k in tensors or v != shard.name}
    index.write_text(json.dumps(idx))
    return shard, name[: -len(".weight_scale")]


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda t, m: t.__setitem__(m + ".weight_scale", t[m + ".weight_scale"][:, :-1].contiguous()), "shape"),
        (lambda t, m: t.__setitem__(m + ".weight_scale", t[m + ".weight_scale"].view(torch.uint8)), "must be F8_E4M3"),
        (lambda t, m: t.__setitem__(m + ".weight_global_scale", torch.zeros(1)), "scale must be finite"),
        (lambda t, m: t.pop(m + ".weight_global_scale"), "required by the config"),
    ],
    ids=["scale-shape", "scale-dtype", "zero-global", "no-global"],
)
def test_a_malformed_nvfp4_tensor_is_named_with_its_file(nvfp4_dir, tmp_path, spoil, message):
    from k3serve.config.model_config import ModelConfig
    from k3serve.weights.errors import CheckpointError
    from k3serve.weights.loader import load_weights

    bad = tmp_path / "bad"
    shard, module = _respoil(nvfp4_dir, bad, spoil)
    cfg = ModelConfig.from_dict(json.loads((bad / "config.json").read_text()))
    with pytest.raises(CheckpointError, match=message) as e:
        load_weights(bad, cfg, progress=False)
    assert module in str(e.value) and (shard.name in str(e.value) or str(bad) in str(e.value))


def test_plan_counts_nvfp4_experts_at_their_bytes():
    """`k3serve plan --experts nvfp4`: 4.5 bits a value (E2M1 + an E4M3 byte per 16) against
    MXFP4's 4.25 (a byte per 32), plus a 4-byte global scale per expert matrix."""
    from k3serve.config.bundled import load_model_config
    from k3serve.planner.cli import experts_as
    from k3serve.planner.weights import weight_split

    cfg = load_model_config("moonshotai/Kimi-K3")
    mx, nv = weight_split(cfg), weight_split(experts_as(cfg, "nvfp4"))
    matrices = 3 * cfg.moe.num_experts * sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert nv.expert - 4 * matrices == mx.expert * 18 // 17  # 0.5625 / 0.53125
    assert (nv.tp_sharded, nv.replicated, nv.params) == (mx.tp_sharded, mx.replicated, mx.params)


def test_quantization_flag_must_name_the_checkpoints_format(nvfp4_dir):
    from k3serve import LLM

    with pytest.raises(ValueError, match="experts are nvfp4"):
        LLM(str(nvfp4_dir), quantization="mxfp4", cache_memory="16MiB", max_model_len=128, kernels="torch")
    llm = LLM(str(nvfp4_dir), quantization="nvfp4", cache_memory="16MiB", max_model_len=128, kernels="torch")
    moe = next(m for m in llm.engine.model.modules() if hasattr(m, "w1") and hasattr(m.w1, "fmt"))
    assert moe.w1.fmt == "nvfp4" and moe.w1.tables.dtype == torch.float32  # kept fp32 through model.to(bf16)
    assert moe.w1.global_scale.dtype == torch.float32
