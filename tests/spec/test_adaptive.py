"""The draft-length policy (spec_decode/adaptive.py) on its own: the cost table, acceptance
estimates, the choice against an exhaustive search, shadow drafts, and the indexed ngram lookup
against its scan."""

from __future__ import annotations

import itertools
import random

import pytest

from k3serve.spec_decode.adaptive import HOLD, MARGIN, Acceptance, DraftPolicy, draft_gain
from k3serve.spec_decode.step_costs import StepCosts
from k3serve.spec_decode.proposer import NgramProposer


def affine(policy: DraftPolicy, a: float, m: float, h: float = 0.0) -> None:
    """Steps costing a + m * rows + h * verifying sequences, profiled as the engine does."""
    for b in (1, 2, 4, 8, 16):
        for k in range(policy.max_k + 1):
            v = b if k else 0
            policy.costs.record(b, b * (1 + k), a + m * b * (1 + k) + h * v, verifying=v)


def gpu_like(policy: DraftPolicy) -> None:
    """A row costs next to nothing beside the step (memory-bound)."""
    affine(policy, 0.01, 1e-6)


def cpu_like(policy: DraftPolicy) -> None:
    """Every row costs the same: verifying a draft costs what decoding its token costs."""
    affine(policy, 0.0, 1e-3)


def test_costs_fit_rows_and_verifying_sequences():
    c = StepCosts()
    for rows, v, t in ((4, 0, 1.0), (8, 4, 2.0), (12, 4, 2.5), (20, 4, 3.5)):
        c.record(4, rows, t, context=100, verifying=v)
    a, m, h = c.fit(4, context=100)
    assert (a, m, h) == pytest.approx((0.5, 0.125, 0.125))
    assert c.estimate(3, 6, context=100, verifying=1) == pytest.approx(0.5 + 0.75 + 0.125)  # same bucket
    c.record(4, 4, 3.0, context=2000)  # attention over 2,000 tokens: a decode step costs 3x
    # only decodes measured there: the row and verifier shares come from the short contexts
    assert c.estimate(4, 8, context=2000, verifying=4) == pytest.approx(2.5 + 1.0 + 0.5)
    assert c.estimate(4, 4, context=5000) == pytest.approx(3.0)  # the nearest context's
    assert c.estimate(64, 64, context=100) == pytest.approx(0.5 + 8.0)  # an unmeasured bucket: the nearest's
    one = StepCosts()
    one.record(2, 2, 1.0)  # one point: a line through the origin
    assert one.estimate(2, 6) == pytest.approx(3.0)
    down = StepCosts()
    for rows, t in ((2, 2.0), (4, 1.0), (6, 1.5)):  # noise: more rows measured cheaper
        down.record(2, rows, t, verifying=2 if rows > 2 else 0)
    assert down.fit(2)[1] >= 0 and down.fit(2)[2] >= 0  # no share is negative


def test_compiles_are_not_costs():
    p = DraftPolicy(2)
    p.record_step(4, 8, 30.0)  # a graph bucket's first step compiles: nothing to compare it with
    assert not p.costs.measured
    p.record_step(4, 8, 0.01)
    p.record_step(4, 12, 0.012)
    p.record_step(4, 12, 3.0)  # the next bucket's compile: 250x the estimate
    p.record_step(16, 16, 2.0)  # another's: 50x what bucket 4's line says of 16 rows
    assert p.costs.estimate(4, 8) == pytest.approx(0.01) and p.costs.estimate(4, 12) == pytest.approx(0.012)
    assert p.costs.samples(16) == 0 and p.costs.samples(4) == 2
    for _ in range(3):  # only bucket 4 measured: another bucket's step takes its line
        p.record_verify("a", 2, 2)
    assert p.choose(["a"], [2], [5]) in ([0], [1], [2])
    assert p.costs.estimate(1, 3) == pytest.approx(0.01 - 5 * 0.0005)


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
    affine(p, 0.01 * (seed % 3), 1e-3, 0.002 * (seed % 5))
    ids = [f"r{i}" for i in range(rng.randint(1, 5))]
    for r in ids:
        for _ in range(rng.randint(0, 6)):
            p.record_verify(r, 4, rng.randint(0, 4))
    proposed = [rng.randint(0, 4) for _ in ids]
    reach = [p.acceptance.reach(r, n) for r, n in zip(ids, proposed)]
    ks = p.choose(ids, proposed, [10] * len(ids))
    B = len(ids)

    def rate(lengths):
        verifying = sum(1 for k in lengths if k)
        cost = p.costs.estimate(B, B + sum(lengths), verifying=verifying)
        return (B + sum(draft_gain(r, k) for r, k in zip(reach, lengths))) / cost

    best = max(itertools.product(*(range(n + 1) for n in proposed)), key=rate)
    if rate(best) <= MARGIN * rate([0] * B):  # drafting must beat decoding by the margin
        best = [0] * B
    assert rate(ks) == pytest.approx(rate(best), rel=1e-9)
    assert all(0 <= k <= n for k, n in zip(ks, proposed))


def test_flat_costs_draft_everything_linear_costs_draft_only_sure_things():
    gpu, cpu, setup = DraftPolicy(4), DraftPolicy(4), DraftPolicy(4)
    gpu_like(gpu)
    cpu_like(cpu)
    affine(setup, 0.01, 1e-4, 0.004)  # a verifying sequence costs 40 rows' worth
    for p in (gpu, cpu, setup):
        for _ in range(10):
            p.record_verify("sure", 4, 4)
            p.record_verify("likely", 4, 3)
            p.record_verify("coin", 4, 0)
    assert gpu.choose(["sure", "likely", "coin"], [4, 4, 4], [9] * 3) == [4, 4, 4]
    assert cpu.choose(["sure", "likely", "coin"], [4, 4, 4], [9] * 3) == [0, 0, 0]  # linear rows: nothing pays
    # a verifier's cost is paid once a request: whole drafts for the likely ones, none for the coin
    assert setup.choose(["sure", "likely", "coin"], [4, 4, 4], [9] * 3) == [4, 4, 0]


def test_a_plan_that_drafts_is_held_for_the_same_requests_and_dropped_on_a_rejection(monkeypatch):
    """The choice runs once per HOLD steps while the same requests get the same proposals; a
    first draft rejected, another request set or other proposals choose afresh."""
    p = DraftPolicy(4)
    gpu_like(p)
    for _ in range(10):
        p.record_verify("a", 4, 4)
        p.record_verify("b", 4, 4)
    calls = []
    best = p._best
    monkeypatch.setattr(p, "_best", lambda *a, **k: calls.append(1) or best(*a, **k))
    for _ in range(HOLD):
        assert p.should_draft(["a", "b"], free=True)
        assert p.choose(["a", "b"], [4, 4], [9, 9]) == [4, 4]
    assert len(calls) == 1  # chosen once, held for the next HOLD - 1 steps
    p.choose(["a", "b"], [4, 4], [9, 9])
    assert len(calls) == 2  # the hold ran out
    p.choose(["a", "b"], [4, 3], [9, 9])
    p.choose(["a"], [4], [9])
    assert len(calls) == 4  # other proposals, another request set
    p.record_verify("a", 4, 0)
    p.choose(["a"], [4], [9])
    assert len(calls) == 5  # a first draft rejected
    cpu = DraftPolicy(4)
    cpu_like(cpu)
    assert cpu.choose(["a"], [4], [9]) == [0] and cpu._held is None  # a plan of no drafts is never held


def test_uniform_gives_one_length_or_none():
    p = DraftPolicy(4, uniform=True)
    gpu_like(p)
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
    affine(p, 0.004, 0.0008)  # 4 ms a step and 0.8 ms a row: a draft must be accepted 44% of the time
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


def test_a_free_drafters_proposing_phase_is_charged():
    """A lookup drafter (ngram) whose drafts win on rows alone loses once its proposing phase
    (the lookup and the policy's own work, timed by the decoder) is counted: at one stream,
    500 us steps and 40% acceptance, a draft of one token gains 1.4 tokens for 1.3 steps of rows,
    and 60 us of proposing a step takes the gain away. The screen (a bound: it credits every
    position the first one's rate) rests once the phase costs more than four such drafts gain."""

    def policy(proposing: float) -> DraftPolicy:
        p = DraftPolicy(4)
        affine(p, 3.5e-4, 1.5e-4)  # 500 us a one-row step, 150 us a row
        for _ in range(30):
            p.record_verify("a", 1, 0)
            p.record_verify("a", 1, 1)
            p.record_verify("a", 1, 0)
            p.record_verify("a", 1, 1)
            p.record_verify("a", 1, 0)
        p.record_draft_time(1, proposing)
        return p

    cheap, costly, ruinous = policy(5e-6), policy(6e-5), policy(3e-4)
    assert cheap.should_draft(["a"], free=True) and cheap.choose(["a"], [1], [9]) == [1]
    assert costly.should_draft(["a"], free=True) and costly.choose(["a"], [1], [9]) == [0]
    assert not ruinous.should_draft(["a"], free=True) and ruinous.resting()


def test_a_choice_of_no_drafts_rests_like_a_failed_screen():
    """The screen is a bound (every position credited the first one's rate), so it can pass
    while the choice drafts nothing; then the drafter rests 1, 2, 4 .. steps with a probe after
    each rest, as after a failed screen, instead of proposing every step for nothing."""
    p = DraftPolicy(4, probe_every=8)
    affine(p, 3.5e-4, 1.5e-4, 3e-4)  # a verifying sequence costs two rows
    for _ in range(30):
        for tau in (1, 1, 1, 0, 0):  # the first position 60%, the second never
            p.record_verify("a", 2, tau)
    ran = []
    for i in range(40):
        if p.resting() or not p.should_draft(["a"], free=True):
            continue
        assert p.choose(["a"], [2], [9]) == [0]
        ran.append(i)
    assert ran[:4] == [0, 2, 5, 10] and all(b - a == 9 for a, b in zip(ran[3:], ran[4:]))


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
