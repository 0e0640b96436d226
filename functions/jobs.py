"""Job identity and the per-job store layout, shared by the SDK, the bucket trigger and the executors.

A job id is ``<kind>-<YYYYMMDDTHHMMSS>-<6 hex>``: sortable by submission time, unique enough for one user,
and a valid Step Functions execution name (the AWS executor uses it as one).
"""

from __future__ import annotations

import datetime as _dt
import re
import secrets

JOB_ID_RE = re.compile(r"^(?P<kind>[a-z][a-z0-9]*)-(?P<ts>\d{8}T\d{6})-(?P<rand>[0-9a-f]{6})$")


def new_job_id(kind: str, now: _dt.datetime | None = None) -> str:
    """A fresh job id for ``kind`` (UTC timestamp plus 24 random bits)."""
    now = now or _dt.datetime.now(_dt.UTC)
    return f"{kind}-{now.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}"


def kind_of(job_id: str) -> str | None:
    """The kind encoded in a job id, or None if the id is not one of ours."""
    m = JOB_ID_RE.match(job_id)
    return m.group("kind") if m else None


def submitted_at(job_id: str) -> str | None:
    """When a job was submitted (UTC, ``YYYY-MM-DDTHH:MM:SS``), read from its id; None for another id."""
    m = JOB_ID_RE.match(job_id)
    return _dt.datetime.strptime(m.group("ts"), "%Y%m%dT%H%M%S").isoformat() if m else None


def job_key(job_id: str, *parts: str) -> str:
    """Key of a job's object relative to the store root: ``jobs/<id>/<parts...>``."""
    return "/".join(["jobs", job_id, *parts])


def spec_key(job_id: str) -> str:
    return job_key(job_id, "spec.json")


def status_key(job_id: str) -> str:
    return job_key(job_id, "status.json")


def result_key(job_id: str) -> str:
    return job_key(job_id, "result.json")


def cancel_key(job_id: str) -> str:
    """The marker a cancel leaves (both executors): a task that waits long (fedavg's wait for late
    updates) looks for it, so a cancelled job's work stops instead of waiting out its time."""
    return job_key(job_id, "cancel")


def scratch_key(job_id: str, kind: str) -> str:
    """The prefix of a job's scratch objects (``jobs/<id>/<kind>/``: part lists, fragments, shards): removed
    once the job has its result, and by ``shardfold clean``."""
    return job_key(job_id, kind) + "/"
