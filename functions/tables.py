"""Plain tables the CLI prints: a kind's plan details and its result view.

Kinds describe what to show as data (titles, columns, rows of str/int/float); only the CLI knows how to
draw it, so nothing here imports a terminal library and a Lambda package carries it for free.
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


def result_fields(result: dict[str, Any]) -> ResultView:
    """The default view: every field of the result document, as it is."""
    return ResultView(summary=dict(result))
