"""Run one function on N tensor-parallel ranks inside this process (one thread per rank, each
with its own ProcessGroupGloo on a shared TCPStore): the model-level TP tests compare rank 0's
logits with the single-process model's without paying for N process start-ups. The engine's
own executor (distributed/executor.py) uses processes; this harness is for tests only.
"""

from __future__ import annotations

import datetime
import threading
import uuid
from typing import Any, Callable

import torch
import torch.distributed as dist

from k3serve.distributed.group import TPGroup


def run_ranks(world: int, fn: Callable[[TPGroup], Any], expert_parallel: bool = False,
              timeout_s: float = 120.0) -> list[Any]:
    """[fn(group of rank r) for r in range(world)], run concurrently; re-raises a rank's error."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False, timeout=timeout)
    prefix = f"harness-{uuid.uuid4().hex}"
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            client = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, world, False, timeout=timeout)
            pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, client), rank, world, timeout)
            with torch.inference_mode():
                results[rank] = fn(TPGroup(rank, world, expert_parallel, pg))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a rank of {world} did not finish in {timeout_s:.0f} s")
    return results
