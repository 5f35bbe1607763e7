"""Adaptive draft lengths: each step, each decoding request drafts 0..K tokens, chosen to maximise
the whole batch's expected tokens per second (issue 61; vLLM's per-step draft budget from a
profiled step-cost table, SGLang's adaptive speculation).

- `StepCosts` (spec_decode/step_costs.py): seconds of a decode / verify step, a + m * rows +
  h * verifying sequences per (sequence bucket, context bucket), fitted to measurements: a
  start-up profile (runner/spec_profile.py) seeds it, and one pure decode / verify step in four
  refreshes it.
- `Acceptance`: P(draft position i accepted | the ones before it were), as decayed counts, for
  the drafter as a whole and per request; a request that drafted but verified nothing is scored
  afterwards against the tokens it went on to emit ("shadow" drafts: free acceptance figures).
- `DraftPolicy.choose`: the lengths maximising the batch's expected tokens per second,
  (B + expected accepted) / cost, found exactly (Dinkelbach's iteration: a few rounds of each
  request choosing alone at a trial rate). K = 0 for
  every request is a plain decode step with no verify overhead; when even the best request's
  acceptance cannot pay, the drafter does not run and drafting rests (`should_draft`).

Pure Python (no torch): the scheduler side of the step, cheap enough to run every step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate
from statistics import median

from k3serve.spec_decode.step_costs import StepCosts, seq_bucket


# a plan that drafts must beat a plain decode by this factor: what the table cannot see (noise,
# the bookkeeping of more tokens) weighs against drafting, so that near break-even it stays off
MARGIN = 1.02
SPARSE = 12  # a cost bucket is sampled every step until it holds this many samples
OUTLIER = 5.0  # a step sample this many times the estimate is a compile or a stall, not a cost
# a plan that drafts is reused this many steps for the same requests and proposals before it is
# recomputed (a first draft rejected drops it at once): the choice costs ~40-70 us, 1.5-2.5% of a
# one-stream step (bench/spec_policy_cost.py --streams 1), and a steady stream keeps its plan
HOLD = 4


def draft_gain(reach: list[float], k: int) -> float:
    """Expected accepted tokens of a k-token draft: the chances of reaching positions 1..k."""
    return sum(reach[:k])


@dataclass
class _Counts:
    """Decayed (accepted, tried) per draft position."""

    acc: list[float] = field(default_factory=list)
    tried: list[float] = field(default_factory=list)

    def add(self, position: int, accepted: bool, decay: float) -> None:
        while len(self.acc) <= position:
            self.acc.append(0.0)
            self.tried.append(0.0)
        self.acc[position] = self.acc[position] * decay + accepted
        self.tried[position] = self.tried[position] * decay + 1.0


class Acceptance:
    """Conditional acceptance per draft position: the drafter's (all requests, slow decay) and
    each request's (fast decay), a request's estimate pulled toward the drafter's by PRIOR
    pseudo-observations, the drafter's toward 1/2 by one."""

    GLOBAL_DECAY, REQUEST_DECAY, PRIOR = 0.995, 0.8, 2.0

    def __init__(self):
        self.drafter = _Counts()
        self.requests: dict[str, _Counts] = {}

    def record(self, request_id: str, k: int, tau: int) -> None:
        """A verify pass (or a scored shadow draft) of k drafts that accepted the first tau."""
        mine = self.requests.setdefault(request_id, _Counts())
        for i in range(min(k, tau + 1)):  # positions past the first rejection were not tried
            ok = i < tau
            self.drafter.add(i, ok, self.GLOBAL_DECAY)
            mine.add(i, ok, self.REQUEST_DECAY)

    def first_rate(self, request_id: str) -> float:
        """P(the request's first draft is accepted): its own decayed counts pulled toward the
        drafter's by PRIOR pseudo-observations, the drafter's toward 1/2 by one."""
        d, c = self.drafter, self.requests.get(request_id)
        g = (d.acc[0] + 0.5) / (d.tried[0] + 1.0) if d.acc else 0.5
        return (c.acc[0] + self.PRIOR * g) / (c.tried[0] + self.PRIOR) if c is not None and c.acc else g

    def reach(self, request_id: str, n: int) -> list[float]:
        """P(draft position i is accepted) for i < n: the product of the conditional rates up to i
        (the rates as `first_rate` reads position 0; this runs for every decoding request every step)."""
        d, c = self.drafter, self.requests.get(request_id)
        own = len(c.acc) if c is not None else 0
        out, p, prior = [], 1.0, self.PRIOR
        for i in range(n):
            g = (d.acc[i] + 0.5) / (d.tried[i] + 1.0) if i < len(d.acc) else 0.5
            p *= (c.acc[i] + prior * g) / (c.tried[i] + prior) if i < own else g
            out.append(p)
        return out

    def release(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


@dataclass
class _Shadow:
    at: int  # the request's token count when it was drafted
    tokens: list[int]


class DraftPolicy:
    """Chooses each step's draft lengths. `max_k`: num_speculative_tokens; `uniform`: every
    sequence of a verify step drafts the same length (the graph backend's verify buckets take a
    step only when every sequence verifies); `probe_every`: a step that would not draft drafts
    anyway this often, so that costs and acceptance of drafting stay measured (a model
    drafter's run costs a forward; a free one's, a lookup)."""

    def __init__(self, max_k: int, uniform: bool = False, probe_every: int = 32):
        self.max_k, self.uniform, self.probe_every = max_k, uniform, probe_every
        self.costs = StepCosts()
        self.acceptance = Acceptance()
        self.draft_seconds: dict[int, deque] = {}  # sequence bucket -> the drafter's last call times
        self._shadows: dict[str, _Shadow] = {}
        self._first_dropped = False  # record_step's first sample (see there)
        self._reach = None  # (request ids, reach over K) should_draft computed this step
        self._rest, self._backoff, self._probe = 0, 1, False  # should_draft's rests (see there)
        self._held: tuple | None = None  # (request ids, proposed, lengths, reuses left): see HOLD
        self.chosen = [0] * (max_k + 1)  # request-steps that drafted each length (/metrics)
        self.skipped_steps = 0  # steps whose drafter did not run: drafting could not pay

    # ---- before the drafter runs -----------------------------------------------------------
    def resting(self) -> bool:
        """Whether this step skips drafting without looking (the rest after a screen found that
        drafting cannot pay): a decode step's cost then stays a counter."""
        if self._rest:
            self._rest -= 1
            self.skipped_steps += 1
            return True
        return False

    def resting_next(self) -> int:
        """The steps still to rest after this one's proposal (0: the next step may draft)."""
        return self._rest

    def should_draft(self, request_ids: list[str], free: bool = False, context: float = 0) -> bool:
        """Whether running the drafter this step can pay for itself. A bound, not a guess: every
        draft position is credited the best first-position acceptance of any request (reach
        never rises with position), drafting its measured cost (`draft_cost`: the whole proposing
        phase, a free drafter's lookup and this policy's own work included: at one stream they were
        ~8% of a step, and an ngram drafting one token at 41% acceptance lost 7% uncharged); when no
        number of drafts beats decoding even so, `choose` would pick none. Then drafting rests
        1, 2, 4 .. `probe_every` steps (`resting`), and the step after a rest drafts regardless
        (a probe: its drafts are verified or kept as shadows, so acceptance keeps being
        measured); drafting that pays again starts the rests over. `context`: the requests'
        mean cached tokens (the cost table's context bucket)."""
        if not request_ids or not self.costs.measured:
            return True
        held = self._held
        if held is not None and held[3] and held[0] == request_ids:  # a plan that drafts, still held
            return True
        if self._probe:
            self._probe = False
            return True
        B = len(request_ids)
        a, m, h = self.costs.fit(B, context)
        draft = self.draft_cost(B)
        p = max(self.acceptance.first_rate(r) for r in request_ids)
        base = MARGIN * B / (a + m * B)
        # d drafts need at least ceil(d / K) verifying sequences
        if any(
            (B + d * p) / (a + m * (B + d) + h * -(-d // self.max_k) + draft) > base
            for d in range(1, B * self.max_k + 1)
        ):
            if free:
                return True
            # a drafter that costs a forward: the choice it would lead to, with its cost, must pay
            reach = [self.acceptance.reach(r, self.max_k) for r in request_ids]
            self._reach = (request_ids, reach)  # choose reads it this step
            if self._best(B, reach, context, draft)[0]:
                return True
        self.skipped_steps += 1
        self._rest_after_nothing()
        return False

    def _rest_after_nothing(self) -> None:
        """Drafting could not pay this step: rest the next `_backoff` steps, then probe, each
        rest twice the last (up to probe_every) until drafting pays again."""
        self._rest, self._probe = self._backoff, True
        self._backoff = min(2 * self._backoff, self.probe_every)

    def record_draft_time(self, seqs: int, seconds: float) -> None:
        """The seconds of one proposing phase of `seqs` requests (spec_decode/decoder.py: from
        the shadows' scoring to the lengths chosen, the drafter's run between)."""
        self.draft_seconds.setdefault(seq_bucket(seqs), deque(maxlen=StepCosts.WINDOW)).append(seconds)

    def draft_cost(self, seqs: int) -> float:
        times = self.draft_seconds.get(seq_bucket(seqs))
        return median(times) if times else 0.0

    # ---- after it ran ------------------------------------------------------------------------
    def choose(
        self, request_ids: list[str], proposed: list[int], token_counts: list[int], drafts=None, context: float = 0
    ) -> list[int]:
        """Each request's draft length (<= what it was proposed) for a step of these decoding
        requests. `token_counts`: each request's tokens now (shadow drafts are scored against the
        tokens that come after); `drafts`: the proposed ids, kept as shadows of requests that
        verify none of them."""
        B = len(request_ids)
        held = self._held
        if held is not None and held[3] and held[0] == request_ids and held[1] == proposed:
            ks = held[2]
            self._held = (*held[:3], held[3] - 1)
            self._reach = None
        elif not self.costs.measured:  # nothing measured yet (a graph backend's first steps): draft all
            ks = list(proposed)
        else:
            held = self._reach
            if held is not None and held[0] == request_ids:  # should_draft's, this step: the same counts
                reach = [r[:n] for r, n in zip(held[1], proposed)]
            else:
                reach = [self.acceptance.reach(r, n) for r, n in zip(request_ids, proposed)]
            self._reach = None
            # drafting's own cost counts although this step paid it: a plan of none rests the
            # steps after it (should_draft), one that drafts pays it again each step
            _, ks = self._best(B, reach, context, self.draft_cost(B))
            self._held = (list(request_ids), list(proposed), ks, HOLD - 1) if any(ks) else None
            if not any(ks) and any(proposed):  # the screen's bound passed, the choice drafts none:
                self._rest_after_nothing()  # rest as after a failed screen: proposing was ~8% of a step
        if any(ks):
            self._backoff = 1  # drafting pays: a later screen that fails rests one step first
        for j, (r, k) in enumerate(zip(request_ids, ks)):
            self.chosen[k] += 1
            if k == 0 and proposed[j] and drafts is not None and r not in self._shadows:
                self._shadows[r] = _Shadow(token_counts[j], list(drafts[j]))
        return ks

    def score_shadows(self, reqs) -> None:
        """Each request's shadow draft (scheduler Request) against the tokens it emitted since:
        accepted up to the first mismatch (what greedy verification would have accepted; for a
        one-hot q, standard verification accepts a draft with the probability that sampling
        emits it). Scored once a mismatch or every draft's position has been seen."""
        if not self._shadows:
            return
        for r in reqs:
            s = self._shadows.get(r.request_id)
            if s is None:
                continue
            emitted = r.token_slice(s.at, s.at + len(s.tokens))
            m = 0
            while m < len(emitted) and emitted[m] == s.tokens[m]:
                m += 1
            if m < len(emitted) or len(emitted) == len(s.tokens):
                self.acceptance.record(r.request_id, len(s.tokens), m)
                del self._shadows[r.request_id]

    def record_verify(self, request_id: str, k: int, tau: int) -> None:
        self.acceptance.record(request_id, k, tau)
        if k and not tau:  # a first draft rejected: the next step chooses afresh
            self._held = None

    def record_step(self, seqs: int, rows: int, seconds: float, context: float = 0, verifying: int = 0) -> None:
        """A pure decode / verify step of `seqs` sequences, `context` cached tokens each on
        average, and `rows` rows took `seconds`. A sample over OUTLIER times the table's
        estimate is not kept, nor the very first when nothing was profiled: a step that
        compiled (the graph backend builds each bucket on its first step)."""
        guess = self.costs.estimate(seqs, rows, context, verifying)
        if guess is None:
            if not self._first_dropped:
                self._first_dropped = True
                return
        elif seconds > OUTLIER * guess:
            return
        self.costs.record(seqs, rows, seconds, context, verifying)

    def sparse(self, seqs: int, context: float) -> bool:
        """Whether the step's bucket has few samples (every step is sampled until it has them)."""
        return self.costs.samples(seqs, context) < SPARSE

    def release(self, request_id: str) -> None:
        self._held = None
        self.acceptance.release(request_id)
        self._shadows.pop(request_id, None)

    # ---- the choice --------------------------------------------------------------------------
    def _best(self, B: int, reach: list[list[float]], context: float = 0, draft: float = 0.0) -> tuple[int, list[int]]:
        """(total drafts D, per-request lengths) maximising (B + expected accepted) / (cost +
        `draft`, the drafter's seconds when it has yet to run), drafting only when that beats a
        plain decode by MARGIN."""
        a, m, h = self.costs.fit(B, context)
        best_rate, best_d, best_ks = MARGIN * B / (a + m * B), 0, [0] * len(reach)
        if self.uniform:  # one length j for every sequence, or none
            for j in range(1, min((len(r) for r in reach), default=0) + 1):
                rate = (B + sum(draft_gain(r, j) for r in reach)) / (a + m * B * (1 + j) + h * B + draft)
                if rate > best_rate:
                    best_rate, best_d, best_ks = rate, B * j, [j] * len(reach)
            return best_d, best_ks
        # Dinkelbach: at a trial rate lam, each request alone takes the length maximising its
        # expected tokens minus lam times its seconds; the plan's own rate is the next lam. It
        # rises to the best plan in a few rounds (each request's choice is independent at a
        # fixed lam, which a sweep over sorted positions is not once a verifier costs h).
        gains = [[0.0, *accumulate(r)] for r in reach]
        lam, ks = best_rate / MARGIN, [0] * len(reach)
        for _ in range(8):
            row, setup = lam * m, lam * h  # a row's and a verifier's seconds, in tokens at lam
            ks, d, gain, verifying = [], 0, 0.0, 0
            for g in gains:
                k_best, v_best = 0, 0.0
                for k in range(1, len(g)):
                    v = g[k] - row * k - setup
                    if v > v_best:
                        k_best, v_best = k, v
                ks.append(k_best)
                if k_best:
                    d, gain, verifying = d + k_best, gain + g[k_best], verifying + 1
            rate = (B + gain) / (a + m * (B + d) + h * verifying + draft)
            if rate <= lam * (1 + 1e-12):
                break
            lam = rate
        if d and lam > best_rate:
            best_d, best_ks = d, ks
        return best_d, best_ks
