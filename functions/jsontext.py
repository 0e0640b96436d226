"""Untrusted JSON: the one parser for what anyone who may write to the store (or a watched folder) can have
written: specs, manifests, job records, telemetry, stack outputs.

It refuses what ``json.loads`` takes and the project must not: nesting deeper than :data:`MAX_DEPTH` (a
hundred thousand ``[`` made every verb fail with a ``RecursionError`` traceback, and ``watch`` stop), a key
given twice (last-wins would hide the first from a reviewer), and ``NaN``/``Infinity`` (not JSON; they
also make ``report --json`` print what other JSON parsers reject).
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64  # specs and records nest a few levels; data rows may ask for more (max_depth=)


class JSONTextError(ValueError):
    """Not a JSON document this project accepts; the message says why (position, key or depth)."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise JSONTextError(f"duplicate key {key[:80]!r} (a key may appear once in an object)")
        out[key] = value
    return out


def _constant(name: str) -> Any:
    raise JSONTextError(f"{name} is not a JSON value (give a number)")


def depth(doc: Any) -> int:
    """How deep ``doc`` nests (a scalar: 0, ``[]``: 1), without recursion: one level at a time, so a list of
    50,000 flat items costs two list comprehensions, not 50,000 stack pushes."""
    level, frontier = 0, [doc]
    while True:
        frontier = [v for v in frontier if isinstance(v, dict | list)]
        if not frontier:
            return level
        level += 1
        below: list[Any] = []
        for v in frontier:
            below.extend(v.values() if isinstance(v, dict) else v)
        frontier = below


def check_depth(doc: Any, max_depth: int = MAX_DEPTH) -> Any:
    """``doc`` (already parsed: a dict from the SDK), or :class:`JSONTextError` when it nests too deep."""
    if depth(doc) > max_depth:
        raise JSONTextError(f"it nests deeper than {max_depth} levels of objects and lists")
    return doc


def loads(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """Parse ``text``; :class:`JSONTextError` for anything :mod:`json` refuses and for the above."""
    try:
        doc = json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant)
    except RecursionError:
        raise JSONTextError(f"it nests deeper than {max_depth} levels of objects and lists") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise JSONTextError(str(exc)) from None
    return check_depth(doc, max_depth)
