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


def assign_weights(model, weights: dict) -> None:
    params = dict(model.named_parameters())
    experts: dict[tuple[int, str], dict[int, object]] = {}
    model.kv_scales = {}  # MLA layer -> the checkpoint's fp8 cache scale (compressed-tensors kv_cache_scheme)
    for name, value in weights.items():
        m = _EXPERT.match(name)
        if m:
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = value
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
        with torch.no_grad():
            p.data = value.to(torch.float32 if name.endswith(_FP32) else p.dtype).clone()
    if params:
        raise MissingTensorError("model parameter not found in the weights", tensor=sorted(params)[0])
    _assign_experts(model, experts)


def _assign_experts(model, experts) -> None:
    for i, layer in enumerate(model.model.layers):
        if not hasattr(layer, "block_sparse_moe"):
            continue
        moe = layer.block_sparse_moe
        for w in ("w1", "w2", "w3"):
            per, count = experts.get((i, w), {}), moe.w1.shape[0]  # this rank's experts (all, without EP)
            if len(per) != count:
                missing = min(set(range(count)) - set(per))
                raise MissingTensorError(
                    "routed expert weight missing",
                    tensor=f"model.layers.{i}.block_sparse_moe.experts.{missing}.{w}.weight",
                )
            mats = [per[e] for e in range(count)]
            if isinstance(mats[0], PackedNVFP4):
                stacked = PackedNVFP4.stack(mats)
            elif isinstance(mats[0], PackedMXFP4):
                stacked = PackedMXFP4(torch.stack([m.packed for m in mats]), torch.stack([m.scale for m in mats]))
            else:
                stacked = torch.stack(mats).to(model.dtype)
            getattr(moe, w).load(stacked)
