"""What an engine is built from before its first step (vLLM v1's engine-core start-up): the
executor holding the model, the backend, tokenizer, cache plan and its managers, the runner,
speculation and prefix-cache tiers; for data parallelism, every replica with its executor."""

from __future__ import annotations

import logging
from k3serve.cache.draft_slots import DraftSlots, first_spare
from k3serve.cache.manager import HybridCacheManager
from k3serve.config.engine_config import EngineConfig
from k3serve.engine.core import EngineCore
from k3serve.engine.startup import check_quantization, make_plan, resolve_max_model_len, seq_limit_note, startup_lines
from k3serve.executor import Allocation, Executor
from k3serve.executor.placement import placement, resolve_backend
from k3serve.scheduler.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger("k3serve.engine")


def build_core(config: EngineConfig, executor: Executor | None = None) -> EngineCore:
    """One replica's core. `executor`: its ranks when the caller built them (a DP-attention
    replica's, distributed/dp_replicas.py); None: started here for `config` (distributed/start.py:
    this process, TP workers or Ray actors). No worker outlives a core that failed to start."""
    from k3serve.distributed.start import start_executor

    where = placement(config)
    ex = executor if executor is not None else start_executor(config, where)
    try:
        return _build(config, ex.model_path, where, ex)
    except BaseException:
        ex.shutdown()
        raise


def _build(config: EngineConfig, model_path: str, where, ex: Executor) -> EngineCore:
    from k3serve.offload.from_config import make_tiers
    from k3serve.runner.graph_step import graph_settings
    from k3serve.runner.model_runner import ModelRunner, speculation
    from k3serve.tokenizer import Tokenizer

    info = ex.info  # the model's config, dtype and weight bytes; the weights are the executor's
    check_quantization(config, info)
    mode = resolve_backend(config, where.device)
    kernels = ex.use_kernels(mode)
    tokenizer = Tokenizer.from_dir(config.tokenizer or model_path)
    max_model_len = resolve_max_model_len(config, info)
    plan = make_plan(config, info, where, max_model_len)
    startup_log = startup_lines(model_path, info, where, plan, config.max_num_seqs)
    per_rank = ex.rank_weight_bytes()
    if len(per_rank) > 1:
        kind = "DP-attention ranks of this replica" if ex.lockstep else "tensor-parallel ranks"
        shares = (
            f"{per_rank[0]:,} B x {len(per_rank)}" if len(set(per_rank)) == 1 else ", ".join(f"{b:,}" for b in per_rank)
        )
        startup_log.append(f"weights per rank: {shares} ({kind})")
    # ids the model can emit but the tokenizer cannot decode: masked out of sampling, stated once
    unmapped = tokenizer.unmapped_ids(info.cfg.vocab_size)
    if unmapped:
        startup_log.append(
            f"tokenizer decodes {info.cfg.vocab_size - len(unmapped):,} of the model's "
            f"{info.cfg.vocab_size:,} vocabulary ids; the other {len(unmapped):,} (first "
            f"{unmapped[0]}) are masked out of sampling and refused in prompts"
        )
    for line in startup_log:
        log.info(line)
    cache = HybridCacheManager(
        plan.num_blocks,
        plan.num_slots,
        plan.block_size,
        plan.slot_bytes,
        plan.token_bytes,
        config.enable_prefix_caching,
        plan.num_checkpoints,
    )
    scheduler = Scheduler(
        SchedulerConfig(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len,
            config.scheduling_policy,
            checkpoint_interval=config.prefix_cache_state_interval,
        ),
        cache,
    )
    target = ex.model if ex.model is not None else info  # a worker's model: its config alone
    spec = speculation(config, model_path, target, max_model_len, where.device)
    graph = graph_settings(config, mode, spec)
    if graph is not None and graph.num_speculative_tokens:  # verify steps write each position's own slot
        k = graph.num_speculative_tokens
        cache.use_draft_slots(DraftSlots(plan.num_slots, k, first_spare(plan.num_slots, plan.num_checkpoints)))
    kv_name = str(where.kv_dtype).removeprefix("torch.")
    # every rank allocates its share of the same plan and runs the same backend
    eplb = config.eplb_config if config.enable_eplb else None
    ex.allocate(
        Allocation(
            plan,
            kv_name,
            mode,
            graph,
            config.calculate_kv_scales,
            tuple(unmapped),
            eplb,
            max(1, config.nnodes // config.pipeline_parallel_size),  # the nodes one stage's ranks span
        )  # fmt: skip
    )
    runner = ModelRunner(
        info.cfg.vocab_size,
        plan,
        config.seed,
        where.device,
        spec,
        masked_ids=unmapped,
        device_sampling=graph is not None and spec is None,
    )
    core = EngineCore(
        config,
        model_path,
        ex,
        info,
        plan,
        max_model_len,
        cache,
        scheduler,
        runner,
        tokenizer,
        unmapped,
        kv_name,
        startup_log,
        seq_limit_note(plan, config.max_num_seqs),
        kernels,
        spec,
    )
    core.tiers = make_tiers(config, core)  # prefix-cache tiers in host memory and on disk, or None
    if spec is not None and spec.policy is not None:
        startup_log.append(_draft_policy(spec, runner, ex, cache, config, graph))
        log.info(startup_log[-1])
    if graph is not None:
        line = graph.startup_line(where.device, ex.lockstep)
        startup_log.append(line)
        log.info(line)
    return core


def _draft_policy(spec, runner, ex: Executor, cache, config: EngineConfig, graph) -> str:
    """Set up the adaptive draft lengths (spec_decode/adaptive.py): the graph backend's verify
    buckets take every sequence at one length; the cost table is profiled now, unless steps
    compile per bucket or the replica steps in lockstep (then it fills from the first steps)."""
    from k3serve.runner.spec_profile import profile_step_costs

    spec.policy.uniform = graph is not None
    k = spec.cfg.num_speculative_tokens
    # (stand-in steps would also calibrate fp8 KV scales on their rows: --calculate-kv-scales waits)
    if graph is not None or ex.lockstep or config.calculate_kv_scales:
        return f"speculation: adaptive draft lengths 0..{k}, step costs measured from the first steps"
    seconds = profile_step_costs(spec, runner, ex, cache, config.max_num_seqs)
    return (
        f"speculation: adaptive draft lengths 0..{k}, step costs profiled in {seconds:.2f} s "
        f"('\"adaptive\": false' in --speculative-config pins {k})"
    )
