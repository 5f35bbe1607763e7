"""`k3serve convert` (issue 64 item 1): a bf16 checkpoint's routed experts packed MXFP4 (K3's own
layout) or NVFP4, streamed tensor by tensor.

- The bf16 twin of a tiny K3 release (its MXFP4 experts dequantized, exact) converts back to the
  release's values: scales bit for bit, every other tensor bit for bit, the config's
  quantization_config K3's own.
- A converted checkpoint serves the greedy tokens of the same model rebuilt in float32 from
  compressed-tensors' own decompression of the converted file (an independent route to the
  same weights), on both tiny architectures, on the torch, cpp and graph backends.
- Peak memory: converting a ~300 MiB bf16 checkpoint in a fresh process stays within a small
  multiple of one expert matrix above the interpreter's baseline, far below the checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from k3serve import LLM, SamplingParams
from k3serve.config.model_config import ModelConfig
from k3serve.testing.builder import _write_shards, build_tiny_checkpoint, write_bf16_twin
from k3serve.testing.tiny_configs import tiny_kimi_linear_config
from k3serve.weights.convert import convert
from k3serve.weights.mxfp4 import dequantize_mxfp4


def _read(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.update({n: fh.get_tensor(n) for n in fh.keys()})
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_the_bf16_twin_of_a_release_converts_back_to_its_values(tmp_path, capsys):
    from k3serve.cli import main

    release = build_tiny_checkpoint(tmp_path / "k3", kind="k3", seed=0)
    twin = write_bf16_twin(release, tmp_path / "twin")
    assert main(["convert", str(twin), str(tmp_path / "out"), "--quiet"]) == 0
    want, got = _read(release), _read(tmp_path / "out")
    packed = sum(n.endswith("_packed") for n in want)
    assert got.keys() == want.keys() and f"{packed:,} routed expert matrices packed MXFP4" in capsys.readouterr().out
    for name, t in want.items():
        if name.endswith(".weight_packed"):  # the same values (a -0 code may come back as +0)
            scale = name.replace("_packed", "_scale")
            assert torch.equal(dequantize_mxfp4(got[name], got[scale]), dequantize_mxfp4(t, want[scale])), name
        else:
            assert got[name].dtype == t.dtype and torch.equal(_bits(got[name]), _bits(t)), name
    cfg = lambda d: json.loads((d / "config.json").read_text())["text_config"]["quantization_config"]  # noqa: E731
    assert cfg(tmp_path / "out") == cfg(release)
    assert (tmp_path / "out" / "tiktoken.model").is_file() or (tmp_path / "out" / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="already has a quantization_config"):
        convert(release, tmp_path / "again", progress=False)


def ct_dequantize(sd: dict[str, torch.Tensor], weights: dict) -> torch.Tensor:
    """compressed-tensors' own decompression of one packed matrix, in float32 (its unpack,
    its scale decoding, its `dequantize` under the checkpoint's weight args)."""
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    packed = sd["weight_packed"]
    values = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
    args = QuantizationArgs(**weights)
    if "weight_global_scale" in sd:  # NVFP4: E4M3 scales and a global one
        scale = sd["weight_scale"].float()
        return dequantize(
            x_q=values, scale=scale, args=args, global_scale=sd["weight_global_scale"], dtype=torch.float32
        )
    scale = decompress_mx_scale(sd["weight_scale"]).float()
    return dequantize(x_q=values, scale=scale, args=args, dtype=torch.float32)


def ct_twin(converted: Path, out: Path) -> Path:
    """The converted checkpoint rebuilt in float32 from compressed-tensors' decompression."""
    raw = json.loads((converted / "config.json").read_text())
    text = raw.get("text_config", raw)
    weights = next(iter(text.pop("quantization_config")["config_groups"].values()))["weights"]
    tensors, twin = _read(converted), {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            module = name[: -len(".weight_packed")]
            parts = {k: tensors.get(f"{module}.{k}") for k in ("weight_packed", "weight_scale", "weight_global_scale")}
            twin[module + ".weight"] = ct_dequantize({k: v for k, v in parts.items() if v is not None}, weights)
        elif not name.endswith((".weight_scale", ".weight_global_scale")):
            twin[name] = t
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    _write_shards(out, ModelConfig.from_dict(raw), twin, None)
    for extra in converted.iterdir():
        if extra.suffix != ".safetensors" and extra.name not in ("config.json", "model.safetensors.index.json"):
            (out / extra.name).write_bytes(extra.read_bytes())
    return out


@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("kind", ["k3", "kimi_linear"])
def test_a_converted_checkpoint_serves_the_tokens_of_its_compressed_tensors_dequantization(kind, scheme, tmp_path):
    if kind == "k3":  # the release's experts dequantized: the bf16 checkpoint a user would start from
        src = write_bf16_twin(build_tiny_checkpoint(tmp_path / "release", kind="k3", seed=3), tmp_path / "bf16")
    else:  # Kimi-Linear ships bf16
        src = build_tiny_checkpoint(tmp_path / "bf16", kind="kimi_linear", seed=3)
    convert(src, tmp_path / "packed", scheme, progress=False)
    twin = ct_twin(tmp_path / "packed", tmp_path / "twin")
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": list(range(50, 61))}]

    def tokens(path, kernels):
        llm = LLM(str(path), dtype="float32", cache_memory="16MiB", max_model_len=256, kernels=kernels)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]

    want = tokens(twin, "torch")
    for kernels in ("torch", "cpp", "graph"):
        assert tokens(tmp_path / "packed", kernels) == want, kernels


# VmHWM, the new image's own high-water mark (ru_maxrss keeps the forking parent's across exec)
PEAK = """
import sys
from k3serve.weights.convert import convert
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
base = status("VmRSS:")
convert(sys.argv[1], sys.argv[2], "mxfp4", progress=False)
print(base, status("VmHWM:"))
"""


@pytest.mark.parametrize(
    "layers",
    [4, pytest.param(12, marks=pytest.mark.slow, id="1GiB")],  # 3 MoE layers: ~300 MiB; 11: ~1.1 GiB
)
def test_converting_streams_with_bounded_memory(layers, tmp_path):
    """bf16 MoE layers of 32 experts of 512 x 1024 (~100 MiB each): the converting process's
    peak stays within 96 MiB of its baseline after imports, under 40% of the checkpoint, where
    holding the checkpoint would take all of it (the issue's bound: 0.5 GB for 1 GB)."""
    raw = tiny_kimi_linear_config(num_layers=layers, hidden_size=1024, num_experts=32, top_k=4)
    raw.update(moe_intermediate_size=512, intermediate_size=2048)
    src = build_tiny_checkpoint(tmp_path / "src", config=raw)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    assert size > 200 * 2**20
    out = subprocess.run(
        [sys.executable, "-c", PEAK, str(src), str(tmp_path / "out")], capture_output=True, text=True, check=True
    )
    base, peak = map(int, out.stdout.split())
    grew = peak - base
    print(f"converting {size / 2**20:.0f} MiB: peak {grew / 2**20:.0f} MiB above the baseline")
    assert grew < min(96 * 2**20, 0.4 * size), (grew, size)
    assert sum(f.stat().st_size for f in (tmp_path / "out").glob("*.safetensors")) < 0.45 * size


def _experts(llm) -> dict[str, torch.Tensor]:
    """Every routed-expert buffer of an engine's model (rank 0's), by name, as raw bits (NVFP4's
    factor tables hold E4M3's NaN byte as a NaN)."""
    out = {}
    for n, b in llm.engine.model.named_buffers():
        if any(f".{w}." in n for w in ("w1", "w2", "w3")):
            out[n] = b.view(torch.int32) if b.dtype == torch.float32 else b.clone()
    return out


@pytest.mark.parametrize("scheme", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("kind", ["k3", "kimi_linear"])
def test_quantizing_at_load_is_converting_without_the_second_copy(kind, scheme, tmp_path):
    """`--quantization mxfp4|nvfp4` on a bf16 checkpoint (issue 64 item 1): the routed experts are
    quantized as they load to the bytes `k3serve convert` writes (each packed code, scale and
    global scale equal, bit for bit), and the engine serves the converted checkpoint's greedy
    tokens on the torch and cpp backends."""
    if kind == "k3":
        src = write_bf16_twin(build_tiny_checkpoint(tmp_path / "release", kind="k3", seed=4), tmp_path / "bf16")
    else:
        src = build_tiny_checkpoint(tmp_path / "bf16", kind="kimi_linear", seed=4)
    convert(src, tmp_path / "packed", scheme, progress=False)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": list(range(50, 61))}]
    kw = dict(dtype="float32", cache_memory="16MiB", max_model_len=256)
    for kernels in ("torch", "cpp"):
        converted = LLM(str(tmp_path / "packed"), kernels=kernels, **kw)
        at_load = LLM(str(src), kernels=kernels, quantization=scheme, **kw)
        want, got = _experts(converted), _experts(at_load)
        assert want.keys() == got.keys() and any(n.endswith(".packed") for n in want)
        for n in want:
            assert want[n].dtype == got[n].dtype and torch.equal(want[n], got[n]), n
        assert at_load.engine.model.cfg.quant == converted.engine.model.cfg.quant
        assert [o.outputs[0].token_ids for o in at_load.generate(prompts, greedy)] == [
            o.outputs[0].token_ids for o in converted.generate(prompts, greedy)
        ], kernels


@pytest.mark.parametrize("kind", ["k3", "kimi_linear"])
def test_quantizing_at_load_under_tensor_parallelism_equals_one_process(kind, tmp_path):
    """Every rank quantizes the whole experts it reads (split by id): a TP2 engine serves the
    one-process engine's tokens. Split by channel, the tiny Kimi-Linear's 32-channel experts give
    16 a rank, not whole MXFP4 groups: refused by name before any worker starts, as for a
    converted checkpoint."""
    if kind == "k3":
        src = write_bf16_twin(build_tiny_checkpoint(tmp_path / "release", kind="k3", seed=5), tmp_path / "bf16")
    else:
        src = build_tiny_checkpoint(tmp_path / "bf16", kind="kimi_linear", seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 30))}]
    kw = dict(dtype="float32", cache_memory="16MiB", max_model_len=256, kernels="torch", quantization="mxfp4")
    want = [o.outputs[0].token_ids for o in LLM(str(src), **kw).generate(prompts, greedy)]
    if kind == "kimi_linear":
        with pytest.raises(ValueError, match="not a multiple of the MXFP4 group of 32"):
            LLM(str(src), tensor_parallel_size=2, **kw)
    tp2 = LLM(str(src), tensor_parallel_size=2, enable_expert_parallel=True, **kw)
    try:
        assert [o.outputs[0].token_ids for o in tp2.generate(prompts, greedy)] == want
    finally:
        tp2.engine.shutdown()
