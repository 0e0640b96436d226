"""Reconstruct workload marginals from residual measurements, and write them as labelled tables.

For a marginal A, x̂_A = Σ_{S⊆A} (⊗_{i∈A} K_i^{(S)}) y_S with K_i^{(S)} = E_{n_i}ᵀ if i ∈ S and the column
1_{n_i}/n_i otherwise (dp-query.md §6). Each term is computed mode-wise: y_S reshaped to (n_i−1 for i ∈ S)
gets E_{n_i}ᵀ along each of its axes, then is broadcast over the attributes of A∖S and divided by
∏_{i∈A∖S} n_i. Without noise x̂_A = x_A exactly (up to float rounding): E_nᵀE_n + J/n = I. With noise it is
unbiased, and every cell has the variance the plan predicts (:attr:`Plan.var`). Pure post-processing of
released measurements: no privacy cost, re-runnable.

Tables (:func:`table`), one row per cell in C order (the last attribute varies fastest):

* one column per attribute of A, in schema order, holding its labels: the categories; for a range, each
  bin's lower bound (bin width 1) or ``"a..b"``;
* for every range attribute ``x``, two int64 columns ``x_lo`` and ``x_hi``, right after its label column:
  the bin's bounds, **both inclusive** (as the spec's ``range``), so ``x_lo <= v AND v <= x_hi`` selects
  the values of the bin (a width-1 range has ``x_lo = x_hi``);
* ``estimate`` (float64), then ``std_error`` and ``variance`` (float64, the same in every cell of a
  marginal: they come from the plan, never from the data; ``variance = std_error²`` up to rounding).

A generated name that an attribute already has gets trailing underscores (:func:`column_names`). The
Parquet schema metadata repeats ``variance`` and ``std_error`` and names the release
(:func:`release_info`): ``mechanism``, ``rho``, ``privacy_unit``, ``dataset_fingerprint``, ``dataset_id``;
and the layout: ``attributes`` (JSON list), ``value_column``. Small marginals also get a JSON rendering
(:func:`json_doc`) that carries the same ``release`` object.

**Covariance** (:func:`covariance`): marginals reconstructed from shared residual measurements have
correlated errors. Cov(x̂_A, x̂_B) = Σ_{S⊆A∩B} σ_S² ⊗_{i∈A∪B} M_i, with M_i = I − J/n_i for i ∈ S,
J/n_i² for i ∈ (A∩B)∖S, the column 1/n_i for i ∈ A∖B and the row 1ᵀ/n_i for i ∈ B∖A: a dense
cells_A × cells_B matrix, refused above :data:`COVARIANCE_MAX_ENTRIES` entries.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from shardfold.functions.dpquery.measure import contrasts, mode_product
from shardfold.functions.dpquery.smasher import (
    answer_axis,
    intervals,
    kron_all,
    pair_queries,
    pieces,
    query_lengths,
)

JSON_MAX_CELLS = 1000  # marginals up to this many cells also get a JSON table
VALUE_COLUMN = "estimate"
STD_ERROR_COLUMN = "std_error"
VARIANCE_COLUMN = "variance"


def reconstruct(
    sizes: Sequence[int], attrs: Sequence[int], terms: Sequence[tuple[tuple[int, ...], np.ndarray]]
) -> np.ndarray:
    """x̂_A for the marginal on ``attrs`` (sorted attribute indices, domain ``sizes``) from its residual
    measurements ``terms``: (S, y_S) for every S ⊆ A (S sorted; y_S flat, C order)."""
    shape = tuple(int(n) for n in sizes)
    pos = {a: k for k, a in enumerate(attrs)}
    out = np.zeros(shape, dtype=np.float64)
    for s_attrs, y in terms:
        sub = [int(sizes[pos[a]]) for a in s_attrs]
        z = mode_product(
            [contrasts(n).T for n in sub], np.asarray(y, dtype=np.float64).reshape([n - 1 for n in sub])
        )
        # broadcast over A∖S (each a 1/n_i average)
        full = [1] * len(shape)
        for a in s_attrs:
            full[pos[a]] = shape[pos[a]]
        rest = math.prod(shape[k] for k, a in enumerate(attrs) if a not in s_attrs)
        out += z.reshape(full) / rest
    return out


def answers(
    kinds: Sequence[str],
    sizes: Sequence[int],
    terms: Sequence[tuple],
    totals: Sequence[np.ndarray | None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """A marginal's answers under general query types (QuerySmasher) and each answer's variance.

    ``kinds`` and ``sizes``: each attribute's query type and domain size, in the marginal's (schema) order;
    ``terms``: for every residual set S ⊆ A, (the positions of S's attributes in A, y_S, σ_S², each
    attribute's V_i (B_i⁺ when its rows are ⊥ 1), each attribute's inside factor diag(W_i V_i V_iᵀ W_iᵀ));
    ``totals``: each attribute's u_i where its total is not spread evenly (an RP+ Schur split; None: 1/n_i).
    x̂_A = Σ_S (⊗_{i∈S} V_i ⊗_{i∈A∖S} u_i) y_S, then W_i along every axis; an answer's variance is
    Σ_S σ_S² ∏_{i∈S} inside_i ∏_{i∈A∖S} (W_i u_i)² (the measurements are independent). A set measured
    through one matrix B over its cells (a 2-way type's, solved whole) gives B⁺ as one array and its inside
    factors as one table over its attributes' queries (:func:`dense_inside`)."""
    shape = [int(n) for n in sizes]
    totals = list(totals) if totals is not None else [None] * len(shape)
    outside = [
        (query_lengths(kind, n) / n) ** 2 if u is None else answer_axis(kind, np.asarray(u), 0) ** 2
        for kind, n, u in zip(kinds, shape, totals, strict=True)
    ]
    x = np.zeros(shape, dtype=np.float64)
    var = np.zeros([o.size for o in outside], dtype=np.float64)
    for pos, y, s2, inverses, insides in terms:
        x += _spread(shape, pos, _residual_estimate(shape, pos, y, inverses), totals)
        if isinstance(insides, np.ndarray):  # one table over the set's queries
            v = float(s2) * insides.reshape([outside[k].size if k in pos else 1 for k in range(len(shape))])
        else:
            inside = dict(zip(pos, insides, strict=True))
            v = np.asarray(float(s2))
            for k in pos:
                v = np.multiply.outer(v, inside[k])
            v = v.reshape([outside[k].size if k in pos else 1 for k in range(len(shape))])
        for k in range(len(shape)):
            if k not in pos:
                v = v * outside[k].reshape([outside[k].size if j == k else 1 for j in range(len(shape))])
        var += v
    for k, kind in enumerate(kinds):
        x = answer_axis(kind, x, k)
    return x, var


def _residual_estimate(shape, pos, y, inverses) -> np.ndarray:
    """x̂_S over the cells of S (axes ``pos`` of ``shape``): ⊗ B_i⁺ y_S, or B⁺ y_S for one matrix."""
    y = np.asarray(y, dtype=np.float64)
    if isinstance(inverses, np.ndarray):
        return (inverses @ y).reshape([shape[k] for k in pos])
    return mode_product(inverses, y.reshape([shape[k] - 1 for k in pos]))


def _spread(shape, pos, z: np.ndarray, totals: Sequence[np.ndarray | None] | None = None) -> np.ndarray:
    """x̂_S spread over the attributes of A not in S: its term of x̂_A (broadcast), evenly, or along u_i
    where ``totals`` gives one."""
    full = [shape[k] if k in pos else 1 for k in range(len(shape))]
    out = z.reshape(full) / math.prod(
        shape[k] for k in range(len(shape)) if k not in pos and (totals is None or totals[k] is None)
    )
    for k in range(len(shape)):
        if k not in pos and totals is not None and totals[k] is not None:
            out = out * np.asarray(totals[k]).reshape([shape[k] if j == k else 1 for j in range(len(shape))])
    return out


def dense_inside(kinds: Sequence[str], sizes: Sequence[int], inverse: np.ndarray) -> np.ndarray:
    """diag(W (BᵀB)⁺ Wᵀ) for the queries W = ⊗W_i (``kinds``) of a set measured through one matrix B over
    its cells (``inverse`` = B⁺, cells × rows): each query's variance factor there, one axis per attribute.
    Taken a few columns of B⁺ at a time, so range queries crossed with range queries stay small."""
    out = np.zeros([int(query_lengths(kind, int(n)).size) for kind, n in zip(kinds, sizes, strict=True)])
    for lo in range(0, inverse.shape[1], 32):
        z = inverse[:, lo : lo + 32].reshape([*map(int, sizes), -1])
        for axis, kind in enumerate(kinds):
            z = answer_axis(kind, z, axis)
        out += np.einsum("...k,...k->...", z, z)
    return out


def pair_answers(kind: Any, sizes: Sequence[int], terms: Sequence[tuple]) -> tuple[np.ndarray, np.ndarray]:
    """The answers of a type over a marginal as a whole (a 2-way type, an explicit
    :class:`~functions.dpquery.spec.QueryMatrix`; :func:`functions.dpquery.smasher.pair_queries`) on a
    marginal of ``sizes``, and each one's variance. ``terms``: for each S ⊆ A, (positions, y_S, σ_S², B_S⁺ —
    per attribute or one matrix, as in :func:`answers`). Each query q is Σ_S q^{⇒S}·x̂_S, of variance
    Σ_S σ_S² q^{⇒S} (B_SᵀB_S)⁺ q^{⇒S}ᵀ (QuerySmasher's decomposition)."""
    shape = [int(n) for n in sizes]
    q = pair_queries(kind, *shape)
    x = np.zeros(shape, dtype=np.float64)
    var = np.zeros(q.shape[0], dtype=np.float64)
    parts = [pieces(row, shape) for row in q]
    for pos, y, s2, inverses in terms:
        x += _spread(shape, pos, _residual_estimate(shape, pos, y, inverses))
        # B⁺, or ⊗B_i⁺ over the set's cells (small: a 2-way type's attributes have few values)
        left = inverses if isinstance(inverses, np.ndarray) else kron_all(inverses)
        rows = np.stack([p[tuple(pos)] for p in parts]) @ left
        var += float(s2) * np.einsum("ij,ij->i", rows, rows)
    return q @ x.reshape(-1), var


def pair_labels(kind: Any, names: Sequence[str], sizes: Sequence[int]) -> list[str]:
    """One label per query of a 2-way type, in bins counted from 0 (``"age_bin + tenure_bin <= 3"``), or of
    an explicit matrix, its row (``"row 0"``, …)."""
    top = pair_queries(kind, *map(int, sizes)).shape[0]
    if not isinstance(kind, str):
        return [f"row {r}" for r in range(top)]
    a, b = (f"{name}_bin" for name in names)
    form = f"{a} + {b}" if kind == "affine" else f"|{a} - {b}|"
    return [f"{form} <= {c}" for c in range(top)]


def query_labels(attribute, kind: str) -> tuple[list, tuple[np.ndarray, np.ndarray] | None]:
    """An axis's labels and bounds in a table: the attribute's own for identity (:func:`attribute_bounds`),
    else one per query, ``"lo..hi"`` of the values it sums (an arc past the last value has lo > hi), with
    those bounds (both inclusive)."""
    if kind == "identity":
        return attribute.labels(), attribute_bounds(attribute)
    lo, hi = attribute_bounds(attribute)
    spans = np.asarray(intervals(kind, len(lo)), dtype=np.int64)
    first, last = np.asarray(lo)[spans[:, 0]], np.asarray(hi)[spans[:, 1]]
    return [f"{a}..{b}" for a, b in zip(first.tolist(), last.tolist(), strict=True)], (first, last)


def variance(sigma2: dict[tuple[int, ...], float], domains: Sequence[int], attrs: Sequence[int]) -> float:
    """Per-cell variance of x̂_A: Σ_{S⊆A} σ_S² ∏_{i∈S}(n_i−1)/n_i ∏_{i∈A∖S} 1/n_i² (for tests and checks;
    jobs use the plan's value)."""
    total = 0.0
    for s, s2 in sigma2.items():
        if not set(s) <= set(attrs):
            continue
        term = s2
        for a in attrs:
            n = domains[a]
            term *= (n - 1) / n if a in s else 1.0 / (n * n)
        total += term
    return total


def _label_array(labels: list) -> pa.Array:
    kinds = {type(v) for v in labels}
    if kinds == {bool}:
        return pa.array(labels, pa.bool_())
    if kinds == {int}:
        return pa.array(labels, pa.int64())
    if kinds == {str}:
        return pa.array(labels, pa.string())
    return pa.array([str(v) for v in labels], pa.string())  # a mixed list of categories: as text


def value_column(names: Sequence[str]) -> str:
    """``estimate``, or with trailing underscores if an attribute already has that name."""
    return _unique(VALUE_COLUMN, set(names))


def _unique(col: str, taken: set[str]) -> str:
    while col in taken:
        col += "_"
    taken.add(col)
    return col


def column_names(names: Sequence[str], ranged: Sequence[bool]) -> dict[str, object]:
    """The table's generated column names, unique against the attribute names (and each other):
    ``{"estimate", "std_error", "variance", "bounds": {attribute: (lo, hi)}}`` (bounds for range
    attributes only)."""
    taken = set(names)
    out: dict[str, object] = {"estimate": value_column(names)}
    taken.add(out["estimate"])
    bounds = {}
    for name, r in zip(names, ranged, strict=True):
        if r:
            bounds[name] = (_unique(f"{name}_lo", taken), _unique(f"{name}_hi", taken))
    out["std_error"] = _unique(STD_ERROR_COLUMN, taken)
    out["variance"] = _unique(VARIANCE_COLUMN, taken)
    out["bounds"] = bounds
    return out


def bin_bounds(lo: int, hi: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Each bin's first and last value (both inclusive) of ``range: [lo, hi]`` with ``bin_width``."""
    first = np.arange(lo, hi + 1, width, dtype=np.int64)
    return first, np.minimum(first + (width - 1), hi)


def attribute_bounds(attribute) -> tuple[np.ndarray | list, np.ndarray | list] | None:
    """:func:`bin_bounds` of a spec attribute with a ``range`` (null bounds for its ``"(other)"`` cell under
    ``out_of_domain: other``); None for categories."""
    rng = getattr(attribute, "range", None)
    if rng is None:
        return None
    lo, hi = bin_bounds(int(rng[0]), int(rng[1]), int(getattr(attribute, "bin_width", None) or 1))
    if getattr(attribute, "policy", None) == "other":  # the "(other)" cell after the bins has no bounds
        return [*lo.tolist(), None], [*hi.tolist(), None]
    return lo, hi


def table(
    estimate: np.ndarray,
    names: Sequence[str],
    labels: Sequence[list],
    var: float | np.ndarray,
    meta: dict[str, str],
    bounds: Sequence[tuple[np.ndarray, np.ndarray] | None] | None = None,
) -> pa.Table:
    """The marginal as a table: one row per cell (C order): attribute label columns (each range
    attribute's followed by its bin bounds ``<name>_lo``, ``<name>_hi``, inclusive), then ``estimate``,
    ``std_error``, ``variance``. ``bounds[k]`` is :func:`bin_bounds` of attribute k, or None. ``var``: the
    variance of every cell, or one per cell (general queries: :func:`answers`))."""
    shape = estimate.shape
    bounds = list(bounds) if bounds is not None else [None] * len(names)
    colnames = column_names(names, [b is not None for b in bounds])
    cols: dict[str, pa.Array] = {}
    cells = int(estimate.size)
    inner = cells
    for name, labs, n, bnd in zip(names, labels, shape, bounds, strict=True):
        inner //= n  # axis k's label repeats for every cell of the later axes, C order
        idx = pa.array(np.tile(np.repeat(np.arange(n, dtype=np.int32), inner), cells // (n * inner)))
        cols[name] = _label_array(list(labs)).take(idx)
        if bnd is not None:
            lo_col, hi_col = colnames["bounds"][name]
            cols[lo_col] = pa.array(bnd[0], pa.int64()).take(idx)
            cols[hi_col] = pa.array(bnd[1], pa.int64()).take(idx)
        del idx
    variances = np.broadcast_to(np.asarray(var, dtype=np.float64), estimate.shape).reshape(-1)
    cols[colnames["estimate"]] = pa.array(estimate.reshape(-1), pa.float64())
    cols[colnames["std_error"]] = pa.array(np.sqrt(variances), pa.float64())
    cols[colnames["variance"]] = pa.array(variances, pa.float64())
    metadata = {**meta, "value_column": colnames["estimate"]}
    if np.ndim(var) == 0:  # one variance for the whole marginal: also in the metadata
        metadata |= {"variance": repr(float(var)), "std_error": repr(math.sqrt(float(var)))}
    return pa.table(cols).replace_schema_metadata({k: str(v) for k, v in metadata.items()})


def json_doc(
    tbl: pa.Table, var: float | None, attributes: Sequence[str], release: dict | None = None
) -> dict:
    """A small marginal as JSON: ``columns`` and ``rows`` (attribute labels and bin bounds, then the
    estimate; the per-cell ``variance`` and ``std_error`` given once), and the ``release``. ``var`` None:
    each row's own (general queries), so ``std_error`` is a column of the rows."""
    meta = tbl.schema.metadata or {}
    value = (meta.get(b"value_column") or VALUE_COLUMN.encode()).decode()
    columns = tbl.column_names[: tbl.column_names.index(value) + 1]
    if var is None:
        columns.append(tbl.column_names[tbl.column_names.index(value) + 1])  # its std_error
    rows = [list(r) for r in zip(*(tbl.column(c).to_pylist() for c in columns), strict=True)]
    out: dict = {"attributes": list(attributes), "columns": columns, "rows": rows}
    if var is not None:
        out |= {"variance": float(var), "std_error": math.sqrt(float(var))}
    if release is not None:
        out["release"] = release
    return out


# --- the release's description ------------------------------------------------------------------------------

MECHANISM = "gaussian, zCDP"
DEFAULT_PRIVACY_UNIT = "one row"


def privacy_unit(spec) -> str:
    """The spec's privacy unit as text (``privacy_unit`` if the spec has one, else ``"one row"``)."""
    unit = getattr(spec, "privacy_unit", None)
    if unit is None:
        return DEFAULT_PRIVACY_UNIT
    if isinstance(unit, str):
        return unit
    if hasattr(unit, "model_dump"):
        unit = unit.model_dump(mode="json", exclude_none=True)
    return json.dumps(unit, sort_keys=True, default=str)


def dataset_fingerprint(plan_doc: dict) -> str | None:
    """A digest that identifies the dataset version the release was computed from, or None.

    A ``dataset_fingerprint`` string in the plan document is used as it is; otherwise the SHA-256 of the
    dataset URI and its pin (``dataset_pin``: size and ETag, or size, mtime and inode), so the file's
    size, which depends on the data, is never published in clear."""
    fp = plan_doc.get("dataset_fingerprint")
    if isinstance(fp, str) and fp:
        return fp
    basis = fp if isinstance(fp, dict) and fp else plan_doc.get("dataset_pin")
    if not basis:
        return None
    text = json.dumps({"dataset": plan_doc.get("dataset"), "pin": basis}, sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def release_info(plan_doc: dict, rho: float, delta: float, spec) -> dict:
    """What a released table says about how it was made (JSON-safe; the Parquet metadata gets each value as
    text). ``rho`` is the job's budget: the guarantee of the whole release."""
    return {
        "mechanism": MECHANISM,
        "rho": float(rho),
        "delta": float(delta),
        "privacy_unit": privacy_unit(spec),
        "dataset_id": getattr(spec, "dataset_id", None),
        "dataset_fingerprint": dataset_fingerprint(plan_doc),
    }


def parquet_metadata(release: dict) -> dict[str, str]:
    """:func:`release_info` as Parquet key-value metadata (text; absent values omitted)."""
    return {k: (v if isinstance(v, str) else repr(v)) for k, v in release.items() if v is not None}


# --- covariance of reconstructed marginals ------------------------------------------------------------------

COVARIANCE_MAX_ENTRIES = 4_000_000  # cells_A × cells_B: 32 MB of float64


def covariance(
    sigma2: dict[tuple[int, ...], float], domains: Sequence[int], a: Sequence[int], b: Sequence[int]
) -> np.ndarray:
    """Cov(x̂_A, x̂_B): the cells_A × cells_B matrix (cells in C order) of the noise covariance between two
    reconstructed marginals (sorted attribute tuples ``a``, ``b``; ``a == b`` gives Cov(x̂_A), whose
    diagonal is :func:`variance`). ``sigma2`` maps every residual set S ⊆ A∩B to σ_S² (others are
    ignored). Refused above :data:`COVARIANCE_MAX_ENTRIES` entries."""
    a, b = tuple(int(i) for i in a), tuple(int(i) for i in b)
    cells_a = math.prod(int(domains[i]) for i in a)
    cells_b = math.prod(int(domains[i]) for i in b)
    if cells_a * cells_b > COVARIANCE_MAX_ENTRIES:
        raise ValueError(
            f"the covariance of marginals {a} and {b} has {cells_a:,} x {cells_b:,} entries; at most "
            f"{COVARIANCE_MAX_ENTRIES:,} are computed (use smaller marginals)"
        )
    union = sorted(set(a) | set(b))
    both = set(a) & set(b)
    out = np.zeros((cells_a, cells_b), dtype=np.float64)
    for s, s2 in sigma2.items():
        if not set(s) <= both:
            continue
        m = np.ones((1, 1))
        for i in union:
            n = int(domains[i])
            if i in s:
                f = np.eye(n) - 1.0 / n
            elif i in both:
                f = np.full((n, n), 1.0 / (n * n))
            elif i in a:
                f = np.full((n, 1), 1.0 / n)
            else:
                f = np.full((1, n), 1.0 / n)
            m = np.kron(m, f)
        out += float(s2) * m
    return out


def file_stem(j: int, names: Sequence[str]) -> str:
    """``00012-age-sex``: the marginal's index, then its attribute names made key-safe (≤ 100 chars)."""
    tail = "-".join(re.sub(r"[^A-Za-z0-9._]+", "_", n) for n in names) or "total"
    return f"{j:05d}-{tail[:100]}"
