"""The exact tensor inventory a config implies: names, shapes, dtypes (k3-model-spec.md §8.2).

One source for the loader (validation), the tiny builder (what to write), `inspect` and the
planner (bytes and parameter counts without a checkpoint). For the bundled K3 config this
lists all 497,220 tensors of the real release.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from k3serve.config.model_config import LayerKind, ModelConfig
from k3serve.weights.mxfp4 import GROUP
from k3serve.weights.nvfp4 import GROUP as NV_GROUP

DTYPE_BYTES = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "U8": 1,
    "I8": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}
FLOAT_DTYPES = frozenset({"BF16", "F16", "F32"})


@dataclass(frozen=True)
class TensorSpec:
    name: str  # checkpoint name, prefix included
    shape: tuple[int, ...]
    dtype: str  # dtype in the real release (safetensors string)
    role: str  # "float" | "packed" | "scale"
    routed_expert: bool = False
    vision: bool = False
    optional: bool = False  # validated when present, not required (NVFP4 activation scales)

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for s in self.shape:
            n *= s
        return n

    @property
    def params(self) -> int:
        """Logical parameters (packed: 2 per byte; scales: none)."""
        if self.role == "scale":
            return 0
        n = 2 if self.role == "packed" else 1
        for s in self.shape:
            n *= s
        return n


def model_tensor_specs(cfg: ModelConfig, include_vision: bool = True, optional: bool = False) -> Iterator[TensorSpec]:
    """Every tensor of the checkpoint `cfg` describes, in release order; `optional`: with the
    ones a checkpoint may add (fp8 KV-cache scales, NVFP4 activation scales: what the loader
    validates when present; the builder, `inspect` and the planner leave them out)."""
    p = cfg.tensor_prefix
    dt = _dtype_name(cfg.dtype)
    for i in range(cfg.num_layers):
        yield from (s for s in _layer_specs(cfg, i, f"{p}model.layers.{i}.", dt) if optional or not s.optional)
    d = cfg.hidden_size
    yield TensorSpec(f"{p}model.embed_tokens.weight", (cfg.vocab_size, d), dt, "float")
    yield TensorSpec(f"{p}model.norm.weight", (d,), dt, "float")
    if cfg.use_attnres:
        yield TensorSpec(f"{p}model.output_attn_res_norm.weight", (d,), dt, "float")
        yield TensorSpec(f"{p}model.output_attn_res_proj.weight", (1, d), dt, "float")
    if not cfg.tie_word_embeddings:
        yield TensorSpec(f"{p}lm_head.weight", (cfg.vocab_size, d), dt, "float")
    if include_vision and cfg.vision is not None:
        yield from _vision_specs(cfg)


def _dtype_name(dtype: str) -> str:
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(dtype, "BF16")


def _layer_specs(cfg: ModelConfig, i: int, lp: str, dt: str) -> Iterator[TensorSpec]:
    d = cfg.hidden_size
    yield TensorSpec(lp + "input_layernorm.weight", (d,), dt, "float")
    yield TensorSpec(lp + "post_attention_layernorm.weight", (d,), dt, "float")
    if cfg.use_attnres:
        for part in ("self_attention_res", "mlp_res"):
            yield TensorSpec(lp + f"{part}_norm.weight", (d,), dt, "float")
            yield TensorSpec(lp + f"{part}_proj.weight", (1, d), dt, "float")
    attn = _kda_specs if cfg.layer_kinds[i] is LayerKind.KDA else _mla_specs
    for name, shape, dtype in attn(cfg):
        yield TensorSpec(lp + "self_attn." + name, shape, dtype or dt, "float")
    if attn is _mla_specs:  # an fp8 KV-cache export's per-layer scales (compressed-tensors kv_cache_scheme)
        for name in ("k_scale", "v_scale"):
            yield TensorSpec(lp + "self_attn." + name, (1,), "F32", "float", optional=True)
    if cfg.is_moe_layer(i):
        yield from _moe_specs(cfg, lp + "block_sparse_moe.", dt)
    else:
        inter = cfg.intermediate_size
        for name, shape in (("gate_proj", (inter, d)), ("up_proj", (inter, d)), ("down_proj", (d, inter))):
            yield TensorSpec(lp + f"mlp.{name}.weight", shape, dt, "float")


def _kda_specs(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], str | None]]:
    k, d = cfg.kda, cfg.hidden_size
    P, D, H = k.proj_dim, k.head_dim, k.num_heads
    a_log = (max(H, D),) if cfg.is_k3 else (1, 1, H, 1)  # K3 pads A_log (96 used of 128)
    out: list[tuple[str, tuple[int, ...], str | None]] = []
    for x in "qkv":
        out.append((f"{x}_proj.weight", (P, d), None))
    for x in "qkv":
        out.append((f"{x}_conv1d.weight", (P, 1, k.conv_kernel), "F32"))
    out += [
        ("f_a_proj.weight", (D, d), None),
        ("f_b_proj.weight", (P, D), None),
        ("dt_bias", (P,), "F32"),
        ("A_log", a_log, "F32"),
        ("b_proj.weight", (H, d), None),
    ]
    if k.use_full_rank_gate:
        out.append(("g_proj.weight", (P, d), None))
    else:
        out += [("g_a_proj.weight", (D, d), None), ("g_b_proj.weight", (P, D), None)]
    out += [("o_norm.weight", (D,), "F32"), ("o_proj.weight", (d, P), None)]
    return out


def _mla_specs(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], str | None]]:
    m, d = cfg.mla, cfg.hidden_size
    H = m.num_heads
    out: list[tuple[str, tuple[int, ...], str | None]] = []
    if m.q_lora_rank is not None:
        out += [
            ("q_a_proj.weight", (m.q_lora_rank, d), None),
            ("q_a_layernorm.weight", (m.q_lora_rank,), None),
            ("q_b_proj.weight", (H * m.qk_head_dim, m.q_lora_rank), None),
        ]
    else:
        out.append(("q_proj.weight", (H * m.qk_head_dim, d), None))
    out += [
        ("kv_a_proj_with_mqa.weight", (m.cache_dim, d), None),
        ("kv_a_layernorm.weight", (m.kv_lora_rank,), None),
        ("kv_b_proj.weight", (H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), None),
    ]
    if m.use_output_gate:
        out.append(("g_proj.weight", (H * m.v_head_dim, d), None))
    out.append(("o_proj.weight", (d, H * m.v_head_dim), None))
    return out


def _moe_specs(cfg: ModelConfig, mp: str, dt: str) -> Iterator[TensorSpec]:
    m, d = cfg.moe, cfg.hidden_size
    yield TensorSpec(mp + "gate.weight", (m.num_experts, d), dt, "float")
    yield TensorSpec(mp + "gate.e_score_correction_bias", (m.num_experts,), "F32", "float")
    inner = m.latent_size or d
    if m.latent_size is not None:
        yield TensorSpec(mp + "routed_expert_down_proj.weight", (inner, d), dt, "float")
        if m.latent_use_norm:
            yield TensorSpec(mp + "routed_expert_norm.weight", (inner,), dt, "float")
        yield TensorSpec(mp + "routed_expert_up_proj.weight", (d, inner), dt, "float")
    inter = m.expert_intermediate_size
    shapes = {"w1": (inter, inner), "w2": (inner, inter), "w3": (inter, inner)}
    for e in range(m.num_experts):
        for w in ("w1", "w2", "w3"):
            yield from expert_specs(cfg, f"{mp}experts.{e}.{w}", shapes[w], dt)
    if m.num_shared_experts:
        s = m.shared_intermediate_size
        for name, shape in (("gate_proj", (s, d)), ("up_proj", (s, d)), ("down_proj", (d, s))):
            yield TensorSpec(mp + f"shared_experts.{name}.weight", shape, dt, "float")


def expert_specs(cfg: ModelConfig, module: str, shape: tuple[int, int], dt: str) -> Iterator[TensorSpec]:
    """One routed-expert matrix: packed codes + scales when the config is quantized (MXFP4: E8M0
    bytes per 32; NVFP4: E4M3 per 16 and an F32 global scale), else a weight."""
    out, inp = shape
    if cfg.quant is None:
        yield TensorSpec(module + ".weight", shape, dt, "float", routed_expert=True)
        return
    yield TensorSpec(module + ".weight_packed", (out, inp // 2), "U8", "packed", routed_expert=True)
    if cfg.quant.scheme == "mxfp4":
        yield TensorSpec(module + ".weight_scale", (out, inp // GROUP), "U8", "scale", routed_expert=True)
        return
    yield TensorSpec(module + ".weight_scale", (out, inp // NV_GROUP), "F8_E4M3", "scale", routed_expert=True)
    yield TensorSpec(module + ".weight_global_scale", (1,), "F32", "scale", routed_expert=True)
    if cfg.quant.input_scales:
        yield TensorSpec(module + ".input_global_scale", (1,), "F32", "scale", routed_expert=True, optional=True)


def _vision_specs(cfg: ModelConfig) -> Iterator[TensorSpec]:
    v = cfg.vision
    assert v is not None
    c, ps = v.hidden_size, v.patch_size
    vt = "vision_tower."

    def spec(name: str, shape: tuple[int, ...]) -> TensorSpec:
        return TensorSpec(name, shape, "BF16", "float", vision=True)

    yield spec(vt + "patch_embed.proj.weight", (c, 3, ps, ps))
    yield spec(vt + "patch_embed.pos_emb.weight", (v.pos_emb_height, v.pos_emb_width, c))
    for b in range(v.num_layers):
        bp = f"{vt}encoder.blocks.{b}."
        yield spec(bp + "norm0.weight", (c,))
        yield spec(bp + "norm1.weight", (c,))
        yield spec(bp + "wqkv.weight", (3 * v.qkv_hidden_size, c))
        yield spec(bp + "wo.weight", (c, v.qkv_hidden_size))
        yield spec(bp + "mlp.fc0.weight", (v.intermediate_size, c))
        yield spec(bp + "mlp.fc1.weight", (c, v.intermediate_size))
    yield spec(vt + "encoder.final_layernorm.weight", (c,))
    merged = v.mm_hidden_size * v.merge_kernel[0] * v.merge_kernel[1]
    yield spec("mm_projector.proj.0.weight", (merged, merged))
    yield spec("mm_projector.proj.2.weight", (v.text_hidden_size, merged))
    yield spec("mm_projector.post_norm.weight", (v.text_hidden_size,))


def loaded_weight_bytes(cfg: ModelConfig, dtype_bytes: int = 4) -> int:
    """Bytes a text model's weights take once loaded with float tensors `dtype_bytes` wide
    (models/registry.py load_model: float32 by default, as the engine loads a `draft_model`
    drafter): packed experts and their scales stay as stored. The engine reserves a draft's this
    way (engine/startup.py spec_reserve) and the planner the same (--draft-model)."""
    return sum(
        s.params * dtype_bytes if s.role == "float" else s.nbytes for s in model_tensor_specs(cfg, include_vision=False)
    )
