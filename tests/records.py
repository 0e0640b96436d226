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


# The estimate of a two-step job ("prep", then a Map of three "work" tasks), as submit keeps it
ESTIMATE = {
    "steps": [
        {"name": "prep", "tasks": 1, "memory_mb": 512, "peak_mb": 100.0, "gets": 1, "puts": 1,
         "duration_s": 0.5, "gb_s": 0.25, "instance_s": 0.0, "why": "the <item> list"},
        {"name": "work", "tasks": 3, "memory_mb": 1024, "peak_mb": 300.0, "gets": 6, "puts": 3,
         "duration_s": 1.0, "gb_s": 3.0, "instance_s": 0.0, "why": "one part"},
    ],
    "cost_usd": {"lambda_compute": 0.5, "total": 1.0},
    "transitions": 6,
    "notes": ["a note"],
    "submitted_at": 100.0,
}  # fmt: skip
