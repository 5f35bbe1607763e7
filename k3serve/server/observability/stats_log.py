"""The periodic engine stats line vLLM operators read in their logs (vLLM `LoggingStatLogger`):

  Engine: avg prompt throughput 812.4 tokens/s, avg generation throughput 96.0 tokens/s,
  running 4 reqs, waiting 0 reqs, KV cache usage 12.5%, KDA slots 25.0%, prefix cache hit
  rate 40.0%, spec acceptance length 2.31

Rates are over the interval since the previous line, from the engine's counters; levels from
its latest stats snapshot. Nothing is logged while the engine is idle and nothing changed.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("k3serve.stats")


def stats_line(prev: dict, now: dict, seconds: float, stats) -> str:
    """`prev` / `now`: engine counters (prompt_tokens, generation_tokens); `stats`: EngineStats."""
    dt = max(seconds, 1e-9)
    parts = [
        f"avg prompt throughput {(now['prompt_tokens'] - prev['prompt_tokens']) / dt:.1f} tokens/s",
        f"avg generation throughput {(now['generation_tokens'] - prev['generation_tokens']) / dt:.1f} tokens/s",
        f"running {stats.num_running} reqs",
        f"waiting {stats.num_waiting} reqs",
        f"KV cache usage {100 * stats.kv_cache_usage:.1f}%",
        f"KDA slots {100 * stats.state_slot_usage:.1f}%",
        f"prefix cache hit rate {100 * stats.prefix_hits / max(1, stats.prefix_queries):.1f}%",
    ]
    if stats.spec_drafts:
        parts.append(f"spec acceptance length {1 + stats.spec_accepted_tokens / stats.spec_drafts:.2f}")
    return "Engine: " + ", ".join(parts)


async def log_stats_forever(engine, interval_s: float) -> None:
    """Background task of the server: one stats line every `interval_s` while there is work."""
    prev, at = dict(engine.counters), time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        now, t = dict(engine.counters), time.monotonic()
        s = engine.stats
        if now != prev or s.num_running or s.num_waiting:
            log.info(stats_line(prev, now, t - at, s))
        prev, at = now, t
