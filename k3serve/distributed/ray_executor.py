"""The `ray` executor: tensor-parallel ranks 1..N-1 as Ray actors, placed by the cluster.

Ray only places and starts the ranks (one actor each, `num_cpus` = its share); the ranks then
meet as they do on several nodes (distributed/multinode.py): a TCPStore on the driver's node,
gloo for the collectives and a control group for the per-step commands, so a step costs the
same as with `mp`. The driver (rank 0) joins the cluster at RAY_ADDRESS (or starts a local one).
Every node needs k3serve installed and the checkpoint at the same path.
Reference: vLLM `executor/ray_distributed_executor.py` (placement, one actor per rank).
"""

from __future__ import annotations

import logging
import os
import socket

from k3serve.distributed.executor import MultiprocExecutor
from k3serve.distributed.multinode import NodeLayout

log = logging.getLogger("k3serve.distributed")


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--distributed-executor-backend ray needs Ray: pip install 'k3serve[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False, include_dashboard=False)
    return ray


def ray_layout() -> NodeLayout:
    """The driver's node address (where every actor finds the store) and a free port on it."""
    ray = _ray()
    ip = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((ip, 0))
        port = s.getsockname()[1]
    return NodeLayout(master_addr=ip, master_port=port, ray=True)


class _Rank:
    """A rank's actor, seen through the Process interface the executor uses."""

    def __init__(self, ray, actor, ref, rank: int):
        self._ray, self.actor, self.ref, self.name = ray, actor, ref, f"k3serve-tp{rank} (Ray actor)"
        self.exitcode = None

    def is_alive(self) -> bool:
        done, _ = self._ray.wait([self.ref], timeout=0)
        if done and self.exitcode is None:
            try:
                self._ray.get(self.ref)
                self.exitcode = 0
            except Exception:  # noqa: BLE001 - the actor died or its rank raised
                self.exitcode = 1
        return not done

    def join(self, timeout: float | None = None) -> None:
        self._ray.wait([self.ref], timeout=timeout)

    def kill(self) -> None:
        self._ray.kill(self.actor)

    def node_id(self) -> str:
        return self._ray.get(self.actor.node_id.remote())


class RankActor:
    def run(self, spec) -> int:
        from k3serve.distributed.worker import worker_main

        worker_main(spec, None)
        return 0

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class RayExecutor(MultiprocExecutor):
    def _start_workers(self, base: dict, ranks: list[int], pipes: bool) -> tuple[list, list]:
        from k3serve.distributed.worker import WorkerSpec

        ray = _ray()
        # on CUDA each actor gets one GPU from Ray and sees only it (WorkerSpec.rank_device: cuda:0)
        cls = ray.remote(num_cpus=base["threads"], num_gpus=1 if base["device"] == "cuda" else 0)(RankActor)
        out = []
        for rank in ranks:
            # two threads: run() serves the rank for good, node_id() still answers beside it
            actor = cls.options(name=f"{base['prefix']}-rank{rank}", max_concurrency=2).remote()
            out.append(_Rank(ray, actor, actor.run.remote(WorkerSpec(rank=rank, **base)), rank))
        return out, []

    def shutdown(self) -> None:
        procs = list(self._procs)
        super().shutdown()  # the shutdown command, then a bounded wait
        for p in procs:
            p.kill()
