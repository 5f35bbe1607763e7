"""`--speculative-config` (vLLM keys): method, num_speculative_tokens, model, draft_sample_method,
rejection_sample_method, prompt_lookup_min/max (ngram); and k3serve's `adaptive` (default true:
num_speculative_tokens is the most a request drafts, each step's lengths are chosen from
measured costs and acceptance; false: always K, for an exact A/B). Pure Python; errors name the key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "dspark", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    draft_sample_method: str = "greedy"  # "greedy" (q one-hot) | "probabilistic" (sample from q, keep q)
    rejection_sample_method: str = "standard"  # "standard" | "block"
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    adaptive: bool = True  # choose each step's draft lengths (spec_decode/adaptive.py); False: always K

    def resolve_model(self, target_dir: str) -> "SpeculativeConfig":
        """A draft path that does not exist as given is looked up inside the target's directory
        (the demo ships its draft as `<model>/dspark`)."""
        from dataclasses import replace
        from pathlib import Path

        if self.model and not Path(self.model).exists() and (Path(target_dir) / self.model).exists():
            return replace(self, model=str(Path(target_dir) / self.model))
        return self

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "SpeculativeConfig":
        known = {
            "method",
            "num_speculative_tokens",
            "model",
            "draft_sample_method",
            "rejection_sample_method",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "adaptive",
        }
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        method = raw.get("method") or ("draft_model" if raw.get("model") else None)
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {raw.get('method')!r}")
        k = raw.get("num_speculative_tokens")
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an int in 1..16, got {k!r}")
        cfg = cls(
            method,
            k,
            raw.get("model"),
            raw.get("draft_sample_method", "greedy"),
            raw.get("rejection_sample_method", "standard"),
            int(raw.get("prompt_lookup_min", 1)),
            int(raw.get("prompt_lookup_max", 4)),
            raw.get("adaptive", True),
        )
        if not isinstance(cfg.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {cfg.adaptive!r}")
        if cfg.draft_sample_method not in ("greedy", "probabilistic"):
            raise ValueError("speculative_config.draft_sample_method must be 'greedy' or 'probabilistic'")
        if cfg.rejection_sample_method not in ("standard", "block"):
            raise ValueError("speculative_config.rejection_sample_method must be 'standard' or 'block'")
        if method != "ngram" and not cfg.model:
            raise ValueError(f"speculative_config.model (a draft checkpoint dir) is required for {method}")
        if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        return cfg
