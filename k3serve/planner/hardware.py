"""Accelerator facts for planning (planner-data.md §1-2; source tags S1-S13 there).

Capacities are the vendor figures in bytes (1 GB = 1e9 B); throughput is dense (no 2:4
sparsity); scale-up bandwidth is the per-GPU bidirectional figure. Custom parts come from
flags or a JSON/TOML file with the same field names.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

GB, TB = 10**9, 10**12


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes: int
    hbm_bw: float  # bytes/s
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float
    fp4_flops: float  # 0 = no FP4 tensor cores (MXFP4 weights run at FP8/BF16 rates)
    scaleup_bw: float  # bytes/s per GPU, bidirectional
    scaleup_domain: int  # GPUs in one NVLink / Infinity Fabric domain
    nic_bw: float  # bytes/s per direction per GPU (scale-out)
    usd_per_hour: float = 0.0  # price of one GPU-hour (PRICES; --price overrides)

    @property
    def native_fp4(self) -> bool:
        return self.fp4_flops > 0

    def to_dict(self) -> dict:
        return asdict(self)


# Illustrative on-demand USD per GPU-hour (late-2026 list prices vary by 2x between clouds;
# an assumption, printed with every cost figure, overridden with --price GPU=USD).
PRICES = {
    "H100": 2.5,
    "H200": 3.5,
    "B200": 5.0,
    "B300": 6.5,
    "GB200": 6.0,
    "GB300": 7.5,
    "MI300X": 2.5,
    "MI325X": 3.0,
    "MI350X": 4.0,
    "MI355X": 4.5,
}


def _g(name, hbm_gb, bw_tbs, bf16_tf, fp8_tf, fp4_tf, nvl_gbs, domain, nic_gbs, usd=None) -> GPU:
    return GPU(
        name,
        int(hbm_gb * GB),
        bw_tbs * TB,
        bf16_tf * TB,
        fp8_tf * TB,
        fp4_tf * TB,
        nvl_gbs * GB,
        domain,
        nic_gbs * GB,
        PRICES.get(name, 0.0) if usd is None else usd,
    )


def with_prices(gpus: list[GPU], overrides: list[str]) -> list[GPU]:
    """Apply `GPU=USD` overrides (per GPU-hour) to the listed GPUs."""
    prices = {}
    for item in overrides:
        name, _, usd = item.partition("=")
        try:
            price = float(usd)
        except ValueError:
            price = -1.0
        if price < 0 or price != price:
            raise ValueError(f"--price {item!r}: expected GPU=USD per GPU-hour, e.g. H200=3.5")
        prices[ALIASES.get(name.upper(), name.upper())] = price
    return [replace(g, usd_per_hour=prices.get(g.name.upper(), g.usd_per_hour)) for g in gpus]


GPUS: dict[str, GPU] = {
    g.name: g
    for g in [
        _g("H100", 80, 3.35, 989, 1979, 0, 900, 8, 50),  # S1, S2, S3; ConnectX-7 400 Gb/s (S12)
        _g("H200", 141, 4.8, 989, 1979, 0, 900, 8, 50),  # S2, S3, S13
        _g("B200", 180, 8.0, 2250, 4500, 9000, 1800, 8, 50),  # 180 GB usable of 192 (S4, S6, S8)
        _g("B300", 288, 8.0, 2250, 4500, 13000, 1800, 8, 100),  # FP4 13-14 PF quoted (S5, S6, S8); CX-8
        _g("GB200", 186, 8.0, 2500, 5000, 10000, 1800, 72, 50),  # NVL72: 13.4 TB / 72 (S4, S7)
        _g("GB300", 279, 8.0, 2500, 5000, 15000, 1800, 72, 100),  # NVL72: ~20 TB / 72, lower bound (S5, S6)
        _g("MI300X", 192, 5.3, 1307, 2615, 0, 896, 8, 50),  # IF point-to-point 7 x 128 GB/s (S3, S9, S11)
        _g("MI325X", 256, 6.0, 1307, 2615, 0, 896, 8, 50),  # S9
        _g("MI350X", 288, 8.0, 2300, 4600, 9200, 1075, 8, 50),  # ~7 x 153.6 GB/s (S10)
        _g("MI355X", 288, 8.0, 2500, 5000, 10000, 1075, 8, 50),  # S10
    ]
}
ALIASES = {"H100-SXM": "H100", "H200-SXM": "H200"}


def get_gpu(name: str) -> GPU:
    key = ALIASES.get(name.upper(), name.upper())
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} (or describe one with --gpu-file)")
    return GPUS[key]


def load_gpu_file(path: str | Path) -> GPU:
    """A custom GPU from JSON or TOML: {name, hbm_gb, hbm_bw_tbs, bf16_tflops, fp8_tflops,
    fp4_tflops, scaleup_gbs, scaleup_domain, nic_gbs, usd_per_hour}."""
    p = Path(path)
    text = p.read_text()
    if p.suffix == ".toml":
        import tomllib

        raw = tomllib.loads(text)
    else:
        raw = json.loads(text)
    need = ["name", "hbm_gb", "hbm_bw_tbs", "bf16_tflops", "fp8_tflops"]
    missing = [k for k in need if k not in raw]
    if missing:
        optional = ["fp4_tflops", "scaleup_gbs", "scaleup_domain", "nic_gbs", "usd_per_hour"]
        raise ValueError(f"{p}: missing {missing}; fields: {need + optional}")
    return _g(
        raw["name"],
        raw["hbm_gb"],
        raw["hbm_bw_tbs"],
        raw["bf16_tflops"],
        raw["fp8_tflops"],
        raw.get("fp4_tflops", 0),
        raw.get("scaleup_gbs", 900),
        raw.get("scaleup_domain", 8),
        raw.get("nic_gbs", 50),
        raw.get("usd_per_hour", 0.0),
    )


FIELD_NAMES = [f.name for f in fields(GPU)]
