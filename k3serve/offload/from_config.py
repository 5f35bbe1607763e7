"""The engine's prefix-cache tiers from its config (EngineConfig.kv_offloading_*), or None."""

from __future__ import annotations

import logging

log = logging.getLogger("k3serve.offload")
HOST_DEFAULT_GIB = 1.0  # host memory when only a directory is given


def make_tiers(config, engine):
    """PrefixTiers for this engine, attached to its cache manager; None when none are asked."""
    if config.kv_offloading_size is None and config.kv_offloading_dir is None:
        return None
    if not config.enable_prefix_caching:
        raise ValueError("kv offloading tiers hold prefix-cache entries: enable prefix caching")
    executor = engine.executor
    # a DP-attention replica's cache is in its workers; pipeline stages hold some layers each
    remote = executor.cache is None or config.pipeline_parallel_size > 1
    if remote and config.calculate_kv_scales:
        raise ValueError(
            "kv offloading tiers with DP-attention worker processes or pipeline stages keep the "
            "checkpoint's fp8 latent scales; --calculate-kv-scales calibrates them inside the workers: drop one"
        )
    if executor.lockstep and config.nnodes > 1:
        raise ValueError("kv offloading tiers with DP-attention ranks on several nodes are not built yet: one node")
    if not executor.transfers:
        raise ValueError(
            "kv offloading tiers under tensor parallelism read and write the other ranks' state over "
            "their pipes: one host, mp workers (not Ray or several nodes) for now"
        )
    from k3serve.offload.entry import model_fingerprint
    from k3serve.offload.store import PrefixTiers

    cache = meta_cache(engine) if remote else executor.cache
    gib = config.kv_offloading_size if config.kv_offloading_size is not None else HOST_DEFAULT_GIB
    fp = model_fingerprint(
        engine.model_path,
        dtype=str(engine.model_info.dtype),
        kv=engine.kv_dtype_name,
        block_size=engine.plan.block_size,
        tp=config.tensor_parallel_size,
        state=str(next(t for t in cache.recurrent if t is not None).dtype),
        # an fp8 latent's scales: the checkpoint's (its header is in the fingerprint already), or
        # calibrated ones, which PrefixTiers keeps in the directory beside the entries they wrote
        kv_scales="calibrated" if config.calculate_kv_scales else cache.latent_scale is not None,
    )
    tiers = PrefixTiers(
        cache,
        engine.plan.block_size,
        int(gib * 2**30),
        config.kv_offloading_dir,
        int(config.kv_offloading_dir_size * 2**30),
        fp,
        executor,
    )
    write_back = config.kv_offloading_write_policy == "write_back"
    engine.cache.attach_tiers(tiers.index, tiers.prefetch, write_back)
    line = f"prefix cache tiers: {gib:g} GiB host memory" + (
        f", {config.kv_offloading_dir_size:g} GiB in {tiers.dir}" if tiers.dir else ""
    )
    line += ", written back as the pools evict" if write_back else ", written through as the pools publish"
    engine.startup_log.append(line)
    log.info(line)
    return tiers


def meta_cache(engine):
    """The shapes and dtypes of a remote replica's cache tensors (one slot, one block, on the
    meta device): what a tier entry holds per rank, without the tensors."""
    import torch

    from k3serve.forward import CacheTensors

    plan = engine.plan
    return CacheTensors.allocate(
        engine.model_info.cfg,
        1,
        1,
        plan.block_size,
        kv_dtype=getattr(torch, engine.kv_dtype_name),
        device="meta",
        tp_size=engine.config.tensor_parallel_size,
        state_dtype=getattr(torch, plan.state_dtype),
    )
