"""The estimate: what a job will do and cost, computed before anything runs (``shardfold plan``).

A kind's workflow says which steps exist and how often each runs; its sizing module
(``functions/<kind>/sizing.py``, named by its :class:`~functions.kinds.JobKind`) says what one task of each
step holds in memory, reads, writes and takes, reading the engine's own constants:

* ``probe(spec, store_root, budget) -> Probe``: a bounded look at the inputs (sizes, a header, a sample of
  rows); ``budget`` caps how many objects it may look at and how many bytes it may read, so checking a
  job at submit costs far less than running it. Missing or unreadable inputs become notes: the job itself
  fails naming them.
* ``loads(spec, probe) -> Loads``: per step of the workflow, keyed by the step objects themselves; a step
  without a load is an error, never a default. Every kind states memory alike (:class:`TaskLoad`): the
  task's runtime baseline plus the buffers it declares, each named.

:func:`estimate` joins the two on the workflow and prices the result (:mod:`functions.pricing`);
:meth:`Estimate.check` refuses a job whose task would not fit the memory it will get — the workflow's
``memory_mb`` locally, the deployed size on AWS (:class:`Limits`) — naming the setting that raises it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from shardfold.functions import pricing
from shardfold.functions.errors import PlanError
from shardfold.functions.tables import Table, size_text
from shardfold.functions.workflow import BatchJob, Map, Parallel, Step, Task, Workflow

MiB = 1024 * 1024


@dataclass(frozen=True)
class ProbeBudget:
    """How much a probe may look at: ``objects`` (HEADs, headers) and ``data_bytes`` read in all.

    ``figures``: whether to look up what only the cost, time and output figures need, not the memory
    check (getbatch's object sizes: its engine's memory is bounded in bytes whatever the sizes). Submit
    checks memory only; ``shardfold plan`` shows the figures.

    ``refuse``: whether what the job's first step would certainly fail on (a missing input, a column the
    dataset lacks) is refused here, naming the field, rather than noted: at submit, not when planning
    ahead of the data."""

    objects: int
    data_bytes: int
    figures: bool = True
    refuse: bool = False


# What submit may spend (a few dozen objects' metadata, at most 1 MiB of data) and what `shardfold plan` may.
SUBMIT_BUDGET = ProbeBudget(objects=32, data_bytes=1 * MiB, figures=False, refuse=True)
PLAN_BUDGET = ProbeBudget(objects=10_000, data_bytes=256 * MiB)


@dataclass
class Probe:
    """What a kind's probe learned: ``facts`` (JSON; recorded as ``jobs/<id>/probe.json``), ``notes``, and
    ``model``, what the kind's ``loads`` needs that is not JSON (fedavg's shard plan, dpquery's noise
    plan)."""

    facts: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    model: Any = None


def projected_peak(runtime_bytes: int, buffers: Mapping[str, float]) -> int:
    """Every task's memory model (Cubed's): the runtime baseline plus each buffer the task declares."""
    return int(runtime_bytes + sum(buffers.values()))


@dataclass
class TaskLoad:
    """What ONE task of a step does: memory, S3 requests, estimated duration.

    Memory is ``runtime_bytes`` (the warm interpreter with the task's libraries, each kind's measured
    constant) plus the ``buffers`` it holds at its peak, named as ``shardfold plan`` shows them (``why``).
    ``total_gets``/``total_puts``, when set, are the exact counts over all of the step's tasks (tasks that
    differ, e.g. fedavg shards); otherwise the step's counts are ``gets``/``puts`` times its tasks.
    """

    runtime_bytes: int
    buffers: Mapping[str, float] = field(default_factory=dict)
    gets: int = 0
    puts: int = 0
    duration_s: float = 0.0
    total_gets: int | None = None
    total_puts: int | None = None

    @property
    def peak_bytes(self) -> int:
        return projected_peak(self.runtime_bytes, self.buffers)

    @property
    def why(self) -> str:
        """The peak in words: the runtime and each buffer with its size (an empty one left out)."""
        terms = {"runtime": self.runtime_bytes, **self.buffers}
        return ", ".join(f"{name} {size_text(n)}" for name, n in terms.items() if n)


@dataclass
class Loads:
    """A kind's sizing answer: a load per Task/BatchJob step and the children of each Map step."""

    items: int
    tasks: Mapping[Step, TaskLoad]
    map_items: Mapping[Map, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    output_bytes: int | None = None
    details: list[Table] = field(default_factory=list)


@dataclass(frozen=True)
class Limit:
    """The memory one step's task gets, and the setting that raises it."""

    memory_mb: int
    setting: str


class Limits:
    """Memory per step: the workflow's ``memory_mb`` (local backend), or the deployed sizes (AWS).

    ``deployed`` is the stack's ``sizes`` output: ``{"functions": {name: {"memory_mb", ...}}, "batch":
    {entry point: {"memory_mb", ...}}}``, each entry with ``"config": {"memory_mb": key}`` naming the
    stack setting that raises it (``shardfold:functionMemory["getbatch.gather"]``).
    """

    def __init__(self, deployed: Mapping[str, Any] | None = None, workflow_file: str = "its workflow"):
        self.deployed = deployed
        self.workflow_file = workflow_file

    @property
    def architecture(self) -> str:
        """The Lambda architecture the tasks are priced at: the deployed one, else the stack's default."""
        return (self.deployed or {}).get("lambda_architecture") or pricing.DEFAULT_LAMBDA_ARCHITECTURE

    def __call__(self, step: Task | BatchJob) -> Limit:
        if self.deployed is None:
            return Limit(step.memory_mb, f"memory_mb of step {step.name!r} in {self.workflow_file}")
        table, key = (
            ("batch", step.entry_point) if isinstance(step, BatchJob) else ("functions", step.function)
        )
        entry = (self.deployed.get(table) or {}).get(key)
        if entry is None:
            raise PlanError(
                f"the deployed stack has no {table} entry {key!r} (step {step.name!r}); "
                "redeploy with `shardfold deploy`"
            )
        default = f'shardfold:{"batchMemory" if table == "batch" else "functionMemory"}["{key}"]'
        setting = (entry.get("config") or {}).get("memory_mb") or default
        return Limit(int(entry["memory_mb"]), f"`pulumi config set --path '{setting}' <MB>`")


@dataclass
class StepEstimate:
    name: str
    function: str
    tasks: int
    memory_mb: int  # what the task gets: the workflow's memory_mb, or the deployed size
    peak_mb: float  # projected peak per task
    gets: int  # total over the step's tasks
    puts: int
    duration_s: float  # per task
    gb_s: float  # Lambda GB-s billed over the step's tasks (0 for a Batch step)
    instance_s: float = 0.0  # EC2 instance seconds over a Batch step's jobs, startup included
    setting: str = ""  # what raises memory_mb
    why: str = ""  # what the peak is made of

    @property
    def fits(self) -> bool:
        return self.peak_mb <= self.memory_mb


@dataclass
class Estimate:
    kind: str
    items: int
    steps: list[StepEstimate]
    transitions: int
    cost_usd: dict[str, float]
    notes: list[str] = field(default_factory=list)
    output_bytes: int | None = None
    details: list[Table] = field(default_factory=list)
    probe: dict[str, Any] = field(default_factory=dict)
    architecture: str = pricing.DEFAULT_LAMBDA_ARCHITECTURE  # the Lambda rate it is priced at
    fan_out: dict[str, int] = field(default_factory=dict)  # each Map step's children

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

    def check(self) -> Estimate:
        """Raise :class:`PlanError` naming each step whose task would not fit the memory it gets, or that
        would fan out over more children than a Map may have (:data:`functions.worklist.MAX_MAP_ITEMS`)."""
        from shardfold.functions.worklist import MAX_MAP_ITEMS

        wide = {name: k for name, k in self.fan_out.items() if k > MAX_MAP_ITEMS}
        if wide:
            what = "; ".join(f"step {name!r} would run {k:,} tasks" for name, k in wide.items())
            raise PlanError(
                f"plan refused: {what}, and a Map fans out over at most {MAX_MAP_ITEMS:,} (Step Functions "
                "gathers every child's output into 256 KiB): give each task more to do (getbatch "
                "items_per_part, inference shard_rows, fedavg shards)"
            )
        over = [s for s in self.steps if not s.fits]
        if over:
            what = "; ".join(
                f"step {s.name!r} ({s.function}) needs ~{s.peak_mb:.0f} MiB per task but gets "
                f"{s.memory_mb} MiB (raise it with {s.setting})"
                for s in over
            )
            hint = " ".join(n for n in self.notes if n.startswith("to fit:"))
            raise PlanError(f"plan refused: {what}." + (f" {hint}" if hint else ""))
        return self


def _runs(steps: tuple[Step, ...], multiplier: int, children: Mapping[Map, int]) -> list[tuple[Any, int]]:
    """Every Task/BatchJob step with how many times it runs (Map children multiply their bodies)."""
    out: list[tuple[Any, int]] = []
    for step in steps:
        if isinstance(step, Map):
            out += _runs(step.body, multiplier * children[step], children)
        elif isinstance(step, Parallel):
            for branch in step.branches:
                out += _runs(branch, multiplier, children)
        else:
            out.append((step, multiplier))
    return out


def transitions(steps: tuple[Step, ...], children: Mapping[Map, int]) -> int:
    """State transitions billed by a Standard workflow on the happy path.

    Each state entered is one transition; a Distributed Map's children are child executions billed the
    same way, so a Map costs one plus its children times its body.
    """
    total = 0
    for step in steps:
        if isinstance(step, Map):
            total += 1 + children[step] * transitions(step.body, children)
        elif isinstance(step, Parallel):
            total += 1 + sum(transitions(b, children) for b in step.branches)
        else:
            total += 1
    return total


def _join(workflow: Workflow, loads: Loads) -> None:
    """Every Task/BatchJob step has a load and every Map its children: no step is priced by a default."""
    missing = [
        s.name
        for s in workflow.walk()
        if (isinstance(s, Map) and s not in loads.map_items)
        or (isinstance(s, Task | BatchJob) and s not in loads.tasks)
    ]
    if missing:
        raise PlanError(f"the {workflow.kind} sizing gives no load for step(s) {missing}")


def probe(spec: Any, store_root: str, budget: ProbeBudget = PLAN_BUDGET) -> Probe:
    """The kind's bounded look at the job's inputs."""
    from shardfold.functions import kinds

    return kinds.find(spec.kind).sizing_module().probe(spec, store_root, budget)


def estimate(
    spec: Any,
    store_root: str,
    *,
    budget: ProbeBudget = PLAN_BUDGET,
    limits: Limits | None = None,
    probed: Probe | None = None,
) -> Estimate:
    """Size and price a validated spec on its workflow; does not refuse (see :meth:`Estimate.check`)."""
    from shardfold.functions import kinds

    kind = kinds.find(spec.kind)
    workflow = kind.workflow
    sizing = kind.sizing_module()
    probed = probed if probed is not None else sizing.probe(spec, store_root, budget)
    loads: Loads = sizing.loads(spec, probed)
    _join(workflow, loads)
    limits = limits or Limits(workflow_file=kind.workflow_file)
    steps: list[StepEstimate] = []
    for task, runs in _runs(workflow.steps, 1, loads.map_items):
        load = loads.tasks[task]
        limit = limits(task)
        batch = isinstance(task, BatchJob)
        billed_s = max(load.duration_s, pricing.LAMBDA_MIN_BILLED_S)
        steps.append(
            StepEstimate(
                name=task.name,
                function=task.entry_point if batch else task.function,
                tasks=runs,
                memory_mb=limit.memory_mb,
                peak_mb=load.peak_bytes / MiB,
                gets=load.gets * runs if load.total_gets is None else load.total_gets,
                puts=load.puts * runs if load.total_puts is None else load.total_puts,
                duration_s=load.duration_s,
                gb_s=0.0 if batch else limit.memory_mb / 1024 * billed_s * runs,
                instance_s=(load.duration_s + pricing.BATCH_STARTUP_S) * runs if batch else 0.0,
                setting=limit.setting,
                why=load.why,
            )
        )
    n_transitions = transitions(workflow.steps, loads.map_items)
    gets = sum(s.gets for s in steps)
    puts = sum(s.puts for s in steps) + 1  # + the submitted spec.json
    cost = {
        "lambda_compute": sum(s.gb_s for s in steps) * pricing.lambda_usd_per_gb_s(limits.architecture),
        "lambda_requests": sum(s.tasks for s in steps if not s.instance_s) * pricing.LAMBDA_USD_PER_REQUEST,
        "s3_get": gets * pricing.S3_USD_PER_GET,
        "s3_put": puts * pricing.S3_USD_PER_PUT,
        "step_functions": n_transitions * pricing.SFN_USD_PER_TRANSITION,
    }
    if any(isinstance(t, BatchJob) for t in workflow.walk()):
        cost["batch_gpu_instances"] = sum(s.instance_s for s in steps) / 3600 * pricing.BATCH_GPU_USD_PER_HOUR
    cost["total"] = sum(cost.values())
    notes = [*probed.notes, *loads.notes, f"Lambda priced at the {limits.architecture} rate"]
    if loads.output_bytes is not None:
        notes.append(
            f"output ~{size_text(loads.output_bytes)}; S3 Standard storage "
            f"${loads.output_bytes / 1024**3 * pricing.S3_USD_PER_GB_MONTH:.6f}/month (not in the total)"
        )
    return Estimate(
        kind=spec.kind,
        items=loads.items,
        steps=steps,
        transitions=n_transitions,
        cost_usd=cost,
        notes=notes,
        output_bytes=loads.output_bytes,
        details=list(loads.details),
        probe=probed.facts,
        architecture=limits.architecture,
        fan_out={workflow.shown_name(m.name): int(k) for m, k in loads.map_items.items()},
    )
