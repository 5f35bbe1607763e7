"""ModelConfig: the one parsed view of a Kimi-K3 / Kimi-Linear `config.json`.

Both real layouts are accepted (k3-model-spec.md §1):
  * `kimi_k3`: top level with `text_config` (model fields, `quantization_config` inside it)
    and `vision_config`; tensors under `language_model.`.
  * `kimi_linear`: one flat dict; tensors under `model.` / `lm_head.`.
Layer kinds come from the **1-based** `full_attn_layers` / `kda_layers` (spec §2).
Serialization noise (`head_dim: 74`, `rope_*`, generation keys) is ignored.
Every inconsistency raises `ConfigError` naming the offending field.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3serve.config.parse import ConfigError, Fields
from k3serve.config.quant_config import QuantConfig, parse_quant_config
from k3serve.config.vision_config import VisionConfig, parse_vision_config


class LayerKind(str, enum.Enum):
    KDA = "kda"
    MLA = "mla"


@dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention dims (`linear_attn_config`)."""

    num_heads: int
    head_dim: int
    conv_kernel: int
    use_full_rank_gate: bool  # K3: g_proj [P, d]; Kimi-Linear: g_a/g_b low rank
    gate_lower_bound: float | None  # set => sigmoid-bounded decay (K3), else softplus

    @property
    def proj_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class MLAConfig:
    """Gated MLA dims (NoPE: the 64 'rope' dims are plain extra key dims)."""

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    use_output_gate: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values cached per token per layer: normed latent + shared k_pe (576 for K3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Routed + shared experts; `latent_size` set => latent MoE (K3)."""

    num_experts: int
    top_k: int
    num_shared_experts: int
    expert_intermediate_size: int
    latent_size: int | None
    latent_use_norm: bool
    router_activation: str
    renormalize: bool
    routed_scaling_factor: float
    num_expert_group: int
    topk_group: int
    first_k_dense_replace: int
    layer_freq: int

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.expert_intermediate_size


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to know about the text model, parsed once."""

    architecture: str
    model_type: str  # top-level: "kimi_k3" or "kimi_linear"
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int  # dense layer-0 MLP
    hidden_act: str  # "situ" or "silu"
    situ_beta: float
    situ_linear_beta: float | None
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int
    pad_token_id: int | None
    dtype: str
    attn_res_block_size: int | None
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig
    layer_kinds: tuple[LayerKind, ...]
    quant: QuantConfig | None
    vision: VisionConfig | None
    media_placeholder_token_id: int | None

    # ---- derived views -------------------------------------------------------------
    @property
    def is_k3(self) -> bool:
        return self.model_type == "kimi_k3"

    @property
    def tensor_prefix(self) -> str:
        """Prefix of text tensors in the checkpoint (spec §1.6)."""
        return "language_model." if self.is_k3 else ""

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is LayerKind.MLA)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is LayerKind.KDA)

    def is_moe_layer(self, i: int) -> bool:
        m = self.moe
        return m.num_experts > 0 and i >= m.first_k_dense_replace and i % m.layer_freq == 0

    @property
    def use_attnres(self) -> bool:
        return self.attn_res_block_size is not None

    @property
    def attnres_block_starts(self) -> tuple[int, ...]:
        if self.attn_res_block_size is None:
            return ()
        return tuple(range(0, self.num_layers, self.attn_res_block_size))

    @property
    def use_latent_moe(self) -> bool:
        return self.moe.latent_size is not None

    @property
    def use_situ(self) -> bool:
        return self.hidden_act == "situ"

    @property
    def use_bounded_decay(self) -> bool:
        return self.kda.gate_lower_bound is not None

    @property
    def use_q_lora(self) -> bool:
        return self.mla.q_lora_rank is not None

    # ---- construction --------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        return parse_model_config(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError("config.json", f"cannot read {path}: {e}") from e
        return parse_model_config(raw)


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    if not isinstance(raw, dict):
        raise ConfigError("config.json", "top level must be a JSON object")
    top_type = raw.get("model_type")
    if top_type == "kimi_k3":
        if not isinstance(raw.get("text_config"), dict):
            raise ConfigError("text_config", "kimi_k3 config needs a text_config object")
        text = Fields(raw["text_config"], "text_config.")
        arch = _architecture(raw)
        vision = parse_vision_config(raw.get("vision_config"))
        quant_raw = raw["text_config"].get("quantization_config", raw.get("quantization_config"))
        media_id = raw.get("media_placeholder_token_id")
    elif top_type == "kimi_linear":
        text = Fields(raw, "")
        arch = _architecture(raw)
        vision, quant_raw, media_id = None, raw.get("quantization_config"), None
    else:
        raise ConfigError("model_type", f"unsupported model_type {top_type!r}; expected 'kimi_k3' or 'kimi_linear'")
    num_layers = text.int("num_hidden_layers", minimum=1)
    lac = Fields(text.obj("linear_attn_config"), text.prefix + "linear_attn_config.")
    kinds = _layer_kinds(lac, num_layers)
    cfg = ModelConfig(
        architecture=arch,
        model_type=top_type,
        vocab_size=text.int("vocab_size", minimum=1),
        hidden_size=text.int("hidden_size", minimum=1),
        num_layers=num_layers,
        intermediate_size=text.int("intermediate_size", minimum=1),
        hidden_act=text.choice("hidden_act", ("situ", "silu")),
        situ_beta=text.float("activation_situ_beta", default=4.0),
        situ_linear_beta=text.opt_float("activation_situ_linear_beta", default=None),
        rms_norm_eps=text.float("rms_norm_eps", default=1e-5),
        max_position_embeddings=text.int("max_position_embeddings", default=1048576),
        tie_word_embeddings=text.bool("tie_word_embeddings", default=False),
        bos_token_id=text.opt_int("bos_token_id", default=None),
        eos_token_id=_eos(text),
        pad_token_id=text.opt_int("pad_token_id", default=None),
        dtype=str(text.raw.get("dtype") or text.raw.get("torch_dtype") or "bfloat16"),
        attn_res_block_size=text.opt_int("attn_res_block_size", default=None, minimum=1),
        kda=_kda(lac),
        mla=_mla(text),
        moe=_moe(text),
        layer_kinds=kinds,
        quant=parse_quant_config(quant_raw),
        vision=vision,
        media_placeholder_token_id=media_id,
    )
    _check_consistency(cfg)
    return cfg


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ConfigError("architectures", "must be a non-empty list of class names")
    return archs[0]


def _eos(text: Fields) -> int:
    eos = text.raw.get("eos_token_id")
    if isinstance(eos, list) and eos and all(isinstance(e, int) for e in eos):
        return eos[0]
    return text.int("eos_token_id", minimum=0)


def _layer_kinds(lac: Fields, num_layers: int) -> tuple[LayerKind, ...]:
    full = lac.int_list("full_attn_layers")
    kda = lac.int_list("kda_layers")
    for name, ids in (("full_attn_layers", full), ("kda_layers", kda)):
        bad = [i for i in ids if not 1 <= i <= num_layers]
        if bad:
            raise ConfigError(lac.prefix + name, f"indices are 1-based in 1..{num_layers}; got {bad}")
        if len(set(ids)) != len(ids):
            raise ConfigError(lac.prefix + name, "contains duplicate layer indices")
    both = sorted(set(full) & set(kda))
    if both:
        raise ConfigError(lac.prefix + "kda_layers", f"layers {both} are also in full_attn_layers")
    missing = sorted(set(range(1, num_layers + 1)) - set(full) - set(kda))
    if missing:
        raise ConfigError(lac.prefix + "kda_layers", f"layers {missing} are in neither kda_layers nor full_attn_layers")
    return tuple(LayerKind.MLA if i + 1 in set(full) else LayerKind.KDA for i in range(num_layers))


def _kda(lac: Fields) -> KDAConfig:
    return KDAConfig(
        num_heads=lac.int("num_heads", minimum=1),
        head_dim=lac.int("head_dim", minimum=1),
        conv_kernel=lac.int("short_conv_kernel_size", default=4, minimum=1),
        use_full_rank_gate=lac.bool("use_full_rank_gate", default=False),
        gate_lower_bound=lac.opt_float("gate_lower_bound", default=None),
    )


def _mla(text: Fields) -> MLAConfig:
    if not text.bool("mla_use_nope", default=True):
        raise ConfigError(
            text.prefix + "mla_use_nope",
            "RoPE MLA is not part of Kimi-K3/Kimi-Linear; only mla_use_nope=true is supported",
        )
    heads = text.int("num_attention_heads", minimum=1)
    kv_heads = text.int("num_key_value_heads", default=heads)
    if kv_heads != heads:
        raise ConfigError(
            text.prefix + "num_key_value_heads", f"MLA decompresses per-head K/V; expected {heads}, got {kv_heads}"
        )
    return MLAConfig(
        num_heads=heads,
        q_lora_rank=text.opt_int("q_lora_rank", default=None, minimum=1),
        kv_lora_rank=text.int("kv_lora_rank", minimum=1),
        qk_nope_head_dim=text.int("qk_nope_head_dim", minimum=1),
        qk_rope_head_dim=text.int("qk_rope_head_dim", minimum=0),
        v_head_dim=text.int("v_head_dim", minimum=1),
        use_output_gate=text.bool("mla_use_output_gate", default=False),
    )


def _moe(text: Fields) -> MoEConfig:
    num_experts = text.int("num_experts", minimum=0)
    top_k = text.int("num_experts_per_token", minimum=1)
    if num_experts and top_k > num_experts:
        raise ConfigError(text.prefix + "num_experts_per_token", f"top-k {top_k} exceeds num_experts {num_experts}")
    grouped = text.bool("use_grouped_topk", default=False)
    groups = text.int("num_expert_group", default=1, minimum=1) if grouped else 1
    topk_group = text.int("topk_group", default=1, minimum=1) if grouped else 1
    if num_experts % groups:
        raise ConfigError(text.prefix + "num_expert_group", f"{groups} groups do not divide {num_experts} experts")
    if topk_group > groups:
        raise ConfigError(text.prefix + "topk_group", f"{topk_group} > num_expert_group {groups}")
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        num_shared_experts=text.int("num_shared_experts", default=0, minimum=0),
        expert_intermediate_size=text.int("moe_intermediate_size", minimum=1),
        latent_size=text.opt_int("routed_expert_hidden_size", default=None, minimum=1),
        latent_use_norm=text.bool("latent_moe_use_norm", default=False),
        router_activation=text.choice("moe_router_activation_func", ("sigmoid", "softmax"), default="sigmoid"),
        renormalize=text.bool("moe_renormalize", default=True),
        routed_scaling_factor=text.float("routed_scaling_factor", default=1.0),
        num_expert_group=groups,
        topk_group=topk_group,
        first_k_dense_replace=text.int("first_k_dense_replace", default=0, minimum=0),
        layer_freq=text.int("moe_layer_freq", default=1, minimum=1),
    )


def _check_consistency(cfg: ModelConfig) -> None:
    p = "text_config." if cfg.is_k3 else ""
    if cfg.hidden_act == "situ" and cfg.situ_beta <= 0:
        raise ConfigError(p + "activation_situ_beta", "must be > 0")
    if cfg.vision is not None and cfg.vision.text_hidden_size != cfg.hidden_size:
        raise ConfigError(
            "vision_config.text_hidden_size", f"{cfg.vision.text_hidden_size} != text hidden_size {cfg.hidden_size}"
        )
    if cfg.quant is not None and cfg.quant.group_size:
        g = cfg.quant.group_size
        inner = cfg.moe.latent_size or cfg.hidden_size
        for name, dim in (
            ("routed_expert_hidden_size", inner),
            ("moe_intermediate_size", cfg.moe.expert_intermediate_size),
        ):
            if dim % g:
                raise ConfigError(p + name, f"{dim} is not a multiple of the {cfg.quant.scheme.upper()} group size {g}")
    if cfg.eos_token_id >= cfg.vocab_size:
        raise ConfigError(p + "eos_token_id", f"{cfg.eos_token_id} >= vocab_size {cfg.vocab_size}")
