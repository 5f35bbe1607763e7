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
DP-attention ranks on several nodes (distributed/dp_workers.py) take commands addressed to one
replica at a time, so they are not broadcast: each worker dials the driver's CommandListener
(its address and an auth key are in the rendezvous store) and the connection then carries the
same messages a local pipe does.
Reference: vLLM `executor/multiproc_executor.py` (multi-node, `--headless`), torchrun docs.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import secrets
import threading
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener

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
    return NodeLayout(
        nnodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        node_rank=int(os.environ.get("GROUP_RANK", "0")),
        master_addr=os.environ["MASTER_ADDR"],
        master_port=int(os.environ["MASTER_PORT"]),
        torchrun=True,
        agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
    )


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


class SocketChannel:
    """A command connection between nodes with a pipe's send / recv / poll: objects go as plain
    pickles, tensors by value (a Connection's own pickler hands tensors over as file
    descriptors of this host's shared memory, which a peer on another host, or with another
    auth key, cannot open)."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def send(self, obj) -> None:
        self.conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self):
        return pickle.loads(self.conn.recv_bytes())

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()


class CommandListener:
    """The driver's end of the DP-attention workers' command connections across nodes: a socket
    on node 0's address whose address and auth key go into the rendezvous store under `prefix`;
    a thread accepts each worker's connection and its first message, ("hello", rank). A peer
    without the key is refused by the handshake and forgotten."""

    def __init__(self, store, prefix: str, host: str, world: int):
        key = secrets.token_bytes(32)
        self._listener = Listener((host, 0), authkey=key)
        self.conns: dict[int, SocketChannel] = {}  # rank -> its connection, as they arrive
        self._lock = threading.Lock()
        store.set(f"{prefix}/dp-driver", f"{host}:{self._listener.address[1]}")
        store.set(f"{prefix}/dp-authkey", key)
        self._thread = threading.Thread(target=self._accept, args=(world,), daemon=True, name="k3serve-dp-listener")
        self._thread.start()

    def _accept(self, world: int) -> None:
        seen: set[int] = set()
        while len(seen) < world:
            try:
                conn = SocketChannel(self._listener.accept())
                kind, rank = conn.recv()
            except (OSError, EOFError):  # closed at shutdown
                return
            except Exception as e:  # noqa: BLE001 - a failed handshake: not one of ours
                logging.getLogger("k3serve.distributed").warning("refused a command connection: %s", e)
                continue
            if kind == "hello" and isinstance(rank, int) and 0 <= rank < world and rank not in seen:
                seen.add(rank)
                with self._lock:
                    self.conns[rank] = conn
            else:
                conn.close()

    def take(self) -> dict[int, SocketChannel]:
        """The connections that arrived since the last call."""
        with self._lock:
            got, self.conns = self.conns, {}
        return got

    def close(self) -> None:
        self._listener.close()


def dial_driver(store, prefix: str, rank: int) -> SocketChannel:
    """A DP-attention worker's command connection to the driver (blocks, up to the store's
    timeout, until the driver has published its listener)."""
    host, port = store.get(f"{prefix}/dp-driver").decode().rsplit(":", 1)
    conn = SocketChannel(Client((host, int(port)), authkey=store.get(f"{prefix}/dp-authkey")))
    conn.send(("hello", rank))
    return conn
