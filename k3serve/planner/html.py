"""`--html FILE`: one self-contained page (no scripts, no external assets) with the summary,
the layout table and a memory-breakdown bar per rank (inline SVG)."""

from __future__ import annotations

from html import escape

from k3serve.planner.report import assumption_lines, headers, not_fit_lines, row, shown, summary_lines
from k3serve.planner.search import LayoutResult, PlanReport

PARTS = [
    ("weights", "#4c72b0"),
    ("draft_weights", "#8172b2"),
    ("draft_cache", "#b39ddb"),
    ("activations", "#dd8452"),
    ("overhead", "#937860"),
    ("encoder_cache", "#da8bc3"),
    ("cache", "#55a868"),
    ("free", "#dddddd"),
]
# The page must fit a 1,280 px window without horizontal scrolling (tested in Chromium):
# compact cells that may wrap, and a narrow bar.
CSS = """body{font-family:sans-serif;margin:1em;max-width:1248px}table{border-collapse:collapse;width:100%}
td,th{border:1px solid #ccc;padding:2px 4px;font-size:12px;overflow-wrap:anywhere}
th{font-weight:600;background:#f2f2f2}tr.no td{color:#888}
pre{background:#f6f6f6;padding:8px;white-space:pre-wrap;overflow-wrap:anywhere}li{overflow-wrap:anywhere}"""


def _bar(r: LayoutResult, width: int = 120) -> str:
    rank = r.rank
    vals = {
        "weights": rank.weights,
        "draft_weights": rank.draft_weights,
        "draft_cache": rank.draft_cache,
        "activations": rank.activations,
        "overhead": rank.overhead,
        "encoder_cache": rank.encoder_cache,
        "cache": max(rank.cache_budget, 0),
    }
    vals["free"] = max(rank.hbm - sum(vals.values()), 0)
    total = max(sum(vals.values()), rank.hbm)
    x, rects = 0.0, []
    for name, color in PARTS:
        w = width * vals[name] / total
        if w > 0:
            rects.append(
                f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="18" fill="{color}">'
                f"<title>{name}: {vals[name] / 1e9:.1f} GB</title></rect>"
            )
        x += w
    return f'<svg width="{width}" height="18" role="img" aria-label="memory per rank">{"".join(rects)}</svg>'


def _items(lines: list[str]) -> str:
    return "".join(f"<li>{escape(line)}</li>" for line in lines)


def to_html(rep: PlanReport, top: int = 10) -> str:
    rows_shown = shown(rep, top)
    rows = []
    for r in rows_shown:
        cells = "".join(f"<td>{escape(c)}</td>" for c in row(rep, r))
        rows.append(f'<tr class="{"fits" if r.fits else "no"}">{cells}<td>{_bar(r)}</td></tr>')
    legend = " ".join(f'<span style="background:{c};padding:0 8px">&nbsp;</span> {n}' for n, c in PARTS)
    launch = "".join(f"<h3>{escape(k)}</h3><pre>{escape(v)}</pre>" for k, v in rep.launch().items())
    head = "".join(f"<th>{escape(h)}</th>" for h in headers(rep) + ["memory per rank"])
    return f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><meta name="viewport" content="width=device-width">
<title>k3serve plan: {escape(rep.model)}</title>
<style>{CSS}</style>
</head>
<body>
<h1>k3serve plan</h1>
<ul>{_items(summary_lines(rep))}</ul>
<p>{legend}</p>
<table><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>
<ul>{_items(not_fit_lines(rep, rows_shown))}</ul>
<h2>Launch commands (best layout)</h2>{launch or "<p>no layout serves this workload</p>"}
<h2>Assumptions</h2>
<ul>{_items(assumption_lines(rep))}</ul>
</body>
</html>
"""
