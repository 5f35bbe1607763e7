"""server/heap.py: malloc_trim gives freed heap pages back (glibc), and the server runs it."""

from __future__ import annotations

import asyncio
import os

import pytest

from k3serve.server.heap import malloc_trim, trim_forever


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_malloc_trim_returns_freed_small_allocations():
    """Many small freed objects stay in glibc's heap until trimmed (below the mmap threshold)."""
    trim = malloc_trim()
    if trim is None:
        pytest.skip("no glibc malloc_trim here")
    trim()
    blocks = [bytearray(4096) for _ in range(40_000)]  # ~160 MiB in heap chunks
    keep = blocks[-1]  # the heap's top stays in use: only a trim returns the pages under it
    del blocks
    before = rss()
    trim()
    assert before - rss() > 64 * 2**20, (before, rss())
    del keep


def test_trim_forever_trims_on_its_interval(monkeypatch):
    calls = []
    monkeypatch.setattr("k3serve.server.heap.malloc_trim", lambda: lambda: calls.append(1))

    async def run():
        task = asyncio.create_task(trim_forever(0.01))
        await asyncio.sleep(0.1)
        task.cancel()

    asyncio.run(run())
    assert len(calls) >= 3
