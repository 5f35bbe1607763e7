"""A tensor-parallel worker process (ranks 1..N-1; the driver is rank 0).

It joins the group's ProcessGroupGloo (the data plane: all-reduces and all-gathers inside the
model), loads its shard of the checkpoint, says "ready" on its pipe (or the error that stopped
it), then runs the commands the driver sends on that pipe, one per step: `allocate` (the
cache for the driver's plan), `forward` (StepInputs), `rollback`, `read_state` / `write_state`
(a prefill/decode hand-off's KDA heads, and latent rows, of this rank), `shutdown`. A DP-attention
rank (`dp_attention`, distributed/dp_workers.py) is a whole replica's model, or its TP share:
it answers `dp_forward` with its StepResult (the replica's TP rank 0; the others with none) and
stats, and runs `idle` forwards. The pipe is the
control plane: it blocks without a timeout while the server idles, and reads EOF when the
driver is gone, so a worker never outlives its engine.
Reference: vLLM v1 `executor/multiproc_executor.py` (WorkerProc.worker_busy_loop).
"""

from __future__ import annotations

import datetime
import logging
import os
import traceback
from dataclasses import dataclass

log = logging.getLogger("k3serve.distributed")
ANSWERS = frozenset(
    {"read_state", "read_rows", "pipe_stats", "graph_steps"}
)  # commands whose result goes back to the driver (pipes only)
DP_ANSWERS = ANSWERS | {"dp_forward"}  # a DP-attention rank's forward, whose logits are sampled
START_TIMEOUT_S = 120.0  # at least this long for a group to form (a loaded 2-core machine took > 20 s)


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world: int
    port: int  # the driver's TCPStore on 127.0.0.1
    prefix: str  # this engine's key space in the store
    timeout_s: float  # every collective's timeout
    expert_parallel: bool
    model_path: str
    dtype: str  # torch dtype name, e.g. "float32"
    load_format: str
    kernels: str
    device: str
    threads: int
    shm_path: str | None = None  # the driver's shared segment (parallel/shm.py), or gloo only
    master_addr: str = "127.0.0.1"  # where the TCPStore is (node 0, or torchrun's agent)
    control: bool = False  # commands over the control group (multi-node), not a pipe
    dp_attention: bool = False  # a DP-attention rank: a replica's model, experts by id over `world`
    all2all: str = "auto"  # its MoE layers' token exchange (layers/moe_dispatch.py)
    redundant_experts: int | None = None  # EPLB's extra expert slots over the expert group; None: off
    tp_size: int = 1  # DP-attention / pipeline stages: TP ranks per DP rank or stage (rank = block * tp_size + tp rank)
    pp_size: int = 1  # pipeline stages (rank // tp_size: this rank's stage)
    dcp_size: int = 1  # decode context parallelism: the latent cache sharded by token over the TP ranks
    dcp_interleave: int = 1  # tokens on one rank before the next (parallel/dcp.py)
    cpu_plan: tuple[tuple[int, ...], ...] = ()  # CPU ranks: each local rank's CPUs to pin to (executor/cpu_topology.py)
    tp_shm_paths: tuple[str, ...] = ()  # DP-attention with TP: each DP rank's TP segment by DP rank ("": none here)
    per_node: int = 0  # ranks on each node (0: all `world`): rank r is local rank r % per_node
    ray: bool = False  # a Ray actor: on CUDA it sees only the GPU Ray gave it
    quantization: str | None = None  # routed experts quantized at load (models/registry.py load_model)

    @property
    def rank_device(self):
        """This rank's device: the driver's device type; on CUDA GPU `local rank` of its node's
        visible ones (executor/placement.py)."""
        import torch

        from k3serve.executor.placement import rank_device

        kind = torch.device(self.device).type
        return rank_device(kind, 0 if self.ray else self.rank % (self.per_node or self.world))


def make_group(spec: WorkerSpec, store, rank: int):
    """This rank's TPGroup over a process group on the shared store (a rendezvous): NCCL on CUDA,
    gloo with the shared-memory transport on the CPU when every rank could map the segment
    (agreed over gloo). For a DP-attention rank: the expert group of all `world` ranks."""
    from k3serve.parallel.group import TPGroup

    pg, shm = _process_group(spec, store, spec.prefix, rank, spec.world, spec.shm_path)
    dp = dict(size_flag="--data-parallel-size", all2all=spec.all2all) if spec.dp_attention else {}
    group = TPGroup(
        rank,
        spec.world,
        spec.expert_parallel,
        pg,
        shm,
        device_type=spec.rank_device.type,
        redundant_experts=spec.redundant_experts,
        dcp=spec.dcp_size,
        dcp_interleave=spec.dcp_interleave,
        **dp,
    )
    return group if spec.pp_size > 1 or spec.dp_attention else with_context_group(spec, store, group, spec.prefix)


def with_context_group(spec: WorkerSpec, store, tp, prefix: str):
    """`tp` with its decode-context-parallel sub-group when --decode-context-parallel-size N is
    below its size: consecutive ranks t // N share one latent cache (parallel/group.py)."""
    import dataclasses

    from k3serve.parallel.group import TPGroup

    n = spec.dcp_size
    if n <= 1 or n == tp.size:
        return tp
    g, t = divmod(tp.rank, n)
    pg, _ = _process_group(spec, store, f"{prefix}/dcp{g}", t, n, None)
    sub = TPGroup(t, n, pg=pg, device_type=tp.device_type, size_flag="--decode-context-parallel-size")
    return dataclasses.replace(tp, dcp_group=sub)


def make_dp_tp_group(spec: WorkerSpec, store):
    """A DP-attention rank's TP group: the tp_size ranks of its DP rank (NO_TP for TP 1); a
    pipeline stage's likewise (with its experts split by id under --enable-expert-parallel)."""
    from k3serve.parallel.group import NO_TP, TPGroup

    if spec.tp_size == 1:
        return NO_TP
    replica, t = divmod(spec.rank, spec.tp_size)
    paths = spec.tp_shm_paths
    pg, shm = _process_group(
        spec, store, f"{spec.prefix}/tp{replica}", t, spec.tp_size, paths[replica] or None if paths else None
    )
    ep = spec.expert_parallel and not spec.dp_attention
    group = TPGroup(
        t,
        spec.tp_size,
        ep,
        pg,
        shm,
        device_type=spec.rank_device.type,
        redundant_experts=spec.redundant_experts if ep else None,
        **({} if spec.dp_attention else dict(dcp=spec.dcp_size, dcp_interleave=spec.dcp_interleave)),
    )
    return group if spec.dp_attention else with_context_group(spec, store, group, f"{spec.prefix}/tp{replica}")


def rank_groups(spec: WorkerSpec, store, rank: int) -> dict:
    """This rank's groups as load_model takes them: {"tp"} (TP), {"ep", "tp"} (DP-attention:
    the expert group of every rank, the TP group of its DP rank), {"tp", "pipe"} (pipeline
    stages: the TP group of its stage, and its links over the group of every rank)."""
    world = make_group(spec, store, rank)
    if spec.dp_attention:
        return {"ep": world, "tp": make_dp_tp_group(spec, store)}
    if spec.pp_size > 1:
        from k3serve.config.bundled import load_model_config
        from k3serve.parallel.pipe import stage_pipe

        cfg = load_model_config(spec.model_path)
        pipe = stage_pipe(cfg, spec.pp_size, spec.tp_size, rank, world.pg, spec.rank_device)
        return {"tp": make_dp_tp_group(spec, store), "pipe": pipe}
    return {"tp": world}


def _process_group(spec: WorkerSpec, store, prefix: str, rank: int, world: int, shm_path: str | None):
    """(the process group of `world` ranks under `prefix`, the shared segment's ShmComm or None):
    parallel/group.py process_group picks NCCL for CUDA ranks (on this rank's GPU; no shared
    segment), gloo for CPU ranks."""
    import torch
    import torch.distributed as dist

    from k3serve.parallel.group import process_group

    # forming the group waits on the slowest rank's start (its imports, its kernels' load) under
    # a start-up bound; the collectives after it get timeout_s, which bounds a hang on a dead peer
    start = max(spec.timeout_s, START_TIMEOUT_S)
    device = spec.rank_device
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return process_group(dist.PrefixStore(prefix, store), rank, world, "cuda", spec.timeout_s), None
    pg = process_group(dist.PrefixStore(prefix, store), rank, world, "cpu", start)
    shm = _attach_shm(shm_path, rank, world, spec.timeout_s)  # its timeout bounds its collectives
    agree = torch.tensor([int(shm is not None)])
    pg.allreduce([agree]).wait()
    pg._set_default_timeout(datetime.timedelta(seconds=spec.timeout_s))
    return pg, shm if int(agree) == world else None


def _attach_shm(path: str | None, rank: int, world: int, timeout_s: float):
    if path is None:
        return None
    from k3serve import kernels
    from k3serve.parallel.shm import ShmComm

    module = kernels.get("auto")  # a transport, not a model kernel: used even under --kernels torch
    if module is None:
        return None
    try:
        return ShmComm(path, rank, world, module, timeout_s)
    except (OSError, RuntimeError) as e:
        log.warning("rank %d: shared-memory collectives unavailable (%s); using gloo", rank, e)
        return None


def worker_main(spec: WorkerSpec, conn=None) -> None:
    """One rank: join the groups, load the shard, report, serve commands. `conn`: the pipe to a
    driver on this machine; None: commands come over the control group (TP across nodes), or a
    connection this rank dials to the driver (DP-attention across nodes)."""
    threads = spec.threads
    if spec.cpu_plan:  # pinned before anything is loaded: first touch puts its memory on its node
        cpus = spec.cpu_plan[spec.rank % len(spec.cpu_plan)]
        os.sched_setaffinity(0, cpus)
        threads = len(cpus)  # one per physical core it holds
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    channel, store = None, None
    try:
        import torch
        import torch.distributed as dist

        from k3serve.distributed.multinode import ControlChannel, control_group, dial_driver
        from k3serve.executor.placement import resolve_mode
        from k3serve.models.registry import load_model
        from k3serve.runner.rank_step import weight_bytes

        torch.set_num_threads(threads)
        store = dist.TCPStore(
            spec.master_addr, spec.port, spec.world, False, timeout=datetime.timedelta(seconds=spec.timeout_s)
        )
        if conn is None and spec.dp_attention:  # DP-attention across nodes: a connection to the driver
            conn = dial_driver(store, spec.prefix, spec.rank)
        groups = rank_groups(spec, store, spec.rank)
        if conn is None:
            channel = ControlChannel(control_group(store, spec.prefix, spec.rank, spec.world), spec.rank)
        device = spec.rank_device
        model = load_model(
            spec.model_path,
            dtype=getattr(torch, spec.dtype),
            load_format=spec.load_format,
            quantization=spec.quantization,
            progress=False,
            **groups,
        ).to(device)
        model.use_kernels(resolve_mode(spec.kernels, device))
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which raises it
        why = f"rank {spec.rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"
        if conn is not None:
            conn.send(("error", why))
        elif store is not None:
            store.set(f"{spec.prefix}/error/{spec.rank}", why)
            if channel is not None:
                channel.ready(False)
        return
    if conn is not None:
        conn.send(("ready", weight_bytes(model)))
    else:
        channel.ready(True)
    serve(conn if conn is not None else channel, model, spec)


def serve(conn, model, spec: WorkerSpec) -> None:
    """`conn`: anything with recv() -> (method, args): the pipe, or the ControlChannel."""

    from k3serve.parallel.group import CollectiveError
    from k3serve.runner.rank_step import RankRunner

    runner = None
    answers = DP_ANSWERS if spec.dp_attention else ANSWERS
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError, RuntimeError):  # the driver is gone (a closed pipe or socket)
            return
        if method == "shutdown":
            return
        try:
            if method == "allocate":  # an executor/base.py Allocation: the driver's plan and backend
                (alloc,) = args
                model.use_kernels(alloc.mode)
                runner = RankRunner.allocate(model, alloc, spec.rank_device)
            else:
                result = getattr(runner, method)(*args)
                if method in answers:
                    conn.send(("ok", result))
        except CollectiveError as e:  # a peer died or timed out: the group is broken for good
            log.error("rank %d: %s: %s", spec.rank, method, e)
            return
        except Exception as e:  # noqa: BLE001 - the same inputs fail the same way on the driver, which
            # retries the step's requests apart; the ranks stay in step
            log.warning("rank %d: %s raised %s: %s", spec.rank, method, type(e).__name__, e)
            if method in answers:
                conn.send(("error", f"{type(e).__name__}: {e}"))
