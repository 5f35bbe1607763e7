"""NVFP4 fidelity (issue 50): a checkpoint whose routed experts were packed by compressed-tensors'
own NVFP4 compressor, served by k3serve, gives the greedy tokens of the same model rebuilt in
float32 from compressed-tensors' own dequantization, on both architectures and through every
backend that serves them on a CPU (the torch reference, the C++ grouped kernel, the graph step).
The rebuilt twin is an independent route to the same weights: k3serve reads the packed bytes,
the twin reads floats the library produced. Exact token equality: the decoded values are equal
bit for bit (tests/unit/test_nvfp4.py), so only summation order differs, in float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from k3serve import LLM
from k3serve.config.model_config import ModelConfig
from k3serve.sampling_params import SamplingParams
from k3serve.testing.builder import _write_shards, build_tiny_checkpoint
from k3serve.config.quant_config import nvfp4_quantization_config
from k3serve.weights.mxfp4 import PackedMXFP4

from tests.unit.test_nvfp4 import ct_nvfp4


def _read(src: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.update({n: fh.get_tensor(n) for n in fh.keys()})
    return out


def _copy_tokenizer(src: Path, out: Path) -> None:
    for extra in ("tiktoken.model", "tokenizer_config.json", "tokenizer.json", "generation_config.json"):
        if (src / extra).is_file():
            (out / extra).write_bytes((src / extra).read_bytes())


def pack_with_compressed_tensors(src: Path, packed_dir: Path, twin_dir: Path) -> None:
    """Every routed expert matrix of `src` (dense or MXFP4) -> compressed-tensors' NVFP4 in
    `packed_dir` (with its quantization_config) and its float32 dequantization in `twin_dir`
    (no quantization_config)."""
    raw = json.loads((src / "config.json").read_text())
    text = raw.get("text_config", raw)
    text.pop("quantization_config", None)
    twin_raw = json.loads(json.dumps(raw))
    text["quantization_config"] = nvfp4_quantization_config()
    tensors = _read(src)
    packed, twin = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale"):
            continue
        if ".experts." not in name or "shared_experts" in name:
            packed[name] = twin[name] = t
            continue
        base = name[: -len("_packed")] if name.endswith("_packed") else name
        w = PackedMXFP4(t, tensors[base + "_scale"]).dequantize() if name.endswith("_packed") else t.float()
        sd, deq = ct_nvfp4(w)
        for key, v in sd.items():
            packed[base[: -len(".weight")] + "." + key] = v
        twin[base] = deq
    for out, cfg_raw, ts in ((packed_dir, raw, packed), (twin_dir, twin_raw, twin)):
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps(cfg_raw, indent=2))
        _write_shards(out, ModelConfig.from_dict(cfg_raw), ts, None)
        _copy_tokenizer(src, out)


@pytest.mark.parametrize("kind", ["k3", "kimi_linear"])
def test_compressed_tensors_nvfp4_serves_the_tokens_of_its_float32_dequantization(kind, tmp_path):
    src = build_tiny_checkpoint(tmp_path / "src", kind=kind, seed=3)  # K3: MXFP4 experts, requantized
    pack_with_compressed_tensors(src, tmp_path / "nvfp4", tmp_path / "twin")
    names = _read(tmp_path / "nvfp4")
    assert any(n.endswith("experts.0.w1.weight_global_scale") for n in names)
    assert next(t for n, t in names.items() if n.endswith(".weight_scale")).dtype == torch.float8_e4m3fn

    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 40))}, {"prompt_token_ids": list(range(50, 61))}]

    def tokens(path, kernels):
        llm = LLM(str(path), dtype="float32", cache_memory="16MiB", max_model_len=256, kernels=kernels)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]

    want = tokens(tmp_path / "twin", "torch")
    for kernels in ("torch", "cpp", "graph"):
        assert tokens(tmp_path / "nvfp4", kernels) == want, kernels
