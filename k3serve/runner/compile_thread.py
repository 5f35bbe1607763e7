"""The graph backend's compile thread: new batch buckets built off the engine's step path
(runner/graph_step.py GraphSteps, a single rank's engine), and a process-wide count of the jobs
queued or running, which `wait_for_compiles` waits out."""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time

log = logging.getLogger("k3serve.graph")
COMPILE_SWITCH_S = 2e-4  # the GIL switch interval while a bucket compiles on its thread (default 5 ms)

_IDLE = threading.Condition()
_pending = 0  # compile jobs queued or running, over every GraphSteps of this process


def count(n: int) -> None:
    global _pending
    with _IDLE:
        _pending += n
        _IDLE.notify_all()


def wait_for_compiles(timeout: float | None = None) -> bool:
    """Block until no bucket is queued or compiling anywhere in this process; False on timeout.
    A compile thread outlives the engine that queued its job (a compile under way finishes):
    the tests wait here between tests, so that one test's compile never overlaps the next
    test's own torch.compile or torch._dynamo.reset() (which crashed a process with SIGFPE)."""
    with _IDLE:
        return _IDLE.wait_for(lambda: _pending == 0, timeout)


def compile_loop(jobs: queue.Queue) -> None:
    """The compile thread: builds the buckets queued to it until its GraphSteps is gone (a None
    job) or the interpreter exits. It is no daemon: a compile under way finishes before the
    process exits (a daemon thread inside torch at exit aborted the process)."""
    while threading.main_thread().is_alive():
        try:
            job = jobs.get(timeout=0.5)
        except queue.Empty:
            continue
        if job is None:
            return
        (warm, key, fut), job = job, None
        warm = warm()  # None: its engine is gone, the job with it
        if warm is None:
            count(-1)
            continue
        t0, interval = time.perf_counter(), sys.getswitchinterval()
        # tracing is Python that holds the GIL: each time the engine thread lets it go (inside a
        # torch op) it waits a whole switch interval to get it back, hundreds of times a step
        sys.setswitchinterval(COMPILE_SWITCH_S)
        try:
            entry = warm(key)
        except Exception as e:  # noqa: BLE001 - reported on the engine thread (GraphSteps._ready)
            fut.set_exception(e)
            continue
        finally:
            sys.setswitchinterval(interval)
            warm = None  # no reference to the GraphSteps while waiting: its finalizer ends the thread
            count(-1)
        log.info(
            "graph backend: bucket B=%d W=%d T=%d compiled in %.1f s", key.B, key.W, key.T, time.perf_counter() - t0
        )
        fut.set_result(entry)
