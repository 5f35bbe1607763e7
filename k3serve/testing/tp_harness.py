"""Run one function on N tensor-parallel ranks inside this process (one thread per rank, each
with its own ProcessGroupGloo on a shared TCPStore, parallel/expert_group.py): the model-level TP tests compare rank 0's
logits with the single-process model's without paying for N process start-ups. The engine's
own executor (distributed/executor.py) uses processes; this harness is for tests only.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from k3serve.parallel.expert_group import in_threads, thread_process_groups
from k3serve.parallel.group import TPGroup


def run_ranks(
    world: int, fn: Callable[[TPGroup], Any], expert_parallel: bool = False, timeout_s: float = 120.0, **group: Any
) -> list[Any]:
    """[fn(group of rank r) for r in range(world)], run concurrently; re-raises a rank's error.
    `group`: further TPGroup fields (all2all=...)."""
    pgs = thread_process_groups(world, timeout_s)
    return _in_threads(world, lambda r: fn(TPGroup(r, world, expert_parallel, pgs[r], **group)), timeout_s)


def run_dp_tp_ranks(
    dp: int, tp: int, fn: Callable[[TPGroup, TPGroup], Any], timeout_s: float = 120.0, **group: Any
) -> list[Any]:
    """DP-attention with TP inside each DP rank: dp x tp ranks as threads, rank g = m * tp + t
    (DP rank m, TP rank t). [fn(TP group of g, expert group of g) for g]: the expert group is all
    dp x tp ranks (experts by id), a TP group the tp ranks of one DP rank. `group`: further
    fields of the expert group (all2all=...)."""
    world = dp * tp
    ep_pgs = thread_process_groups(world, timeout_s)
    tp_pgs = [thread_process_groups(tp, timeout_s) for _ in range(dp)]

    def rank(g: int) -> Any:
        m, t = divmod(g, tp)
        return fn(
            TPGroup(t, tp, False, tp_pgs[m][t]),
            TPGroup(g, world, True, ep_pgs[g], size_flag="--data-parallel-size", **group),
        )

    return _in_threads(world, rank, timeout_s)


def _in_threads(world: int, call: Callable[[int], Any], timeout_s: float) -> list[Any]:
    """[call(r) for r in range(world)], each on its own thread in inference mode; re-raises a rank's error."""
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            with torch.inference_mode():
                results[rank] = call(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    finished = in_threads(world, rank_main, timeout_s)
    if errors:
        raise errors[0]
    if not finished:
        raise TimeoutError(f"a rank of {world} did not finish in {timeout_s:.0f} s")
    return results
