"""EngineStats: one consistent snapshot of the engine's counters and pool levels, taken on the
engine thread between steps (metrics read it; they never touch live scheduler objects).

Counters are cumulative since start (monotonic); gauges are levels at the snapshot.
Reference: vLLM v1 `SchedulerStats` / `IterationStats` (`vllm/v1/metrics/stats.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    taken_at: float = field(default_factory=time.monotonic)
    # gauges
    num_running: int = 0
    num_waiting: int = 0
    latent_blocks_used: int = 0
    latent_blocks_total: int = 1
    state_slots_used: int = 0
    state_slots_total: int = 1
    prefix_cached_free_blocks: int = 0
    prefix_checkpoints: int = 0
    # counters
    num_preemptions: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache (vLLM counts tokens)
    prefix_hits: int = 0  # of them, served from the cache
    prefix_lookups: int = 0  # admissions that looked
    checkpoints_stored: int = 0
    checkpoints_evicted: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    spec_draft_lengths: tuple[int, ...] = ()  # adaptive drafting: request-steps that chose each length 0..K
    spec_skipped_steps: int = 0  # adaptive drafting: steps whose drafter did not run (it could not pay)
    expert_tokens_per_rank: tuple[int, ...] = ()  # expert parallelism: assignments routed to each rank
    tp_collectives: tuple[tuple[str, int, int, float], ...] = ()  # rank 0's (kind, calls, bytes, seconds)
    eplb_rebalances: int = 0  # --enable-eplb: expert rebalances run (runner/eplb.py)
    eplb_balance: tuple[float, ...] = ()  # the last one's max/mean tokens per rank: (before, after)
    # tokens a step scheduled: cumulative counts per ITERATION_BUCKETS upper bound (+inf last), and their sum
    iteration_tokens: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    # prefix-cache tiers (cache/tiers.py): for each of TIERS, TIER_FIELDS in order (empty: no tiers)
    tier_stats: tuple[float, ...] = ()

    @property
    def kv_cache_usage(self) -> float:
        """Share of MLA latent blocks in use, 0..1 (vLLM's kv_cache_usage_perc)."""
        return self.latent_blocks_used / max(1, self.latent_blocks_total)

    @property
    def state_slot_usage(self) -> float:
        """Share of KDA state slots in use, 0..1."""
        return self.state_slots_used / max(1, self.state_slots_total)


TIER_FIELDS = (
    "queries",
    "hits",
    "hit_tokens",
    "bytes_read",
    "bytes_written",
    "evictions",
    "rejected",
    "load_seconds",
    "bytes_held",
)


def tier_values(tiers) -> tuple[float, ...]:
    """PrefixTiers' counters and bytes held, flat: TIERS x TIER_FIELDS."""
    from k3serve.cache.tiers import TIERS

    out = []
    for t in TIERS:
        st, lru = tiers.index.stats[t], getattr(tiers.index, t)
        out += [getattr(st, f) for f in TIER_FIELDS[:-1]] + [lru.used if lru is not None else 0]
    return tuple(out)


# vLLM's vllm:iteration_tokens_total buckets (tokens in one engine step)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class IterationTokens:
    """Per-step scheduled token counts, bucketed as they come (the engine thread adds, the
    snapshot copies)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_BUCKETS) + 1))
    total: int = 0

    def add(self, tokens: int) -> None:
        self.counts[next((i for i, b in enumerate(ITERATION_BUCKETS) if tokens <= b), len(ITERATION_BUCKETS))] += 1
        self.total += tokens


def _draft_policy(spec) -> dict:
    policy = spec.policy if spec is not None else None
    if policy is None:
        return {}
    return {"spec_draft_lengths": tuple(policy.chosen), "spec_skipped_steps": policy.skipped_steps}


def snapshot(engine) -> EngineStats:
    """Read an LLMEngine between steps (call it on the engine thread)."""
    sched, cache, plan = engine.scheduler, engine.cache, engine.plan
    st = cache.checkpoints.stats
    spec = engine.spec.stats if engine.spec is not None else None
    return EngineStats(
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        latent_blocks_used=cache.blocks.num_used,
        latent_blocks_total=plan.num_blocks,
        state_slots_used=cache.slots.num_used,
        state_slots_total=plan.num_slots,
        prefix_cached_free_blocks=cache.blocks.num_cached_free,
        prefix_checkpoints=cache.checkpoints.num_stored,
        num_preemptions=sched.num_preemptions,
        prefix_queries=st.query_tokens,
        prefix_hits=st.hit_tokens,
        prefix_lookups=st.queries,
        checkpoints_stored=st.checkpoints_stored,
        checkpoints_evicted=st.checkpoints_evicted,
        spec_drafts=spec.drafts if spec else 0,
        spec_draft_tokens=spec.draft_tokens if spec else 0,
        spec_accepted_tokens=spec.accepted_tokens if spec else 0,
        spec_accepted_per_position=tuple(spec.accepted_per_position) if spec else (),
        **_draft_policy(engine.spec),
        iteration_tokens=tuple(engine.iteration_tokens.counts),
        iteration_tokens_sum=engine.iteration_tokens.total,
        tier_stats=tier_values(engine.tiers) if getattr(engine, "tiers", None) is not None else (),
        **_parallel(engine),
    )


def _parallel(engine) -> dict:
    """Expert load per rank and rank 0's collective totals (DP-attention: this replica's rank
    of the expert group, asked of its worker process when the model lives there)."""
    return engine.executor.parallel_stats()
