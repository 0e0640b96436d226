"""The planner's parts, checked (:func:`checked`): a dpquery workload as arrays (each marginal's attributes
sorted and padded with d, its weight) and each slot's query type code, or a SpecError that names every
entry at fault. Pure, no store.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from shardfold.functions.dpquery.spec import MAX_MATRICES, PAIR_TYPES, QUERY_TYPES, QueryMatrix
from shardfold.functions.errors import SpecError
from shardfold.functions.privacy import MAX_RHO, REPORT_DELTA

# The largest public row bound N: counts up to 2^53 are exact in float64 (the transform's input).
MAX_ROWS_BOUND = 2**53
LOSSES = ("sum_of_variances", "max_variance")


@dataclass(frozen=True)
class Parts:
    """A job's parts, checked (:func:`checked`): what :func:`functions.dpquery.planner.plan` plans."""

    n: np.ndarray  # (d,) int64 domain sizes
    sizes: np.ndarray  # (|W|,) each marginal's size
    padded_a: np.ndarray  # (|W|, width) int32: each marginal's attributes, sorted, padded with d
    weights: np.ndarray  # (|W|,) float64
    rho: float
    loss: str
    names: list[str] | None
    delta: float
    unit_rows: int
    rows_bound: int | None
    codes: np.ndarray | None  # each slot's query type code (:func:`_type_codes`); None: all identity
    kinds: tuple  # the type of each code


def checked(domains, workload, rho, loss, names, delta, unit_rows, rows_bound, queries) -> Parts:
    """plan()'s parts, checked, with their defaults; a SpecError says what is wrong."""
    if domains is None or workload is None or rho is None:
        raise SpecError("plan needs a spec, or domains, workload and rho")
    loss = loss or "sum_of_variances"
    delta = REPORT_DELTA if delta is None else float(delta)
    n = np.asarray(domains, dtype=np.int64)
    sizes, padded_a, weights = _check_parts(n, workload, float(rho), loss, names)
    typed = _type_codes(queries, padded_a, sizes, loss, n)
    codes, kinds = typed if typed is not None else (None, QUERY_TYPES)
    unit_rows = 1 if unit_rows is None else int(unit_rows)
    if unit_rows < 1:
        raise SpecError(f"unit_rows must be >= 1, got {unit_rows}")
    if rows_bound is not None and not (1 <= int(rows_bound) <= MAX_ROWS_BOUND):
        raise SpecError(f"rows_bound must lie in [1, 2^53], got {rows_bound}")
    return Parts(
        n, sizes, padded_a, weights, float(rho), loss, names, delta, unit_rows, rows_bound, codes, kinds
    )


def _check_parts(n, workload, rho, loss, names) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The workload as (sizes, padded, weights): each marginal's size, its attributes sorted and padded with
    d to the widest, and its weight; a SpecError names every entry at fault. Checked on arrays, not entry by
    entry: a d = 100 workload of all ≤3-way marginals has 166,751 entries."""
    errors = _whole_errors(n, rho, loss, names, workload)
    d = int(n.size)
    sizes, padded, weights, weight_of = _padded_workload(workload, d)
    faulty, entry_errors = _entry_errors(sizes, padded, weights, weight_of, d)
    errors += entry_errors + _repeat_errors(sizes, padded, np.flatnonzero(~faulty))
    if errors:
        errors.sort(key=_error_order)
        raise SpecError("cannot plan: " + "; ".join(f"{e['field']}: {e['error']}" for e in errors), errors)
    return sizes, padded.astype(np.int32), weights


def _whole_errors(n, rho, loss, names, workload) -> list[dict[str, str]]:
    """What is wrong with the parts as a whole: the domains, rho, loss, names, an empty workload."""
    errors = []
    if n.ndim != 1 or n.size == 0:
        errors.append({"field": "domains", "error": "give one domain size per attribute"})
    elif np.any(n < 2):
        j = int(np.argmax(n < 2))
        errors.append({"field": f"domains.{j}", "error": f"domain size {int(n[j])}; at least 2 needed"})
    if not (0 < rho <= MAX_RHO):
        errors.append({"field": "rho", "error": f"must be a number > 0 and at most {MAX_RHO:g}, got {rho}"})
    if loss not in LOSSES:
        errors.append({"field": "loss", "error": f"{loss!r}; expected one of {list(LOSSES)}"})
    if names is not None and len(names) != n.size:
        errors.append({"field": "names", "error": f"{len(names)} names for {n.size} attributes"})
    if not workload:
        errors.append({"field": "workload", "error": "the workload is empty"})
    return errors


def _padded_workload(workload, d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
    """(sizes, padded, weights, the weights as given): each entry's attributes sorted and padded with d to
    the widest. An entry is (attrs, weight) with attrs a tuple/list, or bare attrs (weight 1)."""
    attrs_of, weight_of = [], []
    for entry in workload or []:
        if isinstance(entry, tuple | list) and len(entry) == 2 and isinstance(entry[0], tuple | list):
            attrs_of.append(entry[0])
            weight_of.append(entry[1])
        else:
            attrs_of.append(entry)
            weight_of.append(1.0)
    m = len(attrs_of)
    sizes = np.fromiter(map(len, attrs_of), dtype=np.int64, count=m)
    width = max(int(sizes.max(initial=0)), 1)
    flat = np.fromiter(itertools.chain.from_iterable(attrs_of), dtype=np.int64, count=int(sizes.sum()))
    padded = np.full((m, width), d, dtype=np.int64)
    padded[np.arange(width)[None, :] < sizes[:, None]] = flat  # row-major: each entry's attributes in order
    padded.sort(axis=1)
    return sizes, padded, np.asarray(weight_of, dtype=np.float64), weight_of


def _entry_errors(sizes, padded, weights, weight_of, d: int) -> tuple[np.ndarray, list[dict[str, str]]]:
    """The entries at fault (attribute indices out of range or repeated, a weight not finite and > 0), as a
    mask and as errors."""
    inside = np.arange(padded.shape[1])[None, :] < sizes[:, None]
    out_of_range = np.any(inside & ((padded < 0) | (padded >= d)), axis=1)
    repeated = np.any(inside[:, 1:] & (padded[:, 1:] == padded[:, :-1]), axis=1)
    bad_weight = ~(np.isfinite(weights) & (weights > 0))
    bad = out_of_range | repeated
    errors = []
    for j in np.flatnonzero(bad | bad_weight).tolist():
        if bad[j]:
            attrs = tuple(int(i) for i in padded[j, : sizes[j]])
            errors.append({"field": f"workload.{j}", "error": f"bad attribute indices {attrs} for d = {d}"})
        else:
            errors.append(
                {"field": f"workload.{j}", "error": f"weight must be finite and > 0, got {weight_of[j]}"}
            )
    return bad | bad_weight, errors


def _repeat_errors(sizes, padded, ok: np.ndarray) -> list[dict[str, str]]:
    """The same marginal twice among the entries ``ok``: each repeat referred to its first entry."""
    if ok.size <= 1:
        return []
    width = padded.shape[1]
    rows = padded[ok]
    order = np.lexsort([rows[:, c] for c in range(width - 1, -1, -1)] + [sizes[ok]])
    same = np.zeros(ok.size, dtype=bool)
    same[1:] = np.all(rows[order][1:] == rows[order][:-1], axis=1) & (
        sizes[ok][order][1:] == sizes[ok][order][:-1]
    )
    if not same.any():
        return []
    first = ok[order][np.maximum.accumulate(np.where(~same, np.arange(ok.size), 0))]
    errors = []
    for j, f in sorted(zip(ok[order][same].tolist(), first[same].tolist(), strict=True)):
        attrs = tuple(int(i) for i in padded[j, : sizes[j]])
        errors.append({"field": f"workload.{j}", "error": f"repeats workload.{min(j, f)} ({attrs})"})
    return errors


def _error_order(error: dict[str, str]) -> tuple[int, int]:
    """Errors of the whole (domains, rho, ...) first, then the workload's by entry."""
    field = error["field"]
    if field.startswith("workload."):
        return (1, int(field.split(".")[1]))
    return (0, 0)


def _type_codes(queries, padded_a, sizes, loss, domain_of) -> tuple[np.ndarray, tuple] | None:
    """Each workload slot's query type code, aligned with ``padded_a`` (0, identity, for the padding), and
    the type of each code: QUERY_TYPES, then the workload's explicit matrices (:class:`QueryMatrix`). None
    when every query is an identity."""
    if not queries or not any(q for q in queries):
        return None
    if len(queries) != sizes.size:
        raise SpecError(f"queries: {len(queries)} entries for a workload of {sizes.size} marginals")
    if loss != "sum_of_variances":
        raise SpecError(
            "loss 'max_variance' is for identity marginals; with query types other than identity the plan "
            "minimises the weighted sum of variances",
            [{"field": "loss", "error": "max_variance needs identity queries"}],
        )
    codes = np.zeros(padded_a.shape, dtype=np.int8)
    code_of: dict[str | QueryMatrix, int] = {kind: c for c, kind in enumerate(QUERY_TYPES)}
    for j, q in enumerate(queries):
        if not q:
            continue
        row = padded_a[j, : sizes[j]].tolist()
        if any(isinstance(k, QueryMatrix) for k in q.values()):
            codes[j, : len(row)] = _matrix_code(j, q, row, domain_of, code_of)
        else:
            _named_codes(j, q, row, code_of, codes[j])
    return (codes, tuple(code_of)) if codes.any() else None


def _matrix_code(j: int, q: dict, row: list[int], domain_of, code_of: dict) -> int:
    """The code of marginal j's explicit query matrix (a new one added to ``code_of``), once checked."""
    if len(row) not in (1, 2) or set(q) != set(row) or len(set(q.values())) != 1:
        raise SpecError(
            f"workload.{j}: an explicit query matrix names every attribute of a marginal of one or "
            "two attributes, and no other type",
            [{"field": f"workload.{j}.queries", "error": "a matrix needs a 1- or 2-way marginal"}],
        )
    kind = next(iter(q.values()))
    cells = int(np.prod([int(domain_of[i]) for i in row]))
    if kind.rows.ndim != 2 or kind.rows.shape[1] != cells:
        raise SpecError(
            f"workload.{j}: an explicit query matrix of {kind.rows.shape[-1]} columns on a "
            f"marginal of {cells} cells",
            [{"field": f"workload.{j}.queries", "error": "one weight per cell in every row"}],
        )
    if kind not in code_of:
        if len(code_of) >= len(QUERY_TYPES) + MAX_MATRICES:
            raise SpecError(f"workload: more than {MAX_MATRICES} explicit query matrices")
        code_of[kind] = len(code_of)
    return code_of[kind]


def _named_codes(j: int, q: dict, row: list[int], code_of: dict, out: np.ndarray) -> None:
    """Marginal j's named query types, checked, as codes into ``out`` (its slots)."""
    pair = set(q.values()) & set(PAIR_TYPES)
    if pair and (len(row) != 2 or set(q) != set(row) or len(set(q.values())) != 1):
        raise SpecError(
            f"workload.{j}: a 2-way query type ({', '.join(sorted(pair))}) names both attributes of a "
            f"2-way marginal, and no other type",
            [{"field": f"workload.{j}.queries", "error": "a 2-way type needs a 2-way marginal"}],
        )
    for i, kind in q.items():
        if kind not in code_of:
            raise SpecError(
                f"workload.{j}: unknown query type {kind!r}; expected one of {list(QUERY_TYPES)}",
                [{"field": f"workload.{j}.queries", "error": f"unknown query type {kind!r}"}],
            )
        if i not in row:
            raise SpecError(
                f"workload.{j}: a query type for attribute {i}, which the marginal does not hold",
                [{"field": f"workload.{j}.queries", "error": f"attribute {i} is not in the marginal"}],
            )
        out[row.index(i)] = code_of[kind]
