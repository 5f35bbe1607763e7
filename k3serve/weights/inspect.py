"""`k3serve inspect`: layer schedule, parameter counts, bytes by dtype/format, cache sizes.

Works from a bundled config alone (the schema lists the release's tensors) or from a local
checkpoint, whose safetensors headers give the exact bytes (nothing is loaded).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

from k3serve.cache import sizing
from k3serve.config.model_config import ModelConfig
from k3serve.weights.checkpoint import CheckpointIndex
from k3serve.weights.hub import load_config
from k3serve.weights.loader import validate_checkpoint
from k3serve.weights.schema import TensorSpec, model_tensor_specs


@dataclass
class InspectReport:
    model: str
    source: str  # "bundled config" or "checkpoint headers"
    architecture: str
    num_layers: int
    layer_schedule: str  # one letter per layer: K = KDA, M = MLA; lower case = dense MLP
    mla_layers: list[int]
    kda_layers: list[int]
    attnres_block_starts: list[int]
    total_params: int  # text model, logical (MXFP4 counts 2 per byte)
    active_params: int  # per token, excluding the input embedding (spec §10)
    active_params_incl_embedding: int
    vision_params: int
    routed_expert_params: int
    routed_expert_bytes_per_expert: int
    weight_bytes: int  # everything in the checkpoint, vision included
    text_weight_bytes: int
    bytes_by_dtype: dict[str, int]
    bytes_by_format: dict[str, int]
    mla_cache_bytes_per_token: int  # BF16
    mla_cache_bytes_per_token_fp8: int
    kda_state_bytes_per_request: int  # FP32 recurrent + FP32 conv


def inspect_model(path_or_name: str | Path) -> InspectReport:
    cfg = load_config(path_or_name)
    p = Path(path_or_name)
    if p.is_dir() and any(p.glob("*.safetensors")):
        index = CheckpointIndex.open(p)
        specs = validate_checkpoint(index, cfg)
        dtypes = {n: t.dtype for n, t in index.tensors.items()}
        nbytes = {n: t.nbytes for n, t in index.tensors.items()}
        return _report(str(path_or_name), "checkpoint headers", cfg, specs, dtypes, nbytes)
    specs = list(model_tensor_specs(cfg))
    return _report(
        str(path_or_name),
        "bundled config",
        cfg,
        specs,
        {s.name: s.dtype for s in specs},
        {s.name: s.nbytes for s in specs},
    )


def _report(
    model: str, source: str, cfg: ModelConfig, specs: list[TensorSpec], dtypes: dict[str, str], nbytes: dict[str, int]
) -> InspectReport:
    by_dtype: dict[str, int] = defaultdict(int)
    by_format: dict[str, int] = defaultdict(int)
    for s in specs:
        by_dtype[dtypes[s.name]] += nbytes[s.name]
        packed = s.role in ("packed", "scale") and cfg.quant is not None
        by_format[cfg.quant.scheme if packed else dtypes[s.name].lower()] += nbytes[s.name]
    text = [s for s in specs if not s.vision]
    total = sum(s.params for s in text)
    expert = sum(s.params for s in text if s.routed_expert)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    n_experts = max(1, n_moe * cfg.moe.num_experts)
    per_expert_params = expert // n_experts
    per_expert_bytes = sum(nbytes[s.name] for s in text if s.routed_expert) // n_experts
    embed = cfg.vocab_size * cfg.hidden_size
    active_incl = total - expert + n_moe * cfg.moe.top_k * per_expert_params
    return InspectReport(
        model=model,
        source=source,
        architecture=cfg.architecture,
        num_layers=cfg.num_layers,
        layer_schedule="".join(_letter(cfg, i) for i in range(cfg.num_layers)),
        mla_layers=list(cfg.mla_layers),
        kda_layers=list(cfg.kda_layers),
        attnres_block_starts=list(cfg.attnres_block_starts),
        total_params=total,
        active_params=active_incl - embed,
        active_params_incl_embedding=active_incl,
        vision_params=sum(s.params for s in specs if s.vision),
        routed_expert_params=expert,
        routed_expert_bytes_per_expert=per_expert_bytes,
        weight_bytes=sum(nbytes[s.name] for s in specs),
        text_weight_bytes=sum(nbytes[s.name] for s in text),
        bytes_by_dtype=dict(sorted(by_dtype.items())),
        bytes_by_format=dict(sorted(by_format.items())),
        mla_cache_bytes_per_token=sizing.mla_cache_bytes_per_token(cfg, "bfloat16"),
        mla_cache_bytes_per_token_fp8=sizing.mla_cache_bytes_per_token(cfg, "fp8"),
        kda_state_bytes_per_request=sizing.kda_state_bytes_per_request(cfg),
    )


def _letter(cfg: ModelConfig, i: int) -> str:
    letter = "K" if i in set(cfg.kda_layers) else "M"
    return letter if cfg.is_moe_layer(i) else letter.lower()


def format_report(r: InspectReport) -> str:
    def gb(n: int) -> str:
        return f"{n:,} B ({n / 1e9:,.2f} GB)"

    rows = [
        ("model", f"{r.model}  [{r.architecture}, from {r.source}]"),
        ("layers", f"{r.num_layers}: {len(r.kda_layers)} KDA + {len(r.mla_layers)} MLA"),
        ("schedule", r.layer_schedule + "  (K=KDA M=MLA, lower case = dense MLP)"),
        ("MLA layers", ", ".join(map(str, r.mla_layers))),
        ("AttnRes blocks", ", ".join(map(str, r.attnres_block_starts)) or "none (pre-norm residual)"),
        ("total params", f"{r.total_params:,} ({r.total_params / 1e9:,.2f} B)"),
        ("active params/token", f"{r.active_params:,} ({r.active_params / 1e9:,.2f} B, excl. embedding)"),
        ("vision params", f"{r.vision_params:,}"),
        ("routed expert", f"{r.routed_expert_bytes_per_expert:,} B per expert"),
        ("weight bytes", gb(r.weight_bytes)),
    ]
    rows += [(f"  {k}", gb(v)) for k, v in r.bytes_by_format.items()]
    rows += [
        ("MLA cache/token", f"{r.mla_cache_bytes_per_token:,} B (bf16), {r.mla_cache_bytes_per_token_fp8:,} B (fp8)"),
        ("KDA state/request", f"{r.kda_state_bytes_per_request:,} B (fp32)"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def report_dict(r: InspectReport) -> dict:
    return asdict(r)
