"""Which executor holds an engine's model (the driver's choice, kept apart from executor.py so
that neither executor module imports the other): this process alone (`UniProcExecutor`), worker
processes started here (`MultiprocExecutor`, one node or torchrun/static multi-node), or Ray
actors (`RayExecutor`)."""

from __future__ import annotations

from pathlib import Path

from k3serve.distributed.executor import MultiprocExecutor, check_layout
from k3serve.executor import Executor, UniProcExecutor
from k3serve.executor.placement import check_multi_rank
from k3serve.parallel.group import TPGroup
from k3serve.distributed.multinode import NodeLayout
from k3serve.distributed.worker_group import WorkerLaunch


def start_executor(config, where) -> Executor:
    """The ranks of `config.tensor_parallel_size`, loaded and ready (the checkpoint fetched first
    when `config.model` is a hub id)."""
    model_path = model_source(config)
    if config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1:
        return UniProcExecutor.load(
            model_path,
            where,
            load_format=config.load_format,
            quantization=config.quantization,
            progress=config.load_progress,
        )
    check_multi_rank(
        where, "--tensor-parallel-size" if config.pipeline_parallel_size == 1 else "--pipeline-parallel-size"
    )
    group = TPGroup(
        0, config.tensor_parallel_size, config.enable_expert_parallel, redundant_experts=config.redundant_experts
    )
    check_layout(model_path, group, config.quantization)
    launch = WorkerLaunch.from_config(config, where, model_path)
    kw = dict(where=where, progress=config.load_progress)
    if config.distributed_executor_backend == "ray":
        from k3serve.distributed.ray_executor import RayExecutor, ray_layout

        return RayExecutor(launch, config.tensor_parallel_size, nodes=ray_layout(), **kw)
    return MultiprocExecutor(launch, config.tensor_parallel_size, nodes=node_layout(config), **kw)


def node_layout(config) -> NodeLayout:
    """The engine's nodes: torchrun's environment when it started us, else the static flags."""
    from k3serve.distributed.multinode import torchrun_layout, torchrun_rank

    if torchrun_rank() is not None:
        rank, world = torchrun_rank()
        ranks = config.tensor_parallel_size * config.pipeline_parallel_size
        if world != ranks:
            raise ValueError(
                f"torchrun started {world} processes; --tensor-parallel-size x --pipeline-parallel-size is "
                f"{ranks}: they must be equal (one process per rank)"
            )
        return torchrun_layout()
    return NodeLayout(config.nnodes, config.node_rank, config.master_addr, config.master_port)


def model_source(config) -> str:
    """The checkpoint folder of an EngineConfig: `config.model` (the bundled demo when unset), a hub repo id
    downloaded into the hub cache first (weights/hub.py)."""
    from k3serve.demo import default_model
    from k3serve.weights.hub import resolve_model

    spec_model = (config.speculative_config or {}).get("model")
    return resolve_model(
        str(config.model or default_model()),
        config.revision,
        config.download_dir,
        config.hf_token,
        draft=bool(spec_model) and not Path(spec_model).exists(),  # a draft folder inside the repo
    )
