"""Offline data parallelism: `LLM(model, data_parallel_size=M)` (issue 16).

M `LLMEngine` replicas in this process, each with its own scheduler and cache, stepped at once
(one thread per replica, so their torch ops overlap). A request goes to the replica caching its
longest prompt prefix, else the least loaded, as the server's DPEngine routes. With
`enable_expert_parallel=True` the replicas are DP-attention ranks sharing one expert group
(engine/lockstep.py explains): then every replica steps every time, idle ones included.
`build_replicas` starts the replicas for this class and for the server's DPEngine.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from k3serve.config.engine_config import EngineConfig
from k3serve.executor.placement import placement
from k3serve.engine.dp_routing import pick_replica
from k3serve.engine.llm_engine import LLMEngine, PromptInput
from k3serve.outputs import RequestOutput
from k3serve.sampling_params import SamplingParams


class DataParallelEngine:
    def __init__(self, model: str | None, data_parallel_size: int, **kwargs):
        dp = data_parallel_size
        self.lockstep = dp > 1 and bool(kwargs.get("enable_expert_parallel"))
        self.replicas: list[LLMEngine] = build_replicas(EngineConfig.from_kwargs(model, **kwargs), dp, self.lockstep)
        self._pool = ThreadPoolExecutor(dp, thread_name_prefix="k3serve-dp")
        self._owner: dict[str, LLMEngine] = {}
        self.routed = [0] * dp

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    def add_request(
        self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None, priority: int = 0
    ) -> None:
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.replicas[0].cache_ids(prompt)
        held = [r.reusable_tokens(ids) for r in self.replicas]  # prefix-cache tiers included
        load = [len(r.scheduler.running) + len(r.scheduler.waiting) for r in self.replicas]
        i = pick_replica(held, load)
        self.replicas[i].add_request(request_id, prompt, params, priority)
        self._owner[request_id] = self.replicas[i]
        self.routed[i] += 1

    def abort(self, request_id: str) -> None:
        replica = self._owner.pop(request_id, None)
        if replica is not None:
            replica.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work (of all of them in lockstep), concurrently."""
        busy = [r for r in self.replicas if self.lockstep or r.has_unfinished_requests()]
        outs: list[RequestOutput] = []
        for future in [self._pool.submit(r.step) for r in busy]:
            outs += future.result()
        for out in outs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outs

    def shutdown(self) -> None:
        for r in self.replicas:
            r.shutdown()


def build_replicas(config: EngineConfig, dp: int, dp_attention: bool) -> list:
    """`dp` LLMEngine replicas of `config`: plain ones each start their own executor; under
    DP-attention + EP each takes its rank of one expert group (engine/lockstep.py). If one fails
    to start, the ones already built and every executor started for them are shut down."""
    from k3serve.distributed.dp_replicas import replica_executors

    if dp_attention and config.pipeline_parallel_size > 1:
        raise ValueError(
            "--pipeline-parallel-size with DP-attention (--data-parallel-size and --enable-expert-parallel): "
            "the lockstep replicas do not run pipeline stages yet; use TP x PP, or DP-attention without stages"
        )
    if dp_attention and config.decode_context_parallel_size > 1:
        raise ValueError(
            "--decode-context-parallel-size with DP-attention (--data-parallel-size and --enable-expert-parallel): "
            "each DP rank holds its own requests' whole cache; use DCP inside TP without DP-attention"
        )
    executors = replica_executors(config, dp, dp_attention, placement(config))
    replicas: list[LLMEngine] = []
    try:
        for ex in executors:
            replicas.append(LLMEngine(config, ex))
    except BaseException:
        for r in replicas:
            r.shutdown()
        for ex in executors[len(replicas) :]:  # executors no replica took yet
            if ex is not None:
                ex.shutdown()
        raise
    return replicas
