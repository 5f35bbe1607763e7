"""The draft-length policy (spec_decode/adaptive.py) on its own: the cost table, acceptance
estimates, the choice against an exhaustive search, shadow drafts, and the indexed ngram lookup
against its scan."""

from __future__ import annotations

import itertools
import random

import pytest

from k3serve.spec_decode.adaptive import Acceptance, DraftPolicy, draft_gain
from k3serve.spec_decode.step_costs import StepCosts
from k3serve.spec_decode.proposer import NgramProposer


def gpu_like(policy: DraftPolicy, flat_rows: int = 64, per_row: float = 1e-4) -> None:
    """Step cost flat up to `flat_rows` rows (memory-bound), linear after."""
    for b in (1, 2, 4, 8, 16):
        for k in range(policy.max_k + 1):
            rows = b * (1 + k)
            policy.costs.record(b, rows, 0.01 + per_row * max(0, rows - flat_rows))


def cpu_like(policy: DraftPolicy) -> None:
    """Every row costs the same: verifying a draft costs what decoding its token costs."""
    for b in (1, 2, 4, 8, 16):
        for k in range(policy.max_k + 1):
            policy.costs.record(b, b * (1 + k), 1e-3 * b * (1 + k))


def test_costs_interpolate_and_take_a_neighbours_shape():
    c = StepCosts()
    for rows, t in ((4, 1.0), (8, 2.0), (16, 2.5)):
        c.record(4, rows, t)
    assert c.estimate(4, 8) == 2.0
    assert c.estimate(3, 6) == pytest.approx(1.5)  # same bucket, between points
    assert c.estimate(4, 20) == pytest.approx(2.5 + 4 * 0.5 / 8)  # past the last point: its slope
    c.record(2, 2, 0.5)  # one point in bucket 2: bucket 4's shape through it (bucket 4 at 2 rows: 0.5)
    assert c.estimate(2, 4) == pytest.approx(1.0)
    assert c.estimate(64, 16) == 2.5  # an unmeasured bucket: the nearest curve
    for _ in range(5):  # a window's median: one compile-sized sample does not move it
        c.record(4, 8, 2.0)
    c.record(4, 8, 100.0)
    assert c.estimate(4, 8) == 2.0
    c.record(8, 8, 1.0)
    c.record(8, 16, 3.0)
    c.record(8, 24, 2.0)  # noise: more rows measured cheaper; the policy reads a non-decreasing curve
    dense = c.dense(8, 24)
    assert all(a <= b for a, b in zip(dense[8:], dense[9:])) and dense[16] == dense[24] == 2.5


def test_the_first_step_of_a_shape_is_not_a_cost():
    p = DraftPolicy(2)
    p.record_step(4, 8, 30.0)  # a graph bucket's first step compiles
    assert not p.costs.measured
    p.record_step(4, 8, 0.01)
    p.record_step(4, 8, 0.01)
    assert p.costs.estimate(4, 8) == 0.01
    for _ in range(3):  # one point measured in all: another bucket's step takes its line
        p.record_verify("a", 2, 2)
    assert p.choose(["a"], [2], [5]) in ([0], [1], [2])
    assert p.costs.estimate(1, 3) == pytest.approx(0.01 * 3 / 8)


def test_acceptance_learns_per_request_and_position():
    a = Acceptance()
    for _ in range(20):
        a.record("good", 4, 4)
        a.record("bad", 4, 0)
    good, bad = a.reach("good", 4), a.reach("bad", 4)
    assert good[3] > 0.8 and bad[0] < 0.35
    assert all(x >= y for x, y in zip(good, good[1:]))  # reach never rises with position
    assert a.drafter.tried[1] == pytest.approx(sum(0.995**i for i in range(20)))  # bad never reached 2


@pytest.mark.parametrize("seed", range(30))
def test_choice_is_the_exhaustive_optimum(seed):
    rng = random.Random(seed)
    p = DraftPolicy(4)
    (gpu_like if seed % 2 else cpu_like)(p)
    ids = [f"r{i}" for i in range(rng.randint(1, 5))]
    for r in ids:
        for _ in range(rng.randint(0, 6)):
            p.record_verify(r, 4, rng.randint(0, 4))
    proposed = [rng.randint(0, 4) for _ in ids]
    reach = [p.acceptance.reach(r, n) for r, n in zip(ids, proposed)]
    ks = p.choose(ids, proposed, [10] * len(ids))
    B = len(ids)

    def rate(lengths):
        return (B + sum(draft_gain(r, k) for r, k in zip(reach, lengths))) / p.costs.estimate(B, B + sum(lengths))

    best = max(itertools.product(*(range(n + 1) for n in proposed)), key=rate)
    assert rate(ks) == pytest.approx(rate(best), rel=1e-9)
    assert all(0 <= k <= n for k, n in zip(ks, proposed))


def test_flat_costs_draft_everything_linear_costs_draft_only_sure_things():
    gpu, cpu = DraftPolicy(4), DraftPolicy(4)
    gpu_like(gpu)
    cpu_like(cpu)
    for p in (gpu, cpu):
        for _ in range(10):
            p.record_verify("sure", 4, 4)
            p.record_verify("coin", 4, 0)
    assert gpu.choose(["sure", "coin"], [4, 4], [9, 9]) == [4, 4]
    assert cpu.choose(["sure", "coin"], [4, 4], [9, 9]) == [0, 0]  # linear rows: nothing below ~1 pays
    flat_then_steep = DraftPolicy(4)
    gpu_like(flat_then_steep, flat_rows=6, per_row=0.01)
    for _ in range(10):
        flat_then_steep.record_verify("sure", 4, 4)
        flat_then_steep.record_verify("coin", 4, 0)
    assert flat_then_steep.choose(["sure", "coin"], [4, 4], [9, 9]) == [4, 0]


def test_uniform_gives_one_length_or_none():
    p = DraftPolicy(4, uniform=True)
    gpu_like(p, flat_rows=12)
    for _ in range(10):
        p.record_verify("a", 4, 4)
        p.record_verify("b", 4, 4)
    ks = p.choose(["a", "b"], [4, 3], [9, 9])
    assert len(set(ks)) == 1 and 0 < ks[0] <= 3


class _Req:
    def __init__(self, rid, tokens):
        self.request_id, self.tokens = rid, tokens

    def token_slice(self, a, b):
        return self.tokens[a:b]


def test_shadow_drafts_score_what_verification_would_have_accepted():
    p = DraftPolicy(4)
    cpu_like(p)  # nothing pays: proposals become shadows
    assert p.choose(["x"], [3], [5], [[7, 8, 9]]) == [0]
    r = _Req("x", [0, 1, 2, 3, 4, 7])  # one token emitted, the first draft: wait for more
    p.score_shadows([r])
    assert p.acceptance.drafter.tried == []
    r.tokens += [8, 5]  # 7, 8 then 5 != 9: two accepted, the third rejected
    p.score_shadows([r])
    assert p.acceptance.drafter.acc == [1.0, 1.0, 0.0] and p.acceptance.drafter.tried == [1.0, 1.0, 1.0]


def test_a_useless_drafter_rests_longer_and_longer_and_still_probes():
    p = DraftPolicy(4, probe_every=8)
    for b in (1, 2, 4, 8):  # 4 ms a step and 0.8 ms a row: a draft must be accepted 44% of the time
        for k in range(5):
            p.costs.record(b, b * (1 + k), 0.004 + 0.0008 * b * (1 + k))
    p.record_draft_time(4, 1e-4)
    ids = ["a", "b", "c", "d"]
    for _ in range(30):
        for r in ids:
            p.record_verify(r, 4, 0)

    def step() -> bool:
        return not p.resting() and p.should_draft(ids)

    ran = [i for i in range(64) if step()]
    # rests of 1, 2, 4, 8, 8 ... steps, each followed by a probe, each probe by a screen
    assert ran[:4] == [2, 6, 12, 22] and all(b - a == 10 for a, b in zip(ran[3:], ran[4:]))
    assert p.skipped_steps == 64 - len(ran)
    for _ in range(10):
        p.record_verify("a", 4, 4)  # "a" turns repetitive: its drafts are now sure things
    while p.resting():
        pass
    assert p.should_draft(ids) and p.choose(ids, [4, 4, 4, 4], [9] * 4)[0] > 0 and p._backoff == 1
    good = DraftPolicy(4)
    gpu_like(good)
    good.record_draft_time(4, 1e-4)
    assert all(good.should_draft(ids) for _ in range(10))  # nothing measured against it yet: 1/2 a position


def test_packed_ngram_lookup_equals_the_scan():
    for trial in range(200):
        rng = random.Random(trial)
        n_min = rng.randint(1, 3)
        prop = NgramProposer(4, n_min, rng.randint(n_min, 5))
        # ids whose 4 bytes repeat each other's, so that byte matches straddling two ids abound
        ids = [0, 1, 2, 256, 65536, 1 << 24, 0x01010101, 0x00010001]

        def tok() -> int:
            return ids[rng.randint(0, len(ids) - 1)] if trial % 2 else rng.randint(0, 4)

        toks = [tok() for _ in range(rng.randint(0, 5))]
        for _ in range(30):
            k = rng.randint(1, 5)
            assert prop.indexed_lookup("r", lambda a, b, t=toks: t[a:b], len(toks), k) == prop.lookup(toks, k)
            toks = toks + [tok() for _ in range(rng.randint(0, 3))]
        toks = toks[: len(toks) // 2]  # cut (a stop string): the index starts over
        assert prop.indexed_lookup("r", lambda a, b: toks[a:b], len(toks), 3) == prop.lookup(toks, 3)
