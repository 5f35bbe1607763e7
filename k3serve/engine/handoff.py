"""Prefill/decode disaggregation, engine side (issue 17): one request's state handed from the
engine that prefilled it to the engine that decodes it.

For K3 a request at the end of prefill is its MLA latent rows (`latent[l][row]`, row =
block * block_size + offset, 576 values per token per MLA layer) **plus** its KDA recurrent and
conv state (one slot per KDA layer: [H, D, D] and [K-1, 3P], fp32). Both go, exactly; without the
state the decode engine would continue from a wrong recurrence.

  prefill engine: a request added with `keep_cache` runs its prompt and samples the first
    token; when it finishes, its rows and state are copied into `HandoffStore` (the cache is
    freed at once: the pools return to zero) and kept until pulled or `ttl_s` passes.
  decode engine: `held_tokens(prompt)` says how much of the prompt it already caches (whole
    latent blocks); the prefill engine's `pull(request_id, held)` sends only the rest of the
    rows plus the whole state; `install` shares the held blocks, writes the rest and the state
    into a fresh allocation, and the request decodes as if it had been prefilled there.

Byte counts equal planner/disagg.py `handoff` (latent bytes x tokens not held + KDA state).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field

import torch

from k3serve.runner.forward_batch import CacheTensors


@dataclass
class KVHandoff:
    request_id: str
    prompt_token_ids: list[int]
    first_token: int  # sampled by the prefill engine from the prompt's last position
    block_size: int
    start: int  # latent rows are carried for prompt positions [start, len(prompt)); the rest are held
    latent: dict[int, torch.Tensor]  # MLA layer -> [len(prompt) - start, cache_dim] (cache dtype)
    recurrent: dict[int, torch.Tensor]  # KDA layer -> [H, D, D] fp32, the state after the prompt
    conv: dict[int, torch.Tensor]  # KDA layer -> [K-1, 3P] fp32

    @property
    def latent_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.latent.values())

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.recurrent.values(), *self.conv.values()))

    @property
    def nbytes(self) -> int:
        return self.latent_bytes + self.state_bytes


def rows_of(table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Latent-cache rows of positions [start, end) under a block table."""
    pos = torch.arange(start, end)
    return torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size


def capture(cache: CacheTensors, request_id: str, prompt: list[int], first_token: int, table: list[int],
            slot: int) -> KVHandoff:
    """Copy a finished prefill's rows (every prompt position) and state out of the cache."""
    rows = rows_of(table, 0, len(prompt), cache.block_size)
    latent = {i: t[rows].clone() for i, t in enumerate(cache.latent) if t is not None}
    rec = {i: t[slot].clone() for i, t in enumerate(cache.recurrent) if t is not None}
    conv = {i: t[slot].clone() for i, t in enumerate(cache.conv) if t is not None}
    return KVHandoff(request_id, list(prompt), first_token, cache.block_size, 0, latent, rec, conv)


def install(cache: CacheTensors, h: KVHandoff, table: list[int], slot: int) -> None:
    """Write a hand-off into an allocation: rows [start, len(prompt)) and the state slot."""
    if h.block_size != cache.block_size:
        raise ValueError(f"hand-off block size {h.block_size} != this engine's {cache.block_size}")
    rows = rows_of(table, h.start, len(h.prompt_token_ids), cache.block_size)
    for i, t in enumerate(cache.latent):
        if t is not None:
            t[rows] = h.latent[i].to(t.dtype)
    for i, t in enumerate(cache.recurrent):
        if t is not None:
            t[slot] = h.recurrent[i]
            cache.conv[i][slot] = h.conv[i]


@dataclass
class HandoffStore:
    """Captured prefills waiting for their decode engine, dropped after `ttl_s`."""
    ttl_s: float = 60.0
    held: dict[str, tuple[KVHandoff, float]] = field(default_factory=dict)

    def put(self, h: KVHandoff) -> None:
        self.expire()
        self.held[h.request_id] = (h, time.monotonic() + self.ttl_s)

    def pull(self, request_id: str, held_tokens: int = 0) -> KVHandoff:
        """The hand-off, without the latent rows of the first `held_tokens` prompt tokens (whole
        blocks: a partly held block is sent again); removed from the store."""
        self.expire()
        if request_id not in self.held:
            raise KeyError(f"no prefilled request {request_id!r} to hand off (never kept, pulled, or expired)")
        h, _ = self.held.pop(request_id)
        start = min(held_tokens, len(h.prompt_token_ids) - 1) // h.block_size * h.block_size
        return KVHandoff(h.request_id, h.prompt_token_ids, h.first_token, h.block_size, start,
                         {i: t[start:] for i, t in h.latent.items()}, h.recurrent, h.conv)

    def expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, (_, deadline) in self.held.items() if deadline < now]:
            del self.held[rid]


# ---- wire format: one safetensors blob (what the prefill server's /v1/kv/pull returns) ---------
def to_bytes(h: KVHandoff) -> bytes:
    from safetensors.torch import save

    tensors = {f"latent.{i}": t.contiguous() for i, t in h.latent.items()}
    tensors.update({f"recurrent.{i}": t.contiguous() for i, t in h.recurrent.items()})
    tensors.update({f"conv.{i}": t.contiguous() for i, t in h.conv.items()})
    meta = {"request_id": h.request_id, "prompt_token_ids": json.dumps(h.prompt_token_ids),
            "first_token": str(h.first_token), "block_size": str(h.block_size), "start": str(h.start)}
    return save(tensors, metadata=meta)


def from_bytes(data: bytes) -> KVHandoff:
    from safetensors import safe_open

    parts: dict[str, dict[int, torch.Tensor]] = {"latent": {}, "recurrent": {}, "conv": {}}
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:  # safe_open reads files (and checks headers)
        f.write(data)
        f.flush()
        with safe_open(f.name, framework="pt") as st:
            meta = st.metadata() or {}
            for name in st.keys():
                kind, layer = name.split(".")
                parts[kind][int(layer)] = st.get_tensor(name)
    try:
        return KVHandoff(meta["request_id"], json.loads(meta["prompt_token_ids"]), int(meta["first_token"]),
                         int(meta["block_size"]), int(meta["start"]), parts["latent"], parts["recurrent"],
                         parts["conv"])
    except (KeyError, ValueError) as e:
        raise ValueError(f"not a k3serve hand-off: metadata {e} missing or malformed") from None
