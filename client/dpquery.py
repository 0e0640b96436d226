"""``client.dpquery``: the user's side of the ``dpquery`` job kind (marginals under differential privacy).

A release from the SDK::

    client = Client()
    plan = client.dpquery.plan(spec)           # no data read: noise plan, predicted error, privacy report
    print(plan.rmse, plan.privacy_report()["epsilon_cks"])
    result = client.dpquery.run(spec)          # plan -> measure fan-out -> reconstruct fan-out -> finalize
    tables = client.dpquery.tables(result)     # {"sex,region": pyarrow.Table, ...}
    arrays = client.dpquery.arrays(result)     # {"sex,region": (ndarray, {"sex": [...], "region": [...]})}
    client.dpquery.budget("people")            # the dataset's ledger: total, spent, remaining, jobs
    ms = client.dpquery.measurements(result)   # the noisy residual measurements, for Private-PGM (to_mbi)
    client.dpquery.covariance(result, "sex", "sex,region")  # correlated errors of two tables

Marginals are named by their attribute names in schema order joined with ``,`` (``"sex,region"``);
the total count (a marginal of no attribute) is ``"(total)"``. Every estimate has the same per-cell
variance within its marginal: :meth:`DPQuery.std_errors`, ``result["tables"][i]["std_error"]``, the
``std_error`` and ``variance`` columns of every table, and the same keys of each Parquet file's schema
metadata (which also names the mechanism, ρ, the privacy unit and the dataset's fingerprint). A marginal
that asks prefix or range queries along an attribute (``queries`` in the spec) has a row per answer, each
with its own ``std_error``; its entry's ``std_error`` is their RMSE (so for a marginal asked cell by cell
that shares a residual set with prefix or range queries, whose cells' variances differ too).

Nothing here reads the dataset: :meth:`DPQuery.plan` is the pure planner, and the tables are the job's
released (noisy) output.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardfold.functions import store
from shardfold.functions.dpquery.spec import TOTAL_NAME, DPQuerySpec, marginal_name, schema_order
from shardfold.functions.errors import ShardfoldError, SpecError
from shardfold.functions.jobs import spec_key
from shardfold.functions.ledger import DATASET_ID
from shardfold.functions.privacy import REPORT_DELTA


class LabelledArray(NamedTuple):
    """A released marginal as a dense array: ``values[i, j, ...]`` is the estimate for
    ``labels[attr_0][i], labels[attr_1][j], ...``; ``labels`` maps each axis's attribute to its labels, in
    axis (schema) order. Unpacks as ``values, labels = arrays[name]``."""

    values: np.ndarray
    labels: dict[str, list]


def table_layout(tbl: pa.Table) -> tuple[list[str], str]:
    """(attribute columns, estimate column) of a released table, from its schema metadata (``attributes``,
    ``value_column``; a 2-way query type's table, ``query_type``, has the one axis ``query``); for a table
    without them, every column but the last, and the last."""
    meta = tbl.schema.metadata or {}
    names = tbl.column_names
    if b"query_type" in meta:  # a 2-way query type's answers: one row per query, labelled in "query"
        return ["query"], (meta.get(b"value_column") or b"estimate").decode()
    if b"attributes" in meta:
        attributes = list(json.loads(meta[b"attributes"]))
        value = meta.get(b"value_column")
        return attributes, value.decode() if value else names[len(attributes)]
    return names[:-1], names[-1]


def table_to_array(tbl: pa.Table, attributes: Sequence[str] | None = None) -> LabelledArray:
    """A marginal's table (one row per cell, C order: the last attribute varies fastest) as a dense array
    with its labels. The shape comes from the table itself (each attribute's distinct labels).
    ``attributes`` default to those the table's metadata names."""
    if attributes is None:
        attributes, value_col = table_layout(tbl)
    else:
        meta = tbl.schema.metadata or {}
        value = meta.get(b"value_column")
        value_col = value.decode() if value else tbl.column_names[len(attributes)]
    values = tbl.column(value_col).to_numpy().astype(np.float64, copy=False)
    if not attributes:
        return LabelledArray(values.reshape(()), {})
    shape = [int(pc.count_distinct(tbl.column(a)).as_py()) for a in attributes]
    if math.prod(shape) != tbl.num_rows:
        raise ShardfoldError(
            f"table of marginal {marginal_name(attributes)!r} has {tbl.num_rows} rows, not the "
            f"{math.prod(shape)} cells of its labels; it is not a dpquery output table"
        )
    labels: dict[str, list] = {}
    stride = tbl.num_rows
    for name, n in zip(attributes, shape, strict=True):
        stride //= n
        labels[name] = tbl.column(name).slice(0, n * stride).to_pylist()[::stride]
    return LabelledArray(values.reshape(shape), labels)


def _weighted_queries(
    names: list[str], sizes: list[int], on: str | Sequence[str], weights: Any
) -> tuple[tuple[int, ...], np.ndarray, bool]:
    """``answer``'s ``on`` and ``weights`` as (attributes sorted, one row per query over their cells in C
    order, whether one query was given), checked: each refusal names the argument."""
    wanted = [n.strip() for n in on.split(",")] if isinstance(on, str) else [str(n) for n in on]
    unknown = [n for n in wanted if n not in names]
    if unknown or not wanted or len(set(wanted)) != len(wanted):
        raise SpecError(
            f"answer: on {wanted} must name distinct attributes of this release ({', '.join(names)})"
            + (f"; it has no {unknown[0]!r}" if unknown else "")
        )
    given = [names.index(n) for n in wanted]
    shape = tuple(sizes[i] for i in given)
    try:
        w = np.asarray(weights)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"answer: weights must be numbers: {exc}") from None
    if w.dtype.kind not in "biuf":  # 0/1 masks are weights; text and objects, which float() takes, are not
        raise SpecError(f"answer: weights must be numbers, not {w.dtype}")
    w = w.astype(np.float64)
    if w.shape != shape and w.shape[1:] != shape:
        raise SpecError(
            f"answer: weights has shape {w.shape}; on {wanted} needs {shape} (one query) or (k, *{shape})"
        )
    if not np.all(np.isfinite(w)):
        raise SpecError("answer: weights must be finite numbers")
    if w.size == 0:
        raise SpecError("answer: weights holds no query")
    single = w.ndim == len(shape)
    attrs, rows = schema_order(w[None] if single else w, given, sizes)
    return attrs, rows, single


def _measured_pieces(
    pl: Any, attrs: tuple[int, ...], queries: np.ndarray, names: list[str], sizes: list[int]
) -> list[dict[int, np.ndarray]]:
    """Each query's nonzero pieces by residual set; refused if one is on a set the release did not measure."""
    from shardfold.functions.dpquery.smasher import PIECE_ROUNDING, pieces

    index = pl.residual_index()
    shape = [sizes[i] for i in attrs]
    parts: list[dict[int, np.ndarray]] = []
    missing: set[tuple[int, ...]] = set()
    for q in queries:
        tiny = PIECE_ROUNDING * float(np.max(np.abs(q), initial=0.0))
        parts.append({})
        for pos, piece in pieces(q, shape, [pl.attribute_total(i) for i in attrs]).items():
            subset = tuple(attrs[p] for p in pos)
            if not np.any(np.abs(piece) > tiny):
                continue
            if subset not in index:
                missing.add(subset)
            else:
                parts[-1][index[subset]] = piece
    if missing:
        lacking = marginal_name([names[i] for i in max(missing, key=len)])
        raise ShardfoldError(
            f"answer: the release did not measure {lacking!r}, which a query over "
            f"{marginal_name([names[i] for i in attrs])!r} needs (ask for a marginal holding those "
            "attributes in the workload)"
        )
    return parts


def _selection(attribute: Any, chosen: Any) -> np.ndarray:
    """The 0/1 vector over an attribute's domain of what ``chosen`` selects (see :meth:`DPQuery.answer`)."""
    labels = attribute.labels()
    n = len(labels)
    out = np.zeros(n)
    if isinstance(chosen, tuple) and len(chosen) == 2 and attribute.range is not None:
        lo, hi = (int(v) for v in chosen)
        first, last = _bin_bounds(attribute)
        starts, ends = np.flatnonzero(first == lo), np.flatnonzero(last == hi)
        if lo > hi or not starts.size or not ends.size or ends[0] < starts[0]:
            raise SpecError(
                f"answer: {attribute.name} ({lo}, {hi}) does not start and end on the attribute's bins "
                f"({labels[0]}, {labels[1]}, ..., {labels[-1]}): a box counts whole bins"
            )
        out[starts[0] : ends[0] + 1] = 1.0
        return out
    for value in chosen if isinstance(chosen, list) else [chosen]:
        hits = [j for j, label in enumerate(labels) if label == value or str(label) == str(value)]
        if not hits:
            raise SpecError(f"answer: {attribute.name} has no value {value!r}; its labels are {labels[:10]}")
        out[hits[0]] = 1.0
    return out


def _bin_bounds(attribute: Any) -> tuple[np.ndarray, np.ndarray]:
    """Each bin's first and last value of a range attribute (the tables' ``_lo``/``_hi``)."""
    from shardfold.functions.dpquery.reconstruct import attribute_bounds

    lo, hi = attribute_bounds(attribute)
    return np.asarray(lo[: attribute.declared_size], dtype=np.int64), np.asarray(
        hi[: attribute.declared_size], dtype=np.int64
    )


# --- export of the noisy measurements -----------------------------------------------------------------------

MEASUREMENTS_MAX_SAMPLES = 50_000_000  # measurements() refuses more (400 MB of float64) unless told otherwise
DENSE_QUERY_MAX_ENTRIES = 4_000_000  # ResidualMeasurement.matrix() refuses a larger dense query


def _helmert(x: Any, axis: int, xp: Any) -> Any:
    """E_n x along ``axis`` (n = that axis's length), E_n the (n−1)×n Helmert contrasts of
    :func:`functions.dpquery.measure.contrasts`: row k (1-based) is (1, …, 1, −k, 0, …)/√(k(k+1)) with k
    ones. O(n) per fibre by a cumulative sum; ``xp`` is numpy or jax.numpy."""
    x = xp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    k = np.arange(1, n, dtype=np.float64)
    y = (xp.cumsum(x, axis=-1)[..., : n - 1] - k * x[..., 1:]) / np.sqrt(k * (k + 1.0))
    return xp.moveaxis(y, -1, axis)


@dataclasses.dataclass(frozen=True, eq=False)
class KroneckerQuery:
    """The linear query of a residual set S: y = (⊗_{i∈S} E_{n_i}) x_S on the marginal x_S (axes in
    ``attributes`` order, C order when flattened), E_n the Helmert contrasts (orthonormal rows orthogonal
    to 1). Applied mode-wise, never as a dense matrix.

    Call it on a numpy array of the marginal (flat or shaped), or on a Private-PGM (``mbi``) ``Factor``
    over the clique (any axis order; jax arrays, traceable under ``jax.jit``): this is the ``query`` of
    ``mbi.LinearMeasurement``. ``op_norm_sq`` (= 1: the rows are orthonormal) lets mbi bound the loss's
    Lipschitz constant without power iteration. Hashing is by identity, as mbi's own ``WeightedQuery``
    (jax treats the query as static)."""

    attributes: tuple[str, ...]
    sizes: tuple[int, ...]
    # a job with prefix/range queries measures some attributes through their query type's strategy B_i
    # ((n_i−1)×n_i) instead of E_{n_i}: one matrix per attribute, None for the contrasts
    strategies: tuple[np.ndarray | None, ...] | None = None

    @property
    def factors(self) -> list[np.ndarray]:
        """The Kronecker factors, E_{n_i} or B_i ((n_i−1)×n_i, read-only), one per attribute, in order."""
        from shardfold.functions.dpquery.measure import contrasts

        given = self.strategies or (None,) * len(self.sizes)
        return [contrasts(n) if b is None else b for n, b in zip(self.sizes, given, strict=True)]

    def __call__(self, x: Any) -> Any:
        if hasattr(x, "domain") and hasattr(x, "values"):  # an mbi Factor
            import jax.numpy as jnp

            if tuple(x.domain.attributes) != self.attributes:
                x = x.transpose(self.attributes)
            values, xp = x.values, jnp
        else:
            values, xp = np.asarray(x, dtype=np.float64).reshape(self.sizes), np
        given = self.strategies or (None,) * len(self.sizes)
        for axis, b in enumerate(given):
            if b is None:
                values = _helmert(values, axis, xp)
            else:
                values = xp.moveaxis(xp.tensordot(b, values, axes=([1], [axis])), 0, axis)
        return values.reshape(-1)

    def op_norm_sq(self) -> float:
        """‖query‖₂²: 1 for the contrasts' orthonormal rows; a strategy's largest squared singular value."""
        given = [b for b in (self.strategies or ()) if b is not None]
        return float(math.prod(np.linalg.norm(b, 2) ** 2 for b in given))

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


@dataclasses.dataclass(frozen=True, eq=False)
class DenseQuery:
    """The linear query of a residual set that a 2-way query type reaches: y = B x_S, one matrix B over the
    cells of the marginal x_S (axes in ``attributes`` order, flattened in C order; rows in its residual
    space). Called as :class:`KroneckerQuery` is (numpy arrays, Private-PGM ``Factor``s)."""

    attributes: tuple[str, ...]
    sizes: tuple[int, ...]
    matrix: np.ndarray  # B, (∏(n_i − 1)) × (∏n_i)

    @property
    def factors(self) -> list[np.ndarray]:
        """[B]: one factor, over all the set's cells."""
        return [self.matrix]

    def __call__(self, x: Any) -> Any:
        if hasattr(x, "domain") and hasattr(x, "values"):  # an mbi Factor
            import jax.numpy as jnp

            if tuple(x.domain.attributes) != self.attributes:
                x = x.transpose(self.attributes)
            return jnp.asarray(self.matrix) @ x.values.reshape(-1)
        return self.matrix @ np.asarray(x, dtype=np.float64).reshape(-1)

    def op_norm_sq(self) -> float:
        """‖B‖₂², its largest squared singular value."""
        return float(np.linalg.norm(self.matrix, 2) ** 2)

    def __hash__(self) -> int:
        return id(self)


@dataclasses.dataclass(frozen=True)
class ResidualMeasurement:
    """One released residual measurement: ``noisy_measurement`` = ``query(x_clique)`` + N(0, stddev² I).

    The fields ``noisy_measurement``, ``clique``, ``stddev`` and ``query`` are the arguments of Private-PGM's
    ``mbi.LinearMeasurement`` (:meth:`to_mbi` builds one); ``factors`` are the query's Kronecker factors
    and :meth:`matrix` their dense product (small sets only). ``clique`` is () for the total count, whose
    query is the identity on the total. Independent across sets (each set's noise is drawn separately)."""

    index: int  # the residual set's index in the plan
    clique: tuple[str, ...]  # attribute names, in schema order
    attrs: tuple[int, ...]  # their schema indices
    sizes: tuple[int, ...]  # their domain sizes
    noisy_measurement: np.ndarray  # (∏(n_i − 1),) float64
    stddev: float  # σ_S, the noise's standard deviation (per entry, i.i.d.)
    rho: float  # the sampler's privacy-map value for this set (0 with noise disabled)
    query: KroneckerQuery | DenseQuery

    @property
    def factors(self) -> list[np.ndarray]:
        """The query's Kronecker factors, one per attribute of the set (see :class:`KroneckerQuery`), or
        its one matrix over the set's cells (:class:`DenseQuery`)."""
        return self.query.factors

    def matrix(self) -> np.ndarray:
        """The query as a dense (∏(n_i−1)) × (∏n_i) matrix, ⊗ of :attr:`factors` (refused when large)."""
        rows, cols = math.prod(n - 1 for n in self.sizes), math.prod(self.sizes)
        if rows * cols > DENSE_QUERY_MAX_ENTRIES:
            raise ShardfoldError(
                f"the query of residual set {self.clique} is {rows:,} x {cols:,}; at most "
                f"{DENSE_QUERY_MAX_ENTRIES:,} entries are formed densely (call the query instead)"
            )
        out = np.ones((1, 1))
        for f in self.factors:
            out = np.kron(out, f)
        return out

    def to_mbi(self) -> Any:
        """This measurement as an ``mbi.LinearMeasurement`` (needs Private-PGM, ``pip install mbi``). The
        total's uses mbi's identity query, so mbi's own total estimate (``known_total``) picks it up."""
        import mbi

        query: Any = mbi.DatavectorQuery() if not self.clique else self.query
        return mbi.LinearMeasurement(
            np.asarray(self.noisy_measurement, dtype=np.float64), self.clique, float(self.stddev), query=query
        )


def to_mbi(measurements: Sequence[ResidualMeasurement]) -> tuple[Any, list[Any]]:
    """(``mbi.Domain``, [``mbi.LinearMeasurement``]) of a release's measurements, for Private-PGM::

        domain, ms = to_mbi(client.dpquery.measurements(result))
        model = mbi.estimation.MirrorDescent().estimate(domain, ms, iters=2000)
        model.project(("sex", "region")).datavector()

    The domain holds the measured attributes (every attribute of a workload marginal)."""
    import mbi

    axes: dict[int, tuple[str, int]] = {}
    for m in measurements:
        for i, name, n in zip(m.attrs, m.clique, m.sizes, strict=True):
            axes[i] = (name, n)
    order = [axes[i] for i in sorted(axes)]  # schema order
    return mbi.Domain([a for a, _ in order], [n for _, n in order]), [m.to_mbi() for m in measurements]


class DPQuery:
    """The ``client.dpquery`` namespace: plan a release without data, run it, read its tables, and read a
    dataset's privacy-budget ledger."""

    def __init__(self, client: Any):
        self._client = client

    # -- specs and plans ----------------------------------------------------------------------------------

    def spec(self, spec: Any) -> DPQuerySpec:
        """The validated :class:`DPQuerySpec` of ``spec`` (a model, a dict, JSON text or a ``.json`` file
        path, whose ``./`` URIs are then relative to the file). Reads nothing but the spec file."""
        from shardfold.client.sdk import validate_spec

        parsed = validate_spec(spec)
        if not isinstance(parsed, DPQuerySpec):
            raise SpecError(f"client.dpquery needs a 'dpquery' spec, got kind {parsed.kind!r}")
        return parsed

    def plan(self, spec: Any) -> Any:
        """The job's noise plan (:class:`functions.dpquery.planner.Plan`), computed from the spec alone:
        the dataset is never read (it need not exist yet), nor the ledger.

        ``plan.summary()`` is the human-readable part (residual sets, noise samples, predicted workload
        ``rmse``, largest per-cell standard deviation, ``privacy``); ``plan.privacy_report()`` gives ρ and ε
        at δ by CKS and by the exact Gaussian curve; ``plan.var[j]`` is the predicted per-cell variance of
        workload marginal ``j`` (attributes ``plan.marginal(j)``, indices into the schema)."""
        from shardfold.functions.dpquery import planner

        return planner.plan(self.spec(spec))

    def predicted(self, spec: Any) -> dict[str, dict[str, float]]:
        """{marginal name: {"cells", "weight", "variance", "std_error"}} predicted by the plan (no data).
        For a marginal of prefix or range queries, ``cells`` counts its answers and ``variance`` is their
        mean (``std_error``: their RMSE)."""
        parsed = self.spec(spec)
        from shardfold.functions.dpquery import planner

        pl = planner.plan(parsed)
        names = [a.name for a in parsed.attributes]
        out: dict[str, dict[str, float]] = {}
        for j, var in enumerate(pl.var.tolist()):
            key = marginal_name([names[i] for i in pl.marginal(j)])
            out[key] = {
                "cells": int(pl.queries[j]),
                "weight": float(pl.weights[j]),
                "variance": var,
                "std_error": math.sqrt(var),
            }
        return out

    # -- jobs ---------------------------------------------------------------------------------------------

    def submit(self, spec: Any) -> Any:
        """Start a ``dpquery`` job; returns its :class:`client.Job` at once. The job's prepare step checks the
        dataset and reserves the budget on the ledger before anything is measured."""
        return self._client.submit(self.spec(spec))

    def run(self, spec: Any, progress: bool = False, timeout_s: float | None = None) -> dict[str, Any]:
        """Submit a ``dpquery`` job, wait for it and return its result: ``tables`` (one entry per workload
        marginal: ``attributes``, ``cells``, ``variance``, ``std_error``, ``parquet``, ``json`` for small
        ones), ``report`` (ρ spent, ε by CKS and exact Gaussian, predicted RMSE...), ``ledger``.
        Raises :class:`client.errors.JobFailed` if the job fails (over budget, a column the dataset lacks,
        ...), naming the cause."""
        job = self.submit(spec)
        job.wait(progress=progress, timeout_s=timeout_s)
        return job.result()

    def _result(self, result: Any) -> dict[str, Any]:
        """A result dict from a result dict, a :class:`client.Job` or a job id."""
        if isinstance(result, str):
            result = self._client.job(result).result()
        elif hasattr(result, "result") and hasattr(result, "job_id"):
            result = result.result()
        if not isinstance(result, dict) or result.get("kind") != "dpquery":
            raise ShardfoldError("expected the result of a dpquery job (a result dict, a Job or a job id)")
        return result

    def entries(self, result: Any) -> list[dict[str, Any]]:
        """The result's table entries, in workload order (inline in ``result["tables"]``, or read from
        ``result["tables_index"]`` for workloads too large to inline)."""
        res = self._result(result)
        if "tables" in res:
            return list(res["tables"])
        return list(store.get_json(res["tables_index"]))

    def _select(self, result: Any, marginals: Iterable[str | Sequence[str]] | None) -> list[dict[str, Any]]:
        entries = self.entries(result)
        if marginals is None:
            return entries
        by_name = {marginal_name(e["attributes"]): e for e in entries}
        by_set = {frozenset(e["attributes"]): e for e in entries}
        out = []
        for m in marginals:
            if isinstance(m, str):  # a name; or its attributes comma-separated, in any order
                hit = by_name.get(m) or by_set.get(frozenset(p.strip() for p in m.split(",")))
            else:
                hit = by_set.get(frozenset(m))
            if hit is None:
                raise ShardfoldError(
                    f"marginal {m!r} is not in this result; it has {', '.join(sorted(by_name)) or 'none'}"
                )
            out.append(hit)
        return out

    def tables(
        self, result: Any, marginals: Iterable[str | Sequence[str]] | None = None
    ) -> dict[str, pa.Table]:
        """The released marginals as pyarrow tables, keyed by marginal name (see :func:`marginal_name`):
        one column per attribute (its labels; a range attribute ``x`` also has ``x_lo``, ``x_hi``, its
        bin's bounds, both inclusive), then ``estimate``, ``std_error`` and ``variance`` (per cell; the same
        in every cell of a marginal). The schema metadata names the release (``mechanism``, ``rho``,
        ``privacy_unit``, ``dataset_fingerprint``). ``marginals`` loads only those: names, or attributes in
        any order (``"region, sex"`` or ``["region", "sex"]``)."""
        out: dict[str, pa.Table] = {}
        for e in self._select(result, marginals):
            out[marginal_name(e["attributes"])] = pq.read_table(io.BytesIO(store.get(e["parquet"])))
        return out

    def arrays(
        self, result: Any, marginals: Iterable[str | Sequence[str]] | None = None
    ) -> dict[str, LabelledArray]:
        """The released marginals as labelled numpy arrays: {name: (values, {attribute: labels})}, one
        axis per attribute in schema order (the total count is a 0-d array)."""
        out: dict[str, LabelledArray] = {}
        for name, tbl in self.tables(result, marginals).items():
            out[name] = table_to_array(tbl)  # the attributes and estimate column its metadata names
        return out

    def std_errors(self, result: Any) -> dict[str, float]:
        """{marginal name: per-cell standard error} (every cell of a marginal has the same variance; a
        marginal of prefix or range queries: the RMSE of its answers, each answer's own in its table)."""
        return {marginal_name(e["attributes"]): float(e["std_error"]) for e in self.entries(result)}

    # -- downstream inference: the measurements and the covariance of the estimates -----------------------

    def _job_plan(self, result: Any) -> tuple[str, dict, Any]:
        from shardfold.functions.dpquery import core

        job_id = self._result(result)["job_id"]
        doc, pl = core.load_plan(self._client.store_root, job_id)
        return job_id, doc, pl

    def measurements(
        self, result: Any, max_samples: int | None = MEASUREMENTS_MAX_SAMPLES
    ) -> list[ResidualMeasurement]:
        """The release's noisy measurements, one :class:`ResidualMeasurement` per residual set (in plan
        order; the first is the total count): its attributes (``clique``), the noisy vector, its σ
        (``stddev``) and its linear query (``query``, with Kronecker ``factors``), i.e. the arguments of
        Private-PGM's ``mbi.LinearMeasurement`` (see :func:`to_mbi`). Post-processing of released output:
        no privacy cost. Every workload marginal's estimate is a linear function of these (the job's own
        reconstruction); a downstream tool may combine them differently.

        Reads every measurement object of the job (8 bytes per noise sample: ``result["report"]
        ["noise_samples"]``); refused above ``max_samples`` samples (None: no limit)."""
        from shardfold.functions.dpquery import core
        from shardfold.functions.dpquery import measure as mz

        job_id, doc, pl = self._job_plan(result)
        total = pl.total_noise_samples
        if max_samples is not None and total > max_samples:
            raise ShardfoldError(
                f"job {job_id} released {total:,} noise samples; measurements() reads at most "
                f"{max_samples:,} (pass max_samples=None to read them all)"
            )
        names = pl.names or [f"a{i}" for i in range(int(pl.domains.size))]
        offsets = np.zeros(pl.num_residuals + 1, dtype=np.int64)
        np.cumsum(pl.noise_count, out=offsets[1:])
        out: list[ResidualMeasurement] = []
        for g, (start, stop) in enumerate(doc["measure_groups"]):
            raw = store.get(core.measurement_uri(self._client.store_root, job_id, g))
            payload = 8 * int(offsets[stop] - offsets[start])
            values = mz.decode_values(raw[:payload])
            meta = mz.decode_trailer(raw[payload:])
            for index, scale, _d_in, rho in meta["sets"]:
                k = int(index)
                attrs = pl.residual(k)
                sizes = tuple(int(pl.domains[a]) for a in attrs)
                clique = tuple(names[a] for a in attrs)
                lo = int(offsets[k] - offsets[start])
                strategies = None
                dense = pl.dense(k)
                if pl.res_strategy is not None and dense is None:  # their attributes' strategies
                    strategies = tuple(
                        None if name.startswith("identity:") else pl.strategy(name).matrix
                        for name in pl.set_strategies(k)
                    )
                out.append(
                    ResidualMeasurement(
                        index=k,
                        clique=clique,
                        attrs=attrs,
                        sizes=sizes,
                        noisy_measurement=values[lo : lo + int(pl.noise_count[k])],
                        stddev=float(scale),
                        rho=float(rho),
                        query=(
                            KroneckerQuery(clique, sizes, strategies)
                            if dense is None
                            else DenseQuery(clique, sizes, dense)
                        ),
                    )
                )
        if [m.index for m in out] != list(range(pl.num_residuals)):
            raise ShardfoldError(f"job {job_id}: its measurements do not cover the plan's residual sets")
        return out

    to_mbi = staticmethod(to_mbi)

    def answer(
        self,
        result: Any,
        where: dict[str, Any] | None = None,
        *,
        on: str | Sequence[str] | None = None,
        weights: Any = None,
    ) -> dict[str, float] | list[dict[str, float]]:
        """A linear query's answer from the release: ``{"estimate", "std_error", "variance"}``, unbiased, with
        its exact variance. Post-processing: no privacy cost, no data read.

        **A box**, ``where``: the count of the records in a box of the schema. ``where`` maps attributes to
        what they select: a label as the tables show it (``"female"``, ``"18..27"``, ``42``), a list of
        labels, or for a ``range`` attribute an inclusive ``(lo, hi)`` of values that starts and ends on bin
        bounds (``(18, 47)`` with bins of width 10 from 18 → 3 bins). Attributes not named are summed over;
        ``{}`` (or None) is the total.

        **Any linear query**, ``on`` and ``weights``: Σ weights · counts over the cells of the marginal on the
        attributes ``on`` (names, or one string ``"a,b"``); ``weights`` has one number per cell, shaped by
        the attributes in the order of ``on`` (``age_bin + sex_bin <= 3`` on 10 × 2 bins:
        ``np.add.outer(range(10), range(2)) <= 3``), or a stack of such arrays (a leading axis, one query
        each), answered as a list.

        The query may be one the workload never asked, e.g. ages 18–47 of women when the workload asked
        ``[age, sex]`` cell by cell. It is the sum of its pieces on the residual sets of its attributes
        (QuerySmasher's decomposition; :mod:`functions.dpquery.smasher`), each answered from that set's
        measurement; a piece that is zero (a query constant along an attribute) needs nothing. A piece on a
        set the release did not measure is refused, naming what is missing. A query that is one of the
        release's answers gets that answer's estimate and standard error."""
        from shardfold.functions.dpquery import core

        job_id, doc, pl = self._job_plan(result)
        spec = self.spec(store.get_json(self._client.uri(spec_key(job_id))))
        names = [a.name for a in spec.attributes]
        sizes = [len(a.labels()) for a in spec.attributes]
        if on is None and weights is None:
            attrs, queries, single = self._box(spec, names, dict(where or {}))
        elif on is None or weights is None or where:
            raise SpecError("answer: give a box (where) or a query (on and weights together), not both")
        else:
            attrs, queries, single = _weighted_queries(names, sizes, on, weights)
        parts = _measured_pieces(pl, attrs, queries, names, sizes)
        needed = np.array(sorted({k for p in parts for k in p}), dtype=np.int64)
        values = core.read_residuals(self._client.store_root, job_id, doc, pl, needed)
        answers = []
        for p in parts:
            estimate, variance = core.answer_pieces(pl, values, p)
            answers.append({"estimate": estimate, "std_error": math.sqrt(variance), "variance": variance})
        return answers[0] if single else answers

    @staticmethod
    def _box(spec: Any, names: list[str], where: dict[str, Any]) -> tuple[tuple[int, ...], np.ndarray, bool]:
        """A box as one query over the cells of its attributes (sorted): the product of its selections."""
        unknown = [n for n in where if n not in names]
        if unknown:
            raise SpecError(f"answer: no attribute {unknown[0]!r} in this release; it has {', '.join(names)}")
        attrs = tuple(sorted(names.index(n) for n in where))
        box = np.ones(())
        for i in attrs:
            box = np.multiply.outer(box, _selection(spec.attributes[i], where[names[i]]))
        return attrs, box.reshape(1, -1), True

    def covariance(
        self, release: Any, a: str | Sequence[str], b: str | Sequence[str] | None = None
    ) -> np.ndarray:
        """Cov(x̂_A, x̂_B) of two released marginals: a cells_A × cells_B matrix, rows and columns in the
        tables' cell order (C order; ``b`` defaults to ``a``, whose diagonal is its per-cell variance).
        Marginals built from shared residual measurements have correlated errors (a 2-way marginal's
        cells and a 1-way marginal of one of its attributes, say); this is what a downstream analysis
        summing cells across tables needs. Data-independent: from the plan alone.

        ``release`` is a result, a :class:`client.Job` or job id, or a plan (:meth:`plan`: before running);
        ``a``, ``b`` name workload marginals as in :meth:`tables`. For small releases: refused above
        :data:`functions.dpquery.reconstruct.COVARIANCE_MAX_ENTRIES` entries (4,000,000)."""
        from shardfold.functions.dpquery import reconstruct as rc
        from shardfold.functions.dpquery.planner import Plan

        pl = release if isinstance(release, Plan) else self._job_plan(release)[2]
        if pl.marg_types is not None:
            raise ShardfoldError(
                "covariance() is for releases of identity marginals; this one asks prefix or range queries "
                "(each answer's variance is in its table's std_error column)"
            )
        names = pl.names or [f"a{i}" for i in range(int(pl.domains.size))]
        workload = {frozenset(pl.marginal(j)): pl.marginal(j) for j in range(pl.num_marginals)}

        def attrs_of(m: str | Sequence[str]) -> tuple[int, ...]:
            wanted = m.split(",") if isinstance(m, str) else list(m)
            key = frozenset(names.index(w.strip()) if w.strip() in names else -1 for w in wanted if w.strip())
            if m == TOTAL_NAME:
                key = frozenset()
            if key not in workload:
                have = sorted(marginal_name([names[i] for i in x]) for x in workload.values())
                raise ShardfoldError(f"marginal {m!r} is not in this release; it has {', '.join(have)}")
            return workload[key]

        aa = attrs_of(a)
        bb = aa if b is None else attrs_of(b)
        both = set(aa) & set(bb)
        sigma2 = pl.sigma2
        sets = {
            pl.residual(k): float(sigma2[k]) for k in range(pl.num_residuals) if set(pl.residual(k)) <= both
        }
        try:
            return rc.covariance(sets, [int(n) for n in pl.domains], aa, bb)
        except ValueError as exc:
            raise ShardfoldError(str(exc)) from exc

    # -- the budget ledger --------------------------------------------------------------------------------

    def budget(self, dataset_id: str, delta: float = REPORT_DELTA) -> dict[str, Any]:
        """The privacy-budget ledger of ``dataset_id`` on this client's store (ρ-zCDP throughout):

        * ``total``: the dataset's total ρ (None until a first job registers it);
        * ``spent``: ρ counted against the total (each finished job's actual spend, each unfinished or
          failed job's reservation: a reservation is never released);
        * ``remaining``: ``total − spent`` (None without a total);
        * ``epsilon``: ε of ``spent`` at ``delta`` by the CKS bound (zCDP composes by adding ρ);
        * ``jobs``: one entry per job: ``job_id``, ``reserved``, ``spent`` (None while unfinished).
        """
        from shardfold.functions import ledger
        from shardfold.functions.privacy import cdp_eps

        if not isinstance(dataset_id, str) or not re.fullmatch(DATASET_ID, dataset_id):
            raise SpecError(
                f"dataset_id {dataset_id!r}: letters, digits, '.', '_', '-' (at most 128), as in a spec"
            )
        state = ledger.read(self._client.store_root, dataset_id)
        spent = state.committed()
        total = state.total_rho
        return {
            "dataset_id": dataset_id,
            "total": total,
            "spent": spent,
            "remaining": None if total is None else state.remaining(),
            "delta": delta,
            "epsilon": cdp_eps(spent, delta),
            "jobs": [
                {"job_id": job_id, "reserved": rho, "spent": state.spent.get(job_id)}
                for job_id, rho in state.reserved.items()
            ],
        }
