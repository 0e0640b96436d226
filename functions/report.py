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
Doc = dict[str, Any]  # a record, an estimate, a part of the report


def requests_by_class(requests: dict[str, int]) -> tuple[int, int]:
    """``(GET-class, PUT-class)`` request counts of a record's ``requests``."""
    put = sum(n for op, n in requests.items() if op in PUT_CLASS)
    get = sum(n for op, n in requests.items() if op not in PUT_CLASS and op not in FREE)
    return get, put


def _request_totals(records: list[Doc]) -> tuple[int, int]:
    """``(GET-class, PUT-class)`` request counts of ``records`` together."""
    pairs = [requests_by_class(r.get("requests") or {}) for r in records]
    return sum(g for g, _ in pairs), sum(p for _, p in pairs)


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
    lambda_requests = 0
    for r in records:
        if r["step"] in batch_steps:
            batch_s += r.get("duration_s") or 0.0
        else:
            lambda_requests += 1
            if _measured(r):
                lambda_gb_s += task_gb_s(r, memory_mb.get(r["step"], 0))
    gets, puts = _request_totals(records)
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


RECORD_FIELDS = (
    "step", "task", "attempt", "outcome", "started_at", "ended_at", "duration_s", "peak_memory_mib", "error",
)  # fmt: skip  # a ``tasks`` row: what the timeline draws of an attempt


def _latest_attempts(rs: list[Doc]) -> dict[Any, Doc]:
    """Each task's latest attempt, which says how it ended."""
    last: dict[Any, Doc] = {}
    for r in rs:
        key = r.get("task")
        if key not in last or (r.get("attempt") or 0) >= (last[key].get("attempt") or 0):
            last[key] = r
    return last


def _step(name: str, rs: list[Doc], plan: Doc | None, memory_mb: int | None, batch: bool) -> Doc:
    """One step's entry: its plan and its actual figures from the records ``rs`` of its attempts
    (``memory_mb``: what each of its tasks gets)."""
    measured = [r for r in rs if _measured(r)]
    last = _latest_attempts(rs).values()
    peaks = [r for r in measured if _peak(r) is not None]
    worst = max(peaks, key=_peak, default=None) or {}
    slowest = max(measured, key=lambda r: r["duration_s"], default=None) or {}
    gets, puts = _request_totals(rs)
    durations = [r["duration_s"] for r in measured]
    actual = {
        "tasks": len(last),
        "attempts": len(rs),
        "failed": sum(r.get("outcome") == "failed" for r in last),
        "lost": sum(r.get("outcome") == "running" for r in last),
        "peak_mb": _peak(worst),
        "worst_task": worst.get("task"),
        "memory_scope": sorted({r.get("memory_scope") for r in peaks if r.get("memory_scope")}),
        "gets": gets,
        "puts": puts,
        "duration_s": statistics.median(durations) if durations else None,
        "max_duration_s": slowest.get("duration_s"),
        "slowest_task": slowest.get("task"),
        "gb_s": 0.0 if batch else sum(task_gb_s(r, memory_mb or 0) for r in measured),
        "instance_s": sum(durations) if batch else 0.0,
        "withheld": any(r.get("withheld") for r in rs),
    }
    return {"name": name, "memory_mb": memory_mb, "plan": plan, "actual": actual}


def _cost(
    estimate: Doc, steps: list[Doc], records: list[Doc], memory: dict[str, int], batch_steps: set[str]
) -> Doc:
    """The ``cost`` dimension: the actual cost at list prices beside the plan's, with its transitions."""
    tasks_per_step = {s["name"]: s["actual"]["tasks"] for s in steps}
    extra = sum(max(0, s["actual"]["attempts"] - s["actual"]["tasks"]) for s in steps)
    transitions = _transitions(estimate, tasks_per_step, extra)
    cost = actual_cost(records, memory, batch_steps, transitions, estimate.get("architecture"))
    return {"actual": cost, "plan": estimate.get("cost_usd", {}), "transitions": transitions}


def _sla(timed: list[Doc], start: float | None, deadline_s: float | None) -> Doc:
    """The ``sla`` dimension: the time from ``start`` to the last task's end against the deadline."""
    ended = max((r["ended_at"] for r in timed), default=None)
    elapsed = (ended - start) if (ended is not None and start is not None) else None
    met = None if deadline_s is None or elapsed is None else elapsed <= deadline_s
    return {"deadline_s": deadline_s, "elapsed_s": elapsed, "met": met}


def _responsiveness(timed: list[Doc], start: float | None, first_step: str | None) -> Doc:
    """The ``responsiveness`` dimension: ``start`` to the first task running, and to the first task done
    after the first step."""
    first_start = min((r["started_at"] for r in timed), default=None)
    later_done = [r["ended_at"] for r in timed if r["outcome"] == "succeeded" and r["step"] != first_step]
    return {
        "first_task_s": None if start is None or first_start is None else first_start - start,
        "first_result_s": None if start is None or not later_done else min(later_done) - start,
    }


def _scaling(records: list[Doc], by_step: dict[str, list[Doc]], allowed: dict[str, int] | None) -> Doc:
    """The ``scaling`` dimension: how many tasks ran at once over time against what each step allows."""
    series = _running_series(records)
    return {
        "peak_running": max((n for _, n in series), default=0),
        "allowed": allowed or {},
        "reversals": _reversals(series),
        "span_s": (series[-1][0] - series[0][0]) if len(series) > 1 else 0.0,
        "steps": {name: shortfall(by_step.get(name, []), n) for name, n in (allowed or {}).items()},
    }


def _interpretability(estimate: Doc) -> list[str]:
    """The ``interpretability`` dimension: the estimator's reasons, per step and for the job."""
    reasons = [f"{s['name']}: {s['why']}" for s in estimate["steps"] if s.get("why")]
    return reasons + list(estimate.get("notes", []))


def build(
    estimate: Doc | None,
    records: list[Doc],
    status: Doc,
    *,
    batch_steps: set[str],
    allowed: dict[str, int] | None = None,
    deadline_s: float | None = None,
    submitted_at: float | None = None,
) -> Doc:
    """The report document (see the module doc). ``allowed``: how many tasks of each step may run at once
    (its Map's max concurrency, or what the executor runs at once); ``submitted_at``: epoch seconds."""
    estimate = estimate or {"steps": [], "cost_usd": {}, "transitions": 0, "notes": []}
    planned = {s["name"]: s for s in estimate["steps"]}
    by_step: dict[str, list[Doc]] = defaultdict(list)
    for r in records:
        by_step[r["step"]].append(r)
    order = [s["name"] for s in estimate["steps"]] + sorted(set(by_step) - set(planned))
    memory = {name: int(s.get("memory_mb") or 0) for name, s in planned.items()}
    steps = [_step(n, by_step.get(n, []), planned.get(n), memory.get(n), n in batch_steps) for n in order]
    timed = [r for r in records if _measured(r)]
    start = submitted_at if submitted_at is not None else min((r["started_at"] for r in timed), default=None)
    first_step = estimate["steps"][0]["name"] if estimate["steps"] else None
    return {
        "job_id": status.get("job_id"),
        "kind": status.get("kind"),
        "state": status.get("state"),
        "error": status.get("error"),
        "tasks": sum(s["actual"]["tasks"] for s in steps),
        "attempts": len(records),
        "steps": steps,
        "cost": _cost(estimate, steps, records, memory, batch_steps),
        "sla": _sla(timed, start, deadline_s),
        "responsiveness": _responsiveness(timed, start, first_step),
        "scaling": _scaling(records, by_step, allowed),
        "interpretability": _interpretability(estimate),
        "records": [{k: r.get(k) for k in RECORD_FIELDS} for r in records],
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
        limit = isinstance(step, Map) and (step.max_concurrency or default_concurrency)
        if limit:
            allowed |= dict.fromkeys((inner.name for inner in step.body), limit)
    return build(
        estimate,
        telemetry.with_lambda_reports(telemetry.read_records(store_root, job_id)),
        status,
        batch_steps={s.name for s in kind.workflow.walk() if isinstance(s, BatchJob)},
        allowed=allowed,
        deadline_s=spec.get("deadline_s"),
        submitted_at=(estimate or {}).get("submitted_at"),
    )
