"""A job's telemetry as one table (pyarrow: the client's side; Lambda packages carry no pyarrow).

:func:`table` gives one row per task attempt from the records :mod:`functions.telemetry` writes; once the
job has ended they are merged into ``jobs/<id>/telemetry.parquet`` and later reads take that one object.
"""

from __future__ import annotations

import json
from typing import Any

from shardfold.functions.telemetry import read_records

COLUMNS = (
    "step", "task", "attempt", "outcome", "error_type", "error", "started_at", "ended_at", "duration_s",
    "peak_memory_mib", "memory_scope", "bytes_read", "bytes_written", "requests", "gets", "puts",
    "store_retries", "log", "withheld", "function", "host", "pid",
)  # fmt: skip


def table_uri(store_root: str, job_id: str) -> str:
    from shardfold.functions.store.uri import join

    return join(store_root, "jobs", job_id, "telemetry.parquet")


def to_table(records: list[dict[str, Any]]) -> Any:
    """The records as a pyarrow table of :data:`COLUMNS` (``requests`` and ``log`` as JSON text; ``gets`` and
    ``puts`` the requests by S3's billing class)."""
    import pyarrow as pa

    from shardfold.functions.report import requests_by_class

    rows = []
    for r in records:
        error = r.get("error") or {}
        gets, puts = requests_by_class(r.get("requests") or {})
        rows.append(
            {
                **{k: r.get(k) for k in COLUMNS},
                "error_type": error.get("type"),
                "error": error.get("message"),
                "requests": json.dumps(r.get("requests") or {}, sort_keys=True),
                "log": _place(r.get("log")),
                "gets": gets if not r.get("withheld") else None,
                "puts": puts if not r.get("withheld") else None,
                "withheld": bool(r.get("withheld")),
            }
        )
    schema = pa.schema(
        [
            ("step", pa.string()), ("task", pa.int64()), ("attempt", pa.int64()), ("outcome", pa.string()),
            ("error_type", pa.string()), ("error", pa.string()), ("started_at", pa.float64()),
            ("ended_at", pa.float64()), ("duration_s", pa.float64()), ("peak_memory_mib", pa.float64()),
            ("memory_scope", pa.string()), ("bytes_read", pa.int64()), ("bytes_written", pa.int64()),
            ("requests", pa.string()), ("gets", pa.int64()), ("puts", pa.int64()),
            ("store_retries", pa.int64()), ("log", pa.string()), ("withheld", pa.bool_()),
            ("function", pa.string()), ("host", pa.string()), ("pid", pa.int64()),
        ]
    )  # fmt: skip
    return pa.Table.from_pylist(rows, schema=schema)


def _place(log: Any) -> str | None:
    """Where a record's log is, as JSON text; a small log kept in the record (``inline``) stays out of the
    table (``job.logs()`` reads it from the record)."""
    if not log:
        return None
    return json.dumps({k: v for k, v in log.items() if k != "inline"} if isinstance(log, dict) else log)


def table(store_root: str, job_id: str, ended_at: str | None) -> Any:
    """The job's telemetry table. Once the job has ended (``ended_at``, its status's end time) the records
    are merged into ``jobs/<id>/telemetry.parquet`` and later reads take that one object, until the job
    runs again (a resumed job ends at another time); while it runs the table is built from the records."""
    import io

    import pyarrow.parquet as pq

    from shardfold.functions import store

    uri = table_uri(store_root, job_id)
    if ended_at is not None and store.exists(uri):
        merged = pq.read_table(io.BytesIO(store.get(uri)))
        if (merged.schema.metadata or {}).get(b"ended_at") == ended_at.encode():
            return merged
    merged = to_table(read_records(store_root, job_id))
    if ended_at is not None:
        merged = merged.replace_schema_metadata({"ended_at": ended_at})
        buf = io.BytesIO()
        pq.write_table(merged, buf)
        store.put(uri, buf.getvalue())
    return merged
