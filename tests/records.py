"""Telemetry records built by hand, for the report's tests (test_telemetry.py, test_report_html.py)."""

from __future__ import annotations

from typing import Any


def record(
    step: str, task: int | None, attempt: int, start: float | None, dur: float | None, **kw: Any
) -> dict:
    """A succeeded attempt of ``step`` starting at ``start`` for ``dur`` seconds (None: figures withheld)."""
    return {
        "step": step, "task": task, "attempt": attempt, "outcome": "succeeded", "error": None,
        "started_at": start, "ended_at": None if start is None else start + dur, "duration_s": dur,
        "peak_memory_mib": 50.0, "memory_scope": "task", "requests": {"GET": 2, "PUT": 1}, **kw,
    }  # fmt: skip
