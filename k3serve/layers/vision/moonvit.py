"""MoonViT3d, K3's vision tower (k3-model-spec.md §9.1), in the release's tensor names:

  vision_tower.patch_embed.proj.weight [C, 3, p, p]     Conv2d stride p, no bias
  vision_tower.patch_embed.pos_emb.weight [H0, W0, C]   learned 2-D table, resampled per grid
  vision_tower.encoder.blocks.{i}.{norm0,norm1,wqkv,wo,mlp.fc0,mlp.fc1}.weight
  vision_tower.encoder.final_layernorm.weight

Input: NaViT-packed patches `pixel_values` [L, 3, p, p] and `grid_thws` [(t, h, w)] per media
item (L = sum t*h*w, frames, then raster rows). Per patch: conv embedding + the position table
resampled to (h, w) (bilinear, align_corners False; the identity when (h, w) = (H0, W0)) +, for
t > 1, a fixed sin-cos of the frame index. Blocks are pre-norm RMSNorm (eps unset in the
release: torch's default, finfo(float32).eps even for BF16 inputs since PyTorch #142848, not
finfo(bf16).eps as §9.1 says) -> fused `wqkv` [3*Q, C] (rows q | k | v, each head's dims
interleaved (re, im) pairs) -> 2-D RoPE on q, k (pair j of a head: frequency theta^(-4*(j//2)/d)
times the patch's column for even j, its row for odd j; no temporal RoPE) -> full attention
within each media item -> `wo` [C, Q] -> residual; MLP fc0 -> GELU(tanh) -> fc1 -> residual.
Then the final RMSNorm, and `sd2_tpool`: each 2x2 patch group, averaged over the item's frames,
becomes one [4, C] row. References: transformers `kimi_k25` (K2.5's MoonViT: same structure
with LayerNorm, biases and separate q/k/v in rotate-half layout), NEMO / SGLang K3 vision code.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.config.vision_config import VisionConfig

EPS = torch.finfo(torch.float32).eps  # nn.RMSNorm(eps=None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class Weighted(nn.Module):
    """A module holding one `.weight` (the release names norms and the table this way)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(*shape))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.proj = nn.Conv2d(3, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.pos_emb = Weighted(cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.proj(pixel_values).flatten(1)  # [L, C]
        return x + position_embedding(self.pos_emb.weight, grids, self.cfg).to(x.dtype)


def position_embedding(table: torch.Tensor, grids: list[tuple[int, int, int]], cfg: VisionConfig) -> torch.Tensor:
    """[L, C]: the 2-D table resampled to each (h, w), repeated per frame, + sin-cos(frame) when t > 1."""
    out = []
    for t, h, w in grids:
        if t > cfg.pos_emb_time:
            raise ValueError(f"{t} frames in one media chunk; the temporal table covers {cfg.pos_emb_time}")
        grid = table
        if (h, w) != tuple(table.shape[:2]):
            grid = F.interpolate(
                table.permute(2, 0, 1)[None].float(), size=(h, w), mode=cfg.interpolation, align_corners=False
            )[0].permute(1, 2, 0)
        pos = grid.reshape(1, h * w, -1).expand(t, -1, -1)
        if t > 1:
            pos = pos + temporal_embedding(t, table.shape[-1])[:, None, :]
        out.append(pos.reshape(t * h * w, -1))
    return torch.cat(out)


def temporal_embedding(frames: int, dim: int) -> torch.Tensor:
    """[frames, dim]: cat(sin(f * w), cos(f * w)), w_k = 10000^(-2k/dim)."""
    w = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    f = torch.arange(frames, dtype=torch.float32)[:, None] * w
    return torch.cat([f.sin(), f.cos()], dim=1)


def rope_angles(grids: list[tuple[int, int, int]], head_dim: int, theta: float) -> torch.Tensor:
    """[L, head_dim / 2] angle of each interleaved pair: (col, row) alternating per frequency."""
    freqs = theta ** (-4 * torch.arange(head_dim // 4, dtype=torch.float32) / head_dim)  # [d/4]
    out = []
    for t, h, w in grids:
        rows = torch.arange(h, dtype=torch.float32).repeat_interleave(w)
        cols = torch.arange(w, dtype=torch.float32).repeat(h)
        ang = torch.stack([cols[:, None] * freqs, rows[:, None] * freqs], dim=-1).flatten(1)  # [h*w, d/2]
        out.append(ang.repeat(t, 1))
    return torch.cat(out)


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x [L, H, d] with (re, im) pairs interleaved; angles [L, d/2]. Complex rotation in fp32."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rot = torch.polar(torch.ones_like(angles), angles)[:, None, :]
    return torch.view_as_real(pairs * rot).flatten(-2).to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        c, q = cfg.hidden_size, cfg.qkv_hidden_size
        self.cfg = cfg
        self.norm0, self.norm1 = Weighted(c), Weighted(c)
        self.wqkv = nn.Linear(c, 3 * q, bias=False)
        self.wo = nn.Linear(q, c, bias=False)
        self.mlp = nn.Module()
        self.mlp.fc0 = nn.Linear(c, cfg.intermediate_size, bias=False)
        self.mlp.fc1 = nn.Linear(cfg.intermediate_size, c, bias=False)

    def forward(self, x: torch.Tensor, angles: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        H, d = self.cfg.num_heads, self.cfg.head_dim
        q, k, v = self.wqkv(rms_norm(x, self.norm0.weight)).view(x.shape[0], 3, H, d).unbind(1)  # [L, H, d] each
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        out = torch.empty_like(q)
        start = 0
        for n in lengths:  # full attention inside each media item, none across items
            s = slice(start, start + n)
            out[s] = F.scaled_dot_product_attention(
                q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1)
            ).transpose(0, 1)
            start += n
        x = x + self.wo(out.reshape(x.shape[0], H * d))
        h = self.mlp.fc1(F.gelu(self.mlp.fc0(rms_norm(x, self.norm1.weight)), approximate="tanh"))
        return x + h


class VisionTower(nn.Module):
    """pixel_values [L, 3, p, p] + grids -> merged features [sum (h/2)(w/2), 4, C] per item."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = nn.Module()
        self.encoder.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.encoder.final_layernorm = Weighted(cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        check_grids(grids, pixel_values.shape[0])
        x = self.patch_embed(pixel_values, grids)
        angles = rope_angles(grids, self.cfg.head_dim, self.cfg.rope_theta).to(x.device)
        lengths = [t * h * w for t, h, w in grids]
        for block in self.encoder.blocks:
            x = block(x, angles, lengths)
        return sd2_tpool(rms_norm(x, self.encoder.final_layernorm.weight), grids)


def check_grids(grids: list[tuple[int, int, int]], num_patches: int) -> None:
    total = sum(t * h * w for t, h, w in grids)
    if total != num_patches:
        raise ValueError(f"grid_thws cover {total} patches, pixel_values has {num_patches}")
    bad = [g for g in grids if g[1] % 2 or g[2] % 2 or min(g) < 1]
    if bad:
        raise ValueError(f"grid {bad[0]}: rows and columns must be positive and even (2x2 merge)")


def sd2_tpool(x: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
    """[L, C] -> [sum (h/2)(w/2), 4, C]: each 2x2 group (slots row-major), mean over frames (fp32)."""
    out, start = [], 0
    for t, h, w in grids:
        item = x[start : start + t * h * w].float().view(t, h // 2, 2, w // 2, 2, -1)
        out.append(item.permute(0, 1, 3, 2, 4, 5).mean(0).reshape((h // 2) * (w // 2), 4, -1).to(x.dtype))
        start += t * h * w
    return torch.cat(out)


class Projector(nn.Module):
    """`mm_projector` (patchmergerv2): [N, 4, C] -> flatten -> proj.0 -> GELU (erf) -> proj.2 ->
    post_norm RMSNorm(eps projector_ln_eps) -> [N, text hidden]; no biases, no pre-norm."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        merged = cfg.mm_hidden_size * math.prod(cfg.merge_kernel)
        self.eps = cfg.projector_eps
        self.proj = nn.Sequential(
            nn.Linear(merged, merged, bias=False), nn.GELU(), nn.Linear(merged, cfg.text_hidden_size, bias=False)
        )
        self.post_norm = Weighted(cfg.text_hidden_size)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        return rms_norm(self.proj(merged.flatten(1)), self.post_norm.weight, self.eps)
