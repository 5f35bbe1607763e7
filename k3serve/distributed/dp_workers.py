"""DP-attention ranks as worker processes (issue 16; `--data-parallel-backend mp`, the default).

M data-parallel replicas keep their schedulers, cache bookkeeping, samplers and detokenizers in
the server process (engine/lockstep.py steps them together), but each replica's model runs in
its own worker process: rank r holds replica r's whole attention, its cache tensors and 1/M of
the routed experts, and the M workers form the expert group every MoE layer exchanges tokens
over (gloo plus the shared segment: distributed/worker.py `make_group`). With TP inside the DP
ranks (`--tensor-parallel-size N`, K3's production layout) replica m's model is split over N
workers (ranks m N .. m N + N - 1, a TP group of their own: heads, shared experts, vocabulary),
the routed experts over all M N, and each TP rank dispatches its share of the replica's rows
(layers/moe.py `tp_rows`); its TP rank 0 answers the step. The driver hosts the
rendezvous store and the segment but is not a rank. A replica's engine thread sends its step's
StepInputs down its worker's pipe and waits, the GIL released, for the StepResult, so the M
forwards run at once on their own cores instead of taking turns on one interpreter
(`--data-parallel-backend threads`: engine/lockstep.py's in-process replicas).
Reference: vLLM v1 runs one engine-core process per DP rank; here only the model side moves.
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import replace
from multiprocessing.connection import wait
from pathlib import Path

import torch.distributed as dist

from k3serve.distributed.worker_group import WorkerGroup, WorkerLaunch, spawn_workers, worker_base
from k3serve.executor.base import WorkerDied
from k3serve.parallel.group import TPGroup
from k3serve.distributed.multinode import CommandListener, NodeLayout
from k3serve.parallel.shm import create_segment


class DPAttentionWorkers(WorkerGroup):
    """M x N worker processes: DP rank m's model is TP-split over ranks m * N .. m * N + N - 1
    (N = tp_size, 1 by default: rank m serves replica m), whose command connections are
    `_conns[rank]`: pipes on one node; across nodes (`nodes`), sockets every worker dials
    (distributed/multinode.py CommandListener), this node's workers and the other nodes' alike.
    The base class's liveness and shutdown apply to this node's processes."""

    kind = "DP-attention"

    def __init__(
        self, launch: WorkerLaunch, dp_size: int, *, all2all: str, tp_size: int = 1, nodes: NodeLayout = NodeLayout()
    ):
        """`launch`: every rank's (experts by id over the group whatever it says)."""
        launch = replace(launch, expert_parallel=True)
        timeout_s = launch.timeout_s
        world = dp_size * tp_size
        check_dp_nodes(nodes, world, tp_size)
        self.size = self.world = world
        self.tp_size, self.timeout_s, self.nodes = tp_size, timeout_s, nodes
        self.error: str | None = None
        host, port = (nodes.master_addr, nodes.master_port) if nodes.multi else ("127.0.0.1", 0)
        self._store = dist.TCPStore(
            host, port, world, True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        local = nodes.ranks(world)
        self._shm_path = None if nodes.multi else create_segment(world)  # the expert group's: one host only
        self._tp_shm = tp_segments(local, tp_size)
        base = worker_base(launch, world, nodes, self._store.port, self._shm_path)
        base.update(dp_attention=True, all2all=all2all, tp_size=tp_size, tp_shm_paths=self._tp_shm)
        self._listener = CommandListener(self._store, base["prefix"], host, world) if nodes.multi else None
        self._driver_threads = None  # the driver runs no forward: its threads stay as they are
        self._channel, self._ready, self._weights, self._spec, self._base = None, set(), {}, None, base
        self._procs, conns = spawn_workers(base, local, pipes=not nodes.multi)
        self._proc_of = dict(zip(local, self._procs))
        self._conns: list = list(conns) if conns else [None] * world
        self._locks = [threading.Lock() for _ in range(world)]  # a connection carries one exchange at a time

    def join_group(self) -> TPGroup:
        raise TypeError("the driver is not a rank of the DP-attention workers' group")

    def wait_ready(self) -> None:
        """Block until every rank (on every node) has loaded its shard, at most timeout_s; raise
        the first error a worker reports, or name a local worker that exited."""
        deadline, pending = time.monotonic() + self.timeout_s, set(range(self.size))
        try:
            while pending:
                if self._listener is not None:
                    for rank, conn in self._listener.take().items():
                        self._conns[rank] = conn
                for rank in sorted(pending):
                    conn = self._conns[rank]
                    if conn is not None and conn.poll():
                        kind, detail = self._recv_start(rank, conn)
                        if kind == "error":
                            raise RuntimeError(f"{self.kind} worker failed to start: {detail}")
                        self._weights[rank] = detail
                        pending.discard(rank)
                for rank, p in self._proc_of.items():
                    if rank in pending and not p.is_alive() and not (self._conns[rank] and self._conns[rank].poll()):
                        raise WorkerDied(f"{self.kind} worker {p.name} exited with code {p.exitcode} while loading")
                if time.monotonic() > deadline:
                    raise WorkerDied(
                        f"{self.kind} workers not ready after {self.timeout_s:.0f} s: ranks "
                        f"{sorted(pending)}" + (" (did every node start?)" if self.nodes.multi else "")
                    )
                wait([c for r, c in enumerate(self._conns) if c is not None and r in pending], timeout=0.05)
        except BaseException:
            self.shutdown()
            raise
        finally:
            self._unlink_segment()

    def _recv_start(self, rank: int, conn) -> tuple[str, object]:
        try:
            return conn.recv()
        except (EOFError, OSError):
            return "error", f"rank {rank} closed its connection while loading"

    def weight_bytes(self, rank: int) -> int:
        return self._weights[rank]

    def ranks_of(self, replica: int) -> range:
        """The worker ranks of DP rank `replica`; the first is its TP rank 0."""
        return range(replica * self.tp_size, (replica + 1) * self.tp_size)

    def call_ranks(self, ranks: list[int], method: str, per_rank: list[tuple]) -> list:
        """Run `method(*per_rank[i])` on worker ranks[i], all at once; their answers in that order."""
        for rank in ranks:
            self._locks[rank].acquire()
        try:
            for rank, args in zip(ranks, per_rank):
                self._send(rank, method, args)
            answers = [self._answer(rank) for rank in ranks]
        finally:
            for rank in ranks:
                self._locks[rank].release()
        for rank, (kind, value) in zip(ranks, answers):
            if kind == "error":
                raise RuntimeError(f"{self.kind} worker rank {rank}: {value}")
        return [value for _, value in answers]

    def _answer(self, rank: int) -> tuple[str, object]:
        # an answer may take a whole forward whose collectives wait for the other workers; any
        # of them dying ends it (`alive` reaps a dead one, so this worker's shared-memory wait
        # finds its pid gone; `idle` is never answered, so only this loop can notice it)
        conn = self._conns[rank]
        while not conn.poll(0.5):
            if not self.alive:
                self._died(rank)
        try:
            return conn.recv()
        except (EOFError, OSError):  # it closed its connection: it is exiting or gone
            self._died(rank)

    def send_ranks(self, ranks: list[int], method: str, per_rank: list[tuple]) -> None:
        """`method(*per_rank[i])` on worker ranks[i], unanswered."""
        for rank, args in zip(ranks, per_rank):
            with self._locks[rank]:
                self._send(rank, method, args)

    def send_replica(self, replica: int, method: str, *args) -> None:
        """A command every TP rank of DP rank `replica` runs, unanswered."""
        for rank in self.ranks_of(replica):
            with self._locks[rank]:
                self._send(rank, method, args)

    @property
    def alive(self) -> bool:
        """This node's processes are alive and no other node's worker has closed its connection
        (one with no exchange under way: such a worker never speaks first, so a readable
        connection is a closed one)."""
        if not super().alive:
            return False
        for rank, conn in enumerate(self._conns):
            if rank in self._proc_of or conn is None or not self._locks[rank].acquire(blocking=False):
                continue
            try:
                if conn.poll():
                    self.error = self.error or f"{self.kind} worker rank {rank} (another node) closed its connection"
            except OSError:
                self.error = self.error or f"{self.kind} worker rank {rank} (another node) is unreachable"
            finally:
                self._locks[rank].release()
        return self.error is None

    def _unlink_segment(self) -> None:
        super()._unlink_segment()
        for path in self._tp_shm:
            if path:
                Path(path).unlink(missing_ok=True)
        self._tp_shm = ()

    def shutdown(self) -> None:
        if self._listener is not None:
            self._listener.close()
        self._conns = [c for c in self._conns if c is not None]
        super().shutdown()

    def _send(self, rank: int, method: str, args: tuple) -> None:
        if self.error is not None:
            raise WorkerDied(self.error)
        try:
            self._conns[rank].send((method, args))
        except (BrokenPipeError, OSError):
            self._died(rank)

    def _died(self, rank: int):
        """Worker `rank` is gone (or the group already failed): raise WorkerDied. A local process
        is reaped first, so the other workers' shared-memory waits find its pid gone at once
        instead of waiting out the collective timeout (a zombie still answers kill(pid, 0))."""
        p = self._proc_of.get(rank)
        if p is not None:
            p.join(1.0)
        why = (
            f"{self.kind} worker {p.name} died (exit code {p.exitcode})"
            if p is not None
            else f"{self.kind} worker rank {rank} (another node) closed its connection"
        )
        self.error = self.error or why
        raise WorkerDied(self.error) from None


def check_dp_nodes(nodes: NodeLayout, world: int, tp_size: int) -> None:
    """DP-attention ranks split evenly over the nodes, each DP rank's TP ranks on one node."""
    nodes.check(world)
    if nodes.torchrun or nodes.ray:
        raise ValueError(
            "DP-attention across nodes is launched with --nnodes / --node-rank / --master-addr / "
            "--master-port (each node runs `k3serve serve` itself), not torchrun or Ray"
        )
    if (world // nodes.nnodes) % tp_size:
        raise ValueError(
            f"--data-parallel-size x --tensor-parallel-size = {world} ranks over --nnodes "
            f"{nodes.nnodes} puts {world // nodes.nnodes} on a node, not a multiple of "
            f"--tensor-parallel-size {tp_size}: a DP rank's TP ranks must share a node"
        )


def tp_segments(local: list[int], tp_size: int) -> tuple[str, ...]:
    """A shared segment for each DP rank whose TP ranks are all in `local` (this node's), by DP
    rank ("" for the others'); () without TP."""
    if tp_size == 1:
        return ()
    dp = {r // tp_size for r in local}
    return tuple(create_segment(tp_size) if m in dp else "" for m in range(max(dp) + 1))


def run_headless_dp(launch: WorkerLaunch, dp_size: int, tp_size: int, nodes: NodeLayout, *, all2all: str) -> int:
    """A node other than 0 of DP-attention: start its ranks (they dial node 0's driver), wait
    until they exit (the driver shut down or died)."""
    world = dp_size * tp_size
    check_dp_nodes(nodes, world, tp_size)
    local = nodes.ranks(world)
    segments = tp_segments(local, tp_size)
    base = worker_base(replace(launch, expert_parallel=True), world, nodes, nodes.master_port, None)
    base.update(dp_attention=True, all2all=all2all, tp_size=tp_size, tp_shm_paths=segments)
    try:
        procs, _ = spawn_workers(base, local, pipes=False)
        for p in procs:
            p.join()
        return max((p.exitcode or 0 for p in procs), default=0)
    finally:
        for path in segments:
            if path:
                Path(path).unlink(missing_ok=True)
