"""AsyncEngine: concurrent streams, early exit frees the request, coalescing, overload."""

from __future__ import annotations

import asyncio

import pytest

from k3serve import SamplingParams
from k3serve.engine.async_engine import AsyncEngine, EngineOverloaded

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(1 + i, 12 + 3 * i))} for i in range(6)]


def test_concurrent_streams_equal_offline(k3_llm):
    want = [o.outputs[0].token_ids for o in k3_llm.generate(PROMPTS, GREEDY)]

    async def one(engine, p):
        snaps = [out async for out in engine.generate(p, GREEDY)]
        lens = [len(s.outputs[0].token_ids) for s in snaps]
        assert lens == sorted(lens) and snaps[-1].finished and not any(s.finished for s in snaps[:-1])
        return snaps[-1].outputs[0].token_ids

    async def main():
        engine = AsyncEngine(k3_llm.engine)
        try:
            return await asyncio.gather(*(one(engine, p) for p in PROMPTS))
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == want


def test_leaving_a_stream_aborts_and_frees(k3_llm):
    eng = k3_llm.engine

    async def main():
        engine = AsyncEngine(eng)
        got = 0
        async for out in engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)):
            got = len(out.outputs[0].token_ids)
            if got >= 3:
                break
        # the abort happens before the engine's next step; a later request runs normally
        tail = [o async for o in engine.generate(PROMPTS[1], GREEDY)][-1]
        await engine.shutdown()
        return got, tail

    got, tail = asyncio.run(main())
    assert got >= 3 and len(tail.outputs[0].token_ids) == 10
    assert not eng.has_unfinished_requests()
    assert eng.cache.num_free_slots == eng.plan.num_slots and eng.cache.num_free_blocks == eng.plan.num_blocks


def test_slow_consumer_skips_snapshots_but_not_tokens(k3_llm):
    async def main():
        engine = AsyncEngine(k3_llm.engine)
        snaps = []
        async for out in engine.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)):
            snaps.append(out)
            await asyncio.sleep(0.05)  # slower than a step
        await engine.shutdown()
        return snaps

    snaps = asyncio.run(main())
    assert len(snaps) < 30 and len(snaps[-1].outputs[0].token_ids) == 30


def test_bad_request_raises_to_the_caller_and_overload(k3_llm):
    async def main():
        engine = AsyncEngine(k3_llm.engine)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            async for _ in engine.generate({"prompt_token_ids": [10**9]}, GREEDY):
                pass
        full = AsyncEngine(k3_llm.engine, max_waiting=0)
        with pytest.raises(EngineOverloaded):
            async for _ in full.generate(PROMPTS[0], GREEDY):
                pass
        # shut down before the next request: two step loops over one LLMEngine would race for
        # its outputs (the other loop's stream would never see its request finish)
        await full.shutdown()
        out = [o async for o in engine.generate(PROMPTS[0], GREEDY)][-1]
        await engine.shutdown()
        return out

    assert len(asyncio.run(main()).outputs[0].token_ids) == 10
