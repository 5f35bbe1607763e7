"""Which executor starts an engine's tensor-parallel workers (the driver's choice, kept apart from
executor.py so that neither executor module imports the other): worker processes started here
(`MultiprocExecutor`, one node or torchrun/static multi-node), or Ray actors (`RayExecutor`)."""

from __future__ import annotations

from k3serve.distributed.executor import MultiprocExecutor, check_layout
from k3serve.parallel.group import TPGroup
from k3serve.distributed.multinode import NodeLayout


def start_executor(config, model_path: str, where) -> "MultiprocExecutor | None":
    """The workers of `config.tensor_parallel_size` > 1 (started now, loading beside the driver)."""
    if config.tensor_parallel_size == 1:
        return None
    if where.device.type != "cpu":
        raise ValueError(
            f"tensor_parallel_size > 1 on {where.device}: the NCCL group is not built yet; the gloo (CPU) executor is"
        )
    check_layout(model_path, TPGroup(0, config.tensor_parallel_size, config.enable_expert_parallel))
    if config.distributed_executor_backend == "ray":
        from k3serve.distributed.ray_executor import RayExecutor, ray_layout

        return RayExecutor(
            model_path,
            config.tensor_parallel_size,
            expert_parallel=config.enable_expert_parallel,
            dtype=where.dtype,
            load_format=config.load_format,
            kernels=config.kernels,
            device=where.device,
            timeout_s=config.distributed_timeout,
            nodes=ray_layout(),
        )
    return MultiprocExecutor(
        model_path,
        config.tensor_parallel_size,
        expert_parallel=config.enable_expert_parallel,
        dtype=where.dtype,
        load_format=config.load_format,
        kernels=config.kernels,
        device=where.device,
        timeout_s=config.distributed_timeout,
        nodes=node_layout(config),
    )


def node_layout(config) -> NodeLayout:
    """The engine's nodes: torchrun's environment when it started us, else the static flags."""
    from k3serve.distributed.multinode import torchrun_layout, torchrun_rank

    if torchrun_rank() is not None:
        rank, world = torchrun_rank()
        if world != config.tensor_parallel_size:
            raise ValueError(
                f"torchrun started {world} processes; --tensor-parallel-size is "
                f"{config.tensor_parallel_size}: they must be equal (one process per rank)"
            )
        return torchrun_layout()
    return NodeLayout(config.nnodes, config.node_rank, config.master_addr, config.master_port)
