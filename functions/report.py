"""A job's report: what it did against what its plan said, from its telemetry records (``shardfold report``).

Pure: :func:`build` takes the estimate the job was admitted with (``jobs/<id>/estimate.json``, written at
submit), the job's telemetry records (:mod:`functions.telemetry`) and its status, and returns a JSON
document:

* ``steps``: per workflow step, plan against actual, in the columns ``shardfold plan`` prints (tasks, peak
  memory per task against the memory it gets, GET- and PUT-class requests, seconds per task, GB-s), with
  the attempts, failures, the worst task's peak and duration;
* ``cost``: actual cost at the deployed prices, by the formula of :func:`actual_cost` over the records
  (Lambda GB-s of each attempt at its step's memory, billed per millisecond; a request per attempt; S3
  requests by class; Step Functions transitions; Batch instance time), beside the plan's;
* the five dimensions of the BatchBench protocol for batch jobs: ``cost``; ``sla`` (against the spec's
  optional ``deadline_s``); ``responsiveness`` (submit → first task running → first task done after the
  first step); ``scaling`` (how many tasks ran at once over time against what the plan allows: per Map
  step, the task slots left idle while its work waited, and how often the running count changed
  direction: thrash); ``interpretability`` (the estimator's reasons, in words);
* ``tasks``: one row per attempt (for the timeline).

Records of private steps (dpquery's reading of the rows) carry no figures; the report counts their tasks
and says their figures are withheld.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import defaultdict
from typing import Any

from shardfold.functions import pricing
from shardfold.functions.tables import Table

# S3 request classes, as S3 bills them (https://aws.amazon.com/s3/pricing/); DELETE is free.
PUT_CLASS = frozenset(
    {"PUT", "COPY", "LIST", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload", "POST"}
)
FREE = frozenset({"DELETE", "AbortMultipartUpload"})
STEP_COLUMNS = ["step", "tasks", "MiB peak/mem", "GET", "PUT", "s/task", "GB-s"]


def requests_by_class(requests: dict[str, int]) -> tuple[int, int]:
    """``(GET-class, PUT-class)`` request counts of a record's ``requests``."""
    put = sum(n for op, n in requests.items() if op in PUT_CLASS)
    get = sum(n for op, n in requests.items() if op not in PUT_CLASS and op not in FREE)
    return get, put


def billed_s(duration_s: float) -> float:
    """Lambda's billed duration: rounded up to the millisecond."""
    return max(pricing.LAMBDA_MIN_BILLED_S, math.ceil(duration_s * 1000 - 1e-9) / 1000)


def task_gb_s(r: dict[str, Any], memory_mb: int) -> float:
    """A Lambda attempt's GB-s: Lambda's own billed duration and memory size where its REPORT line was found
    (:func:`functions.telemetry.with_lambda_reports`), else its measured duration, rounded up to the
    millisecond, at its step's memory."""
    if r.get("billed_duration_s") is not None:
        return int(r.get("memory_size_mb") or memory_mb) / 1024 * r["billed_duration_s"]
    return memory_mb / 1024 * billed_s(r["duration_s"])


def _peak(r: dict[str, Any]) -> float | None:
    """An attempt's peak: Lambda's Max Memory Used where known, else the process's measured peak."""
    used = r.get("max_memory_used_mib")
    return used if used is not None else r.get("peak_memory_mib")


def _measured(r: dict[str, Any]) -> bool:
    return not r.get("withheld") and r.get("duration_s") is not None


def actual_cost(
    records: list[dict[str, Any]],
    memory_mb: dict[str, int],
    batch_steps: set[str],
    transitions: int,
    architecture: str | None = None,
) -> dict[str, float]:
    """The job's cost at list prices from its records: ``memory_mb`` per step (what its tasks get),
    ``batch_steps`` (priced as GPU instance time, not Lambda), ``transitions`` (Step Functions)."""
    rate = pricing.lambda_usd_per_gb_s(architecture)
    lambda_gb_s = batch_s = 0.0
    lambda_requests = gets = puts = 0
    for r in records:
        if r["step"] in batch_steps:
            batch_s += r.get("duration_s") or 0.0
        else:
            lambda_requests += 1
            if _measured(r):
                lambda_gb_s += task_gb_s(r, memory_mb.get(r["step"], 0))
        g, p = requests_by_class(r.get("requests") or {})
        gets, puts = gets + g, puts + p
    cost = {
        "lambda_compute": lambda_gb_s * rate,
        "lambda_requests": lambda_requests * pricing.LAMBDA_USD_PER_REQUEST,
        "s3_get": gets * pricing.S3_USD_PER_GET,
        "s3_put": puts * pricing.S3_USD_PER_PUT,
        "step_functions": transitions * pricing.SFN_USD_PER_TRANSITION,
    }
    if batch_steps:
        cost["batch_gpu_instances"] = batch_s / 3600 * pricing.BATCH_GPU_USD_PER_HOUR
    cost["total"] = sum(cost.values())
    return cost


def _transitions(estimate: dict[str, Any], tasks: dict[str, int], attempts: int) -> int:
    """The plan's transitions with each step's planned task count replaced by the actual one (a Map child
    enters each of its body's states once), plus one per extra attempt (a retry enters its state again)."""
    total = int(estimate.get("transitions") or 0)
    for s in estimate.get("steps", []):
        total += tasks.get(s["name"], 0) - int(s["tasks"])
    return max(total, 0) + attempts


def _running_series(records: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """``(time, tasks running from then on)`` at each start and end."""
    events = []
    for r in records:
        if _measured(r):
            events += [(r["started_at"], 1), (r["ended_at"], -1)]
    series, running = [], 0
    for t, d in sorted(events, key=lambda e: (e[0], e[1])):
        running += d
        series.append((t, running))
    return series


def shortfall(records: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """How the running tasks of one step strayed from what it allows: at each moment the step may run
    ``min(limit, running + not yet started)`` tasks; ``task_s`` is the shortfall integrated over time (task
    slots left idle while work waited), ``mean`` that over the step's span, ``peak`` the most that ran."""
    spans = [(r["started_at"], r["ended_at"]) for r in records if _measured(r)]
    if not spans:
        return {"allowed": limit, "peak": 0, "task_s": 0.0, "mean": 0.0}
    starts, ends = sorted(a for a, _ in spans), sorted(b for _, b in spans)
    times = sorted({*starts, *ends})
    idle = peak = 0.0
    for t, nxt in zip(times, times[1:], strict=False):
        started = bisect.bisect_right(starts, t)
        running = started - bisect.bisect_right(ends, t)
        waiting = len(starts) - started
        peak = max(peak, running)
        idle += (min(limit, running + waiting) - running) * (nxt - t)
    span = times[-1] - times[0]
    return {"allowed": limit, "peak": int(peak), "task_s": idle, "mean": idle / span if span > 0 else 0.0}


def _reversals(series: list[tuple[float, int]]) -> int:
    """How often the running count changed direction (up then down, or down then up)."""
    last_dir, turns, prev = 0, 0, None
    for _, n in series:
        if prev is not None and n != prev:
            d = 1 if n > prev else -1
            if last_dir and d != last_dir:
                turns += 1
            last_dir = d
        prev = n
    return turns


def build(
    estimate: dict[str, Any] | None,
    records: list[dict[str, Any]],
    status: dict[str, Any],
    *,
    batch_steps: set[str],
    allowed: dict[str, int] | None = None,
    deadline_s: float | None = None,
    submitted_at: float | None = None,
) -> dict[str, Any]:
    """The report document (see the module doc). ``allowed``: how many tasks of each step may run at once
    (its Map's max concurrency, or what the executor runs at once); ``submitted_at``: epoch seconds."""
    estimate = estimate or {"steps": [], "cost_usd": {}, "transitions": 0, "notes": []}
    planned = {s["name"]: s for s in estimate["steps"]}
    by_step: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_step[r["step"]].append(r)
    order = [s["name"] for s in estimate["steps"]] + sorted(set(by_step) - set(planned))
    memory = {name: int(s.get("memory_mb") or 0) for name, s in planned.items()}

    steps = []
    for name in order:
        rs, plan = by_step.get(name, []), planned.get(name)
        measured = [r for r in rs if _measured(r)]
        last = {}
        for r in rs:  # the latest attempt of each task says how it ended
            key = r.get("task")
            if key not in last or (r.get("attempt") or 0) >= (last[key].get("attempt") or 0):
                last[key] = r
        peaks = [r for r in measured if _peak(r) is not None]
        worst = max(peaks, key=_peak, default=None)
        slowest = max(measured, key=lambda r: r["duration_s"], default=None)
        gets = puts = 0
        for r in rs:
            g, p = requests_by_class(r.get("requests") or {})
            gets, puts = gets + g, puts + p
        durations = [r["duration_s"] for r in measured]
        actual = {
            "tasks": len(last),
            "attempts": len(rs),
            "failed": sum(1 for r in last.values() if r.get("outcome") == "failed"),
            "lost": sum(1 for r in last.values() if r.get("outcome") == "running"),
            "peak_mb": _peak(worst) if worst else None,
            "worst_task": worst.get("task") if worst else None,
            "memory_scope": sorted({r.get("memory_scope") for r in peaks if r.get("memory_scope")}),
            "gets": gets,
            "puts": puts,
            "duration_s": statistics.median(durations) if durations else None,
            "max_duration_s": slowest["duration_s"] if slowest else None,
            "slowest_task": slowest.get("task") if slowest else None,
            "gb_s": 0.0 if name in batch_steps else sum(task_gb_s(r, memory.get(name, 0)) for r in measured),
            "instance_s": sum(r["duration_s"] for r in measured) if name in batch_steps else 0.0,
            "withheld": any(r.get("withheld") for r in rs),
        }
        steps.append({"name": name, "memory_mb": memory.get(name), "plan": plan, "actual": actual})

    tasks_per_step = {s["name"]: s["actual"]["tasks"] for s in steps}
    extra = sum(max(0, s["actual"]["attempts"] - s["actual"]["tasks"]) for s in steps)
    transitions = _transitions(estimate, tasks_per_step, extra)
    cost = actual_cost(records, memory, batch_steps, transitions, estimate.get("architecture"))

    timed = [r for r in records if _measured(r)]
    first_start = min((r["started_at"] for r in timed), default=None)
    first_step = estimate["steps"][0]["name"] if estimate["steps"] else None
    later_done = [r["ended_at"] for r in timed if r["outcome"] == "succeeded" and r["step"] != first_step]
    ended = max((r["ended_at"] for r in timed), default=None)
    start = submitted_at if submitted_at is not None else first_start
    elapsed = (ended - start) if (ended is not None and start is not None) else None
    series = _running_series(records)
    peak_running = max((n for _, n in series), default=0)
    span = (series[-1][0] - series[0][0]) if len(series) > 1 else 0.0
    turns = _reversals(series)

    return {
        "job_id": status.get("job_id"),
        "kind": status.get("kind"),
        "state": status.get("state"),
        "error": status.get("error"),
        "tasks": sum(s["actual"]["tasks"] for s in steps),
        "attempts": len(records),
        "steps": steps,
        "cost": {"actual": cost, "plan": estimate.get("cost_usd", {}), "transitions": transitions},
        "sla": {
            "deadline_s": deadline_s,
            "elapsed_s": elapsed,
            "met": None if deadline_s is None or elapsed is None else elapsed <= deadline_s,
        },
        "responsiveness": {
            "first_task_s": None if start is None or first_start is None else first_start - start,
            "first_result_s": None if start is None or not later_done else min(later_done) - start,
        },
        "scaling": {
            "peak_running": peak_running,
            "allowed": allowed or {},
            "reversals": turns,
            "span_s": span,
            "steps": {name: shortfall(by_step.get(name, []), n) for name, n in (allowed or {}).items()},
        },
        "interpretability": [f"{s['name']}: {s['why']}" for s in estimate["steps"] if s.get("why")]
        + list(estimate.get("notes", [])),
        "records": [
            {
                k: r.get(k)
                for k in (
                    "step",
                    "task",
                    "attempt",
                    "outcome",
                    "started_at",
                    "ended_at",
                    "duration_s",
                    "peak_memory_mib",
                    "error",
                )
            }
            for r in records
        ],
    }


def _fmt(v: Any, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v, spec)


def step_row(
    name: str, tasks: int, peak_mb: float | None, memory_mb: int | None, figures: dict[str, Any]
) -> list[Any]:
    """One row of :data:`STEP_COLUMNS`, the layout ``shardfold plan`` and ``shardfold report`` share."""
    batch_s = figures.get("instance_s") or 0.0
    return [
        name,
        f"{tasks:,}",
        f"{_fmt(peak_mb)}/{_fmt(memory_mb)}",
        _fmt(figures.get("gets")),
        _fmt(figures.get("puts")),
        _fmt(figures.get("duration_s"), ".2f"),
        f"EC2 {batch_s:,.0f} s" if batch_s else _fmt(figures.get("gb_s"), ",.2f"),
    ]


def tables(doc: dict[str, Any]) -> list[Table]:
    """The report's plan and actual step tables (one layout), and its cost table."""
    plan_rows, actual_rows = [], []
    for s in doc["steps"]:
        p, a = s["plan"], s["actual"]
        if p:
            figures = {k: p.get(k) for k in ("gets", "puts", "duration_s", "gb_s", "instance_s")}
            plan_rows.append(step_row(s["name"], p["tasks"], p["peak_mb"], p["memory_mb"], figures))
        figures = {k: a[k] for k in ("gets", "puts", "duration_s", "gb_s", "instance_s")}
        if a["withheld"]:
            figures = {k: None for k in figures}
        actual_rows.append(step_row(s["name"], a["tasks"], a["peak_mb"], s["memory_mb"], figures))
    cost_rows = [
        [k, f"{doc['cost']['plan'].get(k, 0.0):.6f}", f"{v:.6f}"] for k, v in doc["cost"]["actual"].items()
    ]
    return [
        Table("plan (at submit)", STEP_COLUMNS, plan_rows),
        Table("actual", STEP_COLUMNS, actual_rows),
        Table("cost (USD, us-east-1 list prices)", ["component", "plan", "actual"], cost_rows),
    ]


def for_job(
    store_root: str, job_id: str, status: dict[str, Any], default_concurrency: int | None = None
) -> dict[str, Any]:
    """:func:`build` for a job in the store: its admitted estimate, records, spec deadline and workflow.
    ``default_concurrency``: how many children of a Map without ``max_concurrency`` the backend runs at
    once (None: no limit, as on AWS)."""
    from shardfold.functions import kinds, store, telemetry
    from shardfold.functions.jobs import job_key
    from shardfold.functions.store.uri import join
    from shardfold.functions.workflow import BatchJob, Map

    kind = kinds.find(status["kind"])
    estimate_uri = join(store_root, job_key(job_id, "estimate.json"))
    estimate = store.get_json(estimate_uri) if store.exists(estimate_uri) else None
    spec = store.get_json(join(store_root, job_key(job_id, "spec.json")))
    allowed: dict[str, int] = {}
    for step in kind.workflow.walk():
        if isinstance(step, Map):
            limit = step.max_concurrency or default_concurrency
            for inner in step.body:
                if limit:
                    allowed[inner.name] = limit
    return build(
        estimate,
        telemetry.with_lambda_reports(telemetry.read_records(store_root, job_id)),
        status,
        batch_steps={s.name for s in kind.workflow.walk() if isinstance(s, BatchJob)},
        allowed=allowed,
        deadline_s=spec.get("deadline_s"),
        submitted_at=(estimate or {}).get("submitted_at"),
    )
