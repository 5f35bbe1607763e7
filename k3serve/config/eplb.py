"""`--eplb-config` (vLLM's keys, `vllm/config/parallel.py` EPLBConfig): how the expert-parallel
load balancer (`--enable-eplb`, runner/eplb.py) measures and moves. Pure Python; errors name the key."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class EPLBConfig:
    window_size: int = 1000  # steps of expert load a rebalance weighs (the last ones before it)
    step_interval: int = 3000  # steps between rebalances
    num_redundant_experts: int = 0  # extra physical expert slots over the expert group (hot experts' replicas)
    log_balancedness: bool = False  # log each rebalance's max/mean tokens per rank, before and after
    use_async: bool = False  # vLLM's background transfer; here the move runs at a step boundary
    policy: str = "default"  # the hierarchical placement (parallel/eplb_policy.py)

    def __post_init__(self) -> None:
        for name in ("window_size", "step_interval"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--eplb-config {name} must be an integer >= 1, got {v!r}")
        r = self.num_redundant_experts
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ValueError(f"--eplb-config num_redundant_experts must be an integer >= 0, got {r!r}")
        if not isinstance(self.log_balancedness, bool):
            raise ValueError(f"--eplb-config log_balancedness must be true or false, got {self.log_balancedness!r}")
        if self.use_async is not False:
            raise ValueError(
                "--eplb-config use_async: true is not built: k3serve moves experts between two steps "
                "(one step's pause); leave it false"
            )
        if self.policy != "default":
            raise ValueError(f"--eplb-config policy {self.policy!r}: k3serve has the 'default' (hierarchical) policy")

    @classmethod
    def parse(cls, raw: "EPLBConfig | dict[str, Any] | str | None") -> "EPLBConfig":
        """From the flag's JSON text, a dict (YAML --config, the LLM class) or None (defaults)."""
        if isinstance(raw, cls):
            return raw
        if raw is None:
            return cls()
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"--eplb-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"--eplb-config must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--eplb-config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**raw)
