"""The one rule both data-parallel engines (the server's DPEngine, the offline DPLLMEngine) route
by: the replica whose prefix cache (tiers included) holds the longest part of the prompt, among
equals the least loaded (running + waiting), among those the lowest index. A follow-up turn goes
where its history is cached (elsewhere it recomputes it all); new prompts spread by load."""

from __future__ import annotations


def pick_replica(held: list[int], load: list[int]) -> int:
    """held[i]: the prompt tokens replica i can reuse; load[i]: its running + waiting requests."""
    return max(range(len(held)), key=lambda i: (held[i], -load[i], -i))
