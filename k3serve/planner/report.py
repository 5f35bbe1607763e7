"""Plan reports as JSON, Markdown and a terminal table (rich)."""

from __future__ import annotations

import json

from k3serve.planner.perf import __doc__ as PERF_ASSUMPTIONS
from k3serve.planner.search import LayoutResult, PlanReport

GB = 1e9


def result_dict(r: LayoutResult) -> dict:
    rank, plan = r.rank, r.rank.plan
    return {
        "gpu": r.gpu.name, "num_gpus": r.layout.num_gpus, "layout": r.layout.label,
        "tp": r.layout.tp, "dp": r.layout.dp, "ep": r.layout.ep, "fits": r.fits, "problems": r.problems, "warnings": r.warnings,
        "why_not": why(r) or None,
        "per_rank_bytes": {"hbm": rank.hbm, "usable": rank.usable, "weights": rank.weights,
                           "draft_weights": rank.draft_weights, "activations": rank.activations,
                           "overhead": rank.overhead, "cache_budget": rank.cache_budget},
        "cache": None if plan is None else {
            "state_slots": plan.num_slots, "latent_tokens": plan.kv_tokens, "latent_blocks": plan.num_blocks,
            "slot_bytes": plan.slot_bytes, "token_bytes": plan.token_bytes, "checkpoints": plan.num_checkpoints},
        "max_concurrency_at_context": r.capacity, "max_context_one_request": r.max_context,
        "perf": r.perf.to_dict() if r.perf else None, "launch": r.commands,
    }


def report_dict(rep: PlanReport, top: int = 10) -> dict:
    w = rep.weights
    return {
        "model": rep.model, "source": rep.source,
        "weights": {"total_bytes": w.total, "expert_bytes": w.expert, "tp_sharded_bytes": w.tp_sharded,
                    "replicated_bytes": w.replicated, "params": w.params, "active_params": w.active_params},
        "latent_kv_bytes_per_token": {"bf16": rep.token_bytes, "fp8": rep.token_bytes_fp8},
        "kda_state_bytes_per_request": rep.state_bytes,
        "workload": rep.workload.__dict__, "optimize": rep.optimize, "latency_sensitive": rep.latency_sensitive,
        "smallest_gpu_count": rep.smallest,
        "layouts": [result_dict(r) for r in rep.results[:top]],
        "assumptions": " ".join(PERF_ASSUMPTIONS.split()),
    }


def to_json(rep: PlanReport, top: int = 10) -> str:
    return json.dumps(report_dict(rep, top), indent=2)


def _row(r: LayoutResult) -> list[str]:
    rank = r.rank
    verdict = "fits" if r.fits else "no"
    perf = r.perf
    return [f"{r.layout.num_gpus}x{r.gpu.name}", r.layout.label, verdict, f"{rank.weights / GB:.1f}",
            f"{rank.cache_budget / GB:.1f}", str(rank.plan.num_slots if rank.plan else 0),
            f"{rank.plan.kv_tokens:,}" if rank.plan else "0", str(r.capacity), f"{r.max_context:,}",
            f"{perf.tpot_s * 1000:.1f}" if perf else "-", f"{perf.ttft_s:.2f}" if perf else "-",
            f"{perf.tokens_per_s:,.0f}" if perf else "-"]


def why(r: LayoutResult) -> str:
    return "; ".join(r.problems) or r.rank.why_not or ""


HEADERS = ["GPUs", "layout", "verdict", "weights GB/rank", "cache GB/rank", "state slots", "latent tokens",
           "max conc.", "max ctx (1 req)", "TPOT ms", "TTFT s", "tok/s"]


def summary_lines(rep: PlanReport) -> list[str]:
    w, wl = rep.weights, rep.workload
    lines = [f"model {rep.model} ({rep.source}): {w.params / 1e9:,.2f} B params, {w.active_params / 1e9:,.2f} B active, "
             f"weights {w.total:,} B",
             f"latent KV {rep.token_bytes:,} B/token (bf16), {rep.token_bytes_fp8:,} (fp8); "
             f"KDA state {rep.state_bytes:,} B/request",
             f"workload: context {wl.context:,}, concurrency {wl.concurrency}, kv {wl.kv_dtype}, "
             f"memory fraction {wl.memory_fraction}, optimize {rep.optimize}"
             + (", latency-sensitive" if rep.latency_sensitive else "")]
    for gpu, n in rep.smallest.items():
        lines.append(f"smallest {gpu} count that serves it: {n if n else 'none up to 128'}")
    return lines


def to_markdown(rep: PlanReport, top: int = 10) -> str:
    out = ["# k3serve plan", ""] + [f"- {line}" for line in summary_lines(rep)] + [""]
    out += ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    out += ["| " + " | ".join(_row(r)) + " |" for r in rep.results[:top]]
    out += [f"- {r.layout.num_gpus}x{r.gpu.name} {r.layout.label}: {why(r)}" for r in rep.results[:top] if not r.fits]
    best = next((r for r in rep.results if r.serves(rep.workload)), None)
    if best:
        out += ["", "## Launch (best layout)", ""] + [f"```\n{c}\n```" for c in best.commands.values()]
    out += ["", "## Assumptions", "", " ".join(PERF_ASSUMPTIONS.split())]
    return "\n".join(out)


def print_table(rep: PlanReport, top: int = 10) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 160))
    for line in summary_lines(rep):
        console.print(line)
    table = Table(*HEADERS, title="layouts, best first")
    for r in rep.results[:top]:
        table.add_row(*_row(r), style=None if r.fits else "dim")
    console.print(table)
    for r in rep.results[:top]:
        if not r.fits:
            console.print(f"  {r.layout.num_gpus}x{r.gpu.name} {r.layout.label}: {why(r)}", style="dim")
    best = next((r for r in rep.results if r.serves(rep.workload)), None)
    if best:
        console.print("[bold]launch (best layout):[/bold]")
        for name, cmd in best.commands.items():
            console.print(f"  {name}: {cmd}", soft_wrap=True)
