"""DP-attention ranks as worker processes (issue 16; `--data-parallel-backend mp`, the default).

M data-parallel replicas keep their schedulers, cache bookkeeping, samplers and detokenizers in
the server process (engine/lockstep.py steps them together), but each replica's model runs in
its own worker process: rank r holds replica r's whole attention, its cache tensors and 1/M of
the routed experts, and the M workers form the expert group every MoE layer exchanges tokens
over (gloo plus the shared segment: distributed/worker.py `make_group`). The driver hosts the
rendezvous store and the segment but is not a rank. A replica's engine thread sends its step's
StepInputs down its worker's pipe and waits, the GIL released, for the StepResult, so the M
forwards run at once on their own cores instead of taking turns on one interpreter
(`--data-parallel-backend threads`: engine/lockstep.py's in-process replicas).
Reference: vLLM v1 runs one engine-core process per DP rank; here only the model side moves.
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from k3serve.config.model_config import ModelConfig
from k3serve.distributed.executor import MultiprocExecutor, WorkerDied, spawn_workers, worker_base
from k3serve.distributed.group import TPGroup
from k3serve.distributed.multinode import NodeLayout
from k3serve.distributed.shm import create_segment


class DPAttentionWorkers(MultiprocExecutor):
    """M worker processes, rank r serving replica r (its pipe is `_conns[r]`); the base class's
    readiness, liveness and shutdown apply to all of them."""

    kind = "DP-attention"

    def __init__(self, model_path: str, dp_size: int, *, all2all: str, dtype: torch.dtype, load_format: str,
                 kernels: str, device: torch.device, timeout_s: float = 120.0):
        self.size, self.timeout_s, self.nodes = dp_size, timeout_s, NodeLayout()
        self.error: str | None = None
        self._store = dist.TCPStore("127.0.0.1", 0, dp_size, True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self._shm_path = create_segment(dp_size)
        base = worker_base(model_path, dp_size, self.nodes, self._store.port, expert_parallel=True, dtype=dtype,
                           load_format=load_format, kernels=kernels, device=device, timeout_s=timeout_s,
                           shm_path=self._shm_path)
        base.update(dp_attention=True, all2all=all2all)
        self._driver_threads = None  # the driver runs no forward: its threads stay as they are
        self._channel, self._ready, self._weights, self._spec = None, set(), {}, None
        self._procs, self._conns = spawn_workers(base, list(range(dp_size)), pipes=True)
        self._locks = [threading.Lock() for _ in range(dp_size)]  # a pipe carries one exchange at a time

    def join_group(self) -> TPGroup:
        raise TypeError("the driver is not a rank of the DP-attention workers' group")

    def call_one(self, rank: int, method: str, *args):
        """Run `method(*args)` on worker `rank` and return its answer (an answering command)."""
        conn, p = self._conns[rank], self._procs[rank]
        with self._locks[rank]:
            self._send(rank, method, args)
            # an answer may take a whole forward whose collectives wait for the other workers; any
            # of them dying ends it (`alive` reaps a dead one, so this worker's shared-memory wait
            # finds its pid gone; `idle` is never answered, so only this loop can notice it)
            while not conn.poll(0.5):
                if not self.alive:
                    self._died(rank)
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):  # it closed its pipe: it is exiting or gone
                self._died(rank)
        if kind == "error":
            raise RuntimeError(f"{self.kind} worker {p.name}: {value}")
        return value

    def send_one(self, rank: int, method: str, *args) -> None:
        with self._locks[rank]:
            self._send(rank, method, args)

    def _send(self, rank: int, method: str, args: tuple) -> None:
        if self.error is not None:
            raise WorkerDied(self.error)
        try:
            self._conns[rank].send((method, args))
        except (BrokenPipeError, OSError):
            self._died(rank)

    def _died(self, rank: int):
        """Worker `rank` is gone (or the group already failed): raise WorkerDied. The process is
        reaped first, so the other workers' shared-memory waits find its pid gone at once
        instead of waiting out the collective timeout (a zombie still answers kill(pid, 0))."""
        p = self._procs[rank]
        p.join(1.0)
        self.error = self.error or f"{self.kind} worker {p.name} died (exit code {p.exitcode})"
        raise WorkerDied(self.error) from None


@dataclass
class RemoteModel:
    """What a replica's engine in the driver knows of the model its worker holds: the config,
    the dtype and the worker's weight bytes (one meta tensor of that many bytes, so the sizing
    code that sums parameters and buffers counts them)."""

    cfg: ModelConfig
    dtype: torch.dtype
    nbytes: int
    ep: TPGroup  # rank and size of the expert group (no process group here)

    def parameters(self):
        return iter(())

    def buffers(self):
        return iter((torch.empty(self.nbytes, dtype=torch.uint8, device="meta"),))

    def use_kernels(self, kernels: str):
        return None  # the worker chose its kernels when it loaded


class RemoteRank:
    """Replica r's RankRunner in the driver (runner/rank_step.py's interface), over worker r's
    pipe; also the replica engine's `executor` (liveness, faults, shutdown of the whole group)."""

    def __init__(self, workers: DPAttentionWorkers, rank: int, model: RemoteModel):
        self.workers, self.rank, self.model = workers, rank, model
        self._stats: dict = {}  # the worker's parallel_stats as of its last forward

    def allocate(self, plan, kv_dtype: str) -> None:
        self.workers.send_one(self.rank, "allocate", plan, kv_dtype)

    def forward(self, inputs, capture: dict | None = None):
        taps = tuple(capture) if capture else ()
        result, self._stats, states = self.workers.call_one(self.rank, "dp_forward", inputs, taps)
        if capture is not None:
            capture.update(states)  # the tap layers' [N, d], as the in-process forward fills them
        return result

    def rollback(self, slots: list[int], accepted: list[int]) -> None:
        self.workers.send_one(self.rank, "rollback", slots, accepted)

    def idle(self) -> None:
        self.workers.send_one(self.rank, "idle")

    def parallel_stats(self) -> dict:
        return self._stats

    @property
    def alive(self) -> bool:
        return self.workers.alive

    @property
    def error(self) -> str | None:
        return self.workers.error

    @property
    def local(self) -> bool:
        return False

    def fail(self, why: str) -> None:
        self.workers.fail(why)

    def shutdown(self) -> None:
        self.workers.shutdown()  # every replica's: the first stops the group, the rest find it stopped


def start_dp_workers(config, m: int) -> list[RemoteRank]:
    """M DP-attention worker processes for `config` (an EngineConfig), loaded and ready; one
    RemoteRank per replica."""
    from k3serve.config.bundled import load_model_config
    from k3serve.demo import default_model
    from k3serve.engine.setup import placement

    where, model_path = placement(config), str(config.model or default_model())
    if where.device.type != "cpu":
        raise ValueError(f"DP-attention worker processes on {where.device}: the NCCL group is not built yet; "
                         f"the gloo (CPU) one is")
    workers = DPAttentionWorkers(model_path, m, all2all=config.all2all_backend, dtype=where.dtype,
                                 load_format=config.load_format, kernels=config.kernels, device=where.device,
                                 timeout_s=config.distributed_timeout)
    try:
        workers.wait_ready()
    except BaseException:
        workers.shutdown()
        raise
    cfg = load_model_config(model_path)
    return [RemoteRank(workers, r, RemoteModel(cfg, where.dtype, workers.weight_bytes(r),
                                               TPGroup(r, m, True, size_flag="--data-parallel-size",
                                                       all2all=config.all2all_backend)))
            for r in range(m)]


def replica_kwargs(config, dp: int, dp_attention: bool) -> list[dict]:
    """LLMEngine's extra arguments for each of `dp` replicas: nothing for plain replicas; under
    DP-attention + EP, a RemoteRank each (mp) or an in-process expert group each (threads)."""
    if not dp_attention:
        return [{}] * dp
    if config.data_parallel_backend == "mp":
        return [{"remote": r} for r in start_dp_workers(config, dp)]
    from k3serve.distributed.expert_group import expert_groups

    return [{"ep": g} for g in expert_groups(dp, config.distributed_timeout, config.all2all_backend)]
