"""Plan reports as JSON, Markdown and a terminal table (rich)."""

from __future__ import annotations

import json

from k3serve.planner.perf import __doc__ as PERF_ASSUMPTIONS
from k3serve.planner.search import LayoutResult, PlanReport, counts_for

GB = 1e9


def result_dict(r: LayoutResult) -> dict:
    rank, plan = r.rank, r.rank.plan
    lay = r.layout
    return {
        "gpu": r.gpu.name,
        "num_gpus": lay.num_gpus,
        "nodes": lay.nodes(r.gpu.scaleup_domain),
        "layout": lay.label,
        "tp": lay.tp,
        "dp": lay.dp,
        "ep": lay.ep,
        "pp": lay.pp,
        "fits": r.fits,
        "loads": r.loads,
        "verdict": r.verdict,
        "problems": r.problems,
        "warnings": r.warnings,
        "why_not": r.why_not or None,
        "links": lay.links(r.gpu.scaleup_domain),
        "per_rank_bytes": {
            "hbm": rank.hbm,
            "usable": rank.usable,
            "weights": rank.weights,
            "draft_weights": rank.draft_weights,
            "draft_cache": rank.draft_cache,
            "activations": rank.activations,
            "overhead": rank.overhead,
            "encoder_cache": rank.encoder_cache,
            "cache_budget": rank.cache_budget,
        },
        "cache": None
        if plan is None
        else {
            "state_slots": plan.num_slots,
            "latent_tokens": plan.kv_tokens,
            "latent_blocks": plan.num_blocks,
            "slot_bytes": plan.slot_bytes,
            "token_bytes": plan.token_bytes,
            "checkpoints": plan.num_checkpoints,
        },
        "max_concurrency_at_context": r.capacity,
        "max_concurrency_without_dcp": r.capacity_without_dcp,
        "max_context_one_request": r.max_context,
        "usd_per_gpu_hour": r.gpu.usd_per_hour,
        "perf": r.perf.to_dict() if r.perf else None,
        "launch": r.commands,
    }


def assumption_lines(rep: PlanReport) -> list[str]:
    """What was assumed for unasked questions, then the roofline's assumptions (perf.py)."""
    bullets = PERF_ASSUMPTIONS.split("\n- ")[1:]
    return list(rep.assumed) + [" ".join(b.split()) for b in bullets]


def report_dict(rep: PlanReport, top: int = 10) -> dict:
    w = rep.weights
    return {
        "model": rep.model,
        "source": rep.source,
        "weights": {
            "total_bytes": w.total,
            "expert_bytes": w.expert,
            "tp_sharded_bytes": w.tp_sharded,
            "replicated_bytes": w.replicated,
            "params": w.params,
            "active_params": w.active_params,
        },
        "latent_kv_bytes_per_token": {"bf16": rep.token_bytes, "fp8": rep.token_bytes_fp8},
        "kda_state_bytes_per_request": rep.state_bytes,
        "workload": rep.workload.__dict__,
        "optimize": rep.optimize,
        "latency_sensitive": rep.latency_sensitive,
        "smallest_gpu_count": rep.smallest,
        "layouts": [result_dict(r) for r in shown(rep, top)],
        "best_per_gpu": [result_dict(r) for r in rep.best_per_gpu()],
        "disaggregation": rep.pd.to_dict() if rep.pd else None,
        "prefix_cache_tiers": rep.tiers.to_dict() if rep.tiers else None,
        "assumed": rep.assumed,
        "assumptions": assumption_lines(rep)[len(rep.assumed) :],
    }


def to_json(rep: PlanReport, top: int = 10) -> str:
    return json.dumps(report_dict(rep, top), indent=2)


def shown(rep: PlanReport, top: int) -> list[LayoutResult]:
    """The top rows plus the best row of every GPU type asked for that the top left out."""
    rows = rep.results[:top]
    return rows + [r for r in rep.best_per_gpu() if r not in rows]


def headers(rep: PlanReport) -> list[str]:
    out = [
        "GPUs",
        "layout",
        "links",
        "verdict",
        "weights GB/rank",
        "cache GB/rank",
        "state slots",
        "latent tokens",
        "max conc.",
        "max ctx (1 req)",
        "TPOT ms",
        "TTFT s",
        "tok/s",
    ]
    if rep.optimize == "cost":
        out += ["GPU-h/Mtok", "$/Mtok"]
    return out


def row(rep: PlanReport, r: LayoutResult) -> list[str]:
    rank, perf, lay = r.rank, r.perf, r.layout
    tok_s = "-"
    if perf:
        tok_s = f"{perf.tokens_per_s:,.0f}" + ("" if perf.concurrency >= r.wanted else f" (at {perf.concurrency})")
    out = [
        f"{lay.num_gpus}x{r.gpu.name}",
        lay.label,
        lay.links_label(r.gpu.scaleup_domain),
        r.verdict,
        f"{rank.weights / GB:.1f}",
        f"{rank.cache_budget / GB:.1f}",
        str(rank.plan.num_slots if rank.plan else 0),
        f"{rank.plan.kv_tokens:,}" if rank.plan else "0",
        str(r.capacity) + (f" ({r.capacity_without_dcp} w/o DCP)" if r.capacity_without_dcp is not None else ""),
        f"{r.max_context:,}",
        f"{perf.tpot_s * 1000:.1f}" if perf else "-",
        f"{perf.ttft_s:.2f}" if perf else "-",
        tok_s,
    ]
    if rep.optimize == "cost":
        out += [
            f"{perf.gpu_hours_per_mtok:,.2f}" if perf else "-",
            f"{perf.usd_per_mtok:,.2f}" if perf and r.gpu.usd_per_hour else "-",
        ]
    return out


def summary_lines(rep: PlanReport) -> list[str]:
    w, wl = rep.weights, rep.workload
    lines = [
        f"model {rep.model} ({rep.source}): {w.params / 1e9:,.2f} B params, {w.active_params / 1e9:,.2f} B active, "
        f"weights {w.total:,} B",
        f"latent KV {rep.token_bytes:,} B/token (bf16), {rep.token_bytes_fp8:,} (fp8); "
        f"KDA state {rep.state_bytes:,} B/request",
        f"workload: context {wl.context:,}, concurrency {wl.concurrency}, kv {wl.kv_dtype}, "
        f"memory fraction {wl.memory_fraction}, optimize {rep.optimize}"
        + (", latency-sensitive" if rep.latency_sensitive else ""),
    ]
    top = max(counts_for(g)[-1] for g in rep.gpus) if rep.gpus else 128
    for gpu, n in rep.smallest.items():
        lines.append(f"smallest {gpu} count that serves it: {n if n else f'none up to {top}'}")
    if rep.optimize == "cost":
        prices = ", ".join(f"{g.name} ${g.usd_per_hour:g}" for g in rep.gpus)
        lines.append(f"price per GPU-hour: {prices} (illustrative; --price GPU=USD overrides)")
    return lines + pd_lines(rep) + ([rep.tiers.line()] if rep.tiers is not None else [])


def pd_lines(rep: PlanReport) -> list[str]:
    pd = rep.pd
    if pd is None:
        return []
    h, best = pd.handoff, rep.best()
    cached = (
        f" ({h.prompt_tokens - h.sent_tokens:,} already on the decode side)" if h.sent_tokens < h.prompt_tokens else ""
    )
    return [
        f"P/D {pd.prefill}:{pd.decode} of {best.layout.num_gpus}x{best.gpu.name} {best.layout.label}: "
        f"{pd.num_gpus} GPUs (colocated: {best.layout.num_gpus}); per request of {h.prompt_tokens:,} prompt tokens "
        f"it moves latent {h.latent_bytes:,} B for {h.sent_tokens:,} tokens{cached} + KDA state "
        f"{h.state_bytes:,} B = {h.total_bytes / 1e6:,.1f} MB, {pd.seconds * 1e3:,.2f} ms over {pd.link} "
        f"({pd.link_bytes_per_s / 1e9:g} GB/s per GPU per direction x {pd.gpus_per_instance} GPUs)"
    ]


def not_fit_lines(rep: PlanReport, rows: list[LayoutResult]) -> list[str]:
    return [f"{r.layout.num_gpus}x{r.gpu.name} {r.layout.label}: {r.why_not}" for r in rows if not r.fits]


def to_markdown(rep: PlanReport, top: int = 10) -> str:
    rows, hs = shown(rep, top), headers(rep)
    out = ["# k3serve plan", ""] + [f"- {line}" for line in summary_lines(rep)] + [""]
    out += ["| " + " | ".join(hs) + " |", "|" + "---|" * len(hs)]
    out += ["| " + " | ".join(row(rep, r)) + " |" for r in rows]
    out += [f"- {line}" for line in not_fit_lines(rep, rows)]
    launch = rep.launch()
    if launch:
        out += ["", "## Launch (best layout)", ""] + [f"```\n{c}\n```" for c in launch.values()]
    out += ["", "## Assumptions", ""] + [f"- {line}" for line in assumption_lines(rep)]
    return "\n".join(out)


def print_table(rep: PlanReport, top: int = 10) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 200))
    for line in summary_lines(rep):
        console.print(line)
    rows = shown(rep, top)
    table = Table(title="layouts, best first (then the best of each GPU type)")
    for i, h in enumerate(headers(rep)):
        table.add_column(h, no_wrap=i < 4)
    for r in rows:
        table.add_row(*row(rep, r), style=None if r.fits else "dim")
    console.print(table)
    for line in not_fit_lines(rep, rows):
        console.print(f"  {line}", style="dim")
    launch = rep.launch()
    if launch:
        console.print("[bold]launch (best layout):[/bold]")
        for name, cmd in launch.items():
            console.print(f"  {name}: {cmd}", soft_wrap=True)
    console.print("[bold]assumptions:[/bold]")
    for line in assumption_lines(rep):
        console.print(f"  {line}", soft_wrap=True)
