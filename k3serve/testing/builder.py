"""Write tiny checkpoints in exactly the real layouts, from a seed (k3-model-spec.md §8).

K3: nested config.json, `language_model.` prefix, routed experts as compressed-tensors
MXFP4 (`weight_packed` + `weight_scale`), FP32 KDA vectors, padded `A_log`, untied head,
one shard per layer + root/projector/vision shards, `model.safetensors.index.json`.
Kimi-Linear: flat config, BF16, `A_log` [1,1,H,1]. Both get a tokenizer in the real
format (`tiktoken.model` + `tokenizer_config.json`). The weights are random: output is noise.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from k3serve.config.model_config import ModelConfig
from k3serve.testing.corpus import TINY_CORPUS
from k3serve.testing.tiny_configs import TINY_BASE_VOCAB, tiny_k3_config, tiny_kimi_linear_config
from k3serve.tokenizer.bpe_train import train_bpe
from k3serve.tokenizer.specials import K2_SPECIALS, K3_SPECIALS, NUM_RESERVED_SPECIAL
from k3serve.tokenizer.tiktoken_file import write_ranks
from k3serve.weights.mxfp4 import PackedMXFP4
from k3serve.weights.nvfp4 import PackedNVFP4
from k3serve.weights.schema import TensorSpec, model_tensor_specs

_TORCH_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}


def build_tiny_checkpoint(
    out_dir: str | Path,
    kind: str = "k3",
    seed: int = 0,
    config: dict[str, Any] | None = None,
    num_shards: int | None = None,
) -> Path:
    """Write config, weights and tokenizer to `out_dir`; returns the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if config is None:
        config = tiny_k3_config() if kind == "k3" else tiny_kimi_linear_config()
    cfg = ModelConfig.from_dict(config)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = random_weights(cfg, seed)
    _write_shards(out, cfg, tensors, num_shards)
    write_tokenizer(out, cfg.vocab_size - NUM_RESERVED_SPECIAL, k3_names=cfg.is_k3)
    return out


def write_bf16_twin(src: str | Path, out_dir: str | Path) -> Path:
    """The same checkpoint with its packed MXFP4 experts dequantized to bf16 (exact: every MXFP4
    value is a bf16 value) and no quantization_config: for tools that read MXFP4 experts only
    as a quantization of their own (llama.cpp's Kimi-Linear converter), so both sides hold the
    same weights."""
    from safetensors import safe_open

    src, out = Path(src), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = json.loads((src / "config.json").read_text())
    for holder in (raw, raw.get("text_config") or {}):
        holder.pop("quantization_config", None)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                tensors[name] = fh.get_tensor(name)
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        base = name[: -len("_packed")]
        packed = PackedMXFP4(tensors.pop(name), tensors.pop(base + "_scale"))
        tensors[base] = packed.dequantize(torch.bfloat16)
    cfg = ModelConfig.from_dict(raw)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    _write_shards(out, cfg, tensors, None)
    for extra in ("tiktoken.model", "tokenizer_config.json", "tokenizer.json", "generation_config.json"):
        if (src / extra).is_file():
            (out / extra).write_bytes((src / extra).read_bytes())
    return out


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint name -> tensor in its release dtype; deterministic in `seed`."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    specs = list(model_tensor_specs(cfg))
    for spec in specs:
        if spec.role == "scale":
            continue
        if spec.role == "packed":
            module = spec.name[: -len(".weight_packed")]
            logical = (spec.shape[0], spec.shape[1] * 2)
            w = torch.randn(logical, generator=gen) / logical[1] ** 0.5
            if cfg.quant.scheme == "nvfp4":
                nv = PackedNVFP4.quantize(w)
                out[spec.name], out[module + ".weight_scale"] = nv.packed, nv.scale.view(torch.float8_e4m3fn)
                out[module + ".weight_global_scale"] = nv.global_scale.reshape(1)
                continue
            packed = PackedMXFP4.quantize(w)
            out[spec.name], out[module + ".weight_scale"] = packed.packed, packed.scale
            continue
        out[spec.name] = _init(spec, cfg, gen).to(_TORCH_DTYPES[spec.dtype])
    return out


def _init(spec: TensorSpec, cfg: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    name, shape = spec.name, spec.shape
    if name.endswith("A_log"):
        a = torch.log(torch.empty(cfg.kda.num_heads).uniform_(1.0, 16.0, generator=gen))
        flat = torch.zeros(torch.Size(shape).numel())
        flat[: cfg.kda.num_heads] = a  # K3 pads with exact zeros
        return flat.reshape(shape)
    if name.endswith(("norm.weight", "layernorm.weight")):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(("dt_bias", "e_score_correction_bias")):
        return 0.1 * torch.randn(shape, generator=gen)
    if "conv1d" in name:
        return 0.5 * torch.randn(shape, generator=gen)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    fan_in = shape[-1] if len(shape) > 1 else 1
    return torch.randn(shape, generator=gen) / fan_in**0.5


def _shard_key(name: str, cfg: ModelConfig) -> int:
    """K3 placement: layer i -> shard i, root -> next, projector -> next, vision -> last."""
    p = cfg.tensor_prefix + "model.layers."
    if name.startswith(p):
        return int(name[len(p) :].split(".", 1)[0])
    if name.startswith("mm_projector."):
        return cfg.num_layers + 1
    if name.startswith("vision_tower."):
        return cfg.num_layers + 2
    return cfg.num_layers


def _write_shards(out: Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor], num_shards: int | None) -> None:
    if num_shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    groups: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        key = _shard_key(name, cfg)
        if num_shards is not None:
            key = key * num_shards // (cfg.num_layers + 3)
        groups.setdefault(key, {})[name] = t
    n = len(groups)
    weight_map, total = {}, 0
    for i, key in enumerate(sorted(groups), 1):
        fname = f"model-{i:05d}-of-{n:06d}.safetensors"  # 5-digit index, 6-digit total (K3)
        save_file(groups[key], str(out / fname), metadata={"format": "pt"})
        for name, t in groups[key].items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_tokenizer(
    out: Path, base_vocab: int = TINY_BASE_VOCAB, k3_names: bool = True, corpus: str = TINY_CORPUS
) -> None:
    """`tiktoken.model` trained on `corpus` + `tokenizer_config.json` with real special names."""
    ranks = train_bpe(corpus, base_vocab - 256)
    if len(ranks) != base_vocab:
        raise ValueError(f"corpus too small for {base_vocab} ranks (got {len(ranks)})")
    write_ranks(out / "tiktoken.model", ranks)
    names = K3_SPECIALS if k3_names else K2_SPECIALS
    decoder = {}
    for off in range(NUM_RESERVED_SPECIAL):
        tid = base_vocab + off
        decoder[str(tid)] = {
            "content": names.get(off, f"<|reserved_token_{tid}|>"),
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    tk_cfg = {
        "added_tokens_decoder": decoder,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "tokenizer_class": "TikTokenTokenizer",
        "model_max_length": 1048576,
        "clean_up_tokenization_spaces": False,
    }
    if not k3_names:  # K2 family renders chat through Jinja (K3 renders in Python: no template)
        from k3serve.chat.k2_jinja import K2_STYLE_TEMPLATE

        tk_cfg["chat_template"] = K2_STYLE_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tk_cfg, indent=2))


def write_hf_tokenizer(out: Path, texts: list[str], special_tokens: list[str], vocab_size: int = 300) -> None:
    """A byte-level BPE `tokenizer.json` (Hugging Face tokenizers) trained on `texts`."""
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, trainers

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    hf.train_from_iterator(texts * 50, trainer)
    hf.save(str(Path(out) / "tokenizer.json"))


def default_model_dir() -> Path:
    root = Path(os.environ.get("K3SERVE_CACHE", Path.home() / ".cache" / "k3serve"))
    return root / "default-tiny-k3-seed0"


def ensure_default_model() -> Path:
    """The bundled default: a tiny random-weight K3, written once into the cache dir."""
    path = default_model_dir()
    if not (path / "model.safetensors.index.json").is_file():
        tmp = path.with_name(f"{path.name}.partial-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        build_tiny_checkpoint(tmp, kind="k3", seed=0)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)  # atomic: a crashed build never leaves a half-written default
    return path
