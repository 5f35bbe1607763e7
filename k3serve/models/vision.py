"""K3's media encoder: `vision_tower` (MoonViT3d) + `mm_projector`, attribute names equal to the
release's tensor names, so loading is a lookup. encode(pixel_values, grids) gives one
text-embedding-sized row per 2x2 patch group (per 4-frame chunk for video), in the order the
placeholder tokens of the prompt take them (k3-model-spec.md §9.3)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from k3serve.config.model_config import ModelConfig
from k3serve.layers.vision.moonvit import Projector, VisionTower


class VisionModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vision is None:
            raise ValueError("this model has no vision_config")
        self.cfg = cfg.vision
        self.vision_tower = VisionTower(cfg.vision)
        self.mm_projector = Projector(cfg.vision)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """[L, 3, p, p] patches -> [sum (h/2)(w/2), text hidden]."""
        dtype = self.mm_projector.post_norm.weight.dtype
        return self.mm_projector(self.vision_tower(pixel_values.to(dtype), grids))

    @staticmethod
    def tokens(grids: list[tuple[int, int, int]]) -> int:
        """Placeholder tokens the grids fill: one per 2x2 group per chunk."""
        return sum((h // 2) * (w // 2) for _, h, w in grids)


def load_vision(path: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> VisionModel:
    """The checkpoint's vision tensors (validated with the rest of the checkpoint) in a VisionModel."""
    from k3serve.weights.loader import load_weights

    weights = load_weights(path, cfg, include_vision=True, progress=False)
    model = VisionModel(cfg)
    own = model.state_dict()
    missing = sorted(set(own) - set(weights))
    if missing:
        raise ValueError(f"{path}: vision tensor {missing[0]} is missing ({len(missing)} in all)")
    model.load_state_dict({k: weights[k].to(dtype) for k in own})
    return model.to(dtype).eval()
