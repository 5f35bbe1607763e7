"""A captured NCCL group of one (issue 46 item 6, run by bench/gpu_check.sh): the functional
collectives the compiled step uses (all-reduce, all-gather, reduce-scatter) over a
ProcessGroupNCCL resolve by the registered name, compile whole and replay inside a CUDA graph
equal to the eager NCCL calls. Skipped without a CUDA device and NCCL (this CPU build has
neither); multi-rank NCCL needs several GPUs, and the gloo tests check the same step shapes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs a CUDA device and NCCL"
)


def test_a_captured_nccl_group_of_one_replays_its_collectives():
    import torch.distributed._functional_collectives as funcol

    from k3serve.parallel.group import nccl_group, register_functional

    group = nccl_group(dist.HashStore(), 0, 1)
    name = register_functional(group.pg, 0, 1, "cuda")  # a group of one registers all the same

    def step(x):  # [8, 16]: the shapes a TP / DP-attention step hands its collectives
        y = funcol.all_reduce(x * 2, "sum", name)
        g = funcol.all_gather_tensor(y.contiguous(), 0, name)
        return funcol.reduce_scatter_tensor(g + 1, "sum", 0, name)

    x = torch.randn(8, 16, device="cuda")
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            compiled(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(x)
    for seed in range(3):
        x.copy_(torch.randn(8, 16, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        torch.testing.assert_close(out, x * 2 + 1)
    eager = torch.empty(8, 16, device="cuda")
    group.pg.allreduce([eager.copy_(x)]).wait()  # the eager NCCL call on the same group
    torch.testing.assert_close(eager, x)
