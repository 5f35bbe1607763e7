"""Evaluate layouts and search GPU counts: the planner's answers as plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from k3serve.cache.sizing import kda_state_bytes_per_request, mla_cache_bytes_per_token
from k3serve.config.model_config import ModelConfig
from k3serve.planner.commands import launch_commands
from k3serve.planner.disagg import PDLayout
from k3serve.planner.tiers import TierCapacity
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
    perf: Perf | None  # at min(wanted, capacity) requests
    wanted: int  # the requested concurrency
    commands: dict[str, str] = field(default_factory=dict)
    capacity_without_dcp: int | None = None  # a DCP layout's capacity with every rank caching every row

    @property
    def loads(self) -> bool:
        """Weights, reserves and one request of the context fit on every rank."""
        return not self.problems and self.rank.fits

    @property
    def fits(self) -> bool:
        """The requested concurrency at the requested context fits."""
        return self.loads and self.capacity >= self.wanted

    @property
    def verdict(self) -> str:
        if self.fits:
            return "fits"
        return f"holds {self.capacity} of {self.wanted}" if self.loads else "no"

    @property
    def why_not(self) -> str:
        if self.problems or self.rank.why_not:
            return "; ".join(self.problems) or self.rank.why_not or ""
        if not self.fits:
            plan = self.rank.plan
            slots = self.layout.dp * plan.num_slots
            by_tokens = self.layout.dp * plan.requests_by_tokens(plan.max_model_len)
            limit = "KDA state slots" if slots <= by_tokens else "latent KV tokens"
            return (
                f"holds {self.capacity} of the {self.wanted} requested at this context "
                f"({slots} state slots, latent KV for {by_tokens}; {limit} run out first)"
            )
        return ""


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
    smallest: dict[str, int | None]  # per GPU type, searched the same way whatever --num-gpus says
    optimize: str
    latency_sensitive: bool
    gpus: list[GPU] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)  # workload questions not asked: what was assumed
    pd: "PDLayout | None" = None  # --pd: the best layout as P prefill + D decode instances (disagg.py)
    tiers: "TierCapacity | None" = None  # --kv-offloading-size / -dir-size (tiers.py)

    def best(self) -> LayoutResult | None:
        return next((r for r in self.results if r.fits), None)

    def launch(self) -> dict[str, str]:
        """The best layout's launch lines; where it puts DP-attention inside pipeline stages,
        which k3serve does not run yet, k3serve's line is that of the best-ranked fitting
        layout it runs (TP x PP, or DP-attention without stages)."""
        best = self.best()
        if best is None:
            return {}
        out = dict(best.commands)
        if best.layout.pp > 1 and best.layout.dp > 1:
            runs = next((r for r in self.results if r.fits and (r.layout.pp == 1 or r.layout.dp == 1)), None)
            if runs is not None:
                out["k3serve"] = (
                    f"{runs.commands['k3serve'].split('  #')[0]}  # {runs.gpu.name} "
                    f"{runs.layout.label}: the best layout here k3serve runs (DP-attention inside "
                    f"pipeline stages is not built yet)"
                )
        return out

    def best_per_gpu(self) -> list[LayoutResult]:
        """The top-ranked row of every GPU type asked for (serving or not)."""
        seen, out = set(), []
        for r in self.results:
            if r.gpu.name not in seen:
                seen.add(r.gpu.name)
                out.append(r)
        return out


def evaluate(
    cfg: ModelConfig,
    model: str,
    gpu: GPU,
    layout: Layout,
    weights: WeightSplit,
    w: Workload,
    cache_bytes: int | None = None,
) -> LayoutResult:
    problems = layout.problems(cfg, gpu.scaleup_domain)
    E, R = cfg.moe.num_experts, w.redundant_experts
    if R and layout.ep > 1 and (E + R) % layout.ep:
        problems.append(f"{E} experts + {R} redundant do not divide by EP {layout.ep}")
    rank = rank_memory(cfg, gpu, layout, weights, w, cache_bytes)
    capacity = layout.dp * rank.plan.max_concurrency(w.context) if rank.plan else 0
    without = None
    if layout.dcp > 1:  # the concurrency DCP gains: the same rank with the whole latent cache
        whole = rank_memory(cfg, gpu, replace(layout, dcp=1), weights, w, cache_bytes)
        without = layout.dp * whole.plan.max_concurrency(w.context) if whole.plan else 0
    max_ctx = max_context_one_request(cfg, rank, layout, w.kv_dtype, w.state_dtype)
    perf = None
    if not problems and rank.fits:
        perf = estimate(cfg, gpu, layout, weights, min(w.concurrency, capacity), w.context, w.kv_dtype, w.state_dtype)
    static = min(
        0.99, (rank.weights + rank.draft_weights + rank.draft_cache + max(rank.cache_budget, 0)) / gpu.hbm_bytes
    )
    cmds = launch_commands(
        model,
        layout,
        w.context,
        w.max_num_seqs,
        max(rank.cache_budget, 0),
        w.memory_fraction,
        static,
        w.kv_dtype,
        gpu.scaleup_domain,
        w.redundant_experts,
    )
    return LayoutResult(
        gpu,
        layout,
        rank,
        problems,
        layout.warnings(gpu.scaleup_domain),
        capacity,
        max_ctx,
        perf,
        w.concurrency,
        cmds,
        without,
    )


def rank_results(results: list[LayoutResult], optimize: str, latency: bool) -> list[LayoutResult]:
    def key(r: LayoutResult):
        tpot = r.perf.tpot_s if r.perf else float("inf")
        cost = r.perf.gpu_hours_per_mtok * (r.gpu.usd_per_hour or 1.0) if r.perf else float("inf")
        head = (not r.fits, not r.loads)
        if latency:
            return (*head, tpot, r.layout.num_gpus)
        if optimize == "cost":
            return (*head, cost, r.layout.num_gpus)
        return (*head, r.layout.num_gpus, bool(r.warnings), r.layout.pp, -r.capacity, tpot)

    return sorted(results, key=key)


def counts_for(gpu: GPU) -> list[int]:
    return sorted(set(COUNTS) | ({72} if gpu.scaleup_domain >= 72 else set()))


def smallest_count(
    cfg: ModelConfig, model: str, gpu: GPU, weights: WeightSplit, w: Workload, cache_bytes: int | None = None
) -> int | None:
    """The fewest GPUs of this type with any layout that fits the workload: one search,
    whatever --num-gpus / --tp ask to be shown."""
    for n in counts_for(gpu):
        if any(evaluate(cfg, model, gpu, lay, weights, w, cache_bytes).fits for lay in candidate_layouts(n)):
            return n
    return None


def _layouts(
    n: int, tp: int | None, dp: int | None, ep: int | None, pp: int | None, dcp: int | None = None
) -> list[Layout]:
    layouts = _given(n, tp, dp, ep, pp)
    if dcp and dcp > 1:  # DCP shards one attention group's cache: the TP layouts it divides
        layouts = [replace(lay, dcp=dcp) for lay in layouts if lay.dp == 1 and lay.tp % dcp == 0]
    return layouts


def _given(n: int, tp: int | None, dp: int | None, ep: int | None, pp: int | None) -> list[Layout]:
    layouts = candidate_layouts(n)
    if tp or dp or ep or pp:
        layouts = [
            lay
            for lay in layouts
            if (tp is None or lay.tp == tp) and (dp is None or lay.dp == dp) and (pp is None or lay.pp == pp)
        ]
        if ep:
            layouts = [Layout(lay.num_gpus, lay.tp, lay.dp, ep, lay.pp) for lay in layouts]
        if not layouts:  # an explicit layout the search would not try: evaluate it as given
            p = pp or 1
            t = tp or (n // p // dp if dp else n // p)
            layouts = [Layout(n, t, dp or max(1, n // p // t), ep or n // p, p)]
    return layouts


def plan(
    cfg: ModelConfig,
    model: str,
    source: str,
    gpus: list[GPU],
    weights: WeightSplit,
    w: Workload,
    *,
    num_gpus: int | None = None,
    tp: int | None = None,
    dp: int | None = None,
    ep: int | None = None,
    pp: int | None = None,
    dcp: int | None = None,
    optimize: str = "min-hardware",
    latency_sensitive: bool = False,
    cache_bytes: int | None = None,
    assumed: list[str] | None = None,
) -> PlanReport:
    results, smallest = [], {}
    for gpu in gpus:
        smallest[gpu.name] = smallest_count(cfg, model, gpu, weights, w, cache_bytes)
        if num_gpus:
            counts = [num_gpus]
        else:  # the smallest serving count and up to 4x it, to compare against
            low = smallest[gpu.name]
            counts = [n for n in counts_for(gpu) if low is None or low <= n <= 4 * low]
        for n in counts:
            results += [
                evaluate(cfg, model, gpu, lay, weights, w, cache_bytes) for lay in _layouts(n, tp, dp, ep, pp, dcp)
            ]
    ranked = rank_results(results, optimize, latency_sensitive)
    return PlanReport(
        model,
        source,
        weights,
        w,
        mla_cache_bytes_per_token(cfg, "bfloat16"),
        mla_cache_bytes_per_token(cfg, "fp8"),
        kda_state_bytes_per_request(cfg, w.state_dtype),
        ranked,
        smallest,
        optimize,
        latency_sensitive,
        list(gpus),
        list(assumed or []),
    )
