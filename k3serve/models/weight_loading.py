"""Assign loaded checkpoint weights (canonical names) to a KimiForCausalLM.

Dense parameters are copied with a cast to the model dtype, except the tensors the spec keeps
in FP32 (KDA A_log/dt_bias/conv/o_norm, router bias). Routed experts `...experts.{e}.w1.weight`
are stacked per layer into [E, out, in] — still packed for MXFP4 checkpoints.
"""

from __future__ import annotations

import re

import torch

from k3serve.weights.errors import MissingTensorError, UnexpectedTensorError
from k3serve.weights.mxfp4 import PackedMXFP4
from k3serve.weights.nvfp4 import PackedNVFP4

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_FP32 = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight", "e_score_correction_bias")


_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


def assign_weights(model, weights) -> None:
    """`weights`: a dict, or an iterable of (canonical name, weight) as a rank reads them
    (parallel/rank_load.py): each is placed as it comes, so the model (possibly built on the meta
    device, holding nothing) never holds a second copy; a layer's experts are stacked as soon as
    its last one arrives."""
    params = dict(model.named_parameters())
    quant = model.cfg.quant  # packed experts; an unquantized checkpoint's are quantized as they come
    experts: dict[tuple[int, str], dict[int, object]] = {}  # layers still waiting for experts
    loaded: set[tuple[int, str]] = set()
    model.kv_scales = {}  # MLA layer -> the checkpoint's fp8 cache scale (compressed-tensors kv_cache_scheme)
    for name, value in weights.items() if isinstance(weights, dict) else weights:
        m = _EXPERT.match(name)
        if m:
            key = (int(m[1]), m[3])
            experts.setdefault(key, {})[int(m[2])] = _as_packed(value, quant)
            moe = model.model.layers[key[0]].block_sparse_moe
            if len(experts[key]) == getattr(moe, key[1]).shape[0]:  # the layer's last expert
                _load_experts(model, moe, key[1], experts.pop(key))
                loaded.add(key)
            continue
        m = _KV_SCALE.match(name)
        if m:  # one latent row holds K and V alike: k_scale is its scale (vLLM's MLA reads k_scale only)
            if m[2] == "k":
                model.kv_scales[int(m[1])] = float(value.reshape(-1)[0])
            continue
        if name not in params:
            raise UnexpectedTensorError("checkpoint tensor has no model parameter", tensor=name)
        p = params.pop(name)
        if tuple(p.shape) != tuple(value.shape):
            value = value.reshape(p.shape)
        value = value.to(torch.float32 if name.endswith(_FP32) else p.dtype)
        with torch.no_grad():
            if p.is_meta:  # built on the meta device: the weight becomes the parameter
                module, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(module), leaf, torch.nn.Parameter(value, p.requires_grad))
            else:
                p.data = value.clone()
    if params:
        raise MissingTensorError("model parameter not found in the weights", tensor=sorted(params)[0])
    for i, layer in enumerate(model.model.layers):
        if not hasattr(layer, "block_sparse_moe"):
            continue
        for w in ("w1", "w2", "w3"):
            if (i, w) not in loaded:
                count = getattr(layer.block_sparse_moe, w).shape[0]  # this rank's experts (all, without EP)
                missing = min(set(range(count)) - set(experts.get((i, w), {})))
                raise MissingTensorError(
                    "routed expert weight missing",
                    tensor=f"model.layers.{i}.block_sparse_moe.experts.{missing}.{w}.weight",
                )


def _as_packed(value, quant):
    """An expert matrix [out, in] as the model takes it: a dense one from an unquantized
    checkpoint, for a model built with packed experts (--quantization at load,
    models/registry.py quantized_config), is quantized now, one matrix at a time, to the bytes
    `k3serve convert` writes (weights/convert.py _pack)."""
    if quant is None or not isinstance(value, torch.Tensor):
        return value
    return (PackedMXFP4 if quant.scheme == "mxfp4" else PackedNVFP4).quantize(value.float())


def _load_experts(model, moe, w: str, per: dict[int, object]) -> None:
    """One layer's experts stacked [E, out, in] (still packed for MXFP4 / NVFP4 checkpoints)."""
    mats = [per[e] for e in range(len(per))]
    if isinstance(mats[0], PackedNVFP4):
        stacked = PackedNVFP4.stack(mats)
    elif isinstance(mats[0], PackedMXFP4):
        stacked = PackedMXFP4(torch.stack([m.packed for m in mats]), torch.stack([m.scale for m in mats]))
    else:
        stacked = torch.stack(mats).to(model.dtype)
    getattr(moe, w).load(stacked)
