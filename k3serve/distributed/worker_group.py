"""Worker processes of one engine: their shared WorkerSpec fields, their start, the rendezvous,
readiness and the commands of each step over their pipes (or the control group across nodes),
and their shutdown. `MultiprocExecutor` (distributed/executor.py) and the DP-attention workers
(distributed/dp_workers.py) are such groups; `run_headless` runs a node's share of them.

Faults: every collective has `timeout_s`; a worker that dies closes its pipe and its gloo
sockets, so the driver's next send or collective raises instead of hanging; `alive` is what
/health reports.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import threading
import uuid
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist

from k3serve.distributed.multinode import ControlChannel, NodeLayout, control_group
from k3serve.distributed.worker import WorkerSpec, rank_groups, worker_main
from k3serve.executor.base import WorkerDied
from k3serve.parallel.shm import create_segment

log = logging.getLogger("k3serve.distributed")


@dataclass(frozen=True)
class WorkerLaunch:
    """What every rank of one engine is started with, from its config and placement: the one copy
    of the launch arguments the TP / PP executors, the DP-attention workers and a headless node's
    ranks share (they were nine keywords written in four places)."""

    model_path: str
    dtype: torch.dtype
    device: torch.device
    load_format: str = "auto"
    quantization: str | None = None  # routed experts quantized at load (models/registry.py load_model)
    kernels: str = "auto"
    timeout_s: float = 120.0  # every collective's and every start-up's
    expert_parallel: bool = False
    redundant_experts: int | None = None  # EPLB's extra expert slots (parallel/group.py); None: off
    pp_size: int = 1  # pipeline stages
    dcp_size: int = 1  # decode context parallelism over the TP ranks (parallel/dcp.py)
    dcp_interleave: int = 1
    cpu_plan: tuple[tuple[int, ...], ...] = ()  # CPU ranks: each local rank's CPUs (executor/cpu_topology.py)

    @classmethod
    def from_config(cls, config, where, model_path: str, ranks: int | None = None) -> "WorkerLaunch":
        """An EngineConfig's TP x PP ranks on `where` (executor/placement.py Placement), or
        `ranks` of them (DP-attention: DP x TP worker ranks); CPU ranks are placed on cores."""
        ranks = ranks or config.tensor_parallel_size * config.pipeline_parallel_size
        return cls(
            model_path=model_path,
            dtype=where.dtype,
            device=where.device,
            load_format=config.load_format,
            quantization=config.quantization,
            kernels=config.kernels,
            timeout_s=config.distributed_timeout,
            expert_parallel=config.enable_expert_parallel,
            redundant_experts=config.redundant_experts,
            pp_size=config.pipeline_parallel_size,
            dcp_size=config.decode_context_parallel_size,
            dcp_interleave=config.cp_kv_cache_interleave_size,
            cpu_plan=rank_cpus(config, where, ranks),
        )


def rank_cpus(config, where, ranks: int) -> tuple[tuple[int, ...], ...]:
    """CPU ranks' CPUs on this host (executor/cpu_topology.py), logged; () on a GPU or unpinned."""
    if where.device.type != "cpu" or config.distributed_executor_backend == "ray":  # Ray places its actors
        return ()
    from k3serve.executor.cpu_topology import RankCPUs, cpu_plan, describe

    local = ranks // max(1, config.nnodes)
    plan = cpu_plan(local, config.numa, config.cpu_threads_bind)
    for line in describe([RankCPUs(r, None, c) for r, c in enumerate(plan)]):
        logging.getLogger("k3serve.engine").info("CPU placement: %s", line)
    return plan


def worker_base(launch: WorkerLaunch, tp_size: int, nodes: NodeLayout, port: int, shm_path: str | None) -> dict:
    """The WorkerSpec fields every rank of one engine shares (all but `rank`); `tp_size`: every
    rank (TP x PP with `launch.pp_size` pipeline stages: rank g = stage * TP + t)."""
    pp_size, dcp_size = launch.pp_size, launch.dcp_size
    threads = max(1, (os.cpu_count() or 1) // len(nodes.ranks(tp_size)))  # this node's share of its cores
    prefix = f"k3serve-tp-{port}" if nodes.multi else f"k3serve-{uuid.uuid4().hex}"  # nodes must agree
    return dict(
        shm_path=shm_path,
        world=tp_size,
        port=port,
        prefix=prefix,
        timeout_s=launch.timeout_s,
        expert_parallel=launch.expert_parallel,
        model_path=launch.model_path,
        dtype=str(launch.dtype).removeprefix("torch."),
        load_format=launch.load_format,
        quantization=launch.quantization,
        kernels=launch.kernels,
        device=torch.device(launch.device).type,  # each rank's own device: WorkerSpec.rank_device
        threads=threads,
        redundant_experts=launch.redundant_experts,
        **(dict(pp_size=pp_size, tp_size=tp_size // pp_size) if pp_size > 1 else {}),
        **(dict(dcp_size=dcp_size, dcp_interleave=launch.dcp_interleave) if dcp_size > 1 else {}),
        **(dict(cpu_plan=launch.cpu_plan) if launch.cpu_plan else {}),
        master_addr=nodes.master_addr if nodes.multi else "127.0.0.1",
        control=nodes.multi,
        per_node=tp_size // nodes.nnodes,
        ray=nodes.ray,
    )


def worker_name(base: dict, rank: int) -> str:
    """A worker process's name, as errors and `ps` show it: k3serve-dp{rank} for DP-attention
    ranks, k3serve-tp{rank} for tensor-parallel ones."""
    return f"k3serve-{'dp' if base.get('dp_attention') else 'tp'}{rank}"


def spawn_workers(base: dict, ranks: list[int], pipes: bool) -> tuple[list, list]:
    """Start `ranks` as worker processes; (processes, the driver's pipe ends or [])."""
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in ranks:
        ours, theirs = ctx.Pipe() if pipes else (None, None)
        p = ctx.Process(
            target=worker_main, args=(WorkerSpec(rank=rank, **base), theirs), daemon=True, name=worker_name(base, rank)
        )
        p.start()
        if pipes:
            theirs.close()
            conns.append(ours)
        procs.append(p)
    return procs, conns


def run_headless(launch: WorkerLaunch, tp_size: int, nodes: NodeLayout) -> int:
    """A node other than 0: start its ranks, wait until they exit (the driver shut down or died)."""
    nodes.check(tp_size)
    base = worker_base(launch, tp_size, nodes, nodes.master_port, None)
    procs, _ = spawn_workers(base, nodes.ranks(tp_size), pipes=False)
    for p in procs:
        p.join()
    return max((p.exitcode or 0 for p in procs), default=0)


class WorkerGroup:
    """Worker processes for ranks 1..N-1 (or, subclassed, a DP-attention group's ranks): start,
    rendezvous, readiness, the commands of each step over their pipes (or the control group across
    nodes), liveness and shutdown."""

    kind = "tensor-parallel"  # how errors name a worker

    def __init__(self, launch: WorkerLaunch, tp_size: int, nodes: NodeLayout = NodeLayout()):
        """`tp_size`: every rank (TP x PP with `launch.pp_size` pipeline stages)."""
        nodes.check(tp_size)
        timeout_s, pp_size = launch.timeout_s, launch.pp_size
        # `world`: every process of the group; `size` (executor/base.py): the ranks whose KDA heads
        # make up one state, the TP ranks of a stage (all of them without stages)
        self.world, self.size, self.timeout_s, self.nodes = tp_size, tp_size // pp_size, timeout_s, nodes
        self.pp = pp_size
        self.dcp = (
            launch.dcp_size,
            launch.dcp_interleave,
        )  # decode context parallelism over the TP ranks (parallel/dcp.py)
        self.error: str | None = None
        timeout = datetime.timedelta(seconds=timeout_s)
        if nodes.agent_store:  # torchrun's agent hosts it
            self._store = dist.TCPStore(nodes.master_addr, nodes.master_port, tp_size, False, timeout=timeout)
        else:
            host, port = (nodes.master_addr, nodes.master_port) if nodes.multi else ("127.0.0.1", 0)
            self._store = dist.TCPStore(host, port, tp_size, True, wait_for_workers=False, timeout=timeout)
        self._shm_path = None if nodes.multi else create_segment(tp_size)  # ranks on one host only
        base = worker_base(launch, tp_size, nodes, self._store.port, self._shm_path)
        # each rank gets its share of the cores, the driver's included: an idle OpenMP thread
        # spinning on a core a peer needs makes every collective wait for the scheduler
        self._driver_threads = torch.get_num_threads()
        self._driver_cpus = None  # the driver's affinity before it pinned rank 0 (restored at shutdown)
        if launch.cpu_plan:
            from k3serve.executor.cpu_topology import RankCPUs, pin

            self._driver_cpus = os.sched_getaffinity(0)
            pin(RankCPUs(0, None, launch.cpu_plan[0]))
        else:
            torch.set_num_threads(base["threads"])
        local = [] if nodes.torchrun else nodes.ranks(tp_size)[1:]  # torchrun started every rank itself
        self._procs, self._conns = self._start_workers(base, local, pipes=not nodes.multi)
        self._spec, self._base = WorkerSpec(rank=0, **base), base
        self._channel = None  # multi-node: the control group's channel (made in join_group)
        self._ready: set[str] = set()  # workers that said "ready"
        self._weights: dict[str, int] = {}  # each ready worker's weight bytes, by process name

    def _start_workers(self, base: dict, ranks: list[int], pipes: bool) -> tuple[list, list]:
        return spawn_workers(base, ranks, pipes)

    def join_group(self) -> dict:
        """Rank 0's groups (distributed/worker.py rank_groups): a rendezvous with every worker,
        bounded by timeout_s, that gives up as soon as a worker reports an error or exits (the
        rendezvous itself cannot see that)."""
        box: dict = {}

        def rendezvous():
            try:
                box["groups"] = rank_groups(self._spec, self._store, 0)
                if self.nodes.multi:
                    self._channel = ControlChannel(control_group(self._store, self._spec.prefix, 0, self.world), 0)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e

        t = threading.Thread(target=rendezvous, daemon=True, name="k3serve-tp-rendezvous")
        t.start()
        while t.is_alive():
            t.join(timeout=0.2)
            self._check_start()
        if "error" in box:
            self.shutdown()
            raise WorkerDied(f"{self.kind} group did not form: {box['error']}")
        return box["groups"]

    def _check_start(self) -> None:
        """Raise a worker's start-up error or exit, if there is one."""
        for conn, p in zip(self._conns, self._procs):
            if conn.poll():
                kind, detail = conn.recv()
                if kind == "error":
                    self.shutdown()
                    raise RuntimeError(f"{self.kind} worker failed to start: {detail}")
                self._ready.add(p.name)
                self._weights[p.name] = detail
            elif not p.is_alive():
                self.shutdown()
                raise WorkerDied(f"{self.kind} worker {p.name} exited with code {p.exitcode} while starting")

    def wait_ready(self) -> None:
        """Block until every worker has loaded its shard; raise the first worker's error. Every
        rank has mapped the shared segment by then: its file goes (the mappings stay)."""
        try:
            if self._channel is not None:
                self._wait_ready_control()
            else:
                self._wait_ready_pipes()
        finally:
            self._unlink_segment()

    def weight_bytes(self, rank: int) -> int:
        """What the worker process serving `rank` (one of this host's, after wait_ready) loaded."""
        return self._weights[worker_name(self._base, rank)]

    def _wait_ready_pipes(self) -> None:
        pending = {c: p for c, p in zip(self._conns, self._procs) if p.name not in self._ready}
        while pending:
            ready = wait(list(pending) + [p.sentinel for p in pending.values()], timeout=self.timeout_s)
            if not ready:
                raise WorkerDied(f"{self.kind} workers not ready after {self.timeout_s:.0f} s")
            for conn in [c for c in pending if c in ready]:
                kind, detail = conn.recv()
                if kind == "error":
                    self.shutdown()
                    raise RuntimeError(f"{self.kind} worker failed to start: {detail}")
                self._weights[pending.pop(conn).name] = detail
            for conn, p in list(pending.items()):
                if p.sentinel in ready and not conn.poll():
                    self.shutdown()
                    raise WorkerDied(f"{self.kind} worker {p.name} exited with code {p.exitcode} while loading")

    def _wait_ready_control(self) -> None:
        """Multi-node: a barrier where each rank says whether its shard loaded; the errors of
        those that did not are in the store."""
        if self._channel.ready(True) == self.world:
            return
        keys = [f"{self._spec.prefix}/error/{r}" for r in range(1, self.world)]
        why = [self._store.get(k).decode() for k in keys if self._store.check([k])]
        self.shutdown()
        raise RuntimeError(f"{self.kind} worker failed to start: {why[0] if why else 'no reason given'}")

    def send(self, method: str, *args) -> None:
        """Run `method(*args)` on every worker's RankRunner (the driver runs its own after)."""
        if self.error is not None:
            raise WorkerDied(self.error)
        if self._channel is not None:
            try:
                self._channel.send((method, args))
            except RuntimeError as e:  # a node's socket closed
                self.error = f"tensor-parallel control broadcast failed: {str(e).splitlines()[0]}"
                raise WorkerDied(self.error) from None
            return
        for conn, p in zip(self._conns, self._procs):
            try:
                conn.send((method, args))
            except (BrokenPipeError, OSError):
                self.error = f"{self.kind} worker {p.name} died (exit code {p.exitcode})"
                raise WorkerDied(self.error) from None

    def send_each(self, method: str, per_rank: list[tuple]) -> None:
        """Run `method(*per_rank[r - 1])` on worker rank r (one host: over the pipes)."""
        self._check_pipes(method)
        for conn, p, args in zip(self._conns, self._procs, per_rank):
            try:
                conn.send((method, args))
            except (BrokenPipeError, OSError):
                self.error = f"{self.kind} worker {p.name} died (exit code {p.exitcode})"
                raise WorkerDied(self.error) from None

    def call(self, method: str, *args) -> list:
        """Run `method(*args)` on every worker and return their answers, rank order (pipes only)."""
        self._check_pipes(method)
        self.send(method, *args)
        out = []
        for conn, p in zip(self._conns, self._procs):
            if not conn.poll(self.timeout_s):
                self.error = f"{self.kind} worker {p.name} did not answer {method} in {self.timeout_s:.0f} s"
                raise WorkerDied(self.error)
            kind, value = conn.recv()
            if kind == "error":
                raise RuntimeError(f"{self.kind} worker {p.name}: {value}")
            out.append(value)
        return out

    @property
    def local(self) -> bool:
        """Every worker is a process of this host reached over a pipe (not torchrun, Ray or nodes)."""
        return self._channel is None and not self.nodes.multi

    def _check_pipes(self, method: str) -> None:
        if self.error is not None:
            raise WorkerDied(self.error)
        if not self.local:
            raise ValueError(f"{method} needs the tensor-parallel workers on this node (no torchrun, Ray or --nnodes)")

    @property
    def alive(self) -> bool:
        if self.error is None:
            dead = [p for p in self._procs if not p.is_alive()]
            if dead:
                self.error = f"{self.kind} worker {dead[0].name} died (exit code {dead[0].exitcode})"
        return self.error is None

    def fail(self, why: str) -> None:
        """A collective failed: the group is broken for good."""
        self.error = self.error or why

    def _unlink_segment(self) -> None:
        if self._shm_path is not None:
            Path(self._shm_path).unlink(missing_ok=True)
            self._shm_path = None

    def shutdown(self) -> None:
        self._unlink_segment()
        if self._driver_threads is not None:
            torch.set_num_threads(self._driver_threads)
            self._driver_threads = None
        if getattr(self, "_driver_cpus", None) is not None:  # DPAttentionWorkers never pins (nor sets it)
            os.sched_setaffinity(0, self._driver_cpus)
            self._driver_cpus = None
        if self._channel is not None and self.error is None:
            try:
                self._channel.send(("shutdown", ()))
            except RuntimeError:
                pass
            self._channel = None
        for conn in self._conns:
            try:
                conn.send(("shutdown", ()))
            except (BrokenPipeError, OSError):
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
