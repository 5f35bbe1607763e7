"""Data parallelism: M engine replicas behind one API server, routed by prefix, then by load.

Each replica is a whole `AsyncEngine` (its own scheduler, cache and, with TP, its own worker
processes) with its own step thread. A request goes where engine/dp_routing.py says: the replica holding the longest cached
prefix of its prompt (latent blocks with a KDA checkpoint are per replica: sending a follow-up
turn elsewhere recomputes its whole history), and among equals to the least loaded one
(running + waiting), then the lowest index. The server sees the same interface as one
AsyncEngine: `generate`, `abort`, `health`, `stats` (the replicas' sum), `engine` (replica 0's
LLMEngine, for what every replica shares: model, plan, block size, spec config).
The replicas share this process, so their Python step overheads take turns on the GIL while
torch ops run in parallel; vLLM runs each DP engine core in its own process. With expert
parallelism the replicas are DP-attention ranks: one expert group, stepped together
(engine/lockstep.py).
Reference: vLLM v1 `DPLBAsyncMPClient` (load balancing), SGLang's cache-aware router.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from k3serve.engine.async_engine import AsyncEngine
from k3serve.engine.dp_routing import pick_replica
from k3serve.engine.lockstep import Lockstep
from k3serve.engine.stats import EngineStats


class DPEngine:
    def __init__(self, replicas: list[AsyncEngine], lockstep: bool = False):
        """`lockstep`: DP-attention + EP replicas (engine/lockstep.py), which step together."""
        if not replicas:
            raise ValueError("data parallelism needs at least one replica")
        self.replicas = replicas
        self.lockstep = Lockstep(replicas) if lockstep else None
        self._owner: dict[str, AsyncEngine] = {}  # request id -> the replica running it
        self.routed = [0] * len(replicas)  # requests sent to each replica
        self.routed_by_prefix = 0  # of them, placed by a cached prefix (not by load)

    @property
    def engine(self):
        return self.replicas[0].engine

    def info(self):
        return self.replicas[0].engine.info()

    @property
    def executor(self):
        return self.replicas[0].engine.executor

    @property
    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.replicas:
            for k, v in r.engine.counters.items():
                out[k] = out.get(k, 0) + v
        return out

    @property
    def stats(self) -> EngineStats:
        return merge_stats([r.stats for r in self.replicas])

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    async def pick(self, prompt_token_ids: list[int]) -> int:
        """Index of the replica for a prompt: longest cached prefix, then least loaded."""
        held = [await r.reusable_tokens(prompt_token_ids) for r in self.replicas]  # tiers included

        load = [r.stats.num_running + r.num_waiting for r in self.replicas]
        best = pick_replica(held, load)
        if held[best] > 0:
            self.routed_by_prefix += 1
        return best

    async def generate(
        self,
        prompt,
        params=None,
        request_id: str | None = None,
        priority: int = 0,
        keep_cache: bool = False,
        handoff=None,
    ) -> AsyncIterator:
        if keep_cache or handoff is not None:
            raise ValueError(
                "prefill/decode hand-offs with --data-parallel-size > 1 are not built; "
                "run each P/D engine with one replica"
            )
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
        i = await self.pick(ids if isinstance(ids, list) else [])
        replica = self.replicas[i]
        self.routed[i] += 1
        if request_id is not None:
            self._owner[request_id] = replica
        inner = replica.generate(prompt, params, request_id, priority)
        try:
            async for out in inner:
                yield out
        finally:
            await inner.aclose()  # leaving early aborts the request on its replica now, not at GC
            if request_id is not None:
                self._owner.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        replica = self._owner.get(request_id)
        if replica is not None:
            await replica.abort(request_id)

    async def held_tokens(self, prompt_token_ids: list[int]) -> int:
        return max([await r.held_tokens(prompt_token_ids) for r in self.replicas])

    async def reusable_tokens(self, prompt_token_ids: list[int]) -> int:
        return max([await r.reusable_tokens(prompt_token_ids) for r in self.replicas])

    async def cache_ids(self, prompt) -> list[int]:
        return await self.replicas[0].cache_ids(prompt)

    async def reset_prefix_cache(self) -> tuple[int, int]:
        blocks = checkpoints = 0
        for r in self.replicas:
            b, c = await r.reset_prefix_cache()
            blocks, checkpoints = blocks + b, checkpoints + c
        return blocks, checkpoints

    async def pull_handoff(self, request_id: str, held_tokens: int = 0):
        raise ValueError("prefill/decode hand-offs with --data-parallel-size > 1 are not built")

    def health(self, wedged_after_s: float = 120.0) -> str | None:
        for i, r in enumerate(self.replicas):
            why = r.health(wedged_after_s)
            if why is not None:
                return f"data-parallel replica {i}: {why}"
        return None

    async def shutdown(self) -> None:
        if self.lockstep is not None:
            await self.lockstep.shutdown()
        for r in self.replicas:
            await r.shutdown()


def merge_stats(stats: list[EngineStats]) -> EngineStats:
    """The replicas' snapshot as one: counts and pool sizes add up (so usage is the pooled share)."""
    if len(stats) == 1:
        return stats[0]
    values = {}
    for f in dataclasses.fields(EngineStats):
        if f.name == "taken_at":
            values[f.name] = min(s.taken_at for s in stats)
        elif f.name in ("tp_collectives", "eplb_rebalances", "eplb_balance"):  # rank 0's, one group's
            values[f.name] = getattr(stats[0], f.name)
        elif f.name in (
            "spec_accepted_per_position",
            "spec_draft_lengths",
            "expert_tokens_per_rank",
            "iteration_tokens",
            "tier_stats",
        ):
            rows = [getattr(s, f.name) for s in stats]
            width = max(len(r) for r in rows)
            values[f.name] = tuple(sum(r[j] for r in rows if j < len(r)) for j in range(width))
        else:
            values[f.name] = sum(getattr(s, f.name) for s in stats)
    return EngineStats(**values)
