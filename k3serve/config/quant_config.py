"""compressed-tensors `quantization_config` (k3-model-spec.md §1.3).

Only what the engine acts on is kept. Which tensors are MXFP4 is decided per tensor by the
checkpoint (`weight_packed` + `weight_scale` present), as LCPP/NEMO/URB do; this config only
names the method and the group size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k3serve.config.parse import ConfigError, Fields


@dataclass(frozen=True)
class QuantConfig:
    quant_method: str  # "compressed-tensors"
    format: str  # "mxfp4-pack-quantized"
    num_bits: int
    group_size: int
    ignore: tuple[str, ...]


def parse_quant_config(raw: Any) -> QuantConfig | None:
    if raw is None:
        return None
    f = Fields(raw, "quantization_config.")
    method = f.choice("quant_method", ("compressed-tensors",))
    fmt = f.choice("format", ("mxfp4-pack-quantized",))
    groups = f.obj("config_groups")
    if not groups:
        raise ConfigError("quantization_config.config_groups", "is empty")
    name, group = next(iter(groups.items()))
    w = Fields(
        Fields(group, f"quantization_config.config_groups.{name}.").obj("weights"),
        f"quantization_config.config_groups.{name}.weights.",
    )
    num_bits = w.int("num_bits")
    group_size = w.int("group_size")
    if (num_bits, group_size, w.raw.get("type")) != (4, 32, "float"):
        raise ConfigError(
            w.prefix + "num_bits",
            f"only MXFP4 (4-bit float, group 32) is supported, got "
            f"{num_bits}-bit {w.raw.get('type')} group {group_size}",
        )
    return QuantConfig(method, fmt, num_bits, group_size, tuple(raw.get("ignore") or ()))
