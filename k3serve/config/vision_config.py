"""MoonViT3d `vision_config` (k3-model-spec.md §1.4, §9.1): shapes only.

The text engine does not run the tower yet; inspect and the planner need its tensor bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k3serve.config.parse import Fields


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


def parse_vision_config(raw: Any) -> VisionConfig | None:
    if raw is None:
        return None
    f = Fields(raw, "vision_config.")
    merge = raw.get("merge_kernel_size", [2, 2])
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
    )
