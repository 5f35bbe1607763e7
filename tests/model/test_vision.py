"""MoonViT3d (k3serve/layers/vision) against independent references.

Where K3's tower equals K2.5's MoonViT, against transformers' `kimi_k25` vision model on the
same random weights: patch embedding, position table (resampled bilinearly: K2.5 is bicubic,
so that transformers module is set to bilinear), the temporal sin-cos, 2-D RoPE (K3's fused
interleaved `wqkv` permuted into transformers' rotate-half q/k), attention per media item, the
GELU-tanh MLP, the sd2_tpool merge. Where §9.1 says K3 differs, transformers' pieces are swapped
for K3's and the difference is checked on its own against a plain reference written from the
spec: RMSNorm without eps instead of LayerNorm, no biases, qkv width != hidden, the
patchmergerv2 projector (post-norm RMSNorm, no pre-norm)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3serve.config.vision_config import VisionConfig
from k3serve.layers.vision.moonvit import EPS, Projector, VisionTower, position_embedding, sd2_tpool

GRIDS = [(1, 4, 6), (1, 8, 8), (3, 2, 4), (1, 2, 2)]  # (8, 8) is the table's own size: no resampling


def cfg(qkv: int = 32, heads: int = 2) -> VisionConfig:
    return VisionConfig(
        patch_size=2,
        pos_emb_height=8,
        pos_emb_width=8,
        hidden_size=32,
        num_layers=2,
        num_heads=heads,
        intermediate_size=64,
        qkv_hidden_size=qkv,
        merge_kernel=(2, 2),
        mm_hidden_size=32,
        text_hidden_size=24,
    )


def randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            base = (
                1.0
                if name.endswith(("norm0.weight", "norm1.weight", "final_layernorm.weight", "post_norm.weight"))
                else 0.0
            )
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=g))


def pixels(grids, p: int = 2, seed: int = 0) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3, p, p, generator=torch.Generator().manual_seed(seed))


def transformers_tower(c: VisionConfig, ours: VisionTower):
    """transformers' K2.5 tower carrying our weights, with K3's differences swapped in."""
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25VisionModel

    vc = Kimi_K25VisionConfig(
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_heads,
        num_hidden_layers=c.num_layers,
        intermediate_size=c.intermediate_size,
        patch_size=c.patch_size,
        pos_emb_height=c.pos_emb_height,
        pos_emb_width=c.pos_emb_width,
        pos_emb_time=c.pos_emb_time,
        hidden_act="gelu_pytorch_tanh",
    )
    vc._attn_implementation = "eager"
    hf = Kimi_K25VisionModel(vc).eval()
    hf.patch_embed.pos_emb.interpolation_mode = "bilinear"  # K3: bilinear (K2.5: bicubic)
    C, H, d = c.hidden_size, c.num_heads, c.head_dim

    def rope_layout(w):  # interleaved (re, im) pairs per head -> rotate-half halves
        return w.view(H, d // 2, 2, -1).transpose(1, 2).reshape(H * d, -1)

    def rms(weight):  # K3: RMSNorm with torch's default eps (LayerNorm with eps 1e-5 in K2.5)
        n = torch.nn.RMSNorm(C)
        n.weight.data.copy_(weight)
        return n

    with torch.no_grad():
        for p in hf.parameters():  # K3 has no biases
            p.zero_()
        hf.patch_embed.proj.weight.copy_(ours.patch_embed.proj.weight)
        hf.patch_embed.pos_emb.position_embeddings.copy_(ours.patch_embed.pos_emb.weight)
        for layer, block in zip(hf.layers, ours.encoder.blocks):
            q, k, v = block.wqkv.weight.chunk(3)
            layer.attn.q_proj.weight.copy_(rope_layout(q))
            layer.attn.k_proj.weight.copy_(rope_layout(k))
            layer.attn.v_proj.weight.copy_(v)
            layer.attn.proj.weight.copy_(block.wo.weight)
            layer.mlp.fc1.weight.copy_(block.mlp.fc0.weight)
            layer.mlp.fc2.weight.copy_(block.mlp.fc1.weight)
            layer.norm1, layer.norm2 = rms(block.norm0.weight), rms(block.norm1.weight)
        hf.final_layernorm = rms(ours.encoder.final_layernorm.weight)
    return hf


def test_tower_equals_transformers_moonvit_with_k3_differences_swapped_in():
    c = cfg()
    ours = VisionTower(c).eval()
    randomize(ours, 1)
    hf = transformers_tower(c, ours)
    x = pixels(GRIDS)
    with torch.no_grad():
        got = ours(x, GRIDS)
        want = hf(x, grid_thw=torch.tensor(GRIDS)).pooler_output
    assert got.shape == (6 + 16 + 2 + 1, 4, 32)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_position_table_and_temporal_embedding_against_the_spec():
    c = cfg()
    table = torch.randn(8, 8, 32, generator=torch.Generator().manual_seed(3))
    pos = position_embedding(table, [(1, 8, 8)], c)
    assert torch.equal(pos, table.reshape(64, 32))  # the table's own size: used as is
    pos = position_embedding(table, [(2, 4, 6)], c)
    grid = (
        F.interpolate(table.permute(2, 0, 1)[None], size=(4, 6), mode="bilinear", align_corners=False)[0]
        .permute(1, 2, 0)
        .reshape(24, 32)
    )
    w = 1.0 / 10000 ** (torch.arange(0, 32, 2).float() / 32)
    for f in range(2):  # frame f adds cat(sin(f w), cos(f w)); frame 0 gets [0..0, 1..1]
        torch.testing.assert_close(pos[24 * f : 24 * (f + 1)], grid + torch.cat([(f * w).sin(), (f * w).cos()]))
    with pytest.raises(ValueError, match="temporal table covers 4"):
        position_embedding(table, [(5, 2, 2)], c)


def test_k3_rmsnorm_eps_is_torchs_default():
    """The release's nn.RMSNorm has no eps: torch then uses finfo(float32).eps, also for BF16."""
    x = torch.randn(4, 32).to(torch.bfloat16)
    w = torch.ones(32, dtype=torch.bfloat16)
    torch.testing.assert_close(torch.nn.functional.rms_norm(x, (32,), w), F.rms_norm(x, (32,), w, EPS))
    assert EPS == pytest.approx(1.1920929e-07)


def test_qkv_wider_than_hidden_against_a_plain_reference():
    """K3: qkv_hidden_size 1536 != vt_hidden_size 1024 (transformers' K2.5 cannot express it).
    One block written out from §9.1 with loops over heads and pairs."""
    c = cfg(qkv=48, heads=2)  # 2 heads x 24
    tower = VisionTower(c).eval()
    randomize(tower, 2)
    grids = [(1, 2, 4)]
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(4))
    block = tower.encoder.blocks[0]
    from k3serve.layers.vision.moonvit import rope_angles

    with torch.no_grad():
        got = block(x, rope_angles(grids, 24, 10000.0), [8])
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * block.norm0.weight
        qkv = h @ block.wqkv.weight.T  # [8, 144]
        q, k, v = qkv[:, :48].view(8, 2, 24), qkv[:, 48:96].view(8, 2, 24), qkv[:, 96:].view(8, 2, 24)
        rows, cols = [r for r in range(2) for _ in range(4)], [cc for _ in range(2) for cc in range(4)]

        def rot(t):
            out = t.clone()
            for i in range(8):
                for j in range(12):  # pair j: frequency j // 2, column for even j, row for odd j
                    pos = cols[i] if j % 2 == 0 else rows[i]
                    a = pos * 10000.0 ** (-4 * (j // 2) / 24)
                    re, im = t[i, :, 2 * j], t[i, :, 2 * j + 1]
                    out[i, :, 2 * j] = re * torch.cos(torch.tensor(a)) - im * torch.sin(torch.tensor(a))
                    out[i, :, 2 * j + 1] = re * torch.sin(torch.tensor(a)) + im * torch.cos(torch.tensor(a))
            return out

        q, k = rot(q), rot(k)
        att = torch.softmax(torch.einsum("ihd,jhd->hij", q, k) / 24**0.5, -1)
        o = torch.einsum("hij,jhd->ihd", att, v).reshape(8, 48)
        y = x + o @ block.wo.weight.T
        h2 = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS) * block.norm1.weight
        want = y + F.gelu(h2 @ block.mlp.fc0.weight.T, approximate="tanh") @ block.mlp.fc1.weight.T
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_projector_v2_and_merge_against_plain_references():
    c = cfg()
    proj = Projector(c)
    randomize(proj, 5)
    merged = torch.randn(5, 4, 32, generator=torch.Generator().manual_seed(6))
    flat = merged.reshape(5, 128)
    h = F.gelu(flat @ proj.proj[0].weight.T) @ proj.proj[2].weight.T  # exact-erf GELU, no biases
    want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * proj.post_norm.weight  # post-norm
    torch.testing.assert_close(proj(merged), want, rtol=1e-5, atol=1e-5)
    x = torch.arange(2 * 4 * 4, dtype=torch.float32)[:, None].repeat(1, 3)  # 2 frames of 4x4 patches
    out = sd2_tpool(x, [(2, 4, 4)])
    # group (0, 1) = rows 0-1, cols 2-3; slots row-major; averaged over the two frames (+16)
    assert out.shape == (4, 4, 3) and out[1, :, 0].tolist() == [2 + 8, 3 + 8, 6 + 8, 7 + 8]


def test_bad_grids_are_refused():
    tower = VisionTower(cfg()).eval()
    with pytest.raises(ValueError, match="cover 24 patches"):
        tower(pixels([(1, 4, 4)]), [(1, 4, 6)])
    with pytest.raises(ValueError, match="even"):
        tower(pixels([(1, 3, 4)]), [(1, 3, 4)])


def test_the_tiny_checkpoints_tower_loads_by_name_and_encodes(tiny_k3_dir):
    """The release layout the builder writes loads into VisionModel by name (every tensor used,
    none missing) and encodes a 2-image batch into one row per 2x2 group, in text-hidden size."""
    from k3serve.config.bundled import load_model_config
    from k3serve.models.vision import VisionModel, load_vision
    from k3serve.weights.loader import load_weights

    cfg = load_model_config(tiny_k3_dir)
    vm = load_vision(tiny_k3_dir, cfg)
    stored = {
        k
        for k in load_weights(tiny_k3_dir, cfg, include_vision=True, progress=False)
        if k.startswith(("vision_tower.", "mm_projector."))
    }
    assert set(vm.state_dict()) == stored
    grids = [(1, 4, 6), (1, 2, 2)]
    p = cfg.vision.patch_size
    out = vm.encode(pixels(grids, p), grids)
    assert out.shape == (VisionModel.tokens(grids), cfg.hidden_size) == (7, cfg.hidden_size)
    assert torch.isfinite(out).all()
