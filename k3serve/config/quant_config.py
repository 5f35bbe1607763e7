"""compressed-tensors `quantization_config` (k3-model-spec.md §1.3).

Only what the engine acts on is kept. Two packed formats for the routed experts:
`mxfp4-pack-quantized` (K3's release: E2M1 + E8M0 per 32) and `nvfp4-pack-quantized` (E2M1 +
FP8-E4M3 per 16 + a global scale per matrix, weights/nvfp4.py). Activations are computed in
the model dtype for both (W4A16, as vLLM's and SGLang's Hopper paths run NVFP4): an NVFP4
checkpoint's activation scales, where present, are validated and not used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k3serve.config.parse import ConfigError, Fields


@dataclass(frozen=True)
class QuantConfig:
    quant_method: str  # "compressed-tensors"
    format: str  # one of FORMATS
    num_bits: int
    group_size: int
    ignore: tuple[str, ...]
    input_scales: bool = False  # NVFP4 with static-global activations: `input_global_scale` per module
    # MXFP4 weights with MXFP8 activations (the QAT recipe, k3-model-spec.md §1.3): the routed
    # experts' inputs rounded through MXFP8 (E4M3, an E8M0 scale per 32) before each GEMM
    a8: bool = False

    @property
    def scheme(self) -> str:
        """ "mxfp4" or "nvfp4": the packed format of the routed experts."""
        return FORMATS[self.format][0]


# format -> (scheme, group size): both are 4-bit floats
FORMATS = {"mxfp4-pack-quantized": ("mxfp4", 32), "nvfp4-pack-quantized": ("nvfp4", 16)}


def parse_quant_config(raw: Any) -> QuantConfig | None:
    if raw is None:
        return None
    f = Fields(raw, "quantization_config.")
    method = f.choice("quant_method", ("compressed-tensors",))
    fmt = f.choice("format", tuple(FORMATS))
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
    scheme, want = FORMATS[fmt]
    if (num_bits, group_size, w.raw.get("type")) != (4, want, "float"):
        raise ConfigError(
            w.prefix + "num_bits",
            f"{fmt} is a 4-bit float with group {want}, got {num_bits}-bit {w.raw.get('type')} group {group_size}",
        )
    acts = group.get("input_activations") if isinstance(group, dict) else None
    # llm-compressor's NVFP4 (W4A4) stores a static global scale per module for its activations
    input_scales = scheme == "nvfp4" and isinstance(acts, dict) and acts.get("dynamic") in (False, "local")
    a8 = scheme == "mxfp4" and isinstance(acts, dict) and (acts.get("num_bits"), acts.get("type")) == (8, "float")
    if a8 and acts.get("group_size") != 32:
        raise ConfigError(
            f"quantization_config.config_groups.{name}.input_activations.group_size",
            f"MXFP8 activations are grouped by 32, got {acts.get('group_size')}",
        )
    return QuantConfig(method, fmt, num_bits, group_size, tuple(raw.get("ignore") or ()), input_scales, a8)


def mxfp4_quantization_config() -> dict[str, Any]:
    """K3's own compressed-tensors `mxfp4-pack-quantized` config (its release's: routed experts
    only, the ignore list keeping attention, shared experts, the dense MLP and lm_head)."""
    import json
    from pathlib import Path

    bundled = Path(__file__).parent / "bundled" / "moonshotai--Kimi-K3.json"
    return json.loads(bundled.read_text())["text_config"]["quantization_config"]


def nvfp4_quantization_config() -> dict[str, Any]:
    """compressed-tensors' `nvfp4-pack-quantized` config as llm-compressor writes it for NVFP4A16
    (E2M1 + E4M3 per 16 + a global scale per matrix), routed experts only (K3's ignore list)."""
    import json
    from pathlib import Path

    bundled = Path(__file__).parent / "bundled" / "moonshotai--Kimi-K3.json"
    k3 = json.loads(bundled.read_text())["text_config"]["quantization_config"]
    weights = dict(
        num_bits=4,
        type="float",
        group_size=16,
        strategy="tensor_group",
        symmetric=True,
        dynamic=False,
        scale_dtype="torch.float8_e4m3fn",
        observer="minmax",
    )
    group = dict(format="nvfp4-pack-quantized", targets=["Linear"], input_activations=None, weights=weights)
    return {**k3, "format": "nvfp4-pack-quantized", "config_groups": {"group_0": group}}
