"""A job's report as one self-contained HTML page (``shardfold report JOB_ID --html FILE``).

:func:`render` takes the document :func:`functions.report.build` returns and writes a page with inline CSS
and inline SVG only (no scripts, fonts, images or network): the header (job, state, tasks, cost, SLA,
responsiveness, scaling), a timeline of every task attempt, a memory chart (projected against measured peak
against the memory each task gets), a cost chart (plan against actual by component), the step tables in the
layout the CLI prints, and the estimator's reasons.

Every string taken from the document goes through :func:`html.escape`: job ids, step names and error
messages come from users. Any figure may be missing (a failed job, a job admitted without an estimate, a
private step's withheld records).

The timeline stays bounded for jobs of 10,000 attempts: up to :data:`ROW_LIMIT` attempts it draws one row
per attempt; past that each step's attempts are packed into lanes (an attempt takes the first lane free
when it starts), and past :data:`LANE_LIMIT` lanes in all, each step's lanes fold onto its share of rows
(bars drawn translucent, so overlaps show darker).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from html import escape
from typing import Any

from shardfold.functions.report import tables

ROW_LIMIT = 60  # attempts drawn one per row, with a label
LANE_LIMIT = 240  # rows of the timeline, at most (and MIN_BAND_ROWS more for each step)
MIN_BAND_ROWS = 6  # rows a step's lanes fold onto, at least: a step of a few tasks stays visible
PLOT_W = 860  # px: the charts' plotting width
LABEL_W = 200  # px: the labels left of the plots
PALETTE = [
    "#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2",
    "#edc948", "#9c755f", "#ff9da7", "#bab0ac", "#86bcb6",
]  # fmt: skip
FAILED = "#d62728"
RETRY_SWATCH = "background:repeating-linear-gradient(45deg,#ccc 0 2px,#666 2px 4px)"  # the retries' hatching
UNFINISHED = ("RUNNING", "PENDING", "SUBMITTED", "QUEUED", None)

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #222;
       margin: 24px auto; max-width: 1140px; padding: 0 16px; background: #fff; }
h1 { font-size: 22px; margin: 0 0 12px; word-break: break-all; }
h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 14px; margin: 16px 0 6px; }
table { border-collapse: collapse; margin: 4px 0 12px; }
th, td { border: 1px solid #ddd; padding: 3px 10px; text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
table.kv td:first-child { font-weight: 600; background: #fafafa; }
table.kv td { text-align: left; }
.state { display: inline-block; padding: 1px 8px; border-radius: 10px; color: #fff; font-weight: 600; }
.SUCCEEDED { background: #2e7d32; } .FAILED { background: #c62828; } .RUNNING { background: #0277bd; }
.CANCELLED, .INTERRUPTED, .other { background: #757575; }
.ok { color: #2e7d32; font-weight: 600; } .bad { color: #c62828; font-weight: 600; }
.error { color: #c62828; white-space: pre-wrap; word-break: break-word; }
.note { color: #666; font-size: 13px; }
.legend span { display: inline-block; margin-right: 14px; font-size: 13px; }
.sw { display: inline-block; width: 12px; height: 12px; vertical-align: -1px; margin-right: 4px;
      border: 1px solid #0003; }
svg { display: block; margin: 6px 0; } svg text { font-size: 11px; fill: #333; }
ul.why li { margin: 2px 0; }
"""


# --- formatting ---------------------------------------------------------------------------------------------


def _e(v: Any) -> str:
    return escape("-" if v is None else str(v))


def _num(v: Any, spec: str = ",.2f", unit: str = "") -> str:
    if v is None or not isinstance(v, int | float) or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec) + unit


def _usd(v: Any) -> str:
    return "-" if not isinstance(v, int | float) else f"${v:.6f}"


def _error_text(err: Any) -> str | None:
    if not err:
        return None
    if isinstance(err, dict):
        kind, message = err.get("type"), err.get("message")
        return f"{kind}: {message}" if kind and message else str(kind or message or err)
    return str(err)


def _px(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


def _nice_step(span: float, ticks: int = 8) -> float:
    """A round tick spacing (1, 2 or 5 times a power of ten) giving about ``ticks`` ticks over ``span``."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


# --- sections -----------------------------------------------------------------------------------------------


def _header(doc: dict[str, Any]) -> str:
    """The page's title and its table of the job: state, error, tasks, cost and the report's dimensions."""
    state = doc.get("state")
    known = state in ("SUCCEEDED", "FAILED", "RUNNING", "CANCELLED", "INTERRUPTED")
    rows: list[tuple[str, str]] = [
        ("job", _e(doc.get("job_id"))),
        ("kind", _e(doc.get("kind"))),
        ("state", f'<span class="state {state if known else "other"}">{_e(state)}</span>'),
    ]
    error = _error_text(doc.get("error"))
    if error:
        rows.append(("error", f'<span class="error">{escape(error)}</span>'))
    rows.append(("tasks", f"{_num(doc.get('tasks'), ',')} tasks ({_num(doc.get('attempts'), ',')} attempts)"))
    cost = doc.get("cost") or {}
    actual, plan = (cost.get("actual") or {}).get("total"), (cost.get("plan") or {}).get("total")
    rows.append(("cost", f"{_usd(actual)} actual, {_usd(plan) if plan is not None else 'no plan'} planned"))
    rows.append(("elapsed", _elapsed(doc.get("sla") or {})))
    r = doc.get("responsiveness") or {}
    first, result = _num(r.get("first_task_s"), ",.2f", " s"), _num(r.get("first_result_s"), ",.2f", " s")
    rows.append(("responsiveness", f"first task ran after {first}, first result after {result}"))
    rows += _scaling_rows(doc.get("scaling") or {})
    body = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows)
    return f'<h1>Job {_e(doc.get("job_id"))}</h1>\n<table class="kv">{body}</table>'


def _elapsed(sla: dict[str, Any]) -> str:
    """The header's ``sla``: the time the job took, against its deadline where the spec set one."""
    elapsed, deadline, met = sla.get("elapsed_s"), sla.get("deadline_s"), sla.get("met")
    text = f"{_num(elapsed, ',.2f', ' s')} elapsed"
    if deadline is not None:
        text += f" of a {_num(deadline, ',.6g', ' s')} deadline"
    if met is True:
        return text + ' <span class="ok">SLA met</span>'
    if met is False:
        return text + ' <span class="bad">SLA missed</span>'
    return text + (' <span class="note">(no deadline_s in the spec)</span>' if deadline is None else "")


def _scaling_rows(sc: dict[str, Any]) -> list[tuple[str, str]]:
    """The header's ``scaling``: the most tasks at once, and a row for each step that ran against a limit."""
    limits = ", ".join(f"{escape(str(k))} ≤ {_num(v, ',')}" for k, v in (sc.get("allowed") or {}).items())
    text = (
        f"at most {_num(sc.get('peak_running'), ',')} tasks at once"
        + (f" (allowed: {limits})" if limits else "")
        + f"; the count changed direction {_num(sc.get('reversals'), ',')} times"
        + (f" over {_num(sc.get('span_s'), ',.2f', ' s')}" if sc.get("span_s") else "")
    )
    rows = [("scaling", text)]
    for name, st in (sc.get("steps") or {}).items():
        if st.get("peak"):
            text = (
                f"{_num(st.get('peak'), ',')} of {_num(st.get('allowed'), ',')} allowed at most; "
                f"{_num(st.get('task_s'), ',.2f')} task-s of idle slots while work waited"
            )
            rows.append((f"&nbsp;&nbsp;{_e(name)}", text))
    return rows


# --- the timeline: lane packing (where each attempt goes), then drawing -------------------------------------


@dataclass
class _Layout:
    """The timeline's rows: ``placed`` (record, row), ``bands`` (step, first row, rows), ``row_h`` in px."""

    placed: list[tuple[dict[str, Any], int]]
    bands: list[tuple[str, int, int]]
    rows: int
    row_h: float
    per_row: bool  # one labelled row per attempt, else packed lanes
    folded: str | None = None  # the note saying how many lanes folded onto how many rows, if they did


def _drawn_end(r: dict[str, Any], t0: float, span: float) -> float:
    """Where an attempt's bar ends, in seconds from ``t0``: an attempt with no end is drawn to the span's."""
    return (r["ended_at"] - t0) if isinstance(r.get("ended_at"), int | float) else span


def _lanes(records: list[dict[str, Any]], ends: list[float]) -> list[int]:
    """First-fit lanes for ``records`` (sorted by start) that end at ``ends``: the lane each takes."""
    free: list[tuple[float, int]] = []  # (free from, lane)
    spare: list[int] = []  # lanes free now, smallest first
    lanes_used = 0
    out = []
    for r, end in zip(records, ends, strict=True):
        start = r["started_at"]
        while free and free[0][0] <= start:
            heapq.heappush(spare, heapq.heappop(free)[1])
        if spare:
            lane = heapq.heappop(spare)
        else:
            lane, lanes_used = lanes_used, lanes_used + 1
        out.append(lane)
        heapq.heappush(free, (end, lane))
    return out


def _one_row_each(by_step: dict[str, list[dict[str, Any]]]) -> _Layout:
    """Up to :data:`ROW_LIMIT` attempts: a row for each, the steps one after another."""
    placed, bands, row = [], [], 0
    for name, rs in by_step.items():
        bands.append((name, row, len(rs)))
        placed += [(r, row + i) for i, r in enumerate(rs)]
        row += len(rs)
    return _Layout(placed, bands, row, 16.0, per_row=True)


def _packed(by_step: dict[str, list[dict[str, Any]]], t0: float, span: float) -> _Layout:
    """Past :data:`ROW_LIMIT` attempts: each step's in first-fit lanes; past :data:`LANE_LIMIT` lanes in all,
    each step's lanes folded onto its share of rows."""
    lanes_of = {}
    for name, rs in by_step.items():
        rs.sort(key=lambda r: r["started_at"])
        # an attempt holds its lane for at least a 2000th of the span, so bars of no length do not pile up
        ends = [t0 + max(_drawn_end(r, t0, span), r["started_at"] - t0 + span / 2000) for r in rs]
        lanes_of[name] = _lanes(rs, ends)
    total = sum(max(ls) + 1 for ls in lanes_of.values())
    folded = total > LANE_LIMIT
    used = {}  # step -> rows its bars take (its lanes, folded past LANE_LIMIT)
    for name in by_step:
        n = max(lanes_of[name]) + 1
        used[name] = min(n, max(MIN_BAND_ROWS, math.floor(n * LANE_LIMIT / total))) if folded else n
    row_h = max(2.0, min(12.0, 560 / sum(used.values())))
    placed, bands, row = [], [], 0
    for name, rs in by_step.items():
        bands.append((name, row, max(used[name], math.ceil(14 / row_h))))  # room for the step's name
        placed += [(r, row + lane % used[name]) for r, lane in zip(rs, lanes_of[name], strict=True)]
        row += bands[-1][2]
    note = (
        f"{total:,} lanes folded onto {sum(used.values()):,} rows: bars overlap "
        "(drawn translucent, darker where they do)."
    )
    return _Layout(placed, bands, row, row_h, per_row=False, folded=note if folded else None)


@dataclass
class _Chart:
    """The timeline's geometry: the time origin and span, the rows, which step has which colour."""

    t0: float
    span: float
    scale: float  # px per second
    layout: _Layout
    bar_h: float  # px: a bar's height in its row
    finished: bool  # the job ended: an attempt still "running" was lost
    steps_order: dict[str, int]
    by_step: dict[str, list[dict[str, Any]]]  # the attempts of each step, by start
    top: int = 8  # px above the first row

    def x(self, t: float) -> float:
        """Where ``t`` seconds after ``t0`` are drawn, in px from the left."""
        return LABEL_W + t * self.scale

    def colour(self, step: Any) -> str:
        """A step's colour: its place in the report's order of steps, in :data:`PALETTE`."""
        return PALETTE[self.steps_order.get(str(step), len(self.steps_order)) % len(PALETTE)]


def _timeline(doc: dict[str, Any], step_names: list[str]) -> str:
    """The timeline section: every timed attempt as a bar on its step's rows (see the module doc)."""
    records = doc.get("records") or []
    drawn = [r for r in records if isinstance(r.get("started_at"), int | float)]
    hidden = [r for r in records if not isinstance(r.get("started_at"), int | float)]
    notes = [
        f"{len(hidden):,} attempt(s) not drawn: their figures are withheld (private data; "
        f"step {escape(', '.join(sorted({str(r.get('step')) for r in hidden})))})."
    ] * bool(hidden)
    if not drawn:
        notes.append("No timed task attempts to draw.")
        return "\n".join(["<h2>Timeline</h2>"] + [f'<p class="note">{n}</p>' for n in notes])
    chart = _chart(drawn, step_names, doc.get("state") not in UNFINISHED)
    return "\n".join(
        [
            "<h2>Timeline</h2>",
            _legend(chart, drawn, step_names),
            f'<p class="note">{len(drawn):,} attempt(s) drawn over {chart.span:,.2f} s'
            + ("" if chart.layout.per_row else f", packed into {chart.layout.rows:,} row(s) by step")
            + "; hover a bar for its step, task, attempt, duration, peak memory and error.</p>",
            _timeline_svg(chart),
        ]
        + [f'<p class="note">{n}</p>' for n in notes + [chart.layout.folded] * bool(chart.layout.folded)]
    )


def _chart(drawn: list[dict[str, Any]], step_names: list[str], finished: bool) -> _Chart:
    """The timeline of the attempts ``drawn`` (sorted here by step, then start): its span and rows."""
    t0 = min(r["started_at"] for r in drawn)
    t_last = max(
        max((r["ended_at"] for r in drawn if isinstance(r.get("ended_at"), int | float)), default=t0),
        max(r["started_at"] for r in drawn),
    )
    span = max(t_last - t0, 1e-3)
    steps_order = {n: i for i, n in enumerate(step_names)}
    drawn.sort(key=lambda r: (steps_order.get(str(r.get("step")), len(steps_order)), r["started_at"]))
    by_step: dict[str, list[dict[str, Any]]] = {}
    for r in drawn:
        by_step.setdefault(str(r.get("step")), []).append(r)
    layout = _one_row_each(by_step) if len(drawn) <= ROW_LIMIT else _packed(by_step, t0, span)
    bar_h = layout.row_h - (4 if layout.row_h >= 8 else 1 if layout.row_h >= 3 else 0)
    return _Chart(t0, span, PLOT_W / span, layout, bar_h, finished, steps_order, by_step)


def _timeline_svg(c: _Chart) -> str:
    """The timeline's SVG: the steps' bands, the time axis, a bar per attempt and the markers on top."""
    rows, row_h, top = c.layout.rows, c.layout.row_h, c.top
    width, height = LABEL_W + PLOT_W + 20, top + rows * row_h + 26
    svg = [
        f'<svg width="{width}" height="{_px(height)}" '
        f'viewBox="0 0 {width} {_px(height)}" role="img" aria-label="task timeline">',
        "<defs>"
        '<pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)">'
        '<rect width="6" height="6" fill="none"/><line x1="0" y1="0" x2="0" y2="6" stroke="#000" '
        'stroke-opacity="0.45" stroke-width="2.5"/></pattern></defs>',
    ]
    # step bands: alternating background and the step's name
    for i, (name, first, n) in enumerate(c.layout.bands):
        y = top + first * row_h
        if i % 2:
            svg.append(f'<rect x="0" y="{_px(y)}" width="{width}" height="{_px(n * row_h)}" fill="#f6f6f6"/>')
        if not c.layout.per_row:
            svg.append(f'<text x="4" y="{_px(y + 11)}">{escape(str(name))} ({len(c.by_step[name]):,})</text>')
    # grid and axis
    step, axis_y, t = _nice_step(c.span), top + rows * row_h, 0.0
    while t <= c.span + 1e-9:
        gx = c.x(t)
        svg.append(f'<line x1="{_px(gx)}" y1="{top}" x2="{_px(gx)}" y2="{_px(axis_y)}" stroke="#e2e2e2"/>')
        svg.append(f'<text x="{_px(gx)}" y="{_px(axis_y + 14)}" text-anchor="middle">{t:g}</text>')
        t = round(t + step, 10)
    svg.append(
        f'<line x1="{LABEL_W}" y1="{_px(axis_y)}" x2="{LABEL_W + PLOT_W}" y2="{_px(axis_y)}" stroke="#888"/>'
        f'<text x="{LABEL_W + PLOT_W}" y="{_px(axis_y + 25)}" text-anchor="end">seconds since the first task '
        "started</text>"
    )
    bars = [_attempt(c, r, row) for r, row in c.layout.placed]
    return "".join(svg + [bar for bar, _ in bars] + [marks for _, marks in bars]) + "</svg>"


def _tip(r: dict[str, Any], s0: float, finished: bool) -> str:
    """An attempt's tooltip: its step, task, attempt, outcome, duration, start, peak memory and error."""
    outcome, attempt, task = r.get("outcome"), r.get("attempt") or 0, r.get("task")
    lost = "lost (killed: no end recorded)" if finished else "running"
    status = lost if outcome == "running" else outcome or "-"
    tip = [
        f"step {r.get('step')}",
        f"task {'-' if task is None else task}, attempt {attempt}" + (" (retry)" if attempt else ""),
        f"outcome {status}",
        f"duration {_num(r.get('duration_s'), ',.3f', ' s')}"
        + ("" if isinstance(r.get("ended_at"), int | float) else " (still running or killed)"),
        f"started at +{s0:,.3f} s",
        f"peak {_num(r.get('peak_memory_mib'), ',.1f', ' MiB')}",
    ]
    error = _error_text(r.get("error"))
    if error:
        tip.append(f"error {error[:500]}")
    return f"<title>{escape(chr(10).join(tip))}</title>"


def _attempt(c: _Chart, r: dict[str, Any], row: int) -> tuple[str, str]:
    """One attempt: its bar (outlined red if it failed or was lost, hatched if a retry; labelled when each
    attempt has a row), and its markers: a red cross at a failed attempt's end, a dot at a retry's start."""
    row_h, bar_h = c.layout.row_h, c.bar_h
    s0 = r["started_at"] - c.t0
    bx, bw = c.x(s0), max(_drawn_end(r, c.t0, c.span) - s0, 0) * c.scale
    bw = max(bw - (0 if c.layout.per_row else 1), 1.5)  # packed bars one after another keep a gap
    y = c.top + row * row_h + (row_h - bar_h) / 2
    attempt = r.get("attempt") or 0
    lost, failed = r.get("outcome") == "running" and c.finished, r.get("outcome") == "failed"
    title = _tip(r, s0, c.finished)
    stroke = f' stroke="{FAILED}" stroke-width="{1.5 if bar_h >= 4 else 1}"' if failed or lost else ""
    stroke += ' stroke-dasharray="3 2"' if lost else ""
    cls = " ".join(["failed"] * failed + ["retry"] * (attempt > 0) + ["lost"] * lost + ["attempt"])
    opacity = ' fill-opacity="0.6"' if c.layout.folded else ""
    rect = f'<rect x="{_px(bx)}" y="{_px(y)}" width="{_px(bw)}" height="{_px(bar_h)}" '
    bar = (
        f'<g class="{cls}">{rect}fill="{c.colour(r.get("step"))}"{opacity}{stroke}/>'
        + (f'{rect}fill="url(#hatch)"/>' if attempt > 0 else "")
        + f"{title}</g>"
    )
    my, size = y + bar_h / 2, max(2.5, min(5.0, bar_h / 2 + 1))
    marks = ""
    if failed or lost:
        ex = bx + bw
        marks += (
            f'<path d="M{_px(ex - size)} {_px(my - size)}L{_px(ex + size)} {_px(my + size)}'
            f'M{_px(ex - size)} {_px(my + size)}L{_px(ex + size)} {_px(my - size)}" stroke="{FAILED}" '
            f'stroke-width="2" class="mark-failed">{title}</path>'
        )
    if attempt > 0:
        marks += (
            f'<circle cx="{_px(bx)}" cy="{_px(my)}" r="{_px(size * 0.8)}" fill="#222" class="mark-retry">'
            f"{title}</circle>"
        )
    return bar + (_row_label(r, failed, lost, my) if c.layout.per_row else ""), marks


def _row_label(r: dict[str, Any], failed: bool, lost: bool, y: float) -> str:
    """The label left of an attempt's own row: its step, task and try, and whether it failed or was lost."""
    task, attempt = r.get("task"), r.get("attempt") or 0
    label = f"{r.get('step')}" + ("" if task is None else f" #{task}")
    label += f" try {attempt + 1}" if attempt else ""
    flag = " ✕ failed" if failed else " ✕ lost" if lost else ""
    return (
        f'<text x="{LABEL_W - 6}" y="{_px(y + 4)}" text-anchor="end"'
        f"{' fill=' + chr(34) + FAILED + chr(34) if flag else ''}>{escape(label[:40] + flag)}</text>"
    )


def _legend(c: _Chart, drawn: list[dict[str, Any]], step_names: list[str]) -> str:
    """The timeline's legend: each step's colour, then the failed, retried and lost attempts' marks."""
    failed = sum(r.get("outcome") == "failed" for r in drawn)
    retries = sum((r.get("attempt") or 0) > 0 for r in drawn)
    running = sum(r.get("outcome") == "running" for r in drawn)
    lost = f"✕ lost: no end recorded ({running:,})" if c.finished else "running (drawn to the last event)"
    key = [
        _swatch(f"background:#ccc;border:2px solid {FAILED}", f"✕ failed ({failed:,})"),
        _swatch(RETRY_SWATCH, f"● retry: attempt &gt; 0 ({retries:,})"),
    ] + [_swatch(f"background:#ccc;border:2px dashed {FAILED}", lost)] * bool(running)
    present = [n for n in step_names if n in c.by_step] + [n for n in c.by_step if n not in c.steps_order]
    legend = "".join(_swatch(f"background:{c.colour(n)}", escape(n)) for n in present)
    return f'<div class="legend">{legend}{"".join(key)}</div>'


def _swatch(style: str, text: str) -> str:
    """A legend's entry: a swatch drawn in ``style``, then its text."""
    return f'<span><i class="sw" style="{style}"></i>{text}</span>'


def _hbars(groups: list[tuple[str, list[tuple[str, float | None, str, str]]]], unit_fmt: Any) -> str:
    """Grouped horizontal bars: ``groups`` of ``(label, [(series, value, colour, text if no value)])``."""
    values = [v for _, series in groups for _, v, _, _ in series if isinstance(v, int | float)]
    top = max(values, default=0) or 1.0
    bar_h, gap = 14, 12
    rows = sum(len(s) for _, s in groups)
    height = rows * (bar_h + 3) + len(groups) * gap + 8
    width = LABEL_W + PLOT_W + 20
    plot = PLOT_W - 230  # room for the value's text
    svg = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}">']
    y = 6
    for label, series in groups:
        svg.append(
            f'<text x="{LABEL_W - 8}" y="{y + (len(series) * (bar_h + 3)) / 2 + 3}" text-anchor="end" '
            f'font-weight="600">{escape(str(label))[:60]}</text>'
        )
        for name, v, colour, missing in series:
            if isinstance(v, int | float):
                w = max(v / top * plot, 1.0 if v > 0 else 0.0)
                text = unit_fmt(v)
                svg.append(
                    f'<rect x="{LABEL_W}" y="{y}" width="{_px(w)}" height="{bar_h}" fill="{colour}">'
                    f"<title>{escape(f'{label}: {name} {text}')}</title></rect>"
                    f'<text x="{_px(LABEL_W + w + 6)}" y="{y + bar_h - 3}">'
                    f"{escape(name)} {escape(text)}</text>"
                )
            else:
                svg.append(
                    f'<text x="{LABEL_W + 6}" y="{y + bar_h - 3}" fill="#888">{escape(name)}: '
                    f"{escape(missing)}</text>"
                )
            y += bar_h + 3
        y += gap
    svg.append(f'<line x1="{LABEL_W}" y1="2" x2="{LABEL_W}" y2="{height - 4}" stroke="#888"/></svg>')
    return "".join(svg)


def _memory(doc: dict[str, Any]) -> str:
    """The memory chart: each step's projected peak, measured peak and the memory each of its tasks gets."""
    groups, shared = [], []
    for s in doc.get("steps") or []:
        plan, actual = s.get("plan") or {}, s.get("actual") or {}
        memory = s.get("memory_mb") or plan.get("memory_mb")
        missing = "withheld (private data)" if actual.get("withheld") else "not measured"
        worst = actual.get("worst_task")
        measured = "measured peak" + ("" if worst is None else f" (task {worst})")
        series = [
            ("projected peak", plan.get("peak_mb"), "#9ecae1", "no estimate"),
            (measured, actual.get("peak_mb"), "#3182bd", missing),
            ("memory the task gets", memory or None, "#bdbdbd", "unknown"),
        ]
        groups.append((s.get("name"), series))
        if "shared" in (actual.get("memory_scope") or []):
            shared.append(s.get("name"))
    head = "<h2>Memory per task (MiB)</h2>"
    if not groups:
        return head + '<p class="note">No steps.</p>'
    note = (
        f'<p class="note">The measured peak of {escape(", ".join(map(str, shared)))} covers a process '
        "shared with other tasks.</p>"
    )
    return head + _hbars(groups, lambda v: f"{v:,.0f} MiB") + (note if shared else "")


def _cost(doc: dict[str, Any]) -> str:
    cost = doc.get("cost") or {}
    plan, actual = cost.get("plan") or {}, cost.get("actual") or {}
    keys = [k for k in actual if k != "total"] + [k for k in plan if k not in actual and k != "total"]
    groups = [
        (k, [("plan", plan.get(k), "#fdae6b", "none"), ("actual", actual.get(k), "#e6550d", "-")])
        for k in keys
    ]
    rows = "".join(
        f"<tr><td>{escape(str(k))}</td><td>{_usd(plan.get(k))}</td><td>{_usd(actual.get(k))}</td></tr>"
        for k in keys + ["total"]
    )
    chart = _hbars(groups, lambda v: f"${v:.6f}" if v == 0 or v >= 1e-4 else f"${v:.3g}")
    transitions = cost.get("transitions")
    return (
        "<h2>Cost (USD, list prices)</h2>"
        + (chart if groups else '<p class="note">No cost figures.</p>')
        + f"<table><tr><th>component</th><th>plan</th><th>actual</th></tr>{rows}</table>"
        + (
            ""
            if transitions is None
            else f'<p class="note">{_num(transitions, ",")} Step Functions state transitions.</p>'
        )
    )


def _tables(doc: dict[str, Any]) -> str:
    out = ["<h2>Steps</h2>"]
    try:
        found = tables(doc)
    except (KeyError, TypeError, AttributeError) as exc:  # a document too incomplete for the CLI's layout
        return out[0] + f'<p class="note">Step tables unavailable: {escape(str(exc))}</p>'
    for t in found:
        head = "".join(f"<th>{escape(str(c))}</th>" for c in t.columns)
        body = "".join("<tr>" + "".join(f"<td>{_e(v)}</td>" for v in row) + "</tr>" for row in t.rows)
        if not t.rows:
            body = f'<tr><td colspan="{len(t.columns)}" class="note">none</td></tr>'
        out.append(f"<h3>{escape(t.title)}</h3><table><tr>{head}</tr>{body}</table>")
    notes = []
    for s in doc.get("steps") or []:
        a = s.get("actual") or {}
        bits = []
        if a.get("failed"):
            bits.append(f"{a['failed']:,} failed")
        if a.get("lost"):
            bits.append(f"{a['lost']:,} lost (no end recorded)")
        if a.get("max_duration_s") is not None:
            bits.append(f"slowest task {_e(a.get('slowest_task'))}: {a['max_duration_s']:,.2f} s")
        if a.get("withheld"):
            bits.append("figures withheld (private data)")
        if bits:
            notes.append(f"<li>{escape(str(s.get('name')))}: {escape('; '.join(bits))}</li>")
    if notes:
        out.append(f'<ul class="note">{"".join(notes)}</ul>')
    return "\n".join(out)


def _reasons(doc: dict[str, Any]) -> str:
    reasons = doc.get("interpretability") or []
    if not reasons:
        return '<h2>The estimator\'s reasons</h2><p class="note">None recorded (no estimate).</p>'
    items = "".join(f"<li>{escape(str(r))}</li>" for r in reasons)
    return f'<h2>The estimator\'s reasons</h2><ul class="why">{items}</ul>'


def render(doc: dict[str, Any]) -> str:
    """The report document as one self-contained HTML page (see the module doc)."""
    step_names = [str(s.get("name")) for s in doc.get("steps") or []]
    for r in doc.get("records") or []:
        if str(r.get("step")) not in step_names:
            step_names.append(str(r.get("step")))
    title = f"shardfold report: {doc.get('job_id') or '-'}"
    sections = [
        _header(doc),
        _timeline(doc, step_names),
        _memory(doc),
        _cost(doc),
        _tables(doc),
        _reasons(doc),
    ]
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head>\n<body>\n"
        + "\n".join(sections)
        + '\n<p class="note">Generated by <code>shardfold report --html</code>.</p>\n</body></html>\n'
    )
