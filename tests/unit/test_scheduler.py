"""Scheduler units (pure Python): admission, chunking, preemption, abort, accounting to zero,
and a hypothesis state machine with random arrivals, finishes and aborts."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from k3serve.cache.manager import HybridCacheManager
from k3serve.sampling_params import SamplingParams
from k3serve.outputs import SampledToken, StepOutput
from k3serve.scheduler.request import Request, RequestStatus
from k3serve.scheduler.scheduler import Scheduler, SchedulerConfig

EOS = 0


def make(num_blocks=64, num_slots=4, block_size=4, **cfg):
    cfg = {"max_num_seqs": 4, "max_num_batched_tokens": 256, "max_model_len": 512, **cfg}
    return Scheduler(SchedulerConfig(**cfg), HybridCacheManager(num_blocks, num_slots, block_size))


def req(rid, n_prompt, max_tokens=4, arrival=0, priority=0, **kw):
    return Request(
        rid,
        list(range(1, n_prompt + 1)),
        SamplingParams(max_tokens=max_tokens, **kw),
        EOS,
        512,
        arrival=arrival,
        priority=priority,
    )


def run_step(s: Scheduler, token=7):
    batch = s.schedule()
    out = StepOutput({q.request_id: [SampledToken(token)] for q in batch.seqs if q.sample})
    return batch, s.update(batch, out)


def test_decodes_first_then_chunked_prefill_on_kda_grid():
    s = make(num_blocks=128, max_num_batched_tokens=100)
    s.add(req("a", 10, max_tokens=3))
    b, _ = run_step(s)
    assert [(q.request_id, q.start, q.num_tokens, q.sample) for q in b.seqs] == [("a", 0, 10, True)]
    s.add(req("b", 300, arrival=1))
    b, _ = run_step(s)
    # a decodes first (1 token); b gets 99 budget, cut back to the 64-token KDA chunk grid
    assert [(q.request_id, q.start, q.num_tokens, q.sample) for q in b.seqs] == [
        ("a", 10, 1, True),
        ("b", 0, 64, False),
    ]
    b, _ = run_step(s)
    assert [(q.request_id, q.start, q.num_tokens) for q in b.seqs] == [("a", 11, 1), ("b", 64, 64)]
    assert "a" not in s.requests  # 3 tokens generated: finished and forgotten
    for _ in range(5):
        run_step(s)
    rb = s.requests["b"]
    assert rb.num_computed_tokens == 300 + len(rb.output_token_ids) - 1 and rb.num_preemptions == 0


def test_max_num_seqs_and_slots_limit_admission():
    s = make(num_slots=2, max_num_seqs=3)
    for i in range(3):
        s.add(req(str(i), 5, arrival=i))
    b, _ = run_step(s)
    assert {q.request_id for q in b.seqs} == {"0", "1"}  # no third slot
    assert [r.request_id for r in s.waiting] == ["2"]


def test_finish_by_length_and_eos_frees_everything():
    s = make()
    s.add(req("a", 3, max_tokens=2))
    s.add(req("b", 3, max_tokens=9, arrival=1))
    run_step(s, token=5)
    _, fin = run_step(s, token=5)
    assert [r.request_id for r in fin] == ["a"] and fin[0].finish_reason == "length"
    _, fin = run_step(s, token=EOS)
    assert [r.request_id for r in fin] == ["b"] and fin[0].finish_reason == "stop"
    assert s.cache.num_free_blocks == 64 and s.cache.num_free_slots == 4 and not s.has_unfinished


def test_min_tokens_and_stop_token_ids():
    s = make()
    s.add(req("a", 3, max_tokens=9, min_tokens=2, stop_token_ids=[9]))
    run_step(s, token=EOS)  # below min_tokens: eos does not end it
    run_step(s, token=9)  # 2nd token: still below (the sampler masks these ids until then)
    assert not s.requests["a"].finished
    _, fin = run_step(s, token=9)
    assert fin[0].finish_reason == "stop" and fin[0].stop_reason == 9


def test_preemption_by_recompute_and_resume():
    # 6 blocks of 4 tokens: two 9-token prompts take 3 blocks each; the first decode needing a
    # 4th block preempts the later request.
    s = make(num_blocks=6, max_num_batched_tokens=64)
    s.add(req("a", 8, max_tokens=6))
    s.add(req("b", 12, max_tokens=6, arrival=1))
    run_step(s)
    b, _ = run_step(s)  # a needs row 8 (a 3rd block) -> only 0 free -> preempt b
    assert b.preempted == ["b"] and [q.request_id for q in b.seqs] == ["a"]
    rb = s.requests["b"]
    assert rb.status is RequestStatus.WAITING and rb.num_computed_tokens == 0 and rb.output_token_ids == [7]
    while s.has_unfinished:
        run_step(s)
    assert rb.num_preemptions >= 1 and len(rb.output_token_ids) == 6
    assert s.cache.num_free_blocks == 6 and s.cache.num_free_slots == 4


def test_priority_policy_orders_waiting_and_picks_victim():
    s = make(num_slots=1, policy="priority")
    s.add(req("low", 3, arrival=0, priority=5))
    s.add(req("high", 3, arrival=1, priority=-1))
    b, _ = run_step(s)
    assert [q.request_id for q in b.seqs] == ["high"]


def test_abort_waiting_and_running():
    s = make(num_slots=1)
    s.add(req("a", 3, max_tokens=9))
    s.add(req("b", 3, arrival=1))
    run_step(s)
    s.abort("b")
    s.abort("a")
    assert s.requests == {} and s.cache.num_free_blocks == 64 and s.cache.num_free_slots == 1
    assert s.schedule().is_empty


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals, steps (with random eos), aborts: the cache never leaks or double-frees."""

    def __init__(self):
        super().__init__()
        self.s = make(
            num_blocks=12,
            num_slots=3,
            block_size=4,
            max_num_seqs=3,
            max_num_batched_tokens=24,
            max_model_len=40,
            chunk_align=8,
        )
        self.n = 0

    @rule(prompt=st.integers(1, 30), max_tokens=st.integers(1, 9))
    def arrive(self, prompt, max_tokens):
        r = Request(
            f"r{self.n}", list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens), EOS, 40, arrival=self.n
        )
        self.n += 1
        self.s.add(r)

    @rule(eos=st.booleans())
    def step(self, eos):
        batch = self.s.schedule()
        for q in batch.seqs:  # what is computed must lie inside the request's blocks
            assert len(q.block_table) * 4 >= q.start + q.num_tokens
        out = StepOutput({q.request_id: [SampledToken(EOS if eos else 3)] for q in batch.seqs if q.sample})
        self.s.update(batch, out)

    @precondition(lambda self: self.s.requests)
    @rule(data=st.data())
    def abort(self, data):
        self.s.abort(data.draw(st.sampled_from(sorted(self.s.requests))))

    @invariant()
    def accounting(self):
        c = self.s.cache
        held = [b for r in self.s.running for b in c.block_table(r.request_id)]
        assert len(held) == len(set(held)) == c.blocks.num_used
        assert c.slots.num_used == len(self.s.running) == c.num_requests
        assert all(r.status is RequestStatus.WAITING for r in self.s.waiting)

    def teardown(self):
        for rid in list(self.s.requests):
            self.s.abort(rid)
        assert self.s.cache.num_free_blocks == 12 and self.s.cache.num_free_slots == 3


class CachingSchedulerMachine(SchedulerMachine):
    """Same, with prefix caching on and prompts drawn from a few shared prefixes: shared blocks'
    ref counts always equal the number of tables holding them."""

    def __init__(self):
        super().__init__()
        self.s = Scheduler(
            SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=24, max_model_len=40, chunk_align=8),
            HybridCacheManager(12, 3, 4, enable_prefix_caching=True, num_checkpoints=2),
        )

    @rule(
        prefix=st.sampled_from([(), (5, 6, 7, 8), (5, 6, 7, 8, 9, 9, 9, 9)]),
        tail=st.integers(1, 12),
        max_tokens=st.integers(1, 6),
    )
    def arrive_shared(self, prefix, tail, max_tokens):
        r = Request(
            f"r{self.n}", list(prefix) + [3] * tail, SamplingParams(max_tokens=max_tokens), EOS, 40, arrival=self.n
        )
        self.n += 1
        self.s.add(r)

    @invariant()
    def accounting(self):
        c = self.s.cache
        tables = [c.block_table(r.request_id) for r in self.s.running]
        held = {b for t in tables for b in t}
        for b in held:
            assert c.blocks.ref_count(b) == sum(t.count(b) for t in tables)
        assert len(held) == c.blocks.num_used
        assert c.slots.num_used == len(self.s.running) == c.num_requests

    def teardown(self):
        for rid in list(self.s.requests):
            self.s.abort(rid)
        self.s.cache.flush()
        assert self.s.cache.num_free_blocks == 12 and self.s.cache.num_free_slots == 3
        assert self.s.cache.checkpoints.num_stored == 0 and not self.s.cache.blocks.cached


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestCachingSchedulerMachine = CachingSchedulerMachine.TestCase
TestCachingSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_everything_finishes_under_pressure():
    """A long random workload on a tiny cache drains: no deadlock, no leak."""
    s = make(num_blocks=10, num_slots=3, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=40, chunk_align=8)
    for i in range(20):
        s.add(
            Request(str(i), list(range(1, 5 + (i * 7) % 25)), SamplingParams(max_tokens=1 + i % 8), EOS, 40, arrival=i)
        )
    for _ in range(2000):
        if not s.has_unfinished:
            break
        run_step(s)
    assert not s.has_unfinished and s.cache.num_free_blocks == 10 and s.num_preemptions > 0


def test_request_larger_than_the_cache_is_refused():
    s = make(num_blocks=4, block_size=4)
    try:
        s.add(req("big", 10, max_tokens=10))
    except ValueError as e:
        assert "5 latent blocks" in str(e) and "has 4" in str(e)
    else:
        raise AssertionError("a request that can never fit was accepted")


def test_a_failed_step_is_retried_apart_then_batches_again():
    """retry_apart: everything the failed step held is freed, each request then runs alone for
    QUARANTINE_STEPS sampling steps (recompute prefill first), and batching resumes."""
    s = make(num_blocks=64, num_slots=4)
    for i in range(3):
        s.add(req(str(i), 6, max_tokens=20, arrival=i))
    run_step(s)
    run_step(s)  # all three decoding, 2 tokens each
    failed = s.schedule()
    assert len(failed.seqs) == 3
    assert s.retry_apart(failed) == []  # several in it: nobody is blamed yet
    assert s.cache.num_free_blocks == 64 and s.cache.num_free_slots == 4  # all preempted
    assert all(s.requests[str(i)].num_computed_tokens == 0 for i in range(3))
    alone = []
    while s.quarantine:
        b, _ = run_step(s)
        assert len(b.seqs) <= 1 and all(q.request_id in {"0", "1", "2"} for q in b.seqs)
        alone += [(q.request_id, q.start, q.num_tokens) for q in b.seqs]
    # each request: its recompute (prompt + the 2 tokens it had) alone, then one decode alone
    assert sorted(alone) == sorted([(r, 0, 8) for r in "012"] + [(r, 8, 1) for r in "012"])
    b, _ = run_step(s)
    assert len(b.seqs) == 3  # released: batched together again
    assert all(len(s.requests[str(i)].output_token_ids) == 5 for i in range(3))  # 2 + 2 alone + 1


def test_a_step_that_fails_with_one_request_fails_that_request():
    s = make()
    s.add(req("x", 6, max_tokens=20))
    batch = s.schedule()
    culprits = s.retry_apart(batch)
    assert [r.request_id for r in culprits] == ["x"] and culprits[0].finish_reason == "error"
    assert not s.requests and s.cache.num_free_slots == 4 and s.cache.num_free_blocks == 64


def test_token_slice_equals_slicing_all_token_ids():
    r = req("s", 5, max_tokens=10)
    r.output_token_ids = [100, 101, 102, 103]
    every = r.all_token_ids
    for a in range(len(every) + 1):
        for b in range(a, len(every) + 2):
            assert r.token_slice(a, b) == every[a:b], (a, b)


def test_requests_in_flight_are_neither_scheduled_nor_preempted():
    """Pipeline stages keep two steps in flight (engine/llm_engine.py): the second step takes
    only the requests not in the first, and never preempts one of those for blocks."""
    s = make(num_blocks=6, max_num_batched_tokens=64)
    s.add(req("a", 8, max_tokens=6))
    s.add(req("b", 12, max_tokens=6, arrival=1))
    run_step(s)  # both prefilled
    first = s.schedule()
    assert [q.request_id for q in first.seqs] == ["a"]  # a needs a 3rd block: b preempted
    s.add(req("c", 3, max_tokens=2, arrival=2))
    s.in_flight |= {"a"}
    second = s.schedule()  # a in flight: not scheduled again; c cannot preempt it for room
    assert "a" not in [q.request_id for q in second.seqs] and not second.preempted
    assert s.requests["a"].status is RequestStatus.RUNNING
    s.in_flight.clear()
    s.update(first, StepOutput({"a": [SampledToken(7)]}))
    s.update(second, StepOutput({q.request_id: [SampledToken(7)] for q in second.seqs if q.sample}))
    while s.has_unfinished:
        run_step(s)
    assert s.cache.num_free_blocks == 6 and s.cache.num_free_slots == 4
