"""Per-task telemetry: what each task of a job did, recorded by the task decorator on every backend.

Every call of a handler built with :func:`functions.runtime.task` is one *attempt* of one *task*: the step
it belongs to (the workflow's step name), the Map item's index (``task``; None outside a Map) and the
attempt number (0, 1, … in the order attempts start, whoever retries: the executor's retry policy, a
resumed job, a Batch retry). Each attempt writes one small record::

    jobs/<id>/telemetry/<step>/<task>.<attempt>.json      (task "-" outside a Map)

first as ``"outcome": "running"`` when it starts (so a task killed outright — out of memory, timed out —
still shows), then whole when it ends:

* ``started_at``, ``ended_at`` (epoch seconds), ``duration_s``, ``outcome`` (``succeeded``/``failed``) and
  ``error`` (``{"type", "message"}``);
* ``peak_memory_mib``: the process's peak resident set during the call (the kernel's high-water mark,
  reset when the call starts where no other task shares the process); ``memory_scope`` says what it covers:
  ``task`` (this call alone), ``shared`` (other tasks ran in the same process meanwhile: the local
  executor's thread-mode tasks, the moto harness);
* ``bytes_read``, ``bytes_written``, ``requests`` (store requests by type: GET, PUT, HEAD, LIST, DELETE,
  COPY, and the multipart calls on S3), ``store_retries`` (requests the store or botocore retried);
* ``log``: where the attempt's log lines are: ``{"uri", "lines"}`` of a log object beside the record
  (tasks run outside AWS log to it as well as to the console; a log of at most :data:`INLINE_LOG_BYTES`
  is kept in the record itself instead, as ``"inline"``, so a task that says little costs no request for
  it), or ``{"group", "stream", "request_id"}`` in CloudWatch Logs (Lambda), or ``{"batch_job"}`` (an AWS
  Batch container; its log stream is the job's).

**Every attempt's log** starts with ``task started`` (its attempt, host and pid) and ends with ``task
ended`` (its outcome, and its duration, peak memory, bytes and store requests: the figures of its record,
from memory, at no request), in between what the task itself logs; a failing attempt logs ``task failed``
with its error before it ends.

**Private steps.** A kind may name steps whose cost depends on private data (dpquery's prepare and
measure, which read the rows): their records keep the step, task, attempt, outcome, error and log place,
and withhold every measured figure (times, memory, bytes, requests), which would be proxies of the row
count; ``"withheld": true`` says so. Their log lines are kept without their timestamps, for the same
reason, and their ``task ended`` line says only the outcome.

Telemetry never fails a task: a record that cannot be written is logged and skipped.
"""

from __future__ import annotations

import contextvars
import functools
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from shardfold.functions import jsontext
from shardfold.functions.log import logger

MAX_LOG_BYTES = 1024 * 1024  # a task's log object keeps its last MiB
INLINE_LOG_BYTES = 4096  # a log this small is kept in the task's record: no object, no request of its own
MAX_ATTEMPTS = 1000  # attempt slots probed before giving up on a record
MEASURED = (
    "started_at",
    "ended_at",
    "duration_s",
    "peak_memory_mib",
    "memory_scope",
    "bytes_read",
    "bytes_written",
    "requests",
    "store_retries",
)


# --- the meter: store requests of the running task ----------------------------------------------------------


class Meter:
    """Store requests, bytes and retries of one task attempt (threads of the attempt add to it)."""

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        self.retries = 0
        self._lock = threading.Lock()

    def add(self, op: str | None, read: int = 0, written: int = 0, retries: int = 0, times: int = 1) -> None:
        with self._lock:
            if op and times:
                self.requests[op] = self.requests.get(op, 0) + times
            self.bytes_read += read
            self.bytes_written += written
            self.retries += retries


_Figures = tuple[float, float | None, Meter]  # an attempt's duration (s), peak memory (MiB) and meter
_meter: contextvars.ContextVar[Meter | None] = contextvars.ContextVar("shardfold_meter", default=None)


def count(op: str | None, read: int = 0, written: int = 0, retries: int = 0, times: int = 1) -> None:
    """Add ``times`` store requests of type ``op`` (and the bytes they moved) to the running task's meter."""
    meter = _meter.get()
    if meter is not None:
        meter.add(op, read, written, retries, times)


def current() -> Meter | None:
    """The running task's meter, for a callback that will run on a thread outside the task's context."""
    return _meter.get()


def carried(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` bound to a copy of the caller's context, for a pool thread: what it does counts for the task
    that handed it over (a context is entered by one thread at a time, hence a copy per hand-over)."""
    return functools.partial(contextvars.copy_context().run, fn)


# --- the log: a task's lines, beside its record ------------------------------------------------------------


class _TaskLog:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.size = 0
        self.dropped = 0

    def add(self, line: str) -> None:
        self.lines.append(line)
        self.size += len(line) + 1
        while self.size > MAX_LOG_BYTES and len(self.lines) > 1:
            self.size -= len(self.lines.pop(0)) + 1
            self.dropped += 1

    def text(self) -> bytes:
        head = [json.dumps({"level": "INFO", "message": f"{self.dropped} earlier lines dropped"})]
        return ("\n".join((head if self.dropped else []) + self.lines) + "\n").encode()


_log: contextvars.ContextVar[_TaskLog | None] = contextvars.ContextVar("shardfold_task_log", default=None)


class _Capture(logging.Filter):
    """On the ``shardfold`` logger: copies each line emitted in a task's context into that task's log, then
    lets it on to the console (and to parent loggers) only if it reaches the logger's own level.

    So the logger's level stays what the user or the CLI set (standard ``logging`` control of what is
    shown), while a task's log keeps its INFO lines: in a task's context the logger also creates INFO
    records below that level (:func:`_install`), which go to the task's log and no further."""

    def filter(self, record: logging.LogRecord) -> bool:
        log = _log.get()
        if log is not None:
            try:
                console = next((h for h in _LOGGER.handlers if h.formatter is not None), None)
                log.add((console.formatter if console else logging.Formatter()).format(record))
            except Exception:  # noqa: BLE001, S110 - a line that cannot be formatted is not worth failing a task
                pass
        return record.levelno >= _LOGGER.getEffectiveLevel()


_LOGGER = logging.getLogger("shardfold")
_capture = _Capture()
_install_lock = threading.Lock()


def _install() -> None:
    """Hook :class:`_Capture` into the ``shardfold`` logger once per process."""
    with _install_lock:
        if _capture in _LOGGER.filters:
            return
        _LOGGER.addFilter(_capture)
        shown = type(_LOGGER).isEnabledFor.__get__(_LOGGER)  # the level check the logger would make

        def enabled(level: int) -> bool:  # ... plus INFO and up inside a task, for the task's log
            return shown(level) or (level >= logging.INFO and _log.get() is not None)

        _LOGGER.isEnabledFor = enabled  # type: ignore[method-assign]


@contextmanager
def captured_log() -> Iterator[list[str]]:
    """The ``shardfold`` log lines emitted in this context while the block runs (the moto harness's stand-in
    for what Lambda sends to CloudWatch Logs)."""
    _install()
    log = _TaskLog()
    token = _log.set(log)
    try:
        yield log.lines
    finally:
        _log.reset(token)


# --- peak memory --------------------------------------------------------------------------------------------

_active = 0  # attempts running in this process now
_shared = 0  # bumps whenever one starts while another runs
_active_lock = threading.Lock()


def _reset_peak() -> None:
    try:  # Linux: "5" resets the process's peak RSS (VmHWM); elsewhere the peak covers the process's life
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _attempt_starts() -> int:
    """Count an attempt in: the process's peak is reset for it when it runs alone. The sharing count now."""
    global _active, _shared
    with _active_lock:
        _active += 1
        if _active == 1:
            _reset_peak()
        else:
            _shared += 1
        return _shared


def _attempt_ends(shared_at_start: int) -> bool:
    """Count an attempt out: whether another ran in the process while it did (its peak is then shared)."""
    global _active
    with _active_lock:
        shared = _shared != shared_at_start or _active > 1
        _active -= 1
    return shared


def peak_rss_mib() -> float | None:
    """The process's peak resident set (MiB) since it started or was last reset."""
    try:
        with open("/proc/self/status") as f:
            found = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M)
        if found:
            return round(int(found.group(1)) / 1024, 1)
    except OSError:
        pass
    try:
        import resource

        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    except (ImportError, OSError):
        return None


# --- records ------------------------------------------------------------------------------------------------


def prefix(store_root: str, job_id: str) -> str:
    from shardfold.functions.store.uri import join

    return join(store_root, "jobs", job_id, "telemetry")


def record_uri(store_root: str, job_id: str, step: str, task: int | None, attempt: int) -> str:
    from shardfold.functions.store.uri import join

    return join(prefix(store_root, job_id), step, f"{'-' if task is None else task}.{attempt}.json")


def step_of(kind: str, function: str, map_name: str | None, batch_step: str | None = None) -> str:
    """The workflow step a call of ``function`` runs: the one step that calls it, or the one inside the Map
    ``map_name`` (a Map child's event names its Map), or the Batch step ``batch_step`` (the container
    passes its ``SHARDFOLD_STEP``); the function's own name where the kind is not known here."""
    from shardfold.functions import kinds
    from shardfold.functions.workflow import BatchJob, Map, Task

    try:
        workflow = kinds.find(kind).workflow
    except Exception:  # noqa: BLE001 - a handler registered outside any kind (tests' toy flows)
        return function

    def calls(step: Any) -> bool:
        return (isinstance(step, Task) and step.function == function) or (
            isinstance(step, BatchJob) and step.entry_point == function
        )

    found = [s for s in [*workflow.walk(), *filter(None, [workflow.on_failure])] if calls(s)]
    if len(found) == 1:
        return found[0].name
    if map_name:
        for m in workflow.walk():
            if isinstance(m, Map) and m.name == map_name:
                inside = [s for s in m.body if calls(s)]
                if inside:
                    return inside[0].name
    if batch_step and any(s.name == batch_step for s in found):
        return batch_step
    return found[0].name if found else function


def private_steps(kind: str) -> frozenset[str]:
    from shardfold.functions import kinds

    try:
        return kinds.find(kind).private_steps
    except Exception:  # noqa: BLE001 - not a registered kind
        return frozenset()


def _log_place(context: Any, batch_job_id: str | None = None) -> dict[str, Any] | None:
    """Where the platform keeps the attempt's log (CloudWatch, Batch), or None: then a log object does."""
    group = getattr(context, "log_group_name", None)
    if context is not None and group and group != "local":
        return {
            "group": group,
            "stream": getattr(context, "log_stream_name", None),
            "request_id": getattr(context, "aws_request_id", None),
        }
    if batch_job_id:
        return {"batch_job": batch_job_id}
    return None


@contextmanager
def recording(
    *,
    store_root: str,
    job_id: str,
    kind: str,
    function: str,
    task: int | None,
    map_name: str | None,
    context: Any,
    batch_step: str | None = None,
    batch_job_id: str | None = None,
) -> Iterator[None]:
    """Record one attempt of a task around the ``with`` body (see the module doc)."""
    step = step_of(kind, function, map_name, batch_step)
    withheld = step in private_steps(kind)
    doc: dict[str, Any] = {
        "job_id": job_id,
        "kind": kind,
        "step": step,
        "function": function,
        "task": task,
        "attempt": None,
        "outcome": "running",
        "error": None,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started_at": round(time.time(), 6),
    }
    place = _log_place(context, batch_job_id)
    uri = _claim_record(store_root, job_id, task, doc, withheld)
    log_uri = uri[: -len(".json")] + ".log" if uri is not None and place is None else None
    doc["log"] = place or ({"uri": log_uri} if log_uri else None)

    shared_at_start = _attempt_starts()
    meter = Meter()
    task_log = _TaskLog() if log_uri else None
    if task_log is not None:
        _install()
    meter_token = _meter.set(meter)
    log_token = _log.set(task_log) if task_log is not None else None  # else a caller's capture goes on
    attempt = doc["attempt"] if uri is not None else None
    logger.info("task started", extra={"attempt": attempt, "host": doc["host"], "pid": doc["pid"]})
    started = time.perf_counter()
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        error = exc
        # in the task's own log too, so `shardfold logs` shows why it failed
        logger.error("task failed", extra={"step": step, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        raise
    finally:
        duration, peak = time.perf_counter() - started, peak_rss_mib()
        _log_ended(attempt, error, None if withheld else (duration, peak, meter))
        _meter.reset(meter_token)
        if log_token is not None:
            _log.reset(log_token)
        shared = _attempt_ends(shared_at_start)
        if uri is not None:
            _write_record(uri, _ended(doc, error, (duration, peak, meter), shared), withheld, task_log)


def _claim_record(store_root: str, job_id: str, task: int | None, doc: dict, withheld: bool) -> str | None:
    """Write ``doc`` at the first free attempt number, which it takes; its URI (None: none written)."""
    from shardfold.functions import store

    try:
        for n in range(MAX_ATTEMPTS):
            candidate = record_uri(store_root, job_id, doc["step"], task, n)
            doc["attempt"] = n
            if store.put_if_absent(candidate, _dump(doc, withheld)):
                return candidate
    except Exception as exc:  # noqa: BLE001 - telemetry never fails a task
        logger.warning("no telemetry record for this task", extra={"step": doc["step"], "error": str(exc)})
    return None


def _ended(doc: dict, error: BaseException | None, measured: _Figures, shared: bool) -> dict[str, Any]:
    """The ended attempt's record: its outcome and figures (``measured``: duration, peak memory, meter)."""
    duration, peak, meter = measured
    return doc | {
        "outcome": "failed" if error is not None else "succeeded",
        "error": None if error is None else {"type": type(error).__name__, "message": str(error)[:2000]},
        "ended_at": round(time.time(), 6),
        "duration_s": round(duration, 6),
        "peak_memory_mib": peak,
        "memory_scope": "shared" if shared else "task",
        "bytes_read": meter.bytes_read,
        "bytes_written": meter.bytes_written,
        "requests": dict(sorted(meter.requests.items())),
        "store_retries": meter.retries,
    }


def _write_record(uri: str, doc: dict[str, Any], withheld: bool, task_log: _TaskLog | None) -> None:
    """Write the ended attempt's record, and its log: inline when small, else as the object beside it."""
    from shardfold.functions import store

    if task_log is not None:
        doc["log"] = {"uri": doc["log"]["uri"], "lines": len(task_log.lines) + task_log.dropped}
    try:
        if task_log is not None and task_log.lines:
            if withheld:  # the lines' times would tell the task's duration the record withholds
                task_log.lines = [_untimed(line) for line in task_log.lines]
            if not task_log.dropped and task_log.size <= INLINE_LOG_BYTES:
                doc["log"]["inline"] = task_log.lines  # in the record: no request of its own
            else:
                store.put(doc["log"]["uri"], task_log.text())
        store.put(uri, _dump(doc, withheld))
    except Exception as exc:  # noqa: BLE001 - telemetry never fails a task
        logger.warning("telemetry record not written", extra={"step": doc["step"], "error": str(exc)})


def _log_ended(attempt: int | None, error: BaseException | None, measured: _Figures | None) -> None:
    """The attempt's last line, ``task ended``: its outcome, and (``measured``: duration, peak memory and
    meter, None for a private step) the figures its record keeps, all from memory."""
    extra: dict[str, Any] = {"attempt": attempt, "outcome": "failed" if error is not None else "succeeded"}
    if error is not None:
        extra["error_type"] = type(error).__name__
    if measured is not None:
        duration, peak, meter = measured
        extra.update(
            duration_s=round(duration, 3),
            peak_memory_mib=peak,
            bytes_read=meter.bytes_read,
            bytes_written=meter.bytes_written,
            requests=sum(meter.requests.values()),
        )
    try:
        logger.info("task ended", extra=extra)
    except Exception:  # noqa: BLE001, S110 - telemetry never fails a task
        pass


def _untimed(line: str) -> str:
    """A JSON log line without its ``timestamp`` (a line that is not JSON cannot be trusted to have none)."""
    try:
        entry = jsontext.loads(line)
    except ValueError:
        return json.dumps({"message": "(a log line that is not JSON, withheld)"})
    if isinstance(entry, dict):
        entry.pop("timestamp", None)
        return json.dumps(entry)
    return json.dumps({"message": "(a log line that is not JSON, withheld)"})


def _dump(doc: dict[str, Any], withheld: bool) -> bytes:
    if withheld:
        doc = {k: (None if k in MEASURED else v) for k, v in doc.items()} | {"withheld": True}
    return json.dumps(doc, sort_keys=True).encode()


def read_records(store_root: str, job_id: str) -> list[dict[str, Any]]:
    """Every record of the job (fetched together through the GetBatch engine), ordered by step, task and
    attempt; a record a dying task left half-written is skipped."""
    from shardfold.functions import store

    uris = [u for u in store.list_uris(prefix(store_root, job_id) + "/") if u.endswith(".json")]
    out = []
    for uri, entry in zip(uris, store.get_batch(uris, continue_on_error=True), strict=True):
        if entry.error is None:
            try:
                record = jsontext.loads(entry.data)
            except ValueError:
                continue
            if _well_formed(record):
                if (record.get("log") or {}).get("uri"):
                    # the log object is the record's sibling, whatever the record says: a record written
                    # into the bucket by hand cannot make `shardfold logs` read another object
                    record["log"]["uri"] = uri[: -len(".json")] + ".log"
                out.append(record)
    return sorted(out, key=lambda r: (r["step"], _task_order(r.get("task")), r.get("attempt") or 0))


def _well_formed(record: Any) -> bool:
    """A record the report can read: the fields it sorts and joins on, of the types it expects (one written
    by hand into the bucket is skipped, not a crash)."""
    if not isinstance(record, dict) or not isinstance(record.get("step"), str):
        return False
    numbers = ("started_at", "ended_at", "duration_s", "peak_memory_mib")
    return (
        all(record.get(k) is None or isinstance(record[k], int | float) for k in numbers)
        and all(record.get(k) is None or isinstance(record[k], int) for k in ("task", "attempt"))
        and all(record.get(k) is None or isinstance(record[k], dict) for k in ("requests", "log", "error"))
    )


LOG_READ_BYTES = 1 << 20  # a log object is read in ranges of this size, never whole


def log_lines(
    record: dict[str, Any], store_root: str, job_id: str, groups: frozenset[str] = frozenset()
) -> Iterator[str]:
    """The log lines of one attempt, streamed: its log object's (tasks run outside AWS), or its lines in
    CloudWatch Logs (a Lambda invocation: the lines of its request id in its stream; a Batch job: its
    stream). A record is anyone's to forge: a log object is followed only inside the job's own folder, and
    CloudWatch only in ``groups``, the stack's own log groups."""
    from shardfold.functions import store
    from shardfold.functions.jobs import job_key
    from shardfold.functions.store.uri import join

    place = record.get("log") or {}
    if not isinstance(place, dict):
        return
    uri = place.get("uri")
    if isinstance(uri, str):
        own = join(store_root, job_key(job_id)) + "/"
        if not uri.startswith(own) or "/../" in uri:
            yield "(this record's log is outside the job's folder: not followed)"
            return
        inline = place.get("inline")
        if isinstance(inline, list):  # a small log, kept in the record itself
            yield from (line for line in inline if isinstance(line, str))
            return
        if not place.get("lines") and record.get("outcome") != "running":
            return
        yield from _object_lines(store, uri)
        return
    if place.get("group") or place.get("batch_job"):
        group = place.get("group") or BATCH_LOG_GROUP
        if group not in groups:
            yield f"(this record's log group {str(group)[:80]!r} is not one of the stack's: not followed)"
            return
        yield from cloudwatch_lines(place)


def _object_lines(store: Any, uri: str) -> Iterator[str]:
    try:
        size = store.size(uri)
    except Exception:  # noqa: BLE001 - a task killed before its log was written has none
        return
    offset, rest = 0, b""
    while offset < size:
        try:
            chunk = store.get(uri, offset, min(LOG_READ_BYTES, size - offset))
        except Exception:  # noqa: BLE001 - cut short since its size was read: what was read stands
            break
        if not chunk:
            break
        offset += len(chunk)
        *lines, rest = (rest + chunk).split(b"\n")
        for line in lines:
            yield line.decode(errors="replace")
    if rest:
        yield rest.decode(errors="replace")


BATCH_LOG_GROUP = "/aws/batch/job"  # where AWS Batch jobs log unless their definition says otherwise


def cloudwatch_lines(place: dict[str, Any]) -> Iterator[str]:
    """Lines of a Lambda invocation (``group``, ``stream``, ``request_id``) or of a Batch job
    (``batch_job``: its log stream, from DescribeJobs) in CloudWatch Logs, a page at a time."""
    from shardfold.functions import credentials

    session = credentials.session()
    logs = session.client("logs")
    if place.get("batch_job"):
        jobs = session.client("batch").describe_jobs(jobs=[str(place["batch_job"])])["jobs"]
        stream = jobs[0].get("container", {}).get("logStreamName") if jobs else None
        if not stream:
            return
        kwargs: dict[str, Any] = {"logGroupName": place.get("group") or BATCH_LOG_GROUP}
        kwargs["logStreamNames"] = [stream]
    else:
        kwargs = {"logGroupName": place["group"], "logStreamNames": [str(place.get("stream"))]}
        if place.get("request_id"):
            kwargs["filterPattern"] = f'"{place["request_id"]}"'
    for page in logs.get_paginator("filter_log_events").paginate(**kwargs):
        for e in page.get("events", []):
            yield e["message"].rstrip("\n")


REPORT_LINE = re.compile(
    r"REPORT RequestId: (?P<rid>\S+)\s+Duration: (?P<ms>[\d.]+) ms\s+Billed Duration: (?P<billed>\d+) ms"
    r"\s+Memory Size: (?P<size>\d+) MB\s+Max Memory Used: (?P<used>\d+) MB"
)


def with_lambda_reports(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records of Lambda invocations with what Lambda's REPORT line says of them (``billed_duration_s``,
    ``memory_size_mb``, ``max_memory_used_mib``: the most the execution environment used so far), found in
    CloudWatch Logs with one filtered query per function over the job's time span. Withheld records stay
    as they are."""
    lambda_records = [
        r
        for r in records
        if (r.get("log") or {}).get("request_id") and not r.get("withheld") and r.get("ended_at")
    ]
    if not lambda_records:
        return records
    from shardfold.functions import credentials

    logs = credentials.session().client("logs")
    start = int(min(r["started_at"] for r in lambda_records) * 1000) - 60_000
    end = int(max(r["ended_at"] for r in lambda_records) * 1000) + 60_000
    found: dict[str, dict[str, Any]] = {}
    for group in sorted({r["log"]["group"] for r in lambda_records}):
        pages = logs.get_paginator("filter_log_events").paginate(
            logGroupName=group, filterPattern='"REPORT RequestId"', startTime=start, endTime=end
        )
        for page in pages:
            for event in page.get("events", []):
                m = REPORT_LINE.search(event["message"])
                if m:
                    found[m["rid"]] = {
                        "billed_duration_s": int(m["billed"]) / 1000,
                        "memory_size_mb": int(m["size"]),
                        "max_memory_used_mib": float(m["used"]),
                    }
    return [
        {**r, **found.get((r.get("log") or {}).get("request_id") or "", {})} if r in lambda_records else r
        for r in records
    ]


def _task_order(task: int | None) -> int:
    return -1 if task is None else task
