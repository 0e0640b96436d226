"""Rich progress bars for a running job: one bar per workflow step, fed from ``JobStatus.steps``."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)


def _counts(value: Any) -> tuple[int, int | None]:
    """(done, total) from a step entry: a dict {done, total} or an object with those attributes."""
    if isinstance(value, dict):
        done, total = value.get("done", 0), value.get("total")
    else:
        done, total = getattr(value, "done", 0), getattr(value, "total", None)
    return int(done or 0), (int(total) if total else None)


class ProgressView:
    """Context manager; pass :meth:`update` as the executor's ``on_progress`` callback.

    Bars go to stderr so a command's stdout stays clean for its result.
    """

    def __init__(self, job_id: str, console: Console | None = None):
        self._job_id = job_id
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
        )
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> ProgressView:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, status: Any) -> None:
        for step, value in (getattr(status, "steps", None) or {}).items():
            done, total = _counts(value)
            if step not in self._tasks:
                # the description is rendered as markup: a step name prints as written
                self._tasks[step] = self._progress.add_task(escape(str(step)), total=total)
            self._progress.update(self._tasks[step], completed=done, total=total)
