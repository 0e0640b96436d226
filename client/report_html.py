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


def _colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


# --- sections -----------------------------------------------------------------------------------------------


def _header(doc: dict[str, Any]) -> str:
    state = doc.get("state")
    state_class = (
        state if state in ("SUCCEEDED", "FAILED", "RUNNING", "CANCELLED", "INTERRUPTED") else "other"
    )
    rows: list[tuple[str, str]] = [
        ("job", _e(doc.get("job_id"))),
        ("kind", _e(doc.get("kind"))),
        ("state", f'<span class="state {state_class}">{_e(state)}</span>'),
    ]
    error = _error_text(doc.get("error"))
    if error:
        rows.append(("error", f'<span class="error">{escape(error)}</span>'))
    tasks, attempts = doc.get("tasks"), doc.get("attempts")
    rows.append(("tasks", f"{_num(tasks, ',')} tasks ({_num(attempts, ',')} attempts)"))
    cost = doc.get("cost") or {}
    actual, plan = (cost.get("actual") or {}).get("total"), (cost.get("plan") or {}).get("total")
    rows.append(("cost", f"{_usd(actual)} actual, {_usd(plan) if plan is not None else 'no plan'} planned"))
    sla = doc.get("sla") or {}
    elapsed, deadline, met = sla.get("elapsed_s"), sla.get("deadline_s"), sla.get("met")
    text = f"{_num(elapsed, ',.2f', ' s')} elapsed"
    if deadline is not None:
        text += f" of a {_num(deadline, ',.6g', ' s')} deadline"
    if met is True:
        text += ' <span class="ok">SLA met</span>'
    elif met is False:
        text += ' <span class="bad">SLA missed</span>'
    else:
        text += ' <span class="note">(no deadline_s in the spec)</span>' if deadline is None else ""
    rows.append(("elapsed", text))
    r = doc.get("responsiveness") or {}
    rows.append(
        (
            "responsiveness",
            f"first task ran after {_num(r.get('first_task_s'), ',.2f', ' s')}, "
            f"first result after {_num(r.get('first_result_s'), ',.2f', ' s')}",
        )
    )
    sc = doc.get("scaling") or {}
    allowed = sc.get("allowed") or {}
    limits = ", ".join(f"{escape(str(k))} ≤ {_num(v, ',')}" for k, v in allowed.items())
    rows.append(
        (
            "scaling",
            f"at most {_num(sc.get('peak_running'), ',')} tasks at once"
            + (f" (allowed: {limits})" if limits else "")
            + f"; the count changed direction {_num(sc.get('reversals'), ',')} times"
            + (f" over {_num(sc.get('span_s'), ',.2f', ' s')}" if sc.get("span_s") else ""),
        )
    )
    for name, st in (sc.get("steps") or {}).items():
        if st.get("peak"):
            rows.append(
                (
                    f"&nbsp;&nbsp;{_e(name)}",
                    f"{_num(st.get('peak'), ',')} of {_num(st.get('allowed'), ',')} allowed at most; "
                    f"{_num(st.get('task_s'), ',.2f')} task-s of idle slots while work waited",
                )
            )
    body = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows)
    return f'<h1>Job {_e(doc.get("job_id"))}</h1>\n<table class="kv">{body}</table>'


def _lanes(records: list[dict[str, Any]], end: dict[int, float]) -> list[int]:
    """First-fit lanes for ``records`` (sorted by start): the lane each takes; ``end`` maps record index to
    its drawn end."""
    free: list[tuple[float, int]] = []  # (free from, lane)
    spare: list[int] = []  # lanes free now, smallest first
    lanes_used = 0
    out = []
    for i, r in enumerate(records):
        start = r["started_at"]
        while free and free[0][0] <= start:
            heapq.heappush(spare, heapq.heappop(free)[1])
        if spare:
            lane = heapq.heappop(spare)
        else:
            lane, lanes_used = lanes_used, lanes_used + 1
        out.append(lane)
        heapq.heappush(free, (end[i], lane))
    return out


def _timeline(doc: dict[str, Any], step_names: list[str]) -> str:
    records = doc.get("records") or []
    drawn = [r for r in records if isinstance(r.get("started_at"), int | float)]
    withheld = len(records) - len(drawn)
    parts = ["<h2>Timeline</h2>"]
    notes = []
    if withheld:
        steps = sorted(
            {str(r.get("step")) for r in records if not isinstance(r.get("started_at"), int | float)}
        )
        notes.append(
            f"{withheld:,} attempt(s) not drawn: their figures are withheld (private data; "
            f"step {escape(', '.join(steps))})."
        )
    if not drawn:
        notes.append("No timed task attempts to draw.")
        return "\n".join(parts + [f'<p class="note">{n}</p>' for n in notes])

    finished = doc.get("state") not in UNFINISHED
    t0 = min(r["started_at"] for r in drawn)
    t_last = max(
        max((r["ended_at"] for r in drawn if isinstance(r.get("ended_at"), int | float)), default=t0),
        max(r["started_at"] for r in drawn),
    )
    span = max(t_last - t0, 1e-3)
    open_end = span  # where an attempt with no end is drawn to

    steps_order = {n: i for i, n in enumerate(step_names)}
    drawn.sort(key=lambda r: (steps_order.get(str(r.get("step")), len(steps_order)), r["started_at"]))
    by_step: dict[str, list[dict[str, Any]]] = {}
    for r in drawn:
        by_step.setdefault(str(r.get("step")), []).append(r)

    def end_of(r: dict[str, Any]) -> float:
        e = r.get("ended_at")
        return (e - t0) if isinstance(e, int | float) else open_end

    # rows: one per attempt for small jobs, else first-fit lanes per step, folded past LANE_LIMIT
    per_row = len(drawn) <= ROW_LIMIT
    placed: list[tuple[dict[str, Any], int]] = []  # (record, row)
    bands: list[tuple[str, int, int]] = []  # (step, first row, rows)
    row = 0
    folded = False
    if per_row:
        for name, rs in by_step.items():
            bands.append((name, row, len(rs)))
            for r in rs:
                placed.append((r, row))
                row += 1
    else:
        lanes_of = {}
        for name, rs in by_step.items():
            rs.sort(key=lambda r: r["started_at"])
            # an attempt holds its lane for at least a 2000th of the span, so bars of no length do not pile up
            ends = {i: t0 + max(end_of(r), r["started_at"] - t0 + span / 2000) for i, r in enumerate(rs)}
            lanes_of[name] = _lanes(rs, ends)
        total = sum(max(ls) + 1 for ls in lanes_of.values())
        folded = total > LANE_LIMIT
        used = {}  # step -> rows its bars take (its lanes, folded past LANE_LIMIT)
        for name in by_step:
            n = max(lanes_of[name]) + 1
            used[name] = min(n, max(MIN_BAND_ROWS, math.floor(n * LANE_LIMIT / total))) if folded else n
        row_h = max(2.0, min(12.0, 560 / sum(used.values())))
        for name, rs in by_step.items():
            bands.append((name, row, max(used[name], math.ceil(14 / row_h))))  # room for the step's name
            for r, lane in zip(rs, lanes_of[name], strict=True):
                placed.append((r, row + lane % used[name]))
            row += bands[-1][2]
        if folded:
            notes.append(
                f"{total:,} lanes folded onto {sum(used.values()):,} rows: bars overlap "
                "(drawn translucent, darker where they do)."
            )
    n_rows = row
    if per_row:
        row_h = 16.0
    bar_h = row_h - (4 if row_h >= 8 else 1 if row_h >= 3 else 0)
    top, axis_h = 8, 26
    height = top + n_rows * row_h + axis_h
    width = LABEL_W + PLOT_W + 20
    scale = PLOT_W / span

    def x(t: float) -> float:
        return LABEL_W + t * scale

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
    for i, (name, first, rows) in enumerate(bands):
        y = top + first * row_h
        if i % 2:
            svg.append(
                f'<rect x="0" y="{_px(y)}" width="{width}" height="{_px(rows * row_h)}" fill="#f6f6f6"/>'
            )
        if not per_row:
            svg.append(f'<text x="4" y="{_px(y + 11)}">{escape(str(name))} ({len(by_step[name]):,})</text>')
    # grid and axis
    step = _nice_step(span)
    axis_y = top + n_rows * row_h
    t = 0.0
    while t <= span + 1e-9:
        gx = x(t)
        svg.append(f'<line x1="{_px(gx)}" y1="{top}" x2="{_px(gx)}" y2="{_px(axis_y)}" stroke="#e2e2e2"/>')
        svg.append(f'<text x="{_px(gx)}" y="{_px(axis_y + 14)}" text-anchor="middle">{t:g}</text>')
        t = round(t + step, 10)
    svg.append(
        f'<line x1="{LABEL_W}" y1="{_px(axis_y)}" x2="{LABEL_W + PLOT_W}" y2="{_px(axis_y)}" stroke="#888"/>'
        f'<text x="{LABEL_W + PLOT_W}" y="{_px(axis_y + 25)}" text-anchor="end">seconds since the first task '
        "started</text>"
    )
    opacity = ' fill-opacity="0.6"' if folded else ""
    marks = []
    counts = {"failed": 0, "retry": 0, "lost": 0}
    for r, rw in placed:
        s0 = r["started_at"] - t0
        s1 = end_of(r)
        bx, bw = x(s0), max(s1 - s0, 0) * scale
        bw = max(bw - (0 if per_row else 1), 1.5)  # packed bars one after another keep a gap
        y = top + rw * row_h + (row_h - bar_h) / 2
        colour = _colour(steps_order.get(str(r.get("step")), len(steps_order)))
        outcome = r.get("outcome")
        attempt = r.get("attempt") or 0
        ended = isinstance(r.get("ended_at"), int | float)
        lost = outcome == "running" and finished
        failed = outcome == "failed"
        status = "lost (killed: no end recorded)" if lost else outcome or "-"
        if outcome == "running" and not finished:
            status = "running"
        task = r.get("task")
        tip = [
            f"step {r.get('step')}",
            f"task {'-' if task is None else task}, attempt {attempt}" + (" (retry)" if attempt else ""),
            f"outcome {status}",
            f"duration {_num(r.get('duration_s'), ',.3f', ' s')}"
            + ("" if ended else " (still running or killed)"),
            f"started at +{s0:,.3f} s",
            f"peak {_num(r.get('peak_memory_mib'), ',.1f', ' MiB')}",
        ]
        error = _error_text(r.get("error"))
        if error:
            tip.append(f"error {error[:500]}")
        stroke = ""
        if failed or lost:
            stroke = f' stroke="{FAILED}" stroke-width="{1.5 if bar_h >= 4 else 1}"'
            if lost:
                stroke += ' stroke-dasharray="3 2"'
        cls = " ".join(
            c
            for c, on in (("failed", failed), ("retry", attempt > 0), ("lost", lost), ("attempt", True))
            if on
        )
        title = f"<title>{escape(chr(10).join(tip))}</title>"
        svg.append(
            f'<g class="{cls}"><rect x="{_px(bx)}" y="{_px(y)}" width="{_px(bw)}" height="{_px(bar_h)}" '
            f'fill="{colour}"{opacity}{stroke}/>'
            + (
                f'<rect x="{_px(bx)}" y="{_px(y)}" width="{_px(bw)}" height="{_px(bar_h)}" '
                'fill="url(#hatch)"/>'
                if attempt > 0
                else ""
            )
            + f"{title}</g>"
        )
        counts["failed"] += failed
        counts["retry"] += attempt > 0
        counts["lost"] += lost
        # markers: a red cross at a failed attempt's end, a dark dot at a retry's start
        my = y + bar_h / 2
        size = max(2.5, min(5.0, bar_h / 2 + 1))
        if failed or lost:
            ex = bx + bw
            marks.append(
                f'<path d="M{_px(ex - size)} {_px(my - size)}L{_px(ex + size)} {_px(my + size)}'
                f'M{_px(ex - size)} {_px(my + size)}L{_px(ex + size)} {_px(my - size)}" stroke="{FAILED}" '
                f'stroke-width="2" class="mark-failed">{title}</path>'
            )
        if attempt > 0:
            marks.append(
                f'<circle cx="{_px(bx)}" cy="{_px(my)}" r="{_px(size * 0.8)}" fill="#222" class="mark-retry">'
                f"{title}</circle>"
            )
        if per_row:
            label = f"{r.get('step')}" + ("" if task is None else f" #{task}")
            label += f" try {attempt + 1}" if attempt else ""
            flag = " ✕ failed" if failed else " ✕ lost" if lost else ""
            svg.append(
                f'<text x="{LABEL_W - 6}" y="{_px(my + 4)}" text-anchor="end"'
                f"{' fill=' + chr(34) + FAILED + chr(34) if flag else ''}>{escape(label[:40] + flag)}</text>"
            )
    svg += marks
    svg.append("</svg>")
    key = [
        f'<span><i class="sw" style="background:#ccc;border:2px solid {FAILED}"></i>✕ failed '
        f"({counts['failed']:,})</span>",
        '<span><i class="sw" style="background:'
        'repeating-linear-gradient(45deg,#ccc 0 2px,#666 2px 4px)"></i>'
        f"● retry: attempt &gt; 0 ({counts['retry']:,})</span>",
    ]
    if counts["lost"] or any(r.get("outcome") == "running" for r in drawn):
        key.append(
            f'<span><i class="sw" style="background:#ccc;border:2px dashed {FAILED}"></i>'
            + (
                f"✕ lost: no end recorded ({counts['lost']:,})"
                if finished
                else "running (drawn to the last event)"
            )
            + "</span>"
        )
    present = [n for n in step_names if n in by_step] + [n for n in by_step if n not in steps_order]
    legend = "".join(
        f'<span><i class="sw" style="background:{_colour(steps_order.get(n, len(steps_order)))}"></i>'
        f"{escape(n)}</span>"
        for n in present
    )
    parts.append(f'<div class="legend">{legend}{"".join(key)}</div>')
    parts.append(
        f'<p class="note">{len(drawn):,} attempt(s) drawn over {span:,.2f} s'
        + ("" if per_row else f", packed into {n_rows:,} row(s) by step")
        + "; hover a bar for its step, task, attempt, duration, peak memory and error.</p>"
    )
    parts.append("".join(svg))
    parts += [f'<p class="note">{n}</p>' for n in notes]
    return "\n".join(parts)


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
    groups = []
    for s in doc.get("steps") or []:
        plan, actual = s.get("plan") or {}, s.get("actual") or {}
        memory = s.get("memory_mb") or plan.get("memory_mb")
        measured_missing = "withheld (private data)" if actual.get("withheld") else "not measured"
        worst = actual.get("worst_task")
        groups.append(
            (
                s.get("name"),
                [
                    ("projected peak", plan.get("peak_mb"), "#9ecae1", "no estimate"),
                    (
                        "measured peak" + ("" if worst is None else f" (task {worst})"),
                        actual.get("peak_mb"),
                        "#3182bd",
                        measured_missing,
                    ),
                    ("memory the task gets", memory or None, "#bdbdbd", "unknown"),
                ],
            )
        )
    head = "<h2>Memory per task (MiB)</h2>"
    if not groups:
        return head + '<p class="note">No steps.</p>'
    shared = [
        s.get("name")
        for s in doc.get("steps") or []
        if "shared" in ((s.get("actual") or {}).get("memory_scope") or [])
    ]
    note = (
        f'<p class="note">The measured peak of {escape(", ".join(map(str, shared)))} covers a process '
        "shared with other tasks.</p>"
        if shared
        else ""
    )
    return head + _hbars(groups, lambda v: f"{v:,.0f} MiB") + note


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
    transitions = cost.get("transitions")
    return (
        "<h2>Cost (USD, list prices)</h2>"
        + (
            _hbars(groups, lambda v: f"${v:.6f}" if v == 0 or v >= 1e-4 else f"${v:.3g}")
            if groups
            else '<p class="note">No cost figures.</p>'
        )
        + f"<table><tr><th>component</th><th>plan</th><th>actual</th></tr>{rows}</table>"
        + (
            f'<p class="note">{_num(transitions, ",")} Step Functions state transitions.</p>'
            if transitions is not None
            else ""
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
