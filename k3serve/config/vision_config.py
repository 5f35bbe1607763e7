"""MoonViT3d `vision_config` (k3-model-spec.md §1.4, §9.1): shapes and the variant fields the
tower implements. A config naming another variant (norm, merge, projector, interpolation,
biases) is refused by field name instead of being run as something else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k3serve.config.parse import ConfigError, Fields


@dataclass(frozen=True)
class VisionConfig:
    patch_size: int
    pos_emb_height: int
    pos_emb_width: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    qkv_hidden_size: int
    merge_kernel: tuple[int, int]
    mm_hidden_size: int
    text_hidden_size: int
    pos_emb_time: int = 4  # frames the temporal sin-cos table covers (one video chunk)
    interpolation: str = "bilinear"  # how the learned 2-D position table is resampled to a grid
    projector_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.num_heads


def parse_vision_config(raw: Any) -> VisionConfig | None:
    if raw is None:
        return None
    f = Fields(raw, "vision_config.")
    merge = raw.get("merge_kernel_size", [2, 2])
    fixed = {
        "norm_type": "rmsnorm",
        "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmergerv2",
        "mlp_type": "mlp2",
        "activation_func": "gelu_pytorch_tanh",
        "projector_hidden_act": "gelu",
        "pos_emb_type": "divided_fixed",
        "attn_bias": False,
        "linear_bias": False,
        "patch_embed_proj_bias": False,
    }
    for key, want in fixed.items():
        if key in raw and raw[key] != want:
            raise ConfigError(f"vision_config.{key}", f"is {raw[key]!r}; the MoonViT3d tower implements {want!r}")
    heads, qkv = f.int("vt_num_attention_heads", minimum=1), f.int("qkv_hidden_size", minimum=1)
    if qkv % heads or (qkv // heads) % 4:
        raise ConfigError(
            "vision_config.qkv_hidden_size", f"{qkv} must split into {heads} heads of a multiple of 4 (2-D RoPE pairs)"
        )
    if tuple(merge) != (2, 2):
        raise ConfigError("vision_config.merge_kernel_size", f"is {merge}; sd2_tpool merges 2x2")
    return VisionConfig(
        patch_size=f.int("patch_size", minimum=1),
        pos_emb_height=f.int("init_pos_emb_height", minimum=1),
        pos_emb_width=f.int("init_pos_emb_width", minimum=1),
        hidden_size=f.int("vt_hidden_size", minimum=1),
        num_layers=f.int("vt_num_hidden_layers", minimum=1),
        num_heads=f.int("vt_num_attention_heads", minimum=1),
        intermediate_size=f.int("vt_intermediate_size", minimum=1),
        qkv_hidden_size=f.int("qkv_hidden_size", minimum=1),
        merge_kernel=(int(merge[0]), int(merge[1])),
        mm_hidden_size=f.int("mm_hidden_size", minimum=1),
        text_hidden_size=f.int("text_hidden_size", minimum=1),
        pos_emb_time=int(raw.get("init_pos_emb_time", 4)),
        interpolation=f.choice("pos_emb_interpolation_mode", ("bilinear", "bicubic"), default="bilinear"),
        projector_eps=float(raw.get("projector_ln_eps", 1e-5)),
    )
