"""Tiny configs with every structural feature of the real ones (k3-model-spec.md §1).

Tiny K3 (default): 8 layers, MLA at 0-based 3, 6, 7 (last two MLA, like 91/92), AttnRes
blocks of 3 (starts 0, 3, 6), layer 0 dense, latent MoE with 8 experts top-2 (MXFP4),
bounded-decay KDA with a full-rank gate, q-LoRA, gated MLA, SiTU, a tiny vision tower.
Tiny Kimi-Linear: flat config, softplus decay, low-rank gate, plain MoE, SiLU, no AttnRes.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from k3serve.tokenizer.specials import NUM_RESERVED_SPECIAL

BUNDLED_DIR = Path(__file__).resolve().parents[1] / "config" / "bundled"
TINY_BASE_VOCAB = 512  # 256 bytes + 256 merges


def _released(name: str) -> dict[str, Any]:
    """A bundled release config without its `auto_map`: that names modeling code the release
    ships and a directory k3serve writes does not, so transformers would stop to ask whether to
    trust remote code (AutoTokenizer included) and then find none."""
    raw = json.loads((BUNDLED_DIR / name).read_text())
    raw.pop("auto_map", None)
    if isinstance(raw.get("text_config"), dict):
        raw["text_config"].pop("auto_map", None)
    return raw


def _schedule(num_layers: int, last_two_mla: bool) -> tuple[list[int], list[int]]:
    """1-based full-attention / KDA layer lists with the 3:1 pattern."""
    full = {i + 1 for i in range(num_layers) if (i + 1) % 4 == 0}
    full |= {num_layers - 1, num_layers} if last_two_mla else {num_layers}
    kda = [i for i in range(1, num_layers + 1) if i not in full]
    return sorted(full), kda


def tiny_k3_config(
    num_layers: int = 8,
    hidden_size: int = 64,
    num_experts: int = 8,
    top_k: int = 2,
    attn_res_block_size: int = 3,
    base_vocab: int = TINY_BASE_VOCAB,
) -> dict[str, Any]:
    raw = _released("moonshotai--Kimi-K3.json")
    full, kda = _schedule(num_layers, last_two_mla=True)
    specials = base_vocab
    text = raw["text_config"]
    text.update(
        vocab_size=base_vocab + NUM_RESERVED_SPECIAL,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        intermediate_size=2 * hidden_size,
        bos_token_id=specials,
        eos_token_id=specials + 2,
        pad_token_id=specials + 255,
        attn_res_block_size=attn_res_block_size,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=num_experts,
        num_experts_per_token=top_k,
        num_shared_experts=2,
        moe_intermediate_size=32,
        routed_expert_hidden_size=32,
        max_position_embeddings=4096,
    )
    text["linear_attn_config"].update(num_heads=4, head_dim=16, full_attn_layers=full, kda_layers=kda)
    raw.update(
        bos_token_id=specials,
        eos_token_id=specials + 2,
        pad_token_id=specials + 255,
        media_placeholder_token_id=specials + 21,
    )
    raw["vision_config"].update(
        patch_size=2,
        init_pos_emb_height=4,
        init_pos_emb_width=4,
        vt_hidden_size=32,
        vt_num_hidden_layers=1,
        vt_num_attention_heads=2,
        vt_intermediate_size=64,
        qkv_hidden_size=48,
        mm_hidden_size=32,
        text_hidden_size=hidden_size,
    )  # 2 heads x 24: qkv != hidden as in K3
    return raw


def tiny_kimi_linear_config(
    num_layers: int = 6, hidden_size: int = 64, num_experts: int = 8, top_k: int = 2, base_vocab: int = TINY_BASE_VOCAB
) -> dict[str, Any]:
    raw = _released("moonshotai--Kimi-Linear-48B-A3B-Instruct.json")
    full, kda = _schedule(num_layers, last_two_mla=False)
    raw.update(
        vocab_size=base_vocab + NUM_RESERVED_SPECIAL,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        intermediate_size=2 * hidden_size,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=num_experts,
        num_experts_per_token=top_k,
        num_shared_experts=1,
        moe_intermediate_size=32,
        bos_token_id=base_vocab,
        eos_token_id=base_vocab + 2,
        pad_token_id=base_vocab + 255,
        model_max_length=4096,
    )
    raw["linear_attn_config"] = dict(
        full_attn_layers=full, kda_layers=kda, head_dim=16, num_heads=4, short_conv_kernel_size=4
    )
    return copy.deepcopy(raw)


def kimi_linear_400m_config(mxfp4: bool = False) -> dict[str, Any]:
    """Kimi-Linear's layout at ~408 M params, ~110 M active (hidden 1024, 8 layers, 32 experts
    top-4, KDA 8 x 128 heads): the size issue 15 measures decode bandwidth on, where weight
    traffic, not dispatch, sets the speed. Same tiny tokenizer as the tiny configs. `mxfp4`:
    the routed experts packed MXFP4 with K3's own compressed-tensors quantization_config (its
    ignore list keeps attention, shared experts, the dense MLP and lm_head bf16)."""
    raw = tiny_kimi_linear_config(num_layers=8, hidden_size=1024, num_experts=32, top_k=4)
    raw.update(
        intermediate_size=4096,
        num_attention_heads=8,
        num_key_value_heads=8,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        moe_intermediate_size=512,
    )
    raw["linear_attn_config"].update(head_dim=128, num_heads=8)
    return with_mxfp4_experts(raw) if mxfp4 else raw


def with_mxfp4_experts(raw: dict[str, Any]) -> dict[str, Any]:
    """A Kimi-Linear config whose routed experts are packed MXFP4, under K3's own
    compressed-tensors quantization_config."""
    from k3serve.config.quant_config import mxfp4_quantization_config

    return {**raw, "quantization_config": mxfp4_quantization_config()}


def with_nvfp4_experts(raw: dict[str, Any]) -> dict[str, Any]:
    """The config (K3 or Kimi-Linear) with its routed experts packed NVFP4."""
    from k3serve.config.quant_config import nvfp4_quantization_config

    if "text_config" in raw:
        return {**raw, "text_config": {**raw["text_config"], "quantization_config": nvfp4_quantization_config()}}
    return {**raw, "quantization_config": nvfp4_quantization_config()}
