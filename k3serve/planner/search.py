"""Evaluate layouts and search GPU counts: the planner's answers as plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field

from k3serve.cache.sizing import kda_state_bytes_per_request, mla_cache_bytes_per_token
from k3serve.config.model_config import ModelConfig
from k3serve.planner.commands import launch_commands
from k3serve.planner.hardware import GPU
from k3serve.planner.layout import Layout, candidate_layouts
from k3serve.planner.memory import RankMemory, Workload, max_context_one_request, rank_memory
from k3serve.planner.perf import Perf, estimate
from k3serve.planner.weights import WeightSplit

COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)  # power-of-two deployments (NVL72 parts also try 72)


@dataclass
class LayoutResult:
    gpu: GPU
    layout: Layout
    rank: RankMemory
    problems: list[str]
    warnings: list[str]
    capacity: int  # concurrent requests of `context` tokens the deployment holds
    max_context: int
    perf: Perf | None
    commands: dict[str, str] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.problems and self.rank.fits

    def serves(self, w: Workload) -> bool:
        return self.fits and self.capacity >= w.concurrency


@dataclass
class PlanReport:
    model: str
    source: str
    weights: WeightSplit
    workload: Workload
    token_bytes: int
    token_bytes_fp8: int
    state_bytes: int
    results: list[LayoutResult]
    smallest: dict[str, int | None]
    optimize: str
    latency_sensitive: bool


def evaluate(cfg: ModelConfig, model: str, gpu: GPU, layout: Layout, weights: WeightSplit, w: Workload,
             cache_bytes: int | None = None) -> LayoutResult:
    problems = layout.problems(cfg, gpu.scaleup_domain)
    rank = rank_memory(cfg, gpu, layout, weights, w, cache_bytes)
    tp = layout.tp
    capacity = layout.dp * rank.plan.max_concurrency(w.context) if rank.plan else 0
    max_ctx = max_context_one_request(cfg, rank, tp, w.kv_dtype)
    perf = None
    if not problems and rank.fits:
        perf = estimate(cfg, gpu, layout, weights, min(w.concurrency, capacity), w.context, w.kv_dtype)
    static = min(0.99, (rank.weights + rank.draft_weights + max(rank.cache_budget, 0)) / gpu.hbm_bytes)
    cmds = launch_commands(model, layout, w.context, w.max_num_seqs, max(rank.cache_budget, 0),
                           w.memory_fraction, static, w.kv_dtype)
    return LayoutResult(gpu, layout, rank, problems, layout.warnings(gpu.scaleup_domain), capacity, max_ctx, perf,
                        cmds)


def rank_results(results: list[LayoutResult], w: Workload, optimize: str, latency: bool) -> list[LayoutResult]:
    def key(r: LayoutResult):
        serves = r.serves(w)
        tpot = r.perf.tpot_s if r.perf else float("inf")
        cost = r.perf.gpu_hours_per_mtok if r.perf else float("inf")
        if latency:
            return (not serves, not r.fits, tpot, r.layout.num_gpus)
        if optimize == "cost":
            return (not serves, not r.fits, cost, r.layout.num_gpus)
        return (not serves, not r.fits, r.layout.num_gpus, bool(r.warnings), -r.capacity, tpot)
    return sorted(results, key=key)


def plan(cfg: ModelConfig, model: str, source: str, gpus: list[GPU], weights: WeightSplit, w: Workload, *,
         num_gpus: int | None = None, tp: int | None = None, dp: int | None = None, ep: int | None = None,
         optimize: str = "min-hardware", latency_sensitive: bool = False,
         cache_bytes: int | None = None) -> PlanReport:
    results, smallest = [], {}
    for gpu in gpus:
        counts = [num_gpus] if num_gpus else sorted(set(COUNTS) | ({72} if gpu.scaleup_domain >= 72 else set()))
        smallest[gpu.name] = None
        for n in counts:
            layouts = candidate_layouts(n)
            if tp or dp or ep:
                t = tp or (n // dp if dp else n)
                layouts = [Layout(n, t, dp or n // t, ep or n)]
            found = [evaluate(cfg, model, gpu, lay, weights, w, cache_bytes) for lay in layouts]
            results += found
            if smallest[gpu.name] is None and any(r.serves(w) for r in found):
                smallest[gpu.name] = n
            if not num_gpus and smallest[gpu.name] is not None and n >= 2 * smallest[gpu.name]:
                break  # enough larger layouts to compare against
    ranked = rank_results(results, w, optimize, latency_sensitive)
    return PlanReport(model, source, weights, w, mla_cache_bytes_per_token(cfg, "bfloat16"),
                      mla_cache_bytes_per_token(cfg, "fp8"), kda_state_bytes_per_request(cfg), ranked, smallest,
                      optimize, latency_sensitive)
