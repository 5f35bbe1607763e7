"""The start-up profile of the draft-length policy's cost table (spec_decode/adaptive.py).

Before the engine serves, stand-in requests of one cached token run the steps the policy weighs:
a decode step and verify steps of 1 + k rows a sequence, at a few batch sizes, through the real
runner and executor (every rank, this backend, sampling and verification included), best of
REPEATS. Then they are freed; nothing they wrote is ever read (a request's KDA slot is zeroed when
it starts, its latent rows are overwritten before they are attended). Online step timings refine
the table from there (EngineCore.execute). Skipped where the steps compile per bucket (graph,
triton: those costs arrive online) and for DP-attention replicas (their ranks step in lockstep).
"""

from __future__ import annotations

import time

from k3serve.sampling_params import SamplingParams
from k3serve.scheduler.batch import ScheduledBatch, ScheduledSeq
from k3serve.scheduler.request import Request

REPEATS = 2
BATCHES = (1, 2, 4, 8, 16, 32, 64)


def draft_lengths(k: int) -> list[int]:
    """The verify lengths measured: 0 (a decode step), 1, 2, 4, 8 ... up to k, and k."""
    out = [0]
    j = 1
    while j < k:
        out.append(j)
        j *= 2
    return out + [k]


def profile_step_costs(spec, runner, executor, cache, max_num_seqs: int, token: int = 1) -> float:
    """Seed the cost table of `spec`'s (SpecDecoder) policy; returns the seconds it took. The
    stand-ins' verify passes leave no trace in the acceptance figures or statistics."""
    from k3serve.spec_decode.adaptive import Acceptance
    from k3serve.spec_decode.verifier import SpecStats

    policy = spec.policy
    k = policy.max_k
    start = time.perf_counter()
    fits = min(max_num_seqs, cache.num_free_slots, cache.num_free_blocks // max(1, cache.blocks_for(2 + k)))
    sizes = [b for b in BATCHES if b <= fits] or ([fits] if fits else [])
    if not sizes:
        return 0.0
    params = SamplingParams(temperature=0, max_tokens=k + 2, ignore_eos=True)
    # two prompt tokens: the first is cached by a one-row step, the second is each step's newest
    reqs = [Request(f"k3serve-profile-{i}", [token, token], params, None, 2 + k + 1) for i in range(sizes[-1])]
    held = []
    try:
        for r in reqs:
            cache.allocate(r.request_id, 2 + k)
            held.append(r.request_id)
        _step(runner, executor, cache, reqs, 0, [0] * len(reqs))  # each slot zeroed, one row cached
        for b in sizes:
            for j in draft_lengths(k):
                best = min(_step(runner, executor, cache, reqs[:b], 1, [j] * b, token) for _ in range(REPEATS))
                policy.costs.record(b, b * (1 + j), best, verifying=b if j else 0)
    finally:
        for rid in held:
            cache.free(rid)
            runner.release(rid)
        spec.stats, policy.acceptance = SpecStats(), Acceptance()
    return time.perf_counter() - start


def _step(runner, executor, cache, reqs, start: int, ks: list[int], token: int = 1) -> float:
    """One step of `reqs` from `start` cached tokens, request i verifying ks[i] drafts: its seconds."""
    seqs = [
        ScheduledSeq(
            r,
            start,
            1 + k if start else 1,
            cache.state_slot(r.request_id),
            cache.block_table(r.request_id),
            True,
            [token] * k if start else [],
            cache.draft_row(r.request_id) if k and start else None,
        )
        for r, k in zip(reqs, ks)
    ]
    t = time.perf_counter()
    step = runner.prepare(ScheduledBatch(seqs))
    _, rollback = runner.finish(step, executor.execute(step.inputs, step.taps))
    if rollback is not None:
        executor.rollback(*rollback)
    return time.perf_counter() - t
