"""LocalExecutor: runs a workflow in this process, with the data-flow rule the compiled ASL follows.

* Tasks marked ``mode="thread"`` run on threads (I/O-bound), ``mode="process"`` in a process pool
  (CPU-bound). Its workers are forked from a fork server (single-threaded, so no fork-with-threads
  hazards) that imported :data:`POOL_PRELOAD` once: a fresh worker starts in milliseconds, not the
  seconds a spawned Python takes to import them again. A BatchJob runs as a child process of the
  container entry point, ``python -m functions.container``, with Batch's retry table
  (:mod:`orchestrator.local_batch`). Map children run on a thread pool of at most ``threads``
  (:func:`default_threads`: two per core), fewer where the step's ``max_concurrency`` says; Parallel
  branches on one thread each.
* Retries follow the plan's :class:`~functions.workflow.Retry` list with ASL semantics. User errors
  (:class:`ShardfoldError`) are never retried.
* A journal under ``<store_root>/jobs/<id>/journal/`` holds one marker per finished task, Map item step,
  Map and Parallel (written put-if-absent, with the step's small result), so :meth:`resume` re-runs only
  what has not finished, and a retried or resumed step never commits twice.
* :meth:`cancel` sets a flag and writes ``jobs/<id>/cancel`` (so another process's ``shardfold cancel``
  works too); it is checked between tasks and during retry back-off, and the job ends CANCELLED.
* ``jobs/<id>/status.json`` is kept current (at most every ``status_interval_s`` while running).
* The process running a job owns it (:mod:`orchestrator.owner`): ``start`` and ``resume`` claim
  ``jobs/<id>/owner.json`` atomically and a lease thread renews it, so a second ``resume`` of a running
  job is refused naming the owner, and a job whose owner died reads as INTERRUPTED, not RUNNING.
  :meth:`interrupt` (``shardfold run`` stopped by a signal) kills the worker processes and records
  INTERRUPTED; workers of a process killed outright end by themselves (:mod:`orchestrator.lifeline`).
* A final status that cannot be written (disk full) ends the run FAILED in memory, naming why, so
  :meth:`wait` returns rather than blocking on a record that never changes.

A failed task fails the job with an error naming the step, the Map item and the handler's message; what
earlier tasks committed stays in the store.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing
import multiprocessing.context
import multiprocessing.util
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing import popen_forkserver, spawn
from pathlib import Path
from typing import Any

from shardfold.functions import store
from shardfold.functions.errors import JobNotFound, PlanError, ShardfoldError
from shardfold.functions.jobs import cancel_key, job_key, kind_of
from shardfold.functions.log import logger
from shardfold.functions.store.uri import is_file, join, local_path
from shardfold.functions.store.uri import store_root as default_store_root
from shardfold.functions.workflow import (
    LAMBDA_TIMEOUT,
    MODES,
    BatchJob,
    Map,
    Parallel,
    Step,
    Task,
    Workflow,
    progress_steps,
    selectable,
)
from shardfold.functions.worklist import is_worklist_ref, read_worklist
from shardfold.orchestrator import owner as ownership
from shardfold.orchestrator.invoke import MAX_STATE_BYTES, HandlerFailed, call, call_in_worker
from shardfold.orchestrator.lifeline import pool_worker_init
from shardfold.orchestrator.local_batch import Cancelled, run_container
from shardfold.orchestrator.registry import handler_path
from shardfold.orchestrator.status import (
    JobStatus,
    ProgressCallback,
    now,
    read_status,
    resume_hint,
    status_uri,
    step_error,
    write_status,
)

# A cold process-pool worker imports the handler before its clock starts (seconds on a loaded machine, more
# for the fork server's first start): the parent's backstop on a process-mode task waits this much beyond
# its timeout.
WORKER_START_S = 60
# What the built-in kinds' process-mode handlers import first, imported once by the fork server (about 2 s;
# the handler modules themselves add 0.1-0.6 s in each worker, and only the kind in use is imported).
POOL_PRELOAD = ("shardfold.functions.runtime", "shardfold.functions.store", "numpy", "pyarrow.parquet")


class _Cancelled(Exception):
    pass


class _StepFailed(Exception):
    """A step failed for good (retries exhausted or not retryable); the message is the job's error."""


@dataclass
class _Run:
    workflow: Workflow
    input: dict[str, Any]
    status: JobStatus
    journal: str
    cancel_uri: str
    done: set[str]
    cancel: threading.Event = field(default_factory=threading.Event)
    cond: threading.Condition = field(default_factory=threading.Condition)
    version: int = 0
    thread: threading.Thread | None = None
    last_status_write: float = 0.0
    write_lock: threading.Lock = field(default_factory=threading.Lock)
    max_state_bytes: int = 0
    owner: ownership.Owner | None = None
    lease: ownership.Lease | None = None
    lost_to: ownership.Owner | None = None  # another process took the job over (this one's lease lapsed)
    ended: bool = False  # the final record is written (or not ours to write): no status write after it
    children: set = field(default_factory=set)  # running Batch container processes

    def snapshot(self) -> JobStatus:
        with self.cond:
            return JobStatus(**self.status.to_record())


def map_result_bytes(children: int) -> int:
    """The size of the result a Distributed Map gathers from ``children`` children that succeed, each
    output ``{}`` (the compiled children's last state has OutputPath null): ``[{},{},...]``. AWS fails the
    Map with States.DataLimitExceeded above 256 KiB even under ResultPath null (aws-cdk#24799)."""
    return 2 + 2 * children + max(0, children - 1)


def _key(scope: tuple[str, ...], name: str) -> str:
    return "/".join((*scope, name))


def _lookup(state: dict[str, Any], path: str) -> Any:
    node: Any = state
    for part in path.removeprefix("$.").split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _mode(step: Task, state: dict[str, Any]) -> str:
    """How this call runs: the mode its input names at ``step.mode_from``, else the step's own."""
    named = _lookup(state, step.mode_from) if step.mode_from else None
    return named if named in MODES else step.mode


def default_threads() -> int:
    """How many Map children run at once locally: two per core, at least 4. Thread-mode tasks are I/O-bound
    on AWS but share one interpreter here: more of them only take turns holding its lock."""
    return max(4, 2 * (os.cpu_count() or 2))


class LocalExecutor:
    """Runs workflows in-process. ``retry_delay_scale`` multiplies retry back-off (tests use 0)."""

    backend = "local"

    def __init__(
        self,
        store_root: str | None = None,
        workflows: Mapping[str, Workflow] | None = None,
        *,
        threads: int | None = None,
        processes: int | None = None,
        retry_delay_scale: float = 1.0,
        status_interval_s: float = 0.5,
        lease_s: float = ownership.LEASE_S,
    ):
        if workflows is None:
            from shardfold.functions.kinds import WORKFLOWS

            workflows = WORKFLOWS
        self.store_root = (store_root or default_store_root()).rstrip("/")
        self.workflows = workflows
        self.threads = threads or default_threads()
        self.processes = processes or os.cpu_count() or 2
        self.retry_delay_scale = retry_delay_scale
        self.status_interval_s = status_interval_s
        self.lease_s = lease_s
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()
        self._pool: cf.ProcessPoolExecutor | None = None
        self._interrupted: str | None = None

    # --- executor interface ----------------------------------------------------------------------------

    def start(self, job_id: str, kind: str, spec_uri: str) -> None:
        """Start the job on a background thread and return."""
        workflow = self._workflow(kind)
        with self._lock:
            if job_id in self._runs or store.exists(self._uri(job_id, "status.json")):
                raise ShardfoldError(f"job {job_id} already exists; use resume to continue it")
            me = ownership.claim(self.store_root, job_id, self.lease_s)
            run = self._adopt(job_id, me, lambda: self._new_run(job_id, workflow, spec_uri, started_at=now()))
        self._launch(run)

    def status(self, job_id: str) -> JobStatus:
        run = self._runs.get(job_id)
        if run is not None:
            return run.snapshot()
        return self._reconciled(JobStatus.from_record(read_status(self.store_root, job_id)))

    def wait(
        self, job_id: str, on_progress: ProgressCallback | None = None, timeout_s: float | None = None
    ) -> JobStatus:
        """Block until the job ends (or ``timeout_s`` passes); call ``on_progress`` on every change seen."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        run = self._runs.get(job_id)
        if run is None:
            return self._poll_record(job_id, on_progress, deadline)
        seen = -1
        while True:
            with run.cond:
                while run.version == seen and not run.status.finished:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    run.cond.wait(timeout=1.0 if left is None else min(left, 1.0))
                seen = run.version
            snap = run.snapshot()
            if on_progress is not None:
                on_progress(snap)
            if snap.finished or (deadline is not None and time.monotonic() >= deadline):
                return snap

    def cancel(self, job_id: str) -> None:
        """Ask the job to stop; it ends CANCELLED once the tasks now running return. An INTERRUPTED job
        (nothing runs it) is recorded CANCELLED at once."""
        run = self._runs.get(job_id)
        current = self.status(job_id)  # (JobNotFound for an unknown id)
        if current.state == "INTERRUPTED" and run is None:
            self._cancel_interrupted(current)
            return
        if current.finished:
            return
        store.put(join(self.store_root, cancel_key(job_id)), now().encode())
        if run is not None:
            run.cancel.set()
            self._notify(run)

    def resume(self, job_id: str) -> None:
        """Re-run only the unfinished steps of a failed, cancelled or interrupted job (in the background).

        Refused (:class:`~orchestrator.owner.JobOwned`, naming the host and pid) while a live process, this
        one included, runs the job."""
        with self._lock:
            record = read_status(self.store_root, job_id)
            if record.get("state") == "SUCCEEDED":
                logger.info("nothing to resume", extra={"job_id": job_id})
                return
            workflow = self._workflow(record["kind"])
            me = ownership.claim(self.store_root, job_id, self.lease_s)
            record = read_status(self.store_root, job_id)  # again: the previous owner may have ended it
            if record.get("state") == "SUCCEEDED":
                ownership.release(self.store_root, job_id, me)
                logger.info("nothing to resume", extra={"job_id": job_id})
                return

            def new_run() -> _Run:
                if store.exists(join(self.store_root, cancel_key(job_id))):
                    store.delete(join(self.store_root, cancel_key(job_id)))
                return self._new_run(
                    job_id, workflow, record["spec_uri"], started_at=record.get("started_at")
                )

            run = self._adopt(job_id, me, new_run)
        logger.info("resuming", extra={"job_id": job_id, "finished_steps": len(run.done)})
        self._launch(run)

    def jobs(self) -> list[JobStatus]:
        out = [self.status(job_id) for job_id in self._job_ids()]
        return sorted(out, key=lambda s: (s.started_at or "", s.job_id))

    def close(self) -> None:
        """Shut the process pool down (running jobs keep their threads)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def interrupt(self, reason: str) -> list[str]:
        """Stop every job this executor is running, now: kill its worker processes (the pool's and the
        Batch containers), record each job INTERRUPTED (naming ``reason`` and the command that resumes it)
        and let it go, so ``shardfold resume`` can continue it at once. For a process about to exit
        (``shardfold run`` got SIGTERM or Ctrl-C); the executor runs nothing after it. Returns the job ids."""
        self._interrupted = reason
        runs = [run for run in list(self._runs.values()) if not run.snapshot().finished]
        for run in runs:
            run.cancel.set()
        self._kill_pool()
        for run in runs:
            for proc in list(run.children):
                _kill(proc)
        stopped = []
        for run in runs:
            job_id = run.status.job_id
            final = run.snapshot()
            final.state, final.ended_at = "INTERRUPTED", now()
            final.error = f"interrupted ({reason}); {resume_hint(job_id)}"
            if self._end(run, final):
                stopped.append(job_id)
        logger.warning("jobs interrupted", extra={"job_ids": stopped, "reason": reason})
        return stopped

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def max_state_bytes(self, job_id: str) -> int:
        """Largest state (JSON bytes) this executor passed to a handler for ``job_id`` in this process."""
        run = self._runs.get(job_id)
        if run is None:
            raise JobNotFound(f"job {job_id} has not run in this executor")
        return run.max_state_bytes

    # --- set-up ------------------------------------------------------------------------------------------

    def _workflow(self, kind: str) -> Workflow:
        try:
            return self.workflows[kind]
        except KeyError:
            raise PlanError(f"unknown job kind {kind!r}; known: {sorted(self.workflows)}") from None

    def _uri(self, job_id: str, *parts: str) -> str:
        return join(self.store_root, job_key(job_id, *parts))

    def _new_run(self, job_id: str, workflow: Workflow, spec_uri: str, started_at: str | None) -> _Run:
        journal = self._uri(job_id, "journal")
        done = self._journal_keys(journal)
        steps: dict[str, dict[str, int | None]] = {}
        for step in progress_steps(workflow.steps):
            total = None if isinstance(step, Map) else 1
            shown = workflow.shown_name(step.name)
            steps[shown] = {"done": 0, "total": total}
            if step.name in done:
                marker = store.get_json(self._marker_uri(journal, step.name))
                total = marker.get("items", 1)
                steps[shown] = {"done": total, "total": total}
        status = JobStatus(
            job_id=job_id,
            kind=workflow.kind,
            state="RUNNING",
            steps=steps,
            backend=self.backend,
            started_at=started_at,
            spec_uri=spec_uri,
        )
        run_input = {"job_id": job_id, "spec_uri": spec_uri, "store_root": self.store_root}
        return _Run(workflow, run_input, status, journal, join(self.store_root, cancel_key(job_id)), done)

    def _journal_keys(self, journal: str) -> set[str]:
        prefix = journal + "/"
        keys = set()
        for uri in store.list_uris(prefix):
            if uri.startswith(prefix) and uri.endswith(".json"):
                keys.add(uri[len(prefix) : -len(".json")])
        return keys

    @staticmethod
    def _marker_uri(journal: str, key: str) -> str:
        return f"{journal}/{key}.json"

    def _adopt(self, job_id: str, me: ownership.Owner, new_run: Callable[[], _Run]) -> _Run:
        """The run ``new_run()`` builds, owned by ``me``; the claim is let go if that fails."""
        try:
            run = new_run()
        except BaseException:
            ownership.release(self.store_root, job_id, me)
            raise
        run.owner = me
        self._runs[job_id] = run
        return run

    def _launch(self, run: _Run) -> None:
        job_id = run.status.job_id
        try:
            self._write_status(run, force=True)
        except BaseException:
            with self._lock:
                self._runs.pop(job_id, None)
            if run.owner is not None:
                ownership.release(self.store_root, job_id, run.owner)
            raise
        if run.owner is not None:

            def lost(other: ownership.Owner) -> None:
                run.lost_to = other
                run.cancel.set()
                self._notify(run)

            run.lease = ownership.Lease(
                self.store_root, job_id, run.owner, self.lease_s, on_lost=lost
            ).start()
        run.thread = threading.Thread(
            target=self._run_job, args=(run,), name=f"shardfold-{run.status.job_id}", daemon=True
        )
        run.thread.start()

    def _job_ids(self) -> list[str]:
        ids = set(self._runs)
        root = join(self.store_root, "jobs")
        if is_file(root):
            path = local_path(root)
            if path.is_dir():
                ids.update(p.parent.name for p in Path(path).glob("*/status.json"))
        else:
            for uri in store.list_uris(root + "/"):
                rel = uri[len(root) + 1 :].split("/")
                if len(rel) == 2 and rel[1] == "status.json":
                    ids.add(rel[0])
        return sorted(i for i in ids if kind_of(i) is not None)  # a folder not named as a job is none

    # --- running -----------------------------------------------------------------------------------------

    def _run_job(self, run: _Run) -> None:
        job_id = run.status.job_id
        logger.info("job start", extra={"job_id": job_id, "kind": run.workflow.kind})
        try:
            try:
                self._run_steps(run, run.workflow.steps, dict(run.input), (), None)
            except _Cancelled:
                self._finish(run, "CANCELLED", None)
            except _StepFailed as exc:  # a task that saw the cancel stops with an error: cancelled, still
                self._on_failure(run)
                self._finish(run, *(("CANCELLED", None) if run.cancel.is_set() else ("FAILED", str(exc))))
            except Exception as exc:  # an executor bug must still end the job, not leave it RUNNING
                logger.exception("executor error", extra={"job_id": job_id})
                self._finish(run, "FAILED", f"executor error: {type(exc).__name__}: {exc}")
            else:
                self._finish(run, "SUCCEEDED", None)
        finally:
            if not run.snapshot().finished:  # _finish itself broke: waiters must still wake
                with run.cond:
                    run.status.state, run.status.ended_at = "FAILED", now()
                    run.status.error = f"the executor could not end the job; {resume_hint(job_id)}"
                    run.version += 1
                    run.cond.notify_all()

    def _run_steps(
        self,
        run: _Run,
        steps: tuple[Step, ...],
        state: dict[str, Any],
        scope: tuple[str, ...],
        index: int | None,
    ) -> dict[str, Any]:
        for step in steps:
            self._check_cancel(run)
            if isinstance(step, Task):
                state = {**state, step.name: self._run_call(run, step, step.function, state, scope, index)}
            elif isinstance(step, BatchJob):
                self._run_call(run, step, step.entry_point, state, scope, index)
            elif isinstance(step, Map):
                self._run_map(run, step, state, scope, index)
            else:
                result = self._run_parallel(run, step, state, scope, index)
                if result is not None:
                    state = {**state, step.name: result}
        return state

    def _run_call(
        self,
        run: _Run,
        step: Task | BatchJob,
        function: str,
        state: dict[str, Any],
        scope: tuple[str, ...],
        index: int | None,
    ) -> Any:
        key = _key(scope, step.name)
        if key in run.done:
            return store.get_json(self._marker_uri(run.journal, key))["result"]
        result = self._call_with_retry(run, step, function, state, index)
        while isinstance(step, Task) and step.poll and not result.get("ready"):
            self._wait(run, result["wait_s"])  # a Wait state: the state machine's time, no task running
            result = self._call_with_retry(run, step, function, {**state, step.name: result}, index)
        if isinstance(step, BatchJob):
            result = None  # ResultPath null, as on AWS
        result = self._commit(run, key, {"result": result})["result"]
        if index is None:
            self._progress(run, step.name, inc=1)
        return result

    def _on_failure(self, run: _Run) -> None:
        """The workflow's ``on_failure`` task, once, as the state machine runs it from a step's Catch; what
        it raises is logged, and the job ends as it would have."""
        task = run.workflow.on_failure
        if task is None:
            return
        try:
            self._call_with_retry(run, task, task.function, dict(run.input), None)
        except (_StepFailed, _Cancelled, Exception) as exc:  # noqa: BLE001 - it must not mask the failure
            logger.warning("on_failure task failed", extra={"job_id": run.status.job_id, "error": str(exc)})

    def _commit(self, run: _Run, key: str, marker: dict[str, Any]) -> dict[str, Any]:
        """Write the step's journal marker once; a marker already there (a concurrent run) wins."""
        uri = self._marker_uri(run.journal, key)
        if not store.put_if_absent(uri, json.dumps(marker).encode()):
            marker = store.get_json(uri)
        run.done.add(key)
        return marker

    def _call_with_retry(
        self, run: _Run, step: Task | BatchJob, function: str, state: dict[str, Any], index: int | None
    ) -> Any:
        path = handler_path(function)
        size = len(json.dumps(state).encode())
        run.max_state_bytes = max(run.max_state_bytes, size)
        attempts = [0] * len(step.retry)
        while True:
            try:
                if isinstance(step, BatchJob):
                    return run_container(
                        path,
                        function,
                        state,
                        timeout_s=step.timeout_s,
                        cancel=run.cancel,
                        children=run.children,
                        step=step.name,
                    )
                return self._invoke(step, path, function, state)
            except Cancelled:
                raise _Cancelled from None
            except HandlerFailed as failure:
                which = None
                if not failure.user_error:
                    which = next((i for i, r in enumerate(step.retry) if failure.error in r.errors), None)
                if which is None or attempts[which] >= step.retry[which].max_attempts:
                    error, message = failure.error, failure.message
                    if isinstance(step, BatchJob):  # as Step Functions reports a failed Batch job
                        error, message = "States.TaskFailed", f"{failure.error}: {failure.message}"
                    raise _StepFailed(step_error(step.name, index, error, message)) from None
                attempts[which] += 1
                retrier = step.retry[which]
                delay = retrier.delay_s(attempts[which])
                if retrier.jitter:
                    delay = random.uniform(0, delay)
                logger.warning(
                    "retrying",
                    extra={
                        "step": step.name,
                        "index": index,
                        "error": failure.error,
                        "attempt": attempts[which],
                    },
                )
                if run.cancel.wait(delay * self.retry_delay_scale):
                    raise _Cancelled from None
                self._check_cancel(run)

    def _invoke(self, step: Task, path: str, function: str, state: dict[str, Any]) -> Any:
        """Run the task as Lambda would, its ``timeout_s`` included: a task still running then fails with
        Lambda's ``Sandbox.Timedout``. A process-mode task is stopped in its worker (and a worker that does
        not stop is killed, the pool with it, as Lambda ends the sandbox); a thread cannot be stopped, so a
        thread-mode task is abandoned to finish alone."""
        kwargs = {"function_name": function, "memory_mb": step.memory_mb, "timeout_s": step.timeout_s}
        timed_out = HandlerFailed(
            LAMBDA_TIMEOUT, f"{function} ran past its timeout of {step.timeout_s} s (the step's timeout_s)"
        )
        if _mode(step, state) == "thread":
            future: cf.Future = cf.Future()

            def run() -> None:
                try:
                    future.set_result(call(path, state, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                    future.set_exception(exc)

            threading.Thread(target=run, name=f"sf-task-{step.name}", daemon=True).start()
            try:
                return future.result(timeout=step.timeout_s)
            except cf.TimeoutError:
                raise timed_out from None
        if self._interrupted is not None:
            raise _Cancelled
        try:
            # the worker stops its own handler at timeout_s; this backstop (for a handler stuck where no
            # signal reaches it) leaves room for the worker's start-up
            pool = self._process_pool()
            future = pool.submit(call_in_worker, dict(os.environ), list(sys.path), path, state, **kwargs)
            return future.result(timeout=step.timeout_s + WORKER_START_S)
        except cf.TimeoutError:
            self._kill_pool()
            raise timed_out from None
        except cf.process.BrokenProcessPool:
            with self._lock:  # a worker died (out of memory?); the next call gets a fresh pool
                broken, self._pool = self._pool, None
            if broken is not None:
                broken.shutdown(wait=False, cancel_futures=True)
            raise HandlerFailed("Runtime.ExitError", f"the worker process running {function} died") from None

    def _kill_pool(self) -> None:
        """Kill the process pool's workers now (whatever they run) and drop the pool; the next process-mode
        task starts a fresh one. Python has no public way to reach the workers: ``_processes`` it is."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                _kill(proc)
            pool.shutdown(wait=False, cancel_futures=True)

    def _process_pool(self) -> cf.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                # each worker exits once this process is gone, even if it is killed outright
                self._pool = cf.ProcessPoolExecutor(
                    max_workers=self.processes,
                    mp_context=_fork_server(),
                    initializer=pool_worker_init,
                    initargs=(os.getpid(),),
                )
            return self._pool

    def _run_map(
        self, run: _Run, step: Map, state: dict[str, Any], scope: tuple[str, ...], index: int | None
    ) -> None:
        key = _key(scope, step.name)
        if key in run.done:
            return
        ref = _lookup(state, step.items)
        if not is_worklist_ref(ref):
            raise _StepFailed(
                step_error(
                    step.name,
                    index,
                    "States.Runtime",
                    f"{step.items} is {json.dumps(ref)[:200]}, not a work-list reference "
                    "(return shardfold.functions.worklist.worklist_ref(...) from the task that writes the "
                    "work list)",
                )
            )
        try:
            items = read_worklist(ref)
        except ShardfoldError as exc:
            raise _StepFailed(step_error(step.name, index, type(exc).__name__, str(exc))) from None
        total = len(items)
        gathered = map_result_bytes(total)
        if gathered > MAX_STATE_BYTES:
            raise _StepFailed(
                step_error(
                    step.name,
                    index,
                    "States.DataLimitExceeded",
                    f"{total:,} children gather a result of {gathered:,} bytes (each child outputs {{}}), "
                    f"over Step Functions' {MAX_STATE_BYTES:,}",
                )
            )
        child_scope = (*scope, step.name)
        last = step.body[-1].name
        pending = [i for i in range(total) if _key((*child_scope, str(i)), last) not in run.done]
        if index is None:
            self._progress(run, step.name, done=total - len(pending), total=total)
        failures = self._run_children(run, step, items, pending, child_scope, index)
        pct = step.tolerance()
        if failures and (pct is None or len(failures) * 100.0 / total > pct):
            raise failures[min(failures)]
        self._commit(run, key, {"result": None, "items": total, "failed": sorted(failures)})

    def _run_children(
        self,
        run: _Run,
        step: Map,
        items: list[Any],
        pending: list[int],
        child_scope: tuple[str, ...],
        index: int | None,
    ) -> dict[int, _StepFailed]:
        """Run the pending children with at most ``limit`` in flight; stop starting new ones once the
        failures exceed the tolerance or the job is cancelled. Returns {item index: failure}.

        A single pending child runs on this thread (a pool would only add a thread hand-off)."""
        # at most `threads` here, whatever the step allows on AWS (each Lambda has its own interpreter): the
        # children share this one's GIL, and 25 gathers of local files at once ran 1.7x slower than 4
        limit = min(step.max_concurrency or self.threads, self.threads)
        total = len(items)
        pct = step.tolerance()
        failures: dict[int, _StepFailed] = {}
        cancelled = False
        base = {k: run.input[k] for k in ("job_id", "spec_uri", "store_root")}

        def child(i: int) -> None:
            doc = {**base, "item": items[i], "index": i, "map": step.name}
            self._run_steps(run, step.body, doc, (*child_scope, str(i)), i)

        def settle(i: int, exc: BaseException | None) -> None:
            nonlocal cancelled
            if exc is None:
                if index is None:
                    self._progress(run, step.name, inc=1)
            elif isinstance(exc, _Cancelled):
                cancelled = True
            elif isinstance(exc, _StepFailed):
                failures[i] = exc
            else:
                logger.error("map child error", extra={"step": step.name, "index": i, "error": repr(exc)})
                failures[i] = _StepFailed(step_error(step.name, i, type(exc).__name__, str(exc)))

        if len(pending) == 1 and not run.cancel.is_set():
            try:
                child(pending[0])
            except Exception as exc:  # noqa: BLE001 - settled as a pool child's exception would be
                settle(pending[0], exc)
            else:
                settle(pending[0], None)
        elif pending:
            todo = iter(pending)
            inflight: dict[cf.Future, int] = {}
            with cf.ThreadPoolExecutor(
                max_workers=max(1, min(limit, len(pending))), thread_name_prefix="sf-map"
            ) as pool:

                def fill() -> None:
                    while len(inflight) < limit and not run.cancel.is_set():
                        i = next(todo, None)
                        if i is None:
                            return
                        inflight[pool.submit(child, i)] = i

                fill()
                while inflight:
                    finished, _ = cf.wait(inflight, return_when=cf.FIRST_COMPLETED)
                    for fut in finished:
                        settle(inflight.pop(fut), fut.exception())
                    over = bool(failures) and (pct is None or len(failures) * 100.0 / total > pct)
                    if not (cancelled or over):
                        fill()
        if cancelled or run.cancel.is_set():  # some children may never have started: not finished
            raise _Cancelled
        return failures

    def _run_parallel(
        self, run: _Run, step: Parallel, state: dict[str, Any], scope: tuple[str, ...], index: int | None
    ) -> dict[str, Any] | None:
        key = _key(scope, step.name)
        names = [n for branch in step.branches for n in selectable(branch)]
        if key in run.done:
            result = store.get_json(self._marker_uri(run.journal, key))["result"]
        else:
            with cf.ThreadPoolExecutor(max_workers=len(step.branches), thread_name_prefix="sf-par") as pool:
                futures = [
                    pool.submit(self._run_steps, run, branch, dict(state), scope, index)
                    for branch in step.branches
                ]
                cf.wait(futures)
            errors = [f.exception() for f in futures if f.exception() is not None]
            for exc in errors:
                if isinstance(exc, _Cancelled):
                    raise exc
            if errors:
                raise errors[0]
            outputs = [f.result() for f in futures]
            result = {
                n: out[n]
                for branch, out in zip(step.branches, outputs, strict=True)
                for n in selectable(branch)
            }
            result = self._commit(run, key, {"result": result})["result"]
            if index is None:
                self._progress(run, step.name, inc=1)
        return result if names else None

    # --- cancellation, progress, status -----------------------------------------------------------------

    def _wait(self, run: _Run, seconds: float) -> None:
        """A Wait state's ``seconds``, ended by a cancel (another process's marker looked for each second)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if run.cancel.wait(min(left, 1.0)):
                raise _Cancelled
            self._check_cancel(run)

    def _check_cancel(self, run: _Run) -> None:
        # The marker is how another process cancels; one existence check per step is cheap next to the
        # journal write every step makes anyway.
        if run.cancel.is_set() or store.exists(run.cancel_uri):
            run.cancel.set()
            raise _Cancelled

    def _progress(
        self, run: _Run, name: str, *, inc: int = 0, done: int | None = None, total: int | None = None
    ):
        name = run.workflow.shown_name(name)
        with run.cond:
            entry = run.status.steps.setdefault(name, {"done": 0, "total": None})
            if total is not None:
                entry["total"] = total
            if done is not None:
                entry["done"] = done
            entry["done"] = (entry["done"] or 0) + inc
            run.version += 1
            run.cond.notify_all()
        self._write_status(run)

    def _notify(self, run: _Run) -> None:
        with run.cond:
            run.version += 1
            run.cond.notify_all()

    def _finish(self, run: _Run, state: str, error: str | None) -> None:
        final = run.snapshot()
        final.state, final.error, final.ended_at = state, error, now()  # type: ignore[assignment]
        if run.lost_to is not None:
            final.state = "FAILED"
            final.error = f"{run.lost_to.describe()} took the job over; this process stopped running it"
        if self._end(run, final):
            log = logger.info if final.state == "SUCCEEDED" else logger.warning
            log("job end", extra={"job_id": final.job_id, "state": final.state, "error": final.error})

    def _end(self, run: _Run, final: JobStatus) -> bool:
        """Record ``final`` (unless another process took the job over), let the job go, wake the waiters.

        Once only: False when the run had already ended. A record that cannot be written (disk full, store
        unreachable) ends the run FAILED in memory, naming why; the record then still says RUNNING, and
        once this process exits it reads as INTERRUPTED."""
        job_id = final.job_id
        with run.write_lock:  # the record is final before any waiter can see the job as ended
            if run.ended:
                return False
            run.ended = True
            if run.lost_to is None:
                try:
                    write_status(self.store_root, final)
                except Exception as exc:
                    logger.exception("final status not written", extra={"job_id": job_id})
                    final.error = (
                        f"the job ended {final.state}"
                        + (f" ({final.error})" if final.error else "")
                        + f" but its status could not be recorded at {status_uri(self.store_root, job_id)}: "
                        f"{type(exc).__name__}: {exc}; make the store writable (disk full?), then "
                        + resume_hint(job_id)
                    )
                    final.state = "FAILED"
            run.last_status_write = time.monotonic()
        if run.lease is not None:
            run.lease.stop()
        if run.owner is not None and run.lost_to is None:
            try:
                ownership.release(self.store_root, job_id, run.owner)
            except Exception as exc:  # the job reads as INTERRUPTED once this process is gone
                logger.warning("job not released", extra={"job_id": job_id, "error": repr(exc)})
        with run.cond:
            run.status = final
            run.version += 1
            run.cond.notify_all()
        return True

    def _write_status(self, run: _Run, force: bool = False) -> None:
        with run.write_lock:  # serialised, so an older snapshot never lands after a newer one
            if run.ended or run.lost_to is not None:  # the final record is written, or not ours to write
                return
            t = time.monotonic()
            if not force and t - run.last_status_write < self.status_interval_s:
                return
            run.last_status_write = t
            write_status(self.store_root, run.snapshot())

    def _reconciled(self, status: JobStatus) -> JobStatus:
        """A record read from the store, as it stands: RUNNING whose owner is gone is INTERRUPTED."""
        if status.state not in ("PENDING", "RUNNING"):
            return status
        why = ownership.interrupted(self.store_root, status.job_id)
        if why is not None:
            status.state = "INTERRUPTED"
            status.error = f"{why}; {resume_hint(status.job_id)}"
        return status

    def _cancel_interrupted(self, status: JobStatus) -> None:
        """Record CANCELLED for a job no process runs (claiming it first, so none starts meanwhile)."""
        me = ownership.claim(self.store_root, status.job_id, self.lease_s)
        try:
            status.state, status.error, status.ended_at = "CANCELLED", None, now()
            write_status(self.store_root, status)
        finally:
            ownership.release(self.store_root, status.job_id, me)

    def _poll_record(
        self, job_id: str, on_progress: ProgressCallback | None, deadline: float | None
    ) -> JobStatus:
        """Wait for a job another process runs, by polling its status record."""
        last = None
        while True:
            snap = self._reconciled(JobStatus.from_record(read_status(self.store_root, job_id)))
            if on_progress is not None and snap != last:
                on_progress(snap)
            last = snap
            if snap.finished or (deadline is not None and time.monotonic() >= deadline):
                return snap
            time.sleep(0.2)  # polling another process's record; there is no event to wait on


class _WorkerPopen(popen_forkserver.Popen):
    """Starts a pool worker without re-running the user's main script in it.

    multiprocessing prepares every child by importing the parent's ``__main__`` (so that functions defined
    there unpickle). The workers run only :func:`orchestrator.invoke.call_in_worker` and handlers named by
    module path, so they need none of it; and a script that runs jobs without ``if __name__ ==
    "__main__":`` (as a README snippet pasted into a file) would run again in every worker. No public
    hook skips it (the pool's initializer runs after it), so the launch's ``spawn.get_preparation_data`` is
    swapped for one that leaves ``__main__`` out."""

    def _launch(self, process_obj: Any) -> None:
        real = spawn.get_preparation_data

        def without_main(name: str) -> dict[str, Any]:
            data = real(name)
            for key in ("init_main_from_path", "init_main_from_name"):
                data.pop(key, None)
            return data

        with _LAUNCH_LOCK:  # the patch is process-wide: one launch at a time
            spawn.get_preparation_data = without_main
            try:
                super()._launch(process_obj)
            finally:
                spawn.get_preparation_data = real


_LAUNCH_LOCK = threading.Lock()


class _WorkerProcess(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _WorkerPopen(process_obj)


class _WorkerContext(multiprocessing.context.ForkServerContext):
    Process = _WorkerProcess


def _fork_server() -> multiprocessing.context.BaseContext:
    """The process pools' context: forked from one fork server per process, started on first use. Not plain
    fork: the executor runs threads, and forking a threaded process can deadlock. Its workers do not import
    the user's main script (:class:`_WorkerPopen`)."""
    _socket_folder_that_fits()
    ctx = _WorkerContext()
    ctx.set_forkserver_preload(list(POOL_PRELOAD))  # read when the server starts; later calls change nothing
    return ctx


# The fork server listens on a UNIX socket, <multiprocessing's temporary folder>/listener-XXXXXXXX, and that
# folder is pymp-XXXXXXXX under TMPDIR; a socket's path holds at most 107 bytes (Linux), so under a long
# TMPDIR (a test's, a batch scheduler's) the server could not start ("AF_UNIX path too long").
_SOCKET_PATH_MAX = 107
_SOCKET_NAME_BYTES = len("/pymp-XXXXXXXX/listener-XXXXXXXX")


def _socket_folder_that_fits() -> None:
    """Choose multiprocessing's temporary folder under ``/tmp`` when one under TMPDIR would make the fork
    server's socket path too long (as Python 3.14 does itself); removed at exit, as its own would be."""
    config = multiprocessing.process.current_process()._config  # where get_temp_dir() keeps its choice
    if config.get("tempdir") is not None or not os.path.isdir("/tmp"):
        return
    if len(tempfile.gettempdir().encode()) + _SOCKET_NAME_BYTES <= _SOCKET_PATH_MAX:
        return
    folder = tempfile.mkdtemp(prefix="pymp-", dir="/tmp")
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder, True), exitpriority=-100)
    config["tempdir"] = folder


def _kill(proc: Any) -> None:
    """SIGKILL a worker process (a ``multiprocessing.Process`` or a ``subprocess.Popen``) if it still runs."""
    try:
        proc.kill()
    except (OSError, ValueError, AttributeError):  # gone already, or closed
        pass
