"""Reconstruct workload marginals from residual measurements, and write them as labelled tables.

For a marginal A, x̂_A = Σ_{S⊆A} (⊗_{i∈A} K_i^{(S)}) y_S with K_i^{(S)} = E_{n_i}ᵀ if i ∈ S and the column
1_{n_i}/n_i otherwise (dp-query.md §6). Each term is computed mode-wise: y_S reshaped to (n_i−1 for i ∈ S)
gets E_{n_i}ᵀ along each of its axes, then is broadcast over the attributes of A∖S and divided by
∏_{i∈A∖S} n_i. Without noise x̂_A = x_A exactly (up to float rounding): E_nᵀE_n + J/n = I. With noise it is
unbiased, and every cell has the variance the plan predicts (:attr:`Plan.var`). Pure post-processing of
released measurements: no privacy cost, re-runnable.

Tables (:func:`table`): one column per attribute of A (its labels: the categories, or each bin's lower bound
for a width-1 range, or ``"a..b"``), in schema order, plus ``estimate`` (float64). Parquet carries the
per-cell variance and standard error in its schema metadata; small marginals also get a JSON rendering
(:func:`json_doc`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from functions.dpquery.measure import contrasts

JSON_MAX_CELLS = 1000  # marginals up to this many cells also get a JSON table
VALUE_COLUMN = "estimate"


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
        z = np.asarray(y, dtype=np.float64).reshape([n - 1 for n in sub])
        for axis, n in enumerate(sub):
            z = np.moveaxis(np.tensordot(contrasts(n).T, z, axes=([1], [axis])), 0, axis)
        # broadcast over A∖S (each a 1/n_i average)
        full = [1] * len(shape)
        for a in s_attrs:
            full[pos[a]] = shape[pos[a]]
        rest = math.prod(shape[k] for k, a in enumerate(attrs) if a not in s_attrs)
        out += z.reshape(full) / rest
    return out


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
    col = VALUE_COLUMN
    while col in names:
        col += "_"
    return col


def table(
    estimate: np.ndarray, names: Sequence[str], labels: Sequence[list], var: float, meta: dict[str, str]
) -> pa.Table:
    """The marginal as a table: one row per cell (C order), attribute label columns then the estimate."""
    shape = estimate.shape
    cols: dict[str, pa.Array] = {}
    cells = int(estimate.size)
    inner = cells
    for name, labs, n in zip(names, labels, shape, strict=True):
        inner //= n  # axis k's label repeats for every cell of the later axes, C order
        idx = np.tile(np.repeat(np.arange(n, dtype=np.int32), inner), cells // (n * inner))
        cols[name] = _label_array(list(labs)).take(pa.array(idx))
        del idx
    cols[value_column(names)] = pa.array(estimate.reshape(-1), pa.float64())
    metadata = {
        **meta,
        "variance": repr(float(var)),
        "std_error": repr(math.sqrt(float(var))),
    }
    return pa.table(cols).replace_schema_metadata({k: str(v) for k, v in metadata.items()})


def json_doc(tbl: pa.Table, var: float, attributes: Sequence[str]) -> dict:
    """A small marginal as JSON: ``columns`` and ``rows`` (attribute labels, then the estimate)."""
    columns = tbl.column_names
    rows = [list(r) for r in zip(*(tbl.column(c).to_pylist() for c in columns), strict=True)]
    return {
        "attributes": list(attributes),
        "columns": columns,
        "rows": rows,
        "variance": float(var),
        "std_error": math.sqrt(float(var)),
    }


def file_stem(j: int, names: Sequence[str]) -> str:
    """``00012-age-sex``: the marginal's index, then its attribute names made key-safe (≤ 100 chars)."""
    tail = "-".join(re.sub(r"[^A-Za-z0-9._]+", "_", n) for n in names) or "total"
    return f"{j:05d}-{tail[:100]}"
