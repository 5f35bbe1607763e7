"""EngineInfo: what the server reads of an engine, once, at start-up (issue 51's seam: no
handler reaches through `state.engine.engine`). `LLMEngine.info()` builds it; the async and
data-parallel engines hand their (first) replica's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineInfo:
    model_path: str
    model_type: str  # "kimi_k3" | "kimi_linear"
    tokenizer: Any  # tokenizer/ Tokenizer
    max_model_len: int
    vocab_size: int
    eos_token_id: Any
    unmapped: frozenset  # ids the tokenizer cannot decode (masked out of sampling)
    num_slots: int  # requests that can run at once
    seq_limit_note: str | None  # why fewer than --max-num-seqs, if so
    block_size: int  # latent rows per block (a hand-off's granularity)
    slot_bytes: int  # one KDA state slot, every KDA layer
    vision: Any  # the vision tower's config, or None
    speculative: bool
    handoffs: Any  # engine/handoff.py HandoffStore: prefills kept for decode engines
    model_source: str = ""  # the hub repo id served, or "" for a local folder: /v1/models `root`
