"""DP-attention's expert groups for replicas in one process (engine/lockstep.py).

M data-parallel replicas, each a thread with its own engine, form one group of M ranks: a
ProcessGroupGloo per replica on a shared TCPStore (their constructors rendezvous, so they are
made concurrently), with the shared-memory transport (parallel/shm.py) on top, as the TP
ranks of one host use. k3serve/testing/tp_harness.py runs the model tests' ranks on the same groups.
"""

from __future__ import annotations

import datetime
import threading
import uuid
from pathlib import Path

import torch.distributed as dist

from k3serve.parallel.group import TPGroup


def in_threads(world: int, target, timeout_s: float) -> bool:
    """target(r) for r in range(world), each on its own thread; whether all finished in time."""
    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return not any(t.is_alive() for t in threads)


def thread_process_groups(world: int, timeout_s: float = 120.0) -> list:
    """`world` ProcessGroupGloo ranks in this process, made concurrently (their constructors
    rendezvous on one TCPStore); rank r's group is item r."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False, timeout=timeout)
    prefix = f"k3serve-threads-{uuid.uuid4().hex}"
    pgs: list = [None] * world
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            client = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, world, False, timeout=timeout)
            pgs[rank] = dist.ProcessGroupGloo(dist.PrefixStore(prefix, client), rank, world, timeout)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    in_threads(world, join, timeout_s)
    if errors or any(pg is None for pg in pgs):
        raise RuntimeError(f"a group of {world} in-process ranks did not form: {errors[0] if errors else 'timed out'}")
    return pgs


def expert_groups(
    world: int, timeout_s: float = 120.0, all2all: str = "auto", redundant_experts: int | None = None
) -> list[TPGroup]:
    """One TPGroup (expert-parallel, size `world`) per replica, rank r for replica r; `all2all`:
    how their MoE layers exchange tokens (layers/moe_dispatch.py); `redundant_experts`: EPLB's."""
    from k3serve import kernels
    from k3serve.parallel.shm import ShmComm, create_segment

    pgs = thread_process_groups(world, timeout_s)
    module = kernels.get("auto")  # a transport, not a model kernel: used even under --kernels torch
    shms: list = [None] * world
    if module is not None:
        path = create_segment(world)
        try:
            shms = [ShmComm(path, r, world, module, timeout_s) for r in range(world)]
        finally:
            Path(path).unlink(missing_ok=True)  # the mappings stay
    return [
        TPGroup(
            r,
            world,
            True,
            pgs[r],
            shms[r],
            size_flag="--data-parallel-size",
            all2all=all2all,
            redundant_experts=redundant_experts,
        )
        for r in range(world)
    ]
