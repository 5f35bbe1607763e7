"""The one rule that turns a request into the seed of its random draws (issue 51: it was written
twice, in the runner and in the drafters).

A seeded request draws from its own seed; an unseeded one from the engine seed and its arrival
order, so a run is reproducible for a given `--seed` and request order. The sampler uses the
seed itself; each drafter mixes in its own salt, so a draft model's or DSpark's draws are
independent of the sampler's (and of each other's) while just as reproducible.
"""

from __future__ import annotations

ARRIVAL_STRIDE = 1_000_003  # engine seeds far apart in seed space: seed s covers s * stride + arrivals
SALT_STRIDE = 7919  # a drafter's seed: request seed * stride + its salt


def request_seed(seed: int | None, arrival: int, engine_seed: int = 0, salt: int = 0) -> int:
    """`seed`: the request's own (SamplingParams.seed), or None; `salt`: 0 for the sampler, a
    drafter's own constant otherwise."""
    base = seed if seed is not None else engine_seed * ARRIVAL_STRIDE + arrival
    return base if salt == 0 else base * SALT_STRIDE + salt
