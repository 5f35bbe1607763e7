"""Run one function on N tensor-parallel ranks inside this process (one thread per rank, each
with its own ProcessGroupGloo on a shared TCPStore, distributed/expert_group.py): the model-level TP tests compare rank 0's
logits with the single-process model's without paying for N process start-ups. The engine's
own executor (distributed/executor.py) uses processes; this harness is for tests only.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from k3serve.distributed.expert_group import in_threads, thread_process_groups
from k3serve.distributed.group import TPGroup


def run_ranks(world: int, fn: Callable[[TPGroup], Any], expert_parallel: bool = False,
              timeout_s: float = 120.0, **group: Any) -> list[Any]:
    """[fn(group of rank r) for r in range(world)], run concurrently; re-raises a rank's error.
    `group`: further TPGroup fields (all2all=...)."""
    pgs = thread_process_groups(world, timeout_s)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            with torch.inference_mode():
                results[rank] = fn(TPGroup(rank, world, expert_parallel, pgs[rank], **group))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    finished = in_threads(world, rank_main, timeout_s)
    if errors:
        raise errors[0]
    if not finished:
        raise TimeoutError(f"a rank of {world} did not finish in {timeout_s:.0f} s")
    return results
