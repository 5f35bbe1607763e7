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

import dataclasses
import json
import time
from dataclasses import dataclass, field

import torch

from k3serve.executor.transfer import read_request, write_request
from k3serve.outputs import PromptLogprob


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
    # what the request carries beside its cache, so the decode side continues it exactly:
    cache_ids: list[int] | None = None  # prefix-cache keys when media replaced the pads (multimodal/prompt_media.py)
    rng_state: torch.Tensor | None = None  # [5056] uint8: its sampler's generator after the first draw
    first_logprobs: dict[int, float] | None = None  # the first token's {id: logprob} incl. top-n, if asked
    prompt_logprobs: dict[int, PromptLogprob] | None = None  # prompt index -> entry, if asked
    # an fp8 latent cache's per-layer scales the rows were written with (forward/cache.py), or None
    latent_scale: dict[int, float] | None = None

    @property
    def latent_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.latent.values())

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.recurrent.values(), *self.conv.values()))

    @property
    def nbytes(self) -> int:
        return self.latent_bytes + self.state_bytes


def capture(
    executor,
    block_size: int,
    request_id: str,
    prompt: list[int],
    first_token: int,
    table: list[int],
    slot: int,
    **carried,
) -> KVHandoff:
    """Copy a finished prefill's rows (every prompt position) and state, every rank's heads, out
    of the executor's cache; `carried`: the KVHandoff fields beside the cache (cache_ids,
    rng_state, logprobs)."""
    latent, rec, conv, scales = read_request(executor, table, 0, len(prompt), block_size, slot)
    if scales is not None:
        carried["latent_scale"] = scales
    return KVHandoff(request_id, list(prompt), first_token, block_size, 0, latent, rec, conv, **carried)


def install(executor, h: KVHandoff, block_size: int, table: list[int], slot: int) -> None:
    """Write a hand-off into an allocation: rows [start, len(prompt)) on every rank, each rank
    its heads of the state slot."""
    if h.block_size != block_size:
        raise ValueError(f"hand-off block size {h.block_size} != this engine's {block_size}")
    rows = (table, h.start, len(h.prompt_token_ids), block_size)
    write_request(executor, *rows, slot, h.latent, h.latent_scale, h.recurrent, h.conv)


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
        return dataclasses.replace(h, start=start, latent={i: t[start:] for i, t in h.latent.items()})

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
    if h.rng_state is not None:
        tensors["rng.0"] = h.rng_state.contiguous()
    meta = {
        "request_id": h.request_id,
        "prompt_token_ids": json.dumps(h.prompt_token_ids),
        "first_token": str(h.first_token),
        "block_size": str(h.block_size),
        "start": str(h.start),
        "carried": json.dumps(_carried_json(h)),
    }
    return save(tensors, metadata=meta)


def _carried_json(h: KVHandoff) -> dict:
    """cache ids and logprobs as JSON (Python's float repr round-trips exactly)."""
    out: dict = {"cache_ids": h.cache_ids}
    if h.latent_scale is not None:
        out["latent_scale"] = [[i, v] for i, v in h.latent_scale.items()]
    if h.first_logprobs is not None:
        out["first_logprobs"] = [[t, lp] for t, lp in h.first_logprobs.items()]
    if h.prompt_logprobs is not None:
        out["prompt_logprobs"] = [
            [i, e.token_id, e.logprob, e.rank, [list(x) for x in e.top]] for i, e in h.prompt_logprobs.items()
        ]
    return out


def _carried_fields(raw: dict) -> dict:
    out = {"cache_ids": raw.get("cache_ids")}
    if "latent_scale" in raw:
        out["latent_scale"] = {int(i): float(v) for i, v in raw["latent_scale"]}
    if "first_logprobs" in raw:
        out["first_logprobs"] = {int(t): float(lp) for t, lp in raw["first_logprobs"]}
    if "prompt_logprobs" in raw:
        out["prompt_logprobs"] = {
            int(i): PromptLogprob(int(t), float(lp), int(r), tuple((int(a), float(b)) for a, b in top))
            for i, t, lp, r, top in raw["prompt_logprobs"]
        }
    return out


def from_bytes(data: bytes) -> KVHandoff:
    from safetensors.torch import load

    try:
        tensors = load(data)  # checks the header and the offsets
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + n])["__metadata__"]
        parts: dict[str, dict[int, torch.Tensor]] = {"latent": {}, "recurrent": {}, "conv": {}, "rng": {}}
        for name, t in tensors.items():
            kind, layer = name.split(".")
            parts[kind][int(layer)] = t
        return KVHandoff(
            meta["request_id"],
            json.loads(meta["prompt_token_ids"]),
            int(meta["first_token"]),
            int(meta["block_size"]),
            int(meta["start"]),
            parts["latent"],
            parts["recurrent"],
            parts["conv"],
            rng_state=parts["rng"].get(0),
            **_carried_fields(json.loads(meta["carried"])),
        )
    except Exception as e:  # safetensors' own error, a missing key, a malformed value
        raise ValueError(f"not a k3serve hand-off ({type(e).__name__}: {e})") from None
