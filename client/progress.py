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
from rich.text import Text


def _counts(value: Any) -> tuple[int, int | None]:
    """(done, total) from a step entry: a dict {done, total} or an object with those attributes."""
    if isinstance(value, dict):
        done, total = value.get("done", 0), value.get("total")
    else:
        done, total = getattr(value, "done", 0), getattr(value, "total", None)
    return int(done or 0), (None if total is None else int(total))


class _StepSpinner(SpinnerColumn):
    """A spinner while the step runs; once the job has ended, what became of a step that did not finish."""

    def render(self, task: Any) -> Any:
        ended = task.fields.get("ended")
        return Text.from_markup(ended) if ended else super().render(task)


class ProgressView:
    """Context manager; pass :meth:`update` as the executor's ``on_progress`` callback.

    Bars go to stderr so a command's stdout stays clean for its result.
    """

    def __init__(self, job_id: str, console: Console | None = None):
        self._job_id = job_id
        self._progress = Progress(
            _StepSpinner(finished_text="[green]✓[/]"),
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
        state = getattr(status, "state", None)
        ended = bool(getattr(status, "finished", False))
        for step, value in (getattr(status, "steps", None) or {}).items():
            done, total = _counts(value)
            if step not in self._tasks:
                # the description is rendered as markup: a step name prints as written
                self._tasks[step] = self._progress.add_task(escape(str(step)), total=total)
            task = self._tasks[step]
            self._progress.update(task, completed=done, total=total)
            if ended and (total is None or done < total or total == 0):
                # no spinner left turning once the job has ended: say what became of the step
                mark = _ENDED.get(state, "[dim]–[/]") if total != 0 else "[dim]skipped[/]"
                self._progress.update(task, ended=mark)
                self._progress.stop_task(task)


# What an unfinished step shows once the job has ended in this state.
_ENDED = {
    "SUCCEEDED": "[dim]skipped[/]",
    "FAILED": "[red]✗[/]",
    "CANCELLED": "[yellow]cancelled[/]",
    "INTERRUPTED": "[yellow]interrupted[/]",
}
