"""Plain tables the CLI prints: a kind's plan details and its result view.

Kinds describe what to show as data (titles, columns, rows of str/int/float); the client draws it (the
CLI at a terminal, the HTML report), so nothing here imports a terminal library and a Lambda package
carries it for free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Table:
    """A titled table: column names and rows of plain values (str, int, float)."""

    title: str
    columns: list[str]
    rows: list[list[Any]]


@dataclass
class ResultView:
    """How a job's result reads at a terminal: ``summary`` (label -> value), ``tables``, then ``notes``."""

    summary: dict[str, Any]
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def size_text(n: int | float | None) -> str:
    """A byte count for people: "512 B", "7.2 KiB", "5.0 MiB" (binary units); "-" for None."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def result_fields(result: dict[str, Any]) -> ResultView:
    """The default view: every field of the result document, as it is."""
    return ResultView(summary=dict(result))
