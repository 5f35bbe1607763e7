"""`--html FILE`: one self-contained page (no scripts, no external assets) with the summary,
the layout table and a memory-breakdown bar per rank (inline SVG)."""

from __future__ import annotations

from html import escape

from k3serve.planner.report import HEADERS, _row, summary_lines
from k3serve.planner.search import LayoutResult, PlanReport

PARTS = [("weights", "#4c72b0"), ("draft_weights", "#8172b2"), ("activations", "#dd8452"),
         ("overhead", "#937860"), ("cache", "#55a868"), ("free", "#dddddd")]


def _bar(r: LayoutResult, width: int = 640) -> str:
    rank = r.rank
    vals = {"weights": rank.weights, "draft_weights": rank.draft_weights, "activations": rank.activations,
            "overhead": rank.overhead, "cache": max(rank.cache_budget, 0)}
    vals["free"] = max(rank.hbm - sum(vals.values()), 0)
    total = max(sum(vals.values()), rank.hbm)
    x, rects = 0.0, []
    for name, color in PARTS:
        w = width * vals[name] / total
        if w > 0:
            rects.append(f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="22" fill="{color}">'
                         f"<title>{name}: {vals[name] / 1e9:.1f} GB</title></rect>")
        x += w
    return (f'<svg width="{width}" height="22" role="img" aria-label="memory per rank">{"".join(rects)}</svg>')


def to_html(rep: PlanReport, top: int = 10) -> str:
    rows = []
    for r in rep.results[:top]:
        cells = "".join(f"<td>{escape(c)}</td>" for c in _row(r))
        rows.append(f"<tr>{cells}<td>{_bar(r)}</td></tr>")
    legend = " ".join(f'<span style="background:{c};padding:0 8px">&nbsp;</span> {n}' for n, c in PARTS)
    best = next((r for r in rep.results if r.serves(rep.workload)), None)
    launch = "".join(f"<h3>{escape(k)}</h3><pre>{escape(v)}</pre>" for k, v in (best.commands if best else {}).items())
    summary = "".join(f"<li>{escape(line)}</li>" for line in summary_lines(rep))
    head = "".join(f"<th>{escape(h)}</th>" for h in HEADERS + ["memory per rank"])
    return f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>k3serve plan: {escape(rep.model)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 6px;font-size:13px}}pre{{background:#f6f6f6;padding:8px;white-space:pre-wrap}}</style>
</head>
<body>
<h1>k3serve plan</h1>
<ul>{summary}</ul>
<p>{legend}</p>
<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>
<h2>Launch commands (best layout)</h2>{launch or '<p>no layout serves this workload</p>'}
</body>
</html>
"""
