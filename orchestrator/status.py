"""What every executor shares: the job status record, the executor interface, the error wording.

``jobs/<id>/status.json`` (relative to the store root) is the executor-maintained record of a job:
``{job_id, kind, backend, state, started_at, ended_at, error, steps, spec_uri, execution_arn?}``. The
local executor keeps it current while it runs; the AWS executor writes it on start and whenever it
observes a change, so ``status`` works from any process.

States: PENDING, RUNNING, then SUCCEEDED, FAILED or CANCELLED; or INTERRUPTED: the process running a local
job ended before the job did (killed, or stopped with SIGTERM/Ctrl-C), so nothing runs it any more and
``shardfold resume`` continues it. A job's owner process records INTERRUPTED itself when it is stopped;
when it is killed outright the record still says RUNNING and the executor reports INTERRUPTED on reading
it (:mod:`orchestrator.owner`).
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Protocol

from shardfold.functions import store
from shardfold.functions.errors import JobNotFound, ObjectNotFound, StoreError
from shardfold.functions.jobs import kind_of, status_key
from shardfold.functions.store.uri import join

JobState = Literal["PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED", "INTERRUPTED"]
# Step Functions prefixes a States.Runtime cause with where it happened; our Fail states already say so.
_ERROR_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*(?:\.[A-Za-z][A-Za-z0-9_]*)*")
_DECORATION = re.compile(
    r"^An error occurred while executing the state '[^']*' \(entered at the event id #\d+\)\. "
)
TERMINAL: frozenset[str] = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})
# Nothing runs the job: it ended, or (INTERRUPTED) its process did; waiting on it would never end.
STOPPED: frozenset[str] = TERMINAL | {"INTERRUPTED"}


@dataclass
class JobStatus:
    """A job's state and per-step progress (``steps[name] = {"done": int, "total": int | None}``)."""

    job_id: str
    kind: str
    state: JobState
    steps: dict[str, dict[str, int | None]] = field(default_factory=dict)
    error: str | None = None
    backend: str = "local"
    started_at: str | None = None
    ended_at: str | None = None
    spec_uri: str | None = None
    execution_arn: str | None = None

    @property
    def finished(self) -> bool:
        """Nothing runs the job any more: it ended (SUCCEEDED, FAILED, CANCELLED) or was INTERRUPTED."""
        return self.state in STOPPED

    def to_record(self) -> dict[str, Any]:
        # Field by field, not dataclasses.asdict: that deep-copies every value, and a job's records (written
        # and snapshotted at every step) made it the largest fixed cost of a small job
        record = {name: getattr(self, name) for name in _FIELDS}
        record["steps"] = {step: dict(counts) for step, counts in self.steps.items()}
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> JobStatus:
        """The status in ``record`` (:func:`read_status`'s: its identity from its place). A field of the wrong
        shape, which only a hand-written record has, is dropped, so one forged record cannot break
        ``shardfold jobs`` for every job."""
        known = {k: record.get(k) for k in cls.__dataclass_fields__ if k in record}
        for name in ("error", "backend", "started_at", "ended_at", "spec_uri", "execution_arn"):
            if name in known and not isinstance(known[name], str | None):
                del known[name]
        if known.get("state") not in _STATES:
            known["state"] = "FAILED"
            known["error"] = f"the job's status record names no state ({str(record.get('state'))[:40]!r})"
        steps = known.get("steps")
        known["steps"] = {
            str(name): {k: v for k, v in counts.items() if k in ("done", "total") and _count(v)}
            for name, counts in (steps.items() if isinstance(steps, dict) else ())
            if isinstance(counts, dict)
        }
        return cls(**known)


_FIELDS = tuple(f.name for f in fields(JobStatus))
_STATES = frozenset(JobState.__args__)


def _count(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


ProgressCallback = Callable[[JobStatus], None]


class Executor(Protocol):
    """Implemented by :class:`orchestrator.local.LocalExecutor` and :class:`orchestrator.aws.AwsExecutor`."""

    backend: str

    def start(self, job_id: str, kind: str, spec_uri: str) -> None: ...

    def status(self, job_id: str) -> JobStatus: ...

    def wait(
        self, job_id: str, on_progress: ProgressCallback | None = None, timeout_s: float | None = None
    ) -> JobStatus: ...

    def cancel(self, job_id: str) -> None: ...

    def resume(self, job_id: str) -> None: ...

    def jobs(self) -> list[JobStatus]: ...


def now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def resume_hint(job_id: str) -> str:
    return f"resume with: shardfold resume {job_id}"


def step_error(step: str, index: int | None, error: str, message: str) -> str:
    """The one wording of a failed step, shared by both executors (and the ASL Fail states' prefix)."""
    at = f" (item {index})" if index is not None else ""
    return f"step {step}{at} failed: {error}: {message}"


def tidy_cause(cause: str, error: str = "Error") -> str:
    """Turn an ASL Fail state's cause, ``step s (item i) failed: E: {"errorType": ..., "errorMessage": ...}``
    (``E`` the caught error's name, then a Lambda error payload, a Batch job's description or text), into
    the executors' shared wording ``step s (item i) failed: T: message``. ``error`` is used for a cause
    that names no error (an older Fail state's, or a failure outside the steps)."""
    cause = _DECORATION.sub("", cause)
    head, sep, tail = cause.partition(" failed: ")
    if not sep:
        return cause
    name, colon, rest = tail.partition(": ")
    if colon and _ERROR_NAME.fullmatch(name):
        error, tail = name, rest
    elif _ERROR_NAME.fullmatch(tail.strip()):
        error, tail = tail.strip(), ""
    if not tail.strip():
        return f"{head} failed: {error}"
    try:
        payload = json.loads(tail)
    except (json.JSONDecodeError, TypeError):
        return f"{head} failed: {tail}" if tail.startswith(f"{error}:") else f"{head} failed: {error}: {tail}"
    if isinstance(payload, dict) and "errorMessage" in payload:  # a Lambda function's error
        return f"{head} failed: {payload.get('errorType', error)}: {payload['errorMessage']}"
    if isinstance(payload, dict) and "StatusReason" in payload:  # a Batch job's description (.sync)
        return f"{head} failed: {error}: {payload['StatusReason']}"
    return f"{head} failed: {error}: {tail}"


def status_uri(store_root: str, job_id: str) -> str:
    return join(store_root, status_key(job_id))


def read_status(store_root: str, job_id: str) -> dict[str, Any]:
    """The status record of job ``job_id``, its identity (``job_id``, ``kind``) taken from where it lives:
    anyone who may write to the store can forge a record's contents, and a record claiming another job
    must not make ``clean`` or ``cancel`` act on that job. An id that is not a job id is no job."""
    kind = kind_of(job_id)
    if kind is None:
        raise JobNotFound(
            f"{job_id!r} is not a job id (<kind>-<YYYYMMDDTHHMMSS>-<6 hex>): see `shardfold jobs`"
        )
    try:
        record = store.get_json(status_uri(store_root, job_id))
    except ObjectNotFound as exc:
        raise JobNotFound(
            f"no job {job_id!r} under {store_root}: check the id with `shardfold jobs`"
        ) from exc
    except StoreError as exc:  # not JSON (or hostile JSON): the record says nothing
        record = {"state": "FAILED", "error": f"the job's status record is unreadable: {exc}"}
    if not isinstance(record, dict):
        record = {"state": "FAILED", "error": "the job's status record is not a JSON object"}
    return {**record, "job_id": job_id, "kind": kind}


def write_status(store_root: str, status: JobStatus) -> None:
    store.put_json(status_uri(store_root, status.job_id), status.to_record())
