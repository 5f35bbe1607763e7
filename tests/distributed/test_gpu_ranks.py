"""Ranks bound to devices (issue 60): on CUDA, rank r of a layout takes GPU `local rank` of its
node and its TP / EP / DP groups are ProcessGroupNCCL, built by the same code that builds gloo
on the CPU (distributed/worker.py make_group -> parallel/group.py process_group); only the
device type differs. This CPU has no GPU and its torch no NCCL: `torch.cuda` and
ProcessGroupNCCL are stood in for just far enough to record which device and which backend
each rank takes. The same layouts run for real on the CPU in the other tests of this folder
(greedy tokens equal to one process)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from k3serve.distributed.worker_group import WorkerLaunch, worker_base
from k3serve.distributed.multinode import NodeLayout
from k3serve.distributed.worker import WorkerSpec, make_dp_tp_group, make_group
from k3serve.executor.placement import resolve_mode
from k3serve.executor.placement import check_multi_rank, placement
from k3serve.config.engine_config import EngineConfig


class FakeNCCL:
    """Records what a rank asked ProcessGroupNCCL for (no rendezvous, no device)."""

    made: list = []

    class Options:
        _timeout = None

    def __init__(self, store, rank, size, opts):
        self.rank, self.size, self.timeout = rank, size, opts._timeout
        FakeNCCL.made.append(self)


@pytest.fixture
def fake_cuda(monkeypatch):
    devices: dict[str, torch.device] = {}  # thread name -> the device it set
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)  # this CPU build has none
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: devices.__setitem__(threading.current_thread().name, d))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    FakeNCCL.made = []
    return devices


def specs(world: int, nodes: NodeLayout = NodeLayout(), **extra) -> list[WorkerSpec]:
    launch = WorkerLaunch("ckpt", torch.bfloat16, torch.device("cuda", 0), timeout_s=7.0, expert_parallel=True)
    base = worker_base(launch, world, nodes, 0, None)
    base.update(extra)
    return [WorkerSpec(rank=r, **base) for r in nodes.ranks(world)]


def groups(specs_: list[WorkerSpec], build=make_group) -> list:
    store = dist.HashStore()
    return [build(s, store, s.rank) if build is make_group else build(s, store) for s in specs_]


def test_tp2_ranks_take_their_gpu_and_nccl(fake_cuda):
    """The driver (rank 0) on cuda:0 with the triton backend, rank 1 on cuda:1; both groups NCCL."""
    where = placement(EngineConfig.from_kwargs("ckpt", tensor_parallel_size=2))
    check_multi_rank(where, "--tensor-parallel-size")
    assert where.device == torch.device("cuda", 0) and where.dtype == torch.bfloat16
    assert resolve_mode("auto", where.device) == "triton"  # compiled, captured steps on every rank
    tp = specs(2)
    assert [s.rank_device for s in tp] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    made = groups(tp)
    assert [(g.rank, g.size, g.device_type, g.shm) for g in made] == [(0, 2, "cuda", None), (1, 2, "cuda", None)]
    assert all(isinstance(g.pg, FakeNCCL) and g.pg.timeout.total_seconds() == 7.0 for g in made)


def test_dp2_ep2_with_tp2_inside_takes_four_gpus_and_nccl_groups(fake_cuda):
    """DP2 x TP2 (the driver is no rank): rank r on cuda:r, its expert group of all four and its
    DP rank's TP group both NCCL."""
    dp = specs(4, dp_attention=True, tp_size=2)
    assert [s.rank_device.index for s in dp] == [0, 1, 2, 3]
    experts = groups(dp)
    tps = groups(dp, make_dp_tp_group)
    assert [(g.rank, g.size, g.device_type) for g in experts] == [(r, 4, "cuda") for r in range(4)]
    assert [(g.rank, g.size, g.device_type) for g in tps] == [(0, 2, "cuda"), (1, 2, "cuda")] * 2
    assert len(FakeNCCL.made) == 8 and experts[0].size_flag == "--data-parallel-size"


def test_the_second_node_counts_its_gpus_from_zero(fake_cuda):
    """TP4 over two nodes: node 1's ranks 2 and 3 take its cuda:0 and cuda:1; a Ray actor sees
    only the GPU Ray gave it (cuda:0)."""
    node1 = specs(4, NodeLayout(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500))
    assert [(s.rank, s.rank_device) for s in node1] == [(2, torch.device("cuda", 0)), (3, torch.device("cuda", 1))]
    ray = specs(4, NodeLayout(master_addr="10.0.0.1", master_port=29500, ray=True))
    assert {s.rank_device for s in ray} == {torch.device("cuda", 0)}


def test_cpu_ranks_keep_gloo(tmp_path):
    """The same code on the CPU: gloo groups (this is what every equality test here runs)."""
    base = worker_base(
        WorkerLaunch("ckpt", torch.float32, torch.device("cpu"), timeout_s=30.0), 2, NodeLayout(), 0, None
    )
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    base["port"] = store.port
    out: list = [None, None]

    def join(rank: int) -> None:
        client = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, 2, False)
        out[rank] = make_group(WorkerSpec(rank=rank, **base), client, rank)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert [(g.rank, g.device_type, type(g.pg).__name__) for g in out] == [
        (0, "cpu", "ProcessGroupGloo"),
        (1, "cpu", "ProcessGroupGloo"),
    ]


def test_a_layout_that_cannot_run_says_why_naming_the_flag(fake_cuda):
    where = placement(EngineConfig.from_kwargs("ckpt", tensor_parallel_size=2, device="cuda:1"))
    with pytest.raises(ValueError, match="--tensor-parallel-size > 1 on cuda:1.*CUDA_VISIBLE_DEVICES"):
        check_multi_rank(where, "--tensor-parallel-size")
    from k3serve.distributed.dp_replicas import replica_executors

    cfg = EngineConfig.from_kwargs("ckpt", data_parallel_backend="threads", enable_expert_parallel=True)
    with pytest.raises(ValueError, match="--data-parallel-backend threads.*mp.*GPUs"):
        replica_executors(cfg, 2, True, placement(cfg))
