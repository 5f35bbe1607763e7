"""Tensor-parallel ranks on several nodes: a static launch (vLLM's `--nnodes / --node-rank /
--master-addr / --master-port`) or torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT).

Node n holds ranks [n * N / nnodes, (n + 1) * N / nnodes). Node 0 runs the server and rank 0;
every other node runs `k3serve serve ... --node-rank n` (or torchrun starts one process per
rank), which starts that node's workers headless and waits for them. A worker on another node
has no pipe to the driver, so commands travel as pickled bytes broadcast over a second
ProcessGroupGloo, the control group, whose timeout is long: an idle server sends nothing, and
a worker blocked in that broadcast must not give up; a driver that dies closes the sockets,
which ends the broadcast with an error, and the worker exits.
Reference: vLLM `executor/multiproc_executor.py` (multi-node, `--headless`), torchrun docs.
"""

from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass

import torch

CONTROL_TIMEOUT = datetime.timedelta(days=30)


@dataclass(frozen=True)
class NodeLayout:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: any free port (one node only)
    torchrun: bool = False  # every rank's process was started by torchrun: spawn none
    agent_store: bool = False  # torchrun's agent already hosts the TCPStore at master_addr:master_port
    ray: bool = False  # the ranks are Ray actors, placed by the Ray cluster (distributed/ray_executor.py)

    @property
    def multi(self) -> bool:
        """Ranks beyond this machine's pipes: commands go over the control group."""
        return self.nnodes > 1 or self.torchrun or self.ray

    def ranks(self, world: int, node: int | None = None) -> list[int]:
        node = self.node_rank if node is None else node
        if world % self.nnodes:
            raise ValueError(f"--tensor-parallel-size {world} is not divisible by --nnodes {self.nnodes}")
        per = world // self.nnodes
        return list(range(node * per, (node + 1) * per))

    def check(self, world: int) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in [0, --nnodes {self.nnodes})")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("--nnodes > 1 needs --master-port (node 0 serves the rendezvous there)")
        self.ranks(world)


def torchrun_rank() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) when this process was started by torchrun, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def torchrun_layout() -> NodeLayout:
    return NodeLayout(nnodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
                      node_rank=int(os.environ.get("GROUP_RANK", "0")),
                      master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]),
                      torchrun=True, agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


class ControlChannel:
    """Rank 0 broadcasts (method, args) to every rank: a length, then the pickled bytes."""

    def __init__(self, pg, rank: int):
        self.pg, self.rank = pg, rank

    def send(self, obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.pg.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0).wait()
        self.pg.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0).wait()

    def recv(self):
        n = torch.zeros(1, dtype=torch.int64)
        self.pg.broadcast(n, 0).wait()
        buf = torch.empty(int(n), dtype=torch.uint8)
        self.pg.broadcast(buf, 0).wait()
        return pickle.loads(buf.numpy().tobytes())

    def ready(self, ok: bool) -> int:
        """How many ranks loaded their shard (each says 1 or 0): the start-up barrier."""
        t = torch.tensor([int(ok)])
        self.pg.allreduce([t]).wait()
        return int(t)


def control_group(store, prefix: str, rank: int, world: int):
    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.PrefixStore(prefix + "/control", store), rank, world, CONTROL_TIMEOUT)
