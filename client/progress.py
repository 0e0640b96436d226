"""Rich progress bars for a running job: one bar per workflow step, fed from ``JobStatus.steps``.

A step counts its tasks (``{"done", "total"}``); a kind's own counters may count in the user's units
(``{"done", "total", "unit"}``: rows, items, bytes; :func:`functions.kinds.counter`), and show them with a
rate and an ETA. Each step's clock is its own: a finished step shows how long it ran, not the job's time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TaskID,
    TextColumn,
)
from rich.text import Text

BYTES = "bytes"


def _counts(value: Any) -> tuple[int, int | None]:
    """(done, total) from a step entry: a dict {done, total} or an object with those attributes."""
    if isinstance(value, dict):
        done, total = value.get("done", 0), value.get("total")
    else:
        done, total = getattr(value, "done", 0), getattr(value, "total", None)
    return int(done or 0), (None if total is None else int(total))


def _unit(value: Any) -> str | None:
    """What a step entry counts, when it says (a kind's counter: "rows", "items", "bytes"); None: tasks."""
    unit = value.get("unit") if isinstance(value, dict) else getattr(value, "unit", None)
    return unit if isinstance(unit, str) and unit else None


@dataclass
class _Clock:
    """When one step ran, as the view saw it (times from the view's clock)."""

    start: float | None = None  # when it began; None: not seen under way yet
    base: int = 0  # its count at ``start``: work the view did not time (done before it was watching)
    end: float | None = None  # when it was first seen finished, or the job ended with it unfinished
    timed: bool = True  # False: it finished before the view could see it run (its duration is unknown)
    since: float | None = None  # a step not seen under way but next in line: when the one before it ended
    changed: float | None = None  # when its count last moved (what the rate is measured up to)
    last_total: int | None = None
    last_done: int = 0

    def observe(
        self, now: float, done: int, total: int | None, ended: bool, before: float, next_in_line: bool
    ) -> None:
        """Take the step's count at ``now``. ``before``: when the steps listed before it ended (the view's
        start if none has); ``next_in_line``: none of them is still open; ``ended``: the job has ended."""
        finished = total is not None and done >= total
        if self.start is None:
            if self.last_total is None and total is not None and not finished:
                self.start, self.base = now, done  # a Map's items became known: it began
            elif done > 0 or finished:  # a step seen only once it moved began when the one before ended
                self.start = before
        if total == 0:
            self.timed = False  # nothing to run (a repair round with nothing to repair): no time to show
        if done != self.last_done:
            self.changed, self.last_done = now, done
        if self.end is None and (finished or ended):
            self.end = now
        self.last_total = total
        self.since = before if self.start is None and next_in_line and not ended else None

    def running_time(self, now: float) -> float | None:
        if self.end is not None:
            return self.end - self.start if self.timed and self.start is not None else None
        start = self.start if self.start is not None else self.since
        return None if start is None else max(0.0, now - start)

    def rate(self, done: int) -> float | None:
        """``done`` per second since the step began, up to when its count last moved (its average; once it
        ended, over its whole run): counts arrive in steps (a part, a shard), so it holds between them."""
        if self.start is None or not self.timed or done <= self.base:
            return None
        until = self.end if self.end is not None else self.changed
        seconds = (until if until is not None else self.start) - self.start
        return (done - self.base) / seconds if seconds > 0 else None

    def eta(self, done: int, total: int, now: float) -> float | None:
        """Seconds left at that rate, counted from when the count last moved."""
        rate = self.rate(done)
        if rate is None or self.changed is None:
            return None
        return max(0.0, (total - done) / rate - (now - self.changed))


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _eta(seconds: float) -> str:
    return f"{math.ceil(seconds)}s" if seconds < 60 else _duration(seconds)


def _scale(n: float) -> tuple[int, str]:
    """The binary unit to write ``n`` bytes in, as the CLI's result view does ("430 B", "190.7 MiB")."""
    for power, suffix in enumerate(("B", "KiB", "MiB", "GiB", "TiB")):
        if abs(n) < 1024 ** (power + 1) or suffix == "TiB":
            return 1024**power, suffix
    raise AssertionError("unreachable")


def _bytes(n: float, scale: tuple[int, str] | None = None) -> str:
    divisor, suffix = scale or _scale(n)
    return f"{n / divisor:,.0f}" if divisor == 1 else f"{n / divisor:,.1f}"


def _amount(value: float, unit: str) -> str:
    if unit == BYTES:
        scale = _scale(value)
        return f"{_bytes(value, scale)} {scale[1]}"
    return f"{value:,.1f} {unit}" if value < 10 and value != int(value) else f"{value:,.0f} {unit}"


class _StepSpinner(SpinnerColumn):
    """A spinner while the step runs; once the job has ended, what became of a step that did not finish."""

    def render(self, task: Any) -> Any:
        ended = task.fields.get("ended")
        return Text.from_markup(ended) if ended else super().render(task)


class _CountColumn(ProgressColumn):
    """done/total: of a step's tasks ("3/10"), or in the step's unit ("1,200/3,000 rows", "1.2/3.4 MiB")."""

    def __init__(self) -> None:
        super().__init__()
        self._tasks = MofNCompleteColumn()

    def render(self, task: Any) -> Text:
        unit = task.fields.get("unit")
        if unit is None:
            return self._tasks.render(task)
        if unit == BYTES:
            if task.total is None:
                return Text(_amount(task.completed, BYTES), style="progress.download")
            scale = _scale(task.total)
            text = f"{_bytes(task.completed, scale)}/{_bytes(task.total, scale)} {scale[1]}"
            return Text(text, style="progress.download")
        total = "?" if task.total is None else f"{int(task.total):,}"
        return Text(f"{int(task.completed):,}/{total} {unit}", style="progress.download")


class _RateColumn(ProgressColumn):
    """A counter's rate in its unit per second ("400 rows/s", "1.2 MiB/s"): its average since it began."""

    def render(self, task: Any) -> Text:
        unit, step = task.fields.get("unit"), task.fields.get("clock")
        rate = step.rate(int(task.completed)) if unit and step else None
        return Text("" if rate is None else f"{_amount(rate, unit)}/s", style="progress.data.speed")


class _TimeColumn(ProgressColumn):
    """A step's own time: how long it ran once it ended; while it runs, the ETA at its rate where it counts
    in a unit of known total, else how long it has run so far. Blank while it waits its turn."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__()
        self._clock = clock

    def render(self, task: Any) -> Text:
        step: _Clock | None = task.fields.get("clock")
        if step is None:
            return Text("")
        now = self._clock()
        ran = step.running_time(now)
        if step.end is not None:
            return Text("" if ran is None else _duration(ran), style="progress.elapsed")
        eta = None
        if task.fields.get("unit") and task.total is not None:
            eta = step.eta(int(task.completed), int(task.total), now)
        if eta is not None:
            return Text(f"ETA {_eta(eta)}", style="progress.remaining")
        return Text("" if ran is None else _duration(ran), style="progress.elapsed")


class ProgressView:
    """Context manager; pass :meth:`update` as the executor's ``on_progress`` callback.

    Bars go to stderr so a command's stdout stays clean for its result. ``get_time``: the clock (seconds,
    monotonic; rich's ``Progress`` takes it too), for tests.
    """

    def __init__(
        self, job_id: str, console: Console | None = None, get_time: Callable[[], float] | None = None
    ):
        self._job_id = job_id
        self._now = get_time or time.monotonic
        self._progress = Progress(
            _StepSpinner(finished_text="[green]✓[/]"),
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=30),
            _CountColumn(),
            _RateColumn(),
            _TimeColumn(self._now),
            console=console or Console(stderr=True),
            get_time=self._now,
        )
        self._tasks: dict[str, TaskID] = {}
        self._clocks: dict[str, _Clock] = {}
        self._t0 = self._now()  # when the view began watching: the start of what it saw start before it
        self._updates = 0

    def __enter__(self) -> ProgressView:
        self._t0 = self._now()
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def __rich__(self) -> Any:
        """The bars as they stand now (``console.print(view)``), whether or not the view is live."""
        return self._progress.get_renderable()

    def update(self, status: Any) -> None:
        """Take a job's status (the executor's ``on_progress``): each step's count, and when it ran."""
        state = getattr(status, "state", None)
        ended = bool(getattr(status, "finished", False))
        now, first = self._now(), self._updates == 0
        self._updates += 1
        latest_end: float | None = None  # the latest end among the steps listed before this one
        next_in_line = True  # no step listed before this one is still open
        for step, value in (getattr(status, "steps", None) or {}).items():
            done, total = _counts(value)
            clock = self._clocks.get(step) or self._add(step, value, now, first)
            before = latest_end if latest_end is not None else self._t0
            clock.observe(now, done, total, ended, before, next_in_line)
            self._draw(self._tasks[step], value, state, ended)
            if clock.end is not None and total != 0:
                latest_end = clock.end if latest_end is None else max(latest_end, clock.end)
            next_in_line = next_in_line and total is not None and done >= total

    def _add(self, step: str, value: Any, now: float, first: bool) -> _Clock:
        """A bar and a clock for a step seen for the first time: what it did before the view watched is not
        timed; one that appears later under way began now, and one that appears done has no known time."""
        done, total = _counts(value)
        clock = self._clocks[step] = _Clock(changed=now, last_total=total, last_done=done)
        when = self._t0 if first else now
        if total is not None and done >= total:
            clock.start, clock.end, clock.timed = when, when, False
        elif done > 0 or not first:
            clock.start, clock.base = when, done
        # the description is rendered as markup: a step name prints as written
        self._tasks[step] = self._progress.add_task(
            escape(str(step)), total=total, completed=done, unit=_unit(value), clock=clock
        )
        return clock

    def _draw(self, task: TaskID, value: Any, state: str | None, ended: bool) -> None:
        """A step's bar at its count; once the job has ended, what became of it if it did not finish."""
        done, total = _counts(value)
        self._progress.update(task, completed=done, total=total, unit=_unit(value))
        if ended and (total is None or done < total or total == 0):
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
