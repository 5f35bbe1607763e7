"""CompilationConfig: how the `graph` backend's static decode step is compiled and captured.

Spelled as vLLM's `--compilation-config` JSON where vLLM has the key (`cudagraph_capture_sizes`,
`max_cudagraph_capture_size`, `backend`); `--enforce-eager` turns compilation and capture off
(the static step then runs eagerly, still sync-free).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's capture sizes: 1, 2, 4, then every 8 up to 256, every 16 beyond; capped at max_size
    (which is itself a size, so the largest batch never falls back to eager)."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max(max_size, 272) + 1, 16))
    return sorted({s for s in sizes if s < max_size} | {max_size})


@dataclass
class CompilationConfig:
    cudagraph_capture_sizes: list[int] | None = None  # batch buckets; default from max_num_seqs
    max_cudagraph_capture_size: int | None = None  # largest bucket (default: max_num_seqs)
    backend: str = "inductor"  # torch.compile backend of the static step (aot_eager: the suite's)
    # k3serve's own keys. A new bucket compiles on a thread of its own while its steps run
    # eagerly (a first batch size stalled every stream up to 44 s when it compiled inside the
    # step); ranks of a TP or DP-attention group compile in the step, where they agree on it.
    compile_in_background: bool = True
    max_compiled_buckets: int = 32  # compiled variants kept (~10-50 MB each); steps beyond run eagerly
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backend not in COMPILE_BACKENDS:
            raise ValueError(f"compilation_config.backend must be one of {COMPILE_BACKENDS}, got {self.backend!r}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not sizes or any(not isinstance(s, int) or s < 1 for s in sizes)):
            raise ValueError(f"compilation_config.cudagraph_capture_sizes must be positive integers, got {sizes!r}")
        if not isinstance(self.compile_in_background, bool):
            raise ValueError(
                f"compilation_config.compile_in_background must be true or false, got {self.compile_in_background!r}"
            )
        cap = self.max_compiled_buckets
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"compilation_config.max_compiled_buckets must be a positive integer, got {cap!r}")

    @classmethod
    def parse(cls, value: "str | dict | CompilationConfig | None") -> "CompilationConfig":
        """A JSON object (the flag's text), a dict (the Python API) or a config."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = json.loads(value)  # a JSONDecodeError is a ValueError naming the position
        if not isinstance(value, dict):
            raise ValueError(f"compilation_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)} - {"extra"}
        # vLLM keys that do not apply to this engine's single static step are kept, not refused
        # (a shared launch line must not die here), and reported by the startup log
        return cls(
            **{k: v for k, v in value.items() if k in known}, extra={k: v for k, v in value.items() if k not in known}
        )

    def capture_sizes(self, max_num_seqs: int) -> list[int]:
        top = min(self.max_cudagraph_capture_size or max_num_seqs, max_num_seqs)
        if self.cudagraph_capture_sizes is not None:
            return sorted({s for s in self.cudagraph_capture_sizes if s <= top}) or [top]
        return default_capture_sizes(top)
