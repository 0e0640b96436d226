"""Helpers every benchmark script shares: plain-text tables and quiet library logs."""

from __future__ import annotations

import os


def table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    """A plain-text table; columns in ``right`` (default: all but the first and last) right-aligned."""
    n = len(headers)
    if right is None:
        right = set(range(1, n - 1))
    widths = [max(len(headers[i]), *(len(r[i]) for r in rows)) if rows else len(headers[i]) for i in range(n)]
    widths[-1] = 0

    def fmt(vals: list[str]) -> str:
        out = []
        for i, v in enumerate(vals):
            w = widths[i]
            out.append(v if not w else (f"{v:>{w}}" if i in right else f"{v:<{w}}"))
        return "  ".join(out).rstrip()

    lines = [fmt(headers), fmt(["-" * w if w else "----" for w in widths])]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def quiet_logs(verbose: bool) -> None:
    """Library INFO lines would bury the tables: show warnings only unless asked."""
    if not verbose and not (os.environ.get("POWERTOOLS_LOG_LEVEL") or os.environ.get("LOG_LEVEL")):
        os.environ["POWERTOOLS_LOG_LEVEL"] = "WARNING"
