"""The serving process gives freed heap memory back to the OS every 30 s (glibc's malloc_trim).

A long-running server frees most of what each request allocates (token lists, JSON, tier
entries read from disk, tensors of the host tier), but glibc keeps freed chunks in its arenas
(one per thread that allocates: the event loop, the engine's step thread, the prefix tiers'
readers and writer) and the resident set only grows. Measured on the 30-minute tiers soak
(issue 63): one malloc_trim(0) took 1-3 ms and returned 4-18 MB. Elsewhere than glibc (musl,
macOS) there is no malloc_trim and nothing runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging

log = logging.getLogger("k3serve.server")
TRIM_INTERVAL_S = 30.0
M_ARENA_MAX = -8  # glibc mallopt parameter (malloc.h)
ARENA_MAX = 2  # malloc arenas the serving process may make (glibc's default: 8 per core)


def limit_arenas(n: int = ARENA_MAX) -> bool:
    """At most `n` malloc arenas, set before the serving threads start: each thread that
    allocates otherwise gets an arena of its own, each reaching its own high-water mark and
    fragmentation, which malloc_trim cannot give back while a chunk on a page is live (the
    tiers soak's resident set crept ~5 MB over its first 20 minutes with no Python object
    growing). MALLOC_ARENA_MAX in the environment wins. True where it was set."""
    import os

    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_ARENA_MAX, n) == 1


def malloc_trim():
    """glibc's malloc_trim(0) as a callable, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


async def trim_forever(interval_s: float = TRIM_INTERVAL_S) -> None:
    """Trim every `interval_s` seconds, off the event loop (it walks every arena)."""
    trim = malloc_trim()
    if trim is None:
        return
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(trim)
