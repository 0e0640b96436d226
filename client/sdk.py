"""The Python SDK: :class:`Client` submits and inspects jobs on a backend; :class:`Job` is one job.

Every backend has a store root (``file://...`` locally, ``s3://<bucket>`` on AWS and moto) and an executor
implementing the contract's interface (start/status/wait/cancel/resume/jobs). ``submit`` goes through the one
submit path (:mod:`functions.submit`: validation, policy, the plan check against the memory each task gets,
``jobs/<id>/spec.json``) with the executor as the starter; from then on status comes from the executor and
the result from ``jobs/<id>/result.json``, the same on every backend.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from shardfold.client import telemetry_table
from shardfold.client.errors import BackendError, JobNotFinished, ended_badly
from shardfold.functions import extras, kinds, report, store, telemetry
from shardfold.functions.access import Grants
from shardfold.functions.errors import JobNotFound, ShardfoldError, SpecError
from shardfold.functions.estimate import Estimate
from shardfold.functions.jobs import kind_of, result_key, spec_key
from shardfold.functions.log import logger
from shardfold.functions.specs import BatchItem, JobSpec, dump_spec, parse_spec
from shardfold.functions.store.uri import join
from shardfold.functions.submit import check, submit


def _quiet_by_default() -> None:
    """The SDK shows the library's warnings and errors only, so a program's own output is not mixed with
    JSON log lines; ``logging.getLogger("shardfold").setLevel(logging.INFO)`` shows more. A
    ``POWERTOOLS_LOG_LEVEL`` set in the environment wins (on Lambda, and the CLI's ``-v``). The local
    executor's worker processes build their loggers from that variable, so it is set for them too."""
    if os.environ.get("POWERTOOLS_LOG_LEVEL") or os.environ.get("LOG_LEVEL"):
        return
    logging.getLogger("shardfold").setLevel(logging.WARNING)
    os.environ["POWERTOOLS_LOG_LEVEL"] = "WARNING"


_quiet_by_default()

BACKENDS = ("local", "aws", "moto")
SpecInput = BaseModel | dict | str | bytes | os.PathLike
DETACH_START_S = 60.0  # how long submit(detach=True) waits for the detached process to start the job


def load_spec_document(spec: SpecInput) -> tuple[Any, str | None]:
    """The spec as a dict/JSON text plus the URI its ``./`` and ``../`` fields are relative to.

    A path (``Path`` or a string naming an existing ``.json`` file) is read; its ``./`` and ``../`` URI
    fields are then relative to the file, so a spec can ship with its data (see ``events/``). Those of a
    dict or JSON text (``shardfold run -``) are relative to the working directory. A model built in Python
    was resolved when it was built: its values are kept as they are."""
    if isinstance(spec, BaseModel):
        return dump_spec(spec), None
    if isinstance(spec, os.PathLike) or (
        isinstance(spec, str) and spec.endswith(".json") and "\n" not in spec and Path(spec).is_file()
    ):
        path = Path(spec).resolve()
        try:
            return path.read_bytes(), path.as_uri()
        except OSError as exc:
            raise SpecError(f"cannot read spec file {path}: {exc.strerror}") from exc
    return spec, (Path.cwd() / "spec.json").as_uri()  # a file's siblings: the working directory's files


def validate_spec(spec: SpecInput) -> JobSpec:
    """Validate a spec from any accepted form; raises :class:`SpecError` naming every bad field."""
    doc, base = load_spec_document(spec)
    return parse_spec(doc, base_uri=base)


def _refuse_in_a_bootstrapping_worker() -> None:
    """Refuse to submit from a process that multiprocessing is still bootstrapping.

    A process started with multiprocessing's ``spawn`` or ``forkserver`` method re-runs the user's main
    script as it starts (the local executor's own workers skip that, but a user's pool, a DataLoader's
    workers, do not); a script without ``if __name__ == "__main__":`` would otherwise submit the job again
    from every such process (and, for dpquery, reserve privacy budget each time before failing)."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise ShardfoldError(
            "a job was submitted while a new process was importing your script (multiprocessing's spawn and "
            "forkserver start methods re-run the main script in each process they start); put the code that "
            'runs jobs under `if __name__ == "__main__":` so that those processes do not submit it again'
        )


class Client:
    """Entry point of the SDK. ``Client()`` runs jobs in-process on the local store.

    ``backend="aws"`` uses a deployed stack: ``stack="NAME"`` the outputs ``shardfold deploy --stack NAME``
    saved (per user, in ``~/.config/shardfold/stacks/NAME.json``; see :mod:`client.stack`), without it
    ``$SHARDFOLD_STACK``'s, else stack ``dev``'s; or ``stack=`` a dict of the outputs. ``backend="moto"``
    builds the same stack inside moto and drives it with the AWS executor (a local dry run of the cloud path;
    its state lives as long as the client).
    """

    def __init__(self, backend: str = "local", *, stack: dict[str, Any] | str | None = None):
        if backend not in BACKENDS:
            raise BackendError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.backend = backend
        self._closers: list[Any] = []
        self.interrupted: list[str] = []  # jobs :meth:`interrupt` stopped
        self._fedavg: Any = None
        self._dpquery: Any = None
        self._inference: Any = None
        from shardfold.client import backends  # deferred: pulls in orchestrator (and moto for backend="moto")

        self.executor, self.store_root, self._closers = backends.make(backend, stack)
        logger.debug("client ready", extra={"backend": backend, "store_root": self.store_root})

    # -- lifecycle ----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Release backend resources (moto's mock, the executor's pools)."""
        while self._closers:
            closer = self._closers.pop()
            closer()

    def interrupt(self, reason: str = "the client was interrupted") -> list[str]:
        """Stop the jobs this client's process is running, now (local backend: their worker processes are
        killed and they are recorded INTERRUPTED, for ``resume`` to continue). Jobs on AWS run on; this
        process only stops watching them. Returns the ids of the jobs stopped."""
        stop = getattr(self.executor, "interrupt", None)
        stopped = list(stop(reason)) if callable(stop) else []
        self.interrupted += stopped
        return stopped

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # Ctrl-C (or a signal the CLI turns into KeyboardInterrupt) ends this process's jobs and their
        # worker processes, rather than waiting for them in close()
        if isinstance(exc, KeyboardInterrupt):
            self.interrupt(f"{type(exc).__name__}: {exc}" if str(exc) else "KeyboardInterrupt")
        self.close()

    # -- jobs ---------------------------------------------------------------------------------------------

    def uri(self, key: str) -> str:
        """URI of a key relative to this backend's store root."""
        return join(self.store_root, key)

    @property
    def deployed(self) -> dict[str, Any] | None:
        """The deployed sizes the plan check uses (the stack's ``sizes`` output); None locally."""
        return getattr(self.executor, "deployed_sizes", None)

    @property
    def runs_here(self) -> bool:
        """Whether this machine runs the jobs' tasks (the local and moto backends), and so needs the extras
        each kind imports (``pip install 'shardfold[dp]'``, ...); on AWS the deployed images have them."""
        return self.backend != "aws"

    @property
    def grants(self) -> Grants | None:
        """What the deployment lets jobs read and write (from the stack outputs); None locally."""
        return getattr(self.executor, "grants", None)

    def plan(self, spec: SpecInput) -> Estimate:
        """Dry run: steps, task counts, per-task memory, request counts and a cost estimate. Runs nothing.

        Raises :class:`PlanError` when a task would not fit the memory it gets.
        """
        doc, base = load_spec_document(spec)
        return check(
            doc,
            store_root=self.store_root,
            base_uri=base,
            deployed=self.deployed,
            grants=self.grants,
            runs_here=self.runs_here,
        )[1]

    def submit(self, spec: SpecInput, *, detach: bool = False, upload: bool = False) -> Job:
        """Validate ``spec``, check its plan, record it and start it; returns the :class:`Job` at once.

        ``detach`` (local backend): the job runs in a process of its own that outlives this one (its log in
        ``jobs/<id>/detached.log``), so this process may exit while it runs; ``Job.wait()`` (or `shardfold
        wait ID`) follows it from any process. On AWS a job never depends on the submitting process.
        ``upload``: first copy the local files the spec names as inputs into the store, under
        ``uploads/<content hash>/<name>``, and name them there (:mod:`client.uploads`): how a spec written
        for this machine runs on AWS or on the moto backend, whose jobs read only ``s3://`` objects."""
        _refuse_in_a_bootstrapping_worker()
        doc, base = load_spec_document(spec)
        if upload:
            from shardfold.client.uploads import upload_inputs

            doc, base = upload_inputs(doc, base, self.store_root), None
        local = self.backend == "local"
        job = submit(
            doc,
            store_root=self.store_root,
            start=self._start_detached if detach and local else self.start,
            base_uri=base,
            deployed=self.deployed,
            grants=self.grants,
            runs_here=self.runs_here,
        )
        logger.info("job submitted", extra={"job_id": job.job_id, "kind": job.kind, "backend": self.backend})
        return Job(self, job.job_id, job.kind)

    def start(self, job_id: str, kind: str, spec_uri: str) -> str:
        """Start a recorded job on this backend (the submit path's starter, also the CLI's for ``watch``
        and ``invoke dispatch``); returns its execution's name, ``<backend>:<job id>``."""
        self.executor.start(job_id, kind, spec_uri)
        return f"{self.backend}:{job_id}"

    def _start_detached(self, job_id: str, kind: str, spec_uri: str) -> None:
        """Start the job in a new session (``python -m client.detached``) and return once it runs."""
        import subprocess
        import sys

        from shardfold.functions.store.uri import local_path

        log = local_path(self.uri(f"jobs/{job_id}/detached.log"))
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "shardfold.client.detached", job_id, kind, spec_uri],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # not in this terminal's process group: Ctrl-C here does not stop it
            )
        status = self.uri(f"jobs/{job_id}/status.json")
        deadline = time.monotonic() + DETACH_START_S
        while not store.exists(status):
            if proc.poll() is not None:
                raise BackendError(
                    f"job {job_id}: the detached process exited ({proc.returncode}); see {log}"
                )
            if time.monotonic() > deadline:
                raise BackendError(f"job {job_id}: the detached process did not start it in time; see {log}")
            time.sleep(0.05)

    def job(self, job_id: str) -> Job:
        """A handle on an existing job, by its id or the start of one that names one job only
        (``getbatch-2026`` when no other job's id starts so); :class:`JobNotFound` if this backend never
        saw it or the start names several."""
        if not store.exists(self.uri(spec_key(job_id))):
            starting = sorted(s.job_id for s in self.jobs() if job_id and s.job_id.startswith(job_id))
            if len(starting) > 1:
                raise JobNotFound(
                    f"{job_id!r} starts {len(starting)} job ids on the {self.backend} backend: "
                    f"{', '.join(starting[:5])}{', ...' if len(starting) > 5 else ''}; give more of the id"
                )
            if not starting:
                raise JobNotFound(
                    f"no job {job_id!r} on the {self.backend} backend (store {self.store_root}); "
                    "`shardfold jobs` lists the jobs there"
                )
            job_id = starting[0]
        kind = kind_of(job_id) or store.get_json(self.uri(spec_key(job_id))).get("kind", "?")
        return Job(self, job_id, kind)

    def jobs(self) -> list[Any]:
        """Every job's :class:`JobStatus` on this backend, as the executor reports them."""
        return list(self.executor.jobs())

    def clean(self, older_than_s: float = 0.0, *, failed: bool = False) -> list[str]:
        """Remove the scratch objects and the journal of ended jobs; returns their ids.

        A SUCCEEDED job keeps its spec, status, result and outputs. ``failed=True`` cleans FAILED and
        CANCELLED jobs too, which can then no longer be resumed. ``older_than_s``: only jobs that ended at
        least that long ago."""
        import datetime as dt
        import math

        from shardfold.functions.jobs import job_key, kind_of, scratch_key

        if not isinstance(older_than_s, int | float) or not math.isfinite(older_than_s) or older_than_s < 0:
            raise SpecError(f"older_than_s must be a finite number of seconds >= 0, not {older_than_s!r}")
        states = {"SUCCEEDED", "FAILED", "CANCELLED"} if failed else {"SUCCEEDED"}
        cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=min(older_than_s, 1e11))
        cleaned = []
        for st in self.jobs():
            # the job's identity is where its record lives (the executors read it so); its scratch is the
            # folder its registered kind names, inside its own folder, and nothing else
            kind = kind_of(st.job_id)
            if kind is None or kind != st.kind or kind not in kinds.packages():
                continue
            if st.state not in states or not st.ended_at:
                continue
            try:
                ended = dt.datetime.fromisoformat(st.ended_at)
            except ValueError:
                continue  # not a time our executors write: not a job this can prove ended
            if ended.tzinfo is None or ended > cutoff:
                continue
            for prefix in (scratch_key(st.job_id, kind), job_key(st.job_id, "journal") + "/"):
                store.delete_prefix(self.uri(prefix))
            cleaned.append(st.job_id)
        return cleaned

    def delete(self, job_id: str) -> str:
        """Remove an ended job's folder from the store: its spec, status, journal, scratch, result and the
        outputs written inside it (an ``output`` the spec placed elsewhere stays, as does a dpquery job's
        entry in its dataset's budget ledger: spent budget stays spent). Refuses a job that is still running.
        Returns the job's id."""
        from shardfold.functions.jobs import job_key

        job = self.job(job_id)
        status = job.status()
        if not status.finished:
            raise SpecError(
                f"job {job.job_id} is {status.state}: cancel it first (`shardfold cancel {job.job_id}`)",
                [{"field": "job_id", "error": "the job is still running"}],
            )
        store.delete_prefix(self.uri(job_key(job.job_id) + "/"))
        return job.job_id

    # -- direct helpers -----------------------------------------------------------------------------------

    @property
    def fedavg(self) -> Any:
        """The ``fedavg`` helpers (:class:`client.fedavg.FedAvg`): ``save_update``, ``load``, ``run``."""
        from shardfold.client.fedavg import FedAvg  # deferred: numpy and safetensors only when used

        if self._fedavg is None:
            self._fedavg = FedAvg(self)
        return self._fedavg

    @property
    def dpquery(self) -> Any:
        """The ``dpquery`` helpers (:class:`client.dpquery.DPQuery`): ``plan`` (no data), ``run``,
        ``tables``, ``arrays``, ``budget``."""
        from shardfold.client.dpquery import DPQuery  # deferred: pyarrow and the planner only when used

        if self._dpquery is None:
            self._dpquery = DPQuery(self)
        return self._dpquery

    @property
    def inference(self) -> Any:
        """The ``inference`` helpers (:class:`client.inference.Inference`): ``run``, ``submit``, ``load``."""
        from shardfold.client.inference import Inference  # deferred: numpy and pyarrow only when used

        if self._inference is None:
            self._inference = Inference(self)
        return self._inference

    def _item(self, item: BatchItem | dict | str) -> BatchItem:
        item = (
            item
            if isinstance(item, BatchItem)
            else BatchItem.model_validate({"uri": item} if isinstance(item, str) else item)
        )
        # Relative keys name objects under this backend's root. Locally the store resolves (and confines)
        # them itself; on S3 they are keys in the stack's bucket.
        if "://" not in item.uri and self.backend != "local":
            item = item.model_copy(update={"uri": self.uri(item.uri)})
        return item

    def get_batch(
        self,
        items: Iterable[BatchItem | dict | str],
        continue_on_error: bool = False,
        *,
        stream: bool = False,
        **options: Any,
    ) -> list[Any] | Iterator[Any]:
        """Fetch many objects (ranges, TAR members) in one ordered request, in this process.

        Returns the :class:`BatchEntry` list in request order (``stream=True``: a generator yielding each
        entry as soon as it and all before it have arrived). ``options`` pass through to
        :func:`functions.store.get_batch` (window, concurrency, max_bytes, max_soft_errors, hedge_after...).
        """
        batch = [self._item(i) for i in items]
        entries = store.get_batch(batch, continue_on_error=continue_on_error, **options)
        return entries if stream else list(entries)


class Job:
    """One job on one backend. Cheap to create; every call asks the backend afresh."""

    def __init__(self, client: Client, job_id: str, kind: str):
        self.client = client
        self.job_id = job_id
        self.kind = kind
        self._kind_progress: tuple[float, dict[str, Any]] | None = None  # (read at, counters)

    def __repr__(self) -> str:
        return f"Job({self.job_id!r}, backend={self.client.backend!r})"

    @property
    def spec_uri(self) -> str:
        """Where the job's spec was recorded at submit (``jobs/<id>/spec.json``)."""
        return self.client.uri(spec_key(self.job_id))

    @property
    def result_uri(self) -> str:
        """Where the job's result summary is written when it succeeds (``jobs/<id>/result.json``)."""
        return self.client.uri(result_key(self.job_id))

    def spec(self) -> dict[str, Any]:
        """The spec as recorded at submit: validated, with every URI resolved."""
        return store.get_json(self.spec_uri)

    def status(self) -> Any:
        """The executor's :class:`JobStatus`: state, per-step progress counts (plus the kind's own counters,
        e.g. an inference job's ``embedded_shards``), error."""
        return self._with_kind_progress(self.client.executor.status(self.job_id))

    def wait(self, progress: bool = True, timeout_s: float | None = None, console: Any = None) -> Any:
        """Block until the job ends; returns its final :class:`JobStatus` (check ``.state``).

        ``progress=True`` draws one rich progress bar per step (on stderr); ``False`` is silent.
        """
        if not progress:
            status = self.client.executor.wait(self.job_id, on_progress=None, timeout_s=timeout_s)
            return self._with_kind_progress(status)
        from shardfold.client.progress import ProgressView

        with ProgressView(self.job_id, console=console) as view:

            def show(status: Any) -> None:
                view.update(self._with_kind_progress(status, throttle_s=2.0))

            status = self._with_kind_progress(
                self.client.executor.wait(self.job_id, on_progress=show, timeout_s=timeout_s)
            )
            view.update(status)
        return status

    def _with_kind_progress(self, status: Any, throttle_s: float = 0.0) -> Any:
        """``status`` with the kind's counters added to its steps (read at most every ``throttle_s``; while
        there are none yet, as the work is not planned, every quarter second: a counter's bar then begins
        when its work does)."""
        if self.kind not in kinds.packages() or kinds.find(self.kind).progress is None:
            return status
        kind = kinds.find(self.kind)
        now = time.monotonic()
        cached = self._kind_progress
        if cached is None or now - cached[0] >= (throttle_s if cached[1] else min(throttle_s, 0.25)):
            cached = None
        if cached is None or status.finished:
            try:
                cached = (now, kind.counters(self.client.store_root, self.job_id))
            except ShardfoldError:  # the store is unreachable now; the executor's own counts still show
                cached = (now, {})
            self._kind_progress = cached
        status.steps = {**status.steps, **cached[1]}
        return status

    def result(self) -> dict[str, Any]:
        """The job's result summary (``jobs/<id>/result.json``), once it SUCCEEDED."""
        status = self.status()
        state = status.state
        if state in ("FAILED", "CANCELLED", "INTERRUPTED"):
            raise ended_badly(self.job_id, state, status.error)
        if state != "SUCCEEDED":
            raise JobNotFinished(
                f"job {self.job_id} is {state}; wait for it (Job.wait() or `shardfold status {self.job_id}`)"
            )
        return store.get_json(self.result_uri)

    def telemetry(self) -> Any:
        """One row per task attempt, as a pyarrow table (``.to_pandas()`` for pandas): step, task, attempt,
        outcome and error, start and end, duration, peak memory, bytes read and written, store requests,
        retries and where the attempt's log is (see :mod:`functions.telemetry`). Merged into
        ``jobs/<id>/telemetry.parquet`` once the job has ended. Needs pyarrow (``shardfold[pandas]``)."""
        extras.require("pandas", "job.telemetry()", modules=("pyarrow",))
        status = self.status()
        ended = status.ended_at if status.finished else None
        return telemetry_table.table(self.client.store_root, self.job_id, ended)

    def report(self) -> dict[str, Any]:
        """What the job did against its plan: per step tasks, peak memory (projected and measured, with the
        worst task), requests, durations and cost, and the BatchBench dimensions (cost, SLA against the
        spec's ``deadline_s``, responsiveness, scaling, the estimator's reasons): :mod:`functions.report`."""
        status = self.status()
        concurrency = getattr(self.client.executor, "threads", None)
        return report.for_job(self.client.store_root, self.job_id, status.to_record(), concurrency)

    def logs(self, step: str | None = None, task: int | None = None) -> Iterator[tuple[dict[str, Any], str]]:
        """``(record, line)`` for each log line of each task attempt (of ``step``, of Map item ``task``), in
        step, task and attempt order. ``step`` is a step's name as status, the plan and the report show it
        (a Map's own name also selects its tasks); another name is refused, listing the job's steps."""
        if step is not None:
            step = self._step_name(step)
        outputs = getattr(self.client.executor, "outputs", None) or {}
        groups = frozenset(str(g) for g in (outputs.get("log_groups") or {}).values())
        root = self.client.store_root
        for record in telemetry.read_records(root, self.job_id):
            if (step is None or record["step"] == step) and (task is None or record.get("task") == task):
                for line in telemetry.log_lines(record, root, self.job_id, groups):
                    yield record, line

    def _step_name(self, step: str) -> str:
        """``step`` as the job's tasks record it (a Map's name: its task's), or SpecError naming the steps."""
        from shardfold.functions.workflow import BatchJob, Task

        if self.kind not in kinds.packages():
            return step
        workflow = kinds.find(self.kind).workflow
        names = [s.name for s in workflow.walk() if isinstance(s, Task | BatchJob)]
        names += [workflow.on_failure.name] if workflow.on_failure is not None else []
        shown = workflow.shown_name(step) if any(s.name == step for s in workflow.walk()) else step
        if shown not in names:
            raise SpecError(
                f"a {self.kind} job has no step {step!r}; its steps are {', '.join(names)}",
                [{"field": "step", "error": f"one of {', '.join(names)}"}],
            )
        return shown

    def cancel(self) -> None:
        """Stop the job; work already committed stays readable."""
        self.client.executor.cancel(self.job_id)

    def resume(self) -> Job:
        """Re-run what did not finish (locally from the journal; on AWS by redrive or restart)."""
        self.client.executor.resume(self.job_id)
        return self
