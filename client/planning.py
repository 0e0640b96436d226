"""``shardfold plan``: what a job will do and cost, computed before anything runs.

The workflow (``orchestrator.workflows.WORKFLOWS[kind]``) says which steps exist, which function runs each
and with how much memory; a per-kind estimator says how many tasks each step has and what one task reads,
writes, holds in memory and takes. Prices come from :mod:`client.pricing`. A task whose projected peak does
not fit its function's configured memory makes the plan refused (:class:`PlanError`), as Cubed does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from aws_lambda_powertools import Logger

from client import pricing
from functions.errors import PlanError

logger = Logger(service="shardfold")

MiB = 1024 * 1024


@dataclass
class TaskLoad:
    """What ONE task of a function does: peak memory, S3 requests, estimated duration.

    ``total_gets``/``total_puts``, when set, are the exact counts over all of the step's tasks (tasks that
    differ, e.g. fedavg shards); otherwise the step's counts are ``gets``/``puts`` times its tasks.
    """

    peak_bytes: int
    gets: int = 0
    puts: int = 0
    duration_s: float = 0.0
    total_gets: int | None = None
    total_puts: int | None = None


@dataclass
class DetailTable:
    """A kind-specific table that ``shardfold plan`` prints after the cost (e.g. dpquery's privacy and
    accuracy plan): a title, column names and rows of plain values (str, int, float)."""

    title: str
    columns: list[str]
    rows: list[list[Any]]


@dataclass
class KindEstimate:
    """A kind estimator's answer: per-function task loads and how many children each Map step gets."""

    items: int
    loads: dict[str, TaskLoad]  # keyed by the function's short name ("plan", "gather"...)
    map_items: dict[str, int] = field(default_factory=dict)  # Map step name -> children
    notes: list[str] = field(default_factory=list)
    output_bytes: int | None = None
    details: list[DetailTable] = field(default_factory=list)


@dataclass
class StepPlan:
    name: str
    function: str
    tasks: int
    memory_mb: int  # the function's configured memory
    peak_mb: float  # projected peak per task
    gets: int  # total over the step's tasks
    puts: int
    duration_s: float  # per task
    gb_s: float  # Lambda GB-s billed over the step's tasks (0 for a Batch step)
    instance_s: float = 0.0  # EC2 instance seconds over a Batch step's jobs, startup included

    @property
    def fits(self) -> bool:
        return self.peak_mb <= self.memory_mb


@dataclass
class PlanReport:
    kind: str
    items: int
    steps: list[StepPlan]
    transitions: int
    cost_usd: dict[str, float]
    notes: list[str] = field(default_factory=list)
    output_bytes: int | None = None
    details: list[DetailTable] = field(default_factory=list)

    @property
    def gets(self) -> int:
        return sum(s.gets for s in self.steps)

    @property
    def puts(self) -> int:
        return sum(s.puts for s in self.steps)

    @property
    def tasks(self) -> int:
        return sum(s.tasks for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(gets=self.gets, puts=self.puts, tasks=self.tasks)
        return out

    def check(self) -> PlanReport:
        """Raise :class:`PlanError` naming each step whose task would not fit its function's memory."""
        over = [s for s in self.steps if not s.fits]
        if over:
            what = "; ".join(
                f"step {s.name!r} ({s.function}) needs ~{s.peak_mb:.0f} MiB per task but the function has "
                f"{s.memory_mb} MiB"
                for s in over
            )
            hint = " ".join(n for n in self.notes if n.startswith("to fit:")) or (
                "split large objects into byte ranges (start/length) or raise the function's memory_mb"
            )
            raise PlanError(f"plan refused: {what}. {hint}")
        return self


# --- workflow walking ---------------------------------------------------------------------------------------


def _short(function: str) -> str:
    return function.rsplit(".", 1)[-1]


def _walk_tasks(steps: tuple[Any, ...], multiplier: int, map_items: dict[str, int]) -> list[tuple[Any, int]]:
    """Every Task/BatchJob step with how many times it runs (Map children multiply their bodies)."""
    from orchestrator.plan import Map, Parallel

    out: list[tuple[Any, int]] = []
    for step in steps:
        if isinstance(step, Map):
            out += _walk_tasks(step.body, multiplier * map_items.get(step.name, 1), map_items)
        elif isinstance(step, Parallel):
            for branch in step.branches:
                out += _walk_tasks(branch, multiplier, map_items)
        else:
            out.append((step, multiplier))
    return out


def _count_transitions(steps: tuple[Any, ...], map_items: dict[str, int]) -> int:
    """State transitions billed by a Standard workflow on the happy path.

    Each state entered is one transition; a Distributed Map's children are child executions billed the
    same way, so a Map costs one plus its children times its body.
    """
    from orchestrator.plan import Map, Parallel

    total = 0
    for step in steps:
        if isinstance(step, Map):
            total += 1 + map_items.get(step.name, 1) * _count_transitions(step.body, map_items)
        elif isinstance(step, Parallel):
            total += 1 + sum(_count_transitions(b, map_items) for b in step.branches)
        else:
            total += 1
    return total


def _workflow(kind: str) -> Any:
    from orchestrator.workflows import WORKFLOWS

    if kind not in WORKFLOWS:
        raise PlanError(f"no workflow for job kind {kind!r}; known: {sorted(WORKFLOWS)}")
    return WORKFLOWS[kind]


# --- per-kind estimators ------------------------------------------------------------------------------------

ESTIMATORS: dict[str, Callable[..., KindEstimate]] = {}
# Probing sizes costs one HEAD (S3) or stat (local) per item; beyond this many an estimator samples evenly.
PROBE_LIMIT = 10_000


def estimator(kind: str) -> Callable:
    def register(fn: Callable[[Any, str], KindEstimate]) -> Callable[[Any, str], KindEstimate]:
        ESTIMATORS[kind] = fn
        return fn

    return register


def estimate_plan(spec: Any, store_root: str, probe_limit: int | None = None) -> PlanReport:
    """Price and size a validated spec on its workflow; does not check memory (see :meth:`check`).

    ``probe_limit`` caps how many objects are sized (HEAD/stat) to find the largest item; ``submit``
    uses a small sample so checking a plan costs far less than running it.
    """
    from orchestrator.plan import BatchJob

    workflow = _workflow(spec.kind)
    if spec.kind not in ESTIMATORS:
        raise PlanError(f"no plan estimator for job kind {spec.kind!r}")
    est = ESTIMATORS[spec.kind](spec, store_root, probe_limit or PROBE_LIMIT)
    steps: list[StepPlan] = []
    for task, runs in _walk_tasks(workflow.steps, 1, est.map_items):
        function = getattr(task, "function", None) or getattr(task, "entry_point", task.name)
        load = (
            est.loads.get(_short(function))
            or est.loads.get(task.name)
            or TaskLoad(peak_bytes=pricing.LAMBDA_BASELINE_MB * MiB)
        )
        memory_mb = int(getattr(task, "memory_mb", None) or 0)
        billed_s = max(load.duration_s, pricing.LAMBDA_MIN_BILLED_S)
        batch = isinstance(task, BatchJob)
        steps.append(
            StepPlan(
                name=task.name,
                function=function,
                tasks=runs,
                memory_mb=memory_mb,
                peak_mb=load.peak_bytes / MiB,
                gets=load.gets * runs if load.total_gets is None else load.total_gets,
                puts=load.puts * runs if load.total_puts is None else load.total_puts,
                duration_s=load.duration_s,
                gb_s=0.0 if batch else memory_mb / 1024 * billed_s * runs,
                instance_s=(load.duration_s + pricing.BATCH_STARTUP_S) * runs if batch else 0.0,
            )
        )
    transitions = _count_transitions(workflow.steps, est.map_items)
    gb_s = sum(s.gb_s for s in steps)
    instance_s = sum(s.instance_s for s in steps)
    invocations = sum(s.tasks for s in steps if not s.instance_s)
    gets = sum(s.gets for s in steps)
    puts = sum(s.puts for s in steps) + 1  # + the client's spec.json
    cost = {
        "lambda_compute": gb_s * pricing.LAMBDA_USD_PER_GB_S,
        "lambda_requests": invocations * pricing.LAMBDA_USD_PER_REQUEST,
        "s3_get": gets * pricing.S3_USD_PER_GET,
        "s3_put": puts * pricing.S3_USD_PER_PUT,
        "step_functions": transitions * pricing.SFN_USD_PER_TRANSITION,
    }
    if any(isinstance(t, BatchJob) for t in workflow.walk()):
        cost["batch_gpu_instances"] = instance_s / 3600 * pricing.BATCH_GPU_USD_PER_HOUR
    cost["total"] = sum(cost.values())
    notes = list(est.notes)
    if est.output_bytes is not None:
        notes.append(
            f"output ~{est.output_bytes / MiB:.1f} MiB; S3 Standard storage "
            f"${est.output_bytes / 1024**3 * pricing.S3_USD_PER_GB_MONTH:.6f}/month (not in the total)"
        )
    return PlanReport(
        kind=spec.kind,
        items=est.items,
        steps=steps,
        transitions=transitions,
        cost_usd=cost,
        notes=notes,
        output_bytes=est.output_bytes,
        details=list(est.details),
    )


def map_names_for(kind: str, children: int) -> dict[str, int]:
    """Every Map step of ``kind``'s workflow gets ``children`` (for kinds with one Map step)."""
    from orchestrator.plan import Map

    return {step.name: children for step in _workflow(kind).walk() if isinstance(step, Map)}


# The kinds' estimators register themselves on import (one module per kind keeps this one generic).
from client import planning_dpquery, planning_fedavg, planning_getbatch, planning_inference  # noqa: E402, F401
