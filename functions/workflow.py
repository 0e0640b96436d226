"""The plan vocabulary: a workflow is a small tree of steps that both executors understand.

One :class:`Workflow` per job kind compiles to Amazon States Language (:mod:`orchestrator.asl`) and runs
directly in :class:`orchestrator.local.LocalExecutor`. Both follow the same data-flow rule, which mirrors
JSONPath ASL so the two give the same result:

* The workflow input is ``{"job_id", "spec_uri", "store_root"}``.
* A :class:`Task` receives the whole state; its result (a small JSON object) is stored at ``$.<name>``.
  A polling Task (``poll=True``) is called again, with its last result at ``$.<name>``, until that result
  holds ``"ready": true``; between calls the workflow waits the whole seconds its result names as
  ``"wait_s"`` (a Wait state on AWS, so no Lambda is billed while it waits; a cancellable wait locally).
* A :class:`Map` reads a work list (a JSON array in the store) named by a *work-list reference* found at
  its ``items`` path (``functions.worklist.worklist_ref``: ``{"uri", "bucket", "key", "count"}``). Each
  child receives ``{"job_id", "spec_uri", "store_root", "item": <work-list element>, "index": <int>}`` and
  runs ``body``; child results are discarded (``ResultPath: null``), so children write their outputs to the
  store at deterministic keys.
* A :class:`Parallel` runs its branches on copies of the state; ``$.<name>`` becomes
  ``{<task name>: <result>}`` for every Task and Parallel at the top level of any branch.
* A :class:`BatchJob` (an AWS Batch container on AWS) receives the whole state; its result is discarded.

Step names are unique in a workflow and are plain identifiers, so ``$.<name>`` is valid JSONPath and the
name works as a state name, a Map label and a journal key.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from shardfold.functions.errors import PlanError

Mode = Literal["thread", "process"]
MODES: tuple[str, ...] = ("thread", "process")
_PATH_RE = re.compile(r"\$(\.[A-Za-z_][A-Za-z0-9_]*)+")  # the JSONPath both executors read: $.a.b
# How a kind's Lambda functions are packaged on AWS (see Workflow.lambda_package).
LambdaPackage = Literal["zip", "image"]
LAMBDA_PACKAGES: tuple[str, ...] = ("zip", "image")

# Errors the Lambda service (not our code) raises for a transient fault; AWS recommends retrying them.
LAMBDA_TRANSIENT: tuple[str, ...] = (
    "Lambda.ServiceException",
    "Lambda.AWSLambdaException",
    "Lambda.SdkClientException",
    "Lambda.ClientExecutionTimeoutException",
)
# Throttling: retried with full jitter so a burst of children does not retry in lock-step.
LAMBDA_THROTTLED: tuple[str, ...] = ("Lambda.TooManyRequestsException",)
# Python exception class names a handler raises for a fault worth retrying. On Lambda the error name is the
# exception's class name, and the local executor matches the same name, so both retry the same errors.
PYTHON_TRANSIENT: tuple[str, ...] = (
    "TransientError",
    "ConnectionError",
    "ConnectionResetError",
    "ConnectionAbortedError",
    "ConnectionRefusedError",
    "BrokenPipeError",
    "TimeoutError",
)
# Attempts of a Batch job: the job definitions' retryStrategy (infra/gpu.py), followed by the local executor.
BATCH_ATTEMPTS = 3
# What Step Functions reports for a Lambda invocation that ran past the function's timeout (the local executor
# reports the same for a task past its timeout_s).
LAMBDA_TIMEOUT = "Sandbox.Timedout"
# A failed SubmitJob/DescribeJobs of the .sync integration: Step Functions names the Batch exceptions it does
# not model Batch.AWSBatchException (throttling and 5xx included: ASFHyP3/hyp3#911 saw it from real AWS),
# and the modelled ones by their own names. A failed *job* is States.TaskFailed: never retried here (the job
# definition's retry strategy re-runs a container killed by a Spot reclaim).
BATCH_TRANSIENT: tuple[str, ...] = (
    "Batch.AWSBatchException",
    "Batch.ServerException",
    "Batch.TooManyRequestsException",
)

# Catch-all names would also retry user errors (ShardfoldError), which must fail fast on every backend.
_FORBIDDEN_RETRY_ERRORS = frozenset({"States.ALL", "States.TaskFailed"})
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,39}$")  # 40: the limit of a Map Label
# Keys of the workflow input and of a Map child's input: a step of that name would overwrite them.
RESERVED_NAMES = frozenset({"job_id", "spec_uri", "store_root", "item", "index", "error"})


@dataclass(frozen=True)
class Retry:
    """One retrier: ASL ``Retry`` entry semantics (its own attempt counter, first matching retrier wins).

    The delay before attempt ``n`` (1-based) is ``interval_s * backoff**(n-1)``, capped at ``max_delay_s``;
    with ``jitter`` it is drawn uniformly from ``[0, delay]`` (ASL ``JitterStrategy: FULL``).
    """

    errors: tuple[str, ...]
    interval_s: int = 2
    max_attempts: int = 6
    backoff: float = 2.0
    max_delay_s: int | None = None
    jitter: bool = False

    def __post_init__(self) -> None:
        if not self.errors:
            raise PlanError("a Retry needs at least one error name")
        bad = _FORBIDDEN_RETRY_ERRORS.intersection(self.errors)
        if bad:
            raise PlanError(
                f"Retry may not match {sorted(bad)}: user errors must not be retried; list the transient "
                "error names instead (see shardfold.functions.workflow.PYTHON_TRANSIENT)"
            )
        if self.interval_s < 1 or self.max_attempts < 0 or self.backoff < 1.0:
            raise PlanError("Retry needs interval_s >= 1 (ASL seconds), max_attempts >= 0 and backoff >= 1.0")
        if self.max_delay_s is not None and self.max_delay_s < 1:
            raise PlanError("Retry.max_delay_s must be >= 1 second when given")

    def delay_s(self, attempt: int) -> float:
        """Delay (before jitter) ahead of retry number ``attempt`` (1-based)."""
        delay = self.interval_s * self.backoff ** (attempt - 1)
        return min(delay, self.max_delay_s) if self.max_delay_s is not None else delay


DEFAULT_TASK_RETRY: tuple[Retry, ...] = (
    Retry(errors=LAMBDA_TRANSIENT + PYTHON_TRANSIENT, interval_s=2, max_attempts=6, backoff=2.0),
    Retry(errors=LAMBDA_THROTTLED, interval_s=1, max_attempts=8, backoff=2.0, max_delay_s=30, jitter=True),
)
DEFAULT_BATCH_RETRY: tuple[Retry, ...] = (
    Retry(errors=BATCH_TRANSIENT, interval_s=5, max_attempts=3, backoff=2.0, max_delay_s=60, jitter=True),
)


@dataclass(frozen=True)
class Task:
    """Call one registered function (a Lambda function on AWS).

    ``mode`` says how the local executor runs it: ``"thread"`` for I/O-bound work, ``"process"`` for
    CPU-bound work (handlers are top-level functions, so they pickle by reference). ``mode_from``: a path
    into the task's input (``"$.item.mode"``) whose value, where it is ``"thread"`` or ``"process"``,
    is that call's mode instead: for work only the data can say the nature of (a getbatch part of local
    files keeps an interpreter busy; one of S3 objects waits on the network). ``memory_mb`` and
    ``timeout_s`` size the Lambda function; the state's ``TimeoutSeconds`` is ``timeout_s`` plus a margin
    (:mod:`orchestrator.asl`), and the local executor stops a task at ``timeout_s`` as Lambda does.
    ``poll``: call it until its result says it is ready (see the module docstring); each call is short, the
    waiting is the workflow's.
    """

    name: str
    function: str
    mode: Mode = "thread"
    mode_from: str | None = None
    memory_mb: int = 1024
    timeout_s: int = 900
    retry: tuple[Retry, ...] = DEFAULT_TASK_RETRY
    poll: bool = False


@dataclass(frozen=True)
class BatchJob:
    """Run a registered function as an AWS Batch container job (GPU stages); locally, as a child process of
    the same container entry point (:mod:`orchestrator.local_batch`).

    ``entry_point`` names the registered function the worker calls (``functions.container``) with the state as
    its event. Resources size the job definition; ``timeout_s`` is the attempt duration.
    """

    name: str
    entry_point: str
    vcpus: int = 4
    memory_mb: int = 16384
    gpus: int = 0
    timeout_s: int = 3600
    retry: tuple[Retry, ...] = DEFAULT_BATCH_RETRY


@dataclass(frozen=True)
class Map:
    """Fan out over the work list referenced at ``items`` (a JSONPath into the state: ``$.plan.worklist``).

    ``max_concurrency`` bounds concurrent children (0: the backend's default: unbounded on AWS, the local
    executor's thread count locally). ``tolerated_failure_percentage`` lets that share of children fail
    without failing the step (None: no failure tolerated).
    """

    name: str
    items: str
    body: tuple[Step, ...]
    max_concurrency: int = 0
    tolerated_failure_percentage: float | None = None

    def tolerance(self) -> float | None:
        """The tolerated failure percentage both executors apply: two decimals (finer is meaningless, and
        it keeps the ASL number out of exponent notation, which moto's parser cannot read)."""
        pct = self.tolerated_failure_percentage
        return None if pct is None else round(float(pct), 2)


@dataclass(frozen=True)
class Parallel:
    """Run branches concurrently on copies of the state; see the module docstring for the result."""

    name: str
    branches: tuple[tuple[Step, ...], ...]


Step = Task | BatchJob | Map | Parallel


@dataclass(frozen=True)
class Workflow:
    """A job kind's plan. Validated on construction: names, retry policies, item paths, packaging.

    ``lambda_package`` says how the kind's Task functions are deployed on AWS (the executors ignore it):
    ``"zip"`` (the default): in the shared zip package (``infra.package``, at most 250 MB unzipped);
    ``"image"``: the kind's functions need dependencies too large for a zip and deploy as container-image
    Lambda functions (``Dockerfile.lambda``, up to 10 GB), one image for all such functions, the handler
    chosen per function.
    """

    kind: str
    steps: tuple[Step, ...]
    comment: str = field(default="")
    lambda_package: LambdaPackage = "zip"
    # Run once when a step fails, before the job ends FAILED (both executors; on AWS every top-level step's
    # Catch passes through it): it removes what a failed job must not keep (a DP round's clip factors). Its
    # own failure is logged and changes nothing of the job's outcome.
    on_failure: Task | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9]*", self.kind):
            raise PlanError(f"workflow kind {self.kind!r} must be lower-case letters and digits")
        if self.lambda_package not in LAMBDA_PACKAGES:
            raise PlanError(
                f"workflow {self.kind!r}: lambda_package {self.lambda_package!r} must be one of "
                f"{list(LAMBDA_PACKAGES)}"
            )
        seen: set[str] = set()
        _check_steps(self.steps, f"workflow {self.kind!r}", seen=seen)
        if self.on_failure is not None:
            if not isinstance(self.on_failure, Task):
                raise PlanError(f"workflow {self.kind!r}: on_failure must be a Task")
            _check_steps((self.on_failure,), f"workflow {self.kind!r} on_failure", seen=seen)

    def tasks(self) -> Iterator[Task]:
        """Every Task this workflow may run, the ``on_failure`` one included (what is deployed, sized and
        invoked), in plan order."""
        yield from (s for s in self.walk() if isinstance(s, Task))
        if self.on_failure is not None:
            yield self.on_failure

    def walk(self) -> Iterator[Step]:
        """Every step, depth first, in plan order."""
        yield from walk_steps(self.steps)

    def functions(self) -> list[str]:
        """Registered function names this workflow calls (Tasks and BatchJob entry points), in order."""
        out: list[str] = []
        for step in [*self.walk(), *([self.on_failure] if self.on_failure else [])]:
            fn = step.function if isinstance(step, Task) else getattr(step, "entry_point", None)
            if fn and fn not in out:
                out.append(fn)
        return out

    def shown_name(self, name: str) -> str:
        """The name users see for step ``name`` in status and progress, as in the plan, the report, the
        telemetry and ``shardfold logs``: a Map of one Task or BatchJob is its body's name (``gather_part``,
        ``infer``), since that is what each of its items runs; any other step its own."""
        step = next((s for s in self.walk() if s.name == name), None)
        if isinstance(step, Map) and len(step.body) == 1 and isinstance(step.body[0], Task | BatchJob):
            return step.body[0].name
        return name

    def step(self, name: str) -> Step:
        for s in self.walk():
            if s.name == name:
                return s
        raise KeyError(name)


def walk_steps(steps: tuple[Step, ...]) -> Iterator[Step]:
    for step in steps:
        yield step
        if isinstance(step, Map):
            yield from walk_steps(step.body)
        elif isinstance(step, Parallel):
            for branch in step.branches:
                yield from walk_steps(branch)


def progress_steps(steps: tuple[Step, ...]) -> Iterator[Step]:
    """Steps shown in progress: all but those inside Map bodies (their work shows as the Map's items)."""
    for step in steps:
        yield step
        if isinstance(step, Parallel):
            for branch in step.branches:
                yield from progress_steps(branch)


def selectable(branch: tuple[Step, ...]) -> list[str]:
    """Names whose results a Parallel exposes from one branch: its top-level Tasks and Parallels."""
    return [s.name for s in branch if isinstance(s, Task | Parallel)]


def _check_steps(steps: tuple[Step, ...], where: str, seen: set[str]) -> None:
    """Check a sequence of steps and the steps inside them; ``seen``: the names taken so far."""
    if not steps:
        raise PlanError(f"{where} has no steps")
    for step in steps:
        _check_name(step, where, seen)
        if isinstance(step, Task | BatchJob):
            _check_task(step)
        elif isinstance(step, Map):
            _check_map(step)
            _check_steps(step.body, f"Map {step.name!r}", seen)
        else:
            if not step.branches:
                raise PlanError(f"Parallel {step.name!r} has no branches")
            for branch in step.branches:
                _check_steps(branch, f"Parallel {step.name!r}", seen)


def _check_name(step: Step, where: str, seen: set[str]) -> None:
    """A step of a known type, named by an identifier no other step (nor a workflow input field) has."""
    if not isinstance(step, Task | BatchJob | Map | Parallel):
        raise PlanError(f"{where}: {step!r} is not a Task, BatchJob, Map or Parallel")
    if not _NAME_RE.match(step.name):
        raise PlanError(f"{where}: step name {step.name!r} must be an identifier (letters, digits, _)")
    if step.name in RESERVED_NAMES:
        raise PlanError(f"{where}: step name {step.name!r} is reserved for workflow input fields")
    if step.name in seen:
        raise PlanError(f"{where}: step name {step.name!r} is used twice; names must be unique")
    seen.add(step.name)


def _check_task(step: Task | BatchJob) -> None:
    """A Task's or BatchJob's mode, timeout and memory."""
    if isinstance(step, Task) and step.mode not in MODES:
        raise PlanError(f"step {step.name!r}: mode must be 'thread' or 'process'")
    if isinstance(step, Task) and step.mode_from is not None and not _PATH_RE.fullmatch(step.mode_from):
        raise PlanError(
            f"step {step.name!r}: mode_from {step.mode_from!r} must be a JSONPath like '$.item.mode'"
        )
    if step.timeout_s < 1 or step.memory_mb < 128:
        raise PlanError(f"step {step.name!r}: timeout_s must be >= 1 and memory_mb >= 128")
    if isinstance(step, BatchJob) and step.timeout_s < 60:
        raise PlanError(f"BatchJob {step.name!r}: timeout_s must be >= 60 (AWS Batch's minimum)")


def _check_map(step: Map) -> None:
    """A Map's items path, concurrency and tolerated failures."""
    if not _PATH_RE.fullmatch(step.items):
        raise PlanError(f"Map {step.name!r}: items {step.items!r} must be a JSONPath like '$.plan.worklist'")
    if step.max_concurrency < 0:
        raise PlanError(f"Map {step.name!r}: max_concurrency must be >= 0")
    pct = step.tolerated_failure_percentage
    if pct is not None and not 0.0 <= pct <= 100.0:
        raise PlanError(f"Map {step.name!r}: tolerated_failure_percentage must be within 0..100")
