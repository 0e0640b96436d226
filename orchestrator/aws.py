"""AwsExecutor: runs jobs on the deployed Standard state machines (and, unchanged, on the moto harness).

Takes the stack outputs (``client.stack``; the moto harness builds the same dict):
``{"bucket", "region", "state_machine_arns": {kind: arn}, "functions": {name: arn},
"batch_job_queue"?, "batch_job_definitions"?, "endpoint_url"?, "backend"?}``.

* start: ``StartExecution`` named after the job id, input ``{job_id, spec_uri, store_root}``.
* status: ``DescribeExecution``; per-step progress from the execution history (a step is done once it
  exited without entering its Fail state) and, for Maps, ``DescribeMapRun`` item counts.
* errors: the ASL's Fail states word the cause as ``step <name> [(item <i>)] failed: <cause>``; a Map that
  failed because children failed is traced to its first failed child (``ListExecutions`` by map run).
* cancel: ``StopExecution`` and ``TerminateJob`` for the job's Batch jobs (their names start with the id).
* resume: a fresh execution ``<job_id>-r<n>`` of the same job, never ``RedriveExecution`` (every error is
  caught into a Fail state, and a redrive restarts from the unsuccessful state: that Fail state); the tasks'
  idempotent writes skip the work already done. The execution is the job's owner: resume is refused,
  naming the execution, while it runs, also when another client restarted it a moment before (Step
  Functions refuses a second execution of the same name, so of two restarts one wins).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from shardfold.functions import store
from shardfold.functions.access import Grants
from shardfold.functions.errors import PlanError, ShardfoldError
from shardfold.functions.jobs import cancel_key, kind_of
from shardfold.functions.log import logger
from shardfold.functions.store.uri import join
from shardfold.functions.workflow import Map, Task, Workflow, progress_steps
from shardfold.orchestrator.asl import fail_state_name, poll_state_names
from shardfold.orchestrator.status import (
    JobStatus,
    ProgressCallback,
    now,
    read_status,
    tidy_cause,
    write_status,
)

_STATES = {
    "RUNNING": "RUNNING",
    "PENDING_REDRIVE": "RUNNING",
    "SUCCEEDED": "SUCCEEDED",
    "FAILED": "FAILED",
    "TIMED_OUT": "FAILED",
    "ABORTED": "CANCELLED",
}
_EXITED = {"TaskStateExited", "MapStateExited", "ParallelStateExited", "ChoiceStateExited"}
_BATCH_ACTIVE = {"SUBMITTED", "PENDING", "RUNNABLE", "STARTING", "RUNNING"}
THRESHOLD_ERROR = "States.ExceedToleratedFailureThreshold"


def _step_ended(name: str, polling: bool, exited: dict[str, int], entered: dict[str, int]) -> bool:
    """Whether step ``name`` ended well, from the ids of its states' last exits and entries: it exited and
    never entered its Fail state; a polling Task only once its Choice let it go on (its last look's exit
    came before the Choice's last exit, and no Wait followed that)."""
    if name not in exited or fail_state_name(name) in entered:
        return False
    ready, wait = poll_state_names(name)
    return not polling or (exited.get(ready, -1) > exited[name] and entered.get(wait, -1) < exited[ready])


def _entered_state(events: dict[int, dict[str, Any]], event: dict[str, Any]) -> str | None:
    """The state an event belongs to: follow ``previousEventId`` back to its ``*StateEntered`` event."""
    seen = 0
    while event is not None and seen < 100:
        if event["type"].endswith("StateEntered"):
            return event["stateEnteredEventDetails"]["name"]
        event = events.get(event.get("previousEventId", 0))  # type: ignore[assignment]
        seen += 1
    return None


def _still_running(job_id: str, execution_arn: str) -> ShardfoldError:
    return ShardfoldError(
        f"job {job_id} is still running in execution {execution_arn}; wait for it "
        f"(`shardfold status {job_id}`) or cancel it (`shardfold cancel {job_id}`)"
    )


def map_run_label(map_run_arn: str) -> str:
    """``arn:...:mapRun:<machine>/<label>:<id>`` -> ``<label>``, the Map state's ``Label`` (the step's name,
    as compiled): names a run whose MapRunStarted event the history does not show yet."""
    tail = map_run_arn.split(":mapRun:", 1)[-1]
    return tail.split("/", 1)[-1].rsplit(":", 1)[0]


class AwsExecutor:
    """Executor over boto3 Step Functions (and Batch, to cancel GPU jobs)."""

    def __init__(
        self,
        outputs: Mapping[str, Any],
        workflows: Mapping[str, Workflow] | None = None,
        *,
        poll_s: float | None = None,
        session: boto3.session.Session | None = None,
    ):
        if workflows is None:
            from shardfold.functions.kinds import WORKFLOWS

            workflows = WORKFLOWS
        self.outputs = dict(outputs)
        self.workflows = workflows
        self.backend = str(outputs.get("backend") or "aws")
        self.store_root = f"s3://{outputs['bucket']}"
        self.state_machine_arns: dict[str, str] = dict(outputs["state_machine_arns"])
        # what each function and Batch job was deployed with: the plan check sizes tasks against it
        self.deployed_sizes: dict[str, Any] | None = outputs.get("sizes")
        # what the deployment lets jobs read and write: submit holds a spec to it (functions.access)
        self.grants: Grants | None = Grants.from_outputs(outputs)
        # moto answers in milliseconds; AWS state transitions take a while, so poll it gently.
        self.poll_s = poll_s if poll_s is not None else (0.1 if self.backend == "moto" else 2.0)
        session = session or boto3.session.Session()
        kwargs: dict[str, Any] = {"config": Config(retries={"mode": "standard", "max_attempts": 5})}
        if outputs.get("region"):
            kwargs["region_name"] = outputs["region"]
        if outputs.get("endpoint_url"):
            kwargs["endpoint_url"] = outputs["endpoint_url"]
        self._sfn = session.client("stepfunctions", **kwargs)
        self._batch = session.client("batch", **kwargs) if outputs.get("batch_job_queue") else None

    # --- executor interface ----------------------------------------------------------------------------

    def start(self, job_id: str, kind: str, spec_uri: str) -> None:
        arn = self.state_machine_arns.get(kind)
        if arn is None:
            raise PlanError(
                f"job kind {kind!r} is not deployed here; deployed: {sorted(self.state_machine_arns)}"
            )
        payload = {"job_id": job_id, "spec_uri": spec_uri, "store_root": self.store_root}
        try:
            resp = self._sfn.start_execution(stateMachineArn=arn, name=job_id, input=json.dumps(payload))
        except self._sfn.exceptions.ExecutionAlreadyExists as exc:
            raise ShardfoldError(f"job {job_id} already exists; use resume to continue it") from exc
        status = JobStatus(
            job_id=job_id,
            kind=kind,
            state="RUNNING",
            steps=self._shown(kind, self._initial_steps(kind)),
            backend=self.backend,
            started_at=now(),
            spec_uri=spec_uri,
            execution_arn=resp["executionArn"],
        )
        write_status(self.store_root, status)
        logger.info(
            "job start", extra={"job_id": job_id, "kind": kind, "execution_arn": resp["executionArn"]}
        )

    def status(self, job_id: str) -> JobStatus:
        record = read_status(self.store_root, job_id)
        old = JobStatus.from_record(record)
        if old.finished or not old.execution_arn:
            return old  # a terminal record is final; nothing more to ask AWS
        arn = old.execution_arn
        desc = self._sfn.describe_execution(executionArn=arn)
        state = _STATES.get(desc["status"], "RUNNING")
        new = JobStatus(
            job_id=job_id,
            kind=old.kind,
            state=state,  # type: ignore[arg-type]
            steps=self._shown(old.kind, self._steps(old.kind, arn)),
            error=self._error(arn, desc) if state == "FAILED" else None,
            backend=old.backend or self.backend,
            started_at=old.started_at,
            ended_at=None,
            spec_uri=old.spec_uri,
            execution_arn=arn,
        )
        if new.finished:
            stop = desc.get("stopDate")
            new.ended_at = stop.isoformat(timespec="seconds") if stop is not None else now()
            write_status(self.store_root, new)
        return new

    def wait(
        self, job_id: str, on_progress: ProgressCallback | None = None, timeout_s: float | None = None
    ) -> JobStatus:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last: JobStatus | None = None
        # with nobody watching the steps, a poll asks only whether the execution ended (one call, not the
        # history and Map runs the steps are read from)
        record = None if on_progress else JobStatus.from_record(read_status(self.store_root, job_id))
        arn = record.execution_arn if record is not None else None
        while True:
            expired = deadline is not None and time.monotonic() >= deadline
            if arn and not expired and self._sfn.describe_execution(executionArn=arn)["status"] == "RUNNING":
                time.sleep(self.poll_s)
                continue
            status = self.status(job_id)
            if on_progress is not None and status != last:
                on_progress(status)
            last = status
            if status.finished or (deadline is not None and time.monotonic() >= deadline):
                return status
            time.sleep(self.poll_s)  # Step Functions has no push channel for a client; poll it

    def cancel(self, job_id: str) -> None:
        status = self.status(job_id)
        if status.finished:
            return
        try:
            self._sfn.stop_execution(
                executionArn=status.execution_arn, error="Shardfold.Cancelled", cause="cancelled by the user"
            )
        except self._sfn.exceptions.ExecutionDoesNotExist as exc:
            raise ShardfoldError(f"job {job_id}: execution {status.execution_arn} is gone") from exc
        self._terminate_batch_jobs(job_id)
        store.put(join(self.store_root, cancel_key(job_id)), now().encode())  # long waits in tasks see it
        # StopExecution is final once accepted, so the record says so now (tasks already running on Lambda
        # finish on their own; their results are discarded).
        status.state, status.ended_at = "CANCELLED", now()
        write_status(self.store_root, status)
        logger.info("job cancelled", extra={"job_id": job_id})

    def resume(self, job_id: str) -> None:
        record = read_status(self.store_root, job_id)
        old = JobStatus.from_record(record)
        if old.state == "SUCCEEDED":
            logger.info("nothing to resume", extra={"job_id": job_id})
            return
        arn = old.execution_arn
        desc = self._sfn.describe_execution(executionArn=arn)
        if desc["status"] in ("RUNNING", "PENDING_REDRIVE"):
            # the execution is the job's owner on AWS (Step Functions refuses a second one of the same name)
            raise _still_running(job_id, arn)
        # Never RedriveExecution: every step's errors are caught into a Fail state, and a redrive restarts
        # from the unsuccessful state, the Fail state itself. A new execution of the same job does only what
        # is unfinished: every task finds its committed outputs (put-if-absent) and skips their work.
        arn = self._restart(job_id, old.kind, arn, desc["input"])
        status = JobStatus(
            **{**old.to_record(), "state": "RUNNING", "error": None, "ended_at": None, "execution_arn": arn}
        )
        write_status(self.store_root, status)

    def jobs(self) -> list[JobStatus]:
        found: dict[str, JobStatus] = {}
        for kind, sm_arn in self.state_machine_arns.items():
            for page in self._sfn.get_paginator("list_executions").paginate(stateMachineArn=sm_arn):
                for ex in page["executions"]:
                    job_id = re.sub(r"-r\d+$", "", ex["name"])
                    if kind_of(job_id) != kind:  # not one of this state machine's jobs
                        continue
                    started = ex["startDate"].isoformat(timespec="seconds")
                    if job_id in found and (found[job_id].started_at or "") >= started:
                        continue
                    found[job_id] = JobStatus(
                        job_id=job_id,
                        kind=kind,
                        state=_STATES.get(ex["status"], "RUNNING"),  # type: ignore[arg-type]
                        backend=self.backend,
                        started_at=started,
                        execution_arn=ex["executionArn"],
                    )
        return sorted(found.values(), key=lambda s: (s.started_at or "", s.job_id))

    def close(self) -> None:
        """Nothing to release (boto3 clients close with the process); kept for a uniform interface."""

    # --- internals ---------------------------------------------------------------------------------------

    def _shown(self, kind: str, steps: dict[str, dict[str, int | None]]) -> dict[str, dict[str, int | None]]:
        """``steps`` (by state name) under the names users see (:meth:`Workflow.shown_name`)."""
        workflow = self.workflows.get(kind)
        return steps if workflow is None else {workflow.shown_name(k): v for k, v in steps.items()}

    def _initial_steps(self, kind: str) -> dict[str, dict[str, int | None]]:
        workflow = self.workflows.get(kind)
        if workflow is None:
            return {}
        return {
            s.name: {"done": 0, "total": None if isinstance(s, Map) else 1}
            for s in progress_steps(workflow.steps)
        }

    def _history(self, arn: str) -> Iterator[dict[str, Any]]:
        token = None
        while True:
            kwargs: dict[str, Any] = {"executionArn": arn, "maxResults": 1000, "includeExecutionData": False}
            if token:
                kwargs["nextToken"] = token
            page = self._sfn.get_execution_history(**kwargs)
            yield from page["events"]
            token = page.get("nextToken")
            if not token:
                return

    def _steps(self, kind: str, arn: str) -> dict[str, dict[str, int | None]]:
        steps = self._initial_steps(kind)
        exited: dict[str, int] = {}  # state name -> the id of its last exit (and of its last entry)
        entered: dict[str, int] = {}
        events: dict[int, dict[str, Any]] = {}
        run_names: dict[str, str] = {}
        for event in self._history(arn):
            events[event["id"]] = event
            if event["type"] in _EXITED:
                exited[event["stateExitedEventDetails"]["name"]] = event["id"]
            elif event["type"].endswith("StateEntered"):
                entered[event["stateEnteredEventDetails"]["name"]] = event["id"]
            elif event["type"] == "MapRunStarted":
                name = _entered_state(events, event)
                if name:
                    run_names[event["mapRunStartedEventDetails"]["mapRunArn"]] = name
        workflow = self.workflows.get(kind)
        polling = {s.name for s in workflow.walk() if isinstance(s, Task) and s.poll} if workflow else set()
        for name, entry in steps.items():
            if _step_ended(name, name in polling, exited, entered):
                entry["done"] = entry["total"] or 0
        for run in self._map_runs(arn):
            name = run_names.get(run["mapRunArn"]) or map_run_label(run["mapRunArn"])
            if name not in steps:  # not (yet) attributable to a step: the next poll's history names it
                continue
            counts = self._sfn.describe_map_run(mapRunArn=run["mapRunArn"])["itemCounts"]
            steps[name] = {"done": counts.get("succeeded", 0), "total": counts.get("total")}
        return steps

    def _map_runs(self, arn: str) -> list[dict[str, Any]]:
        runs: list[dict[str, Any]] = []
        token = None
        while True:
            kwargs: dict[str, Any] = {"executionArn": arn}
            if token:
                kwargs["nextToken"] = token
            page = self._sfn.list_map_runs(**kwargs)
            runs += page.get("mapRuns", [])
            token = page.get("nextToken")
            if not token:
                return runs

    def _error(self, arn: str, desc: dict[str, Any]) -> str:
        error = desc.get("error") or "Error"
        cause = desc.get("cause") or ""
        if desc["status"] == "TIMED_OUT":
            return f"the execution timed out ({error})"
        if error == THRESHOLD_ERROR or f"failed: {THRESHOLD_ERROR}" in cause:  # a Map's children failed
            child = self._first_failed_child(arn)
            if child is not None:
                return child
        return tidy_cause(cause, error) if cause else error

    def _first_failed_child(self, arn: str) -> str | None:
        """The error of the lowest-index failed child of the execution's failed map runs."""
        best: tuple[int, str] | None = None
        for run in self._map_runs(arn):
            resp = self._sfn.list_executions(mapRunArn=run["mapRunArn"], statusFilter="FAILED", maxResults=20)
            for child in resp.get("executions", []):
                desc = self._sfn.describe_execution(executionArn=child["executionArn"])
                try:
                    index = int(json.loads(desc.get("input") or "{}").get("index", 0))
                except (ValueError, AttributeError):
                    index = 0
                text = tidy_cause(desc.get("cause") or "", desc.get("error") or "Error")
                if best is None or index < best[0]:
                    best = (index, text)
        return best[1] if best else None

    def _restart(self, job_id: str, kind: str, arn: str, execution_input: str) -> str:
        """Start the job again as ``<job_id>-r<n>``; completed tasks' outputs make the re-run cheap."""
        name = arn.rsplit(":", 1)[-1]
        m = re.fullmatch(rf"{re.escape(job_id)}-r(\d+)", name)
        n = int(m.group(1)) + 1 if m else 1
        sm_arn = self.state_machine_arns[kind]
        try:
            resp = self._sfn.start_execution(
                stateMachineArn=sm_arn, name=f"{job_id}-r{n}", input=execution_input
            )
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "ExecutionAlreadyExists":
                raise
            other = f"{sm_arn.replace(':stateMachine:', ':execution:')}:{job_id}-r{n}"
            raise _still_running(job_id, other) from exc  # another client restarted it just now
        logger.info("job restarted", extra={"job_id": job_id, "execution_arn": resp["executionArn"]})
        return resp["executionArn"]

    def _terminate_batch_jobs(self, job_id: str) -> None:
        queue = self.outputs.get("batch_job_queue")
        if not queue or self._batch is None:
            return
        filters = [{"name": "JOB_NAME", "values": [f"{job_id}*"]}]
        for page in self._batch.get_paginator("list_jobs").paginate(jobQueue=queue, filters=filters):
            for job in page.get("jobSummaryList", []):
                if job.get("status") in _BATCH_ACTIVE:
                    self._batch.terminate_job(jobId=job["jobId"], reason=f"shardfold job {job_id} cancelled")
                    logger.info("batch job terminated", extra={"job_id": job_id, "batch_job": job["jobId"]})
