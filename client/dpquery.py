"""``client.dpquery``: the user's side of the ``dpquery`` job kind (marginals under differential privacy).

A release from the SDK::

    client = Client()
    plan = client.dpquery.plan(spec)           # no data read: noise plan, predicted error, privacy report
    print(plan.rmse, plan.privacy_report()["epsilon_cks"])
    result = client.dpquery.run(spec)          # plan -> measure fan-out -> reconstruct fan-out -> finalize
    tables = client.dpquery.tables(result)     # {"sex,region": pyarrow.Table, ...}
    arrays = client.dpquery.arrays(result)     # {"sex,region": (ndarray, {"sex": [...], "region": [...]})}
    client.dpquery.budget("people")            # the dataset's ledger: total, spent, remaining, jobs

Marginals are named by their attribute names in schema order joined with ``,`` (``"sex,region"``);
the total count (a marginal of no attribute) is ``"(total)"``. Every estimate has the same per-cell
variance within its marginal: :meth:`DPQuery.std_errors`, ``result["tables"][i]["std_error"]``, and the
``variance``/``std_error`` keys of each Parquet file's schema metadata.

Nothing here reads the dataset: :meth:`DPQuery.plan` is the pure planner, and the tables are the job's
released (noisy) output.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from functions import store
from functions.dpquery.spec import DPQueryJob, marginal_name
from functions.errors import ShardfoldError, SpecError

LEDGER_REPORT_DELTA = 1e-9  # δ at which budget() states the dataset's ε (CKS) by default


class LabelledArray(NamedTuple):
    """A released marginal as a dense array: ``values[i, j, ...]`` is the estimate for
    ``labels[attr_0][i], labels[attr_1][j], ...``; ``labels`` maps each axis's attribute to its labels, in
    axis (schema) order. Unpacks as ``values, labels = arrays[name]``."""

    values: np.ndarray
    labels: dict[str, list]


def _dataset_id_pattern() -> str:
    for meta in DPQueryJob.model_fields["dataset_id"].metadata:
        pattern = getattr(meta, "pattern", None)
        if pattern:
            return pattern
    return r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # pragma: no cover - the spec always sets one


def table_to_array(tbl: pa.Table, attributes: Sequence[str]) -> LabelledArray:
    """A marginal's table (one row per cell, C order: the last attribute varies fastest) as a dense array
    with its labels. The shape comes from the table itself (each attribute's distinct labels)."""
    value_col = tbl.column_names[len(attributes)]
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


class DPQuery:
    """The ``client.dpquery`` namespace: plan a release without data, run it, read its tables, and read a
    dataset's privacy-budget ledger."""

    def __init__(self, client: Any):
        self._client = client

    # -- specs and plans ----------------------------------------------------------------------------------

    def spec(self, spec: Any) -> DPQueryJob:
        """The validated :class:`DPQueryJob` of ``spec`` (a model, a dict, JSON text or a ``.json`` file
        path, whose ``./`` URIs are then relative to the file). Reads nothing but the spec file."""
        from client.sdk import validate_spec

        parsed = validate_spec(spec)
        if not isinstance(parsed, DPQueryJob):
            raise SpecError(f"client.dpquery needs a 'dpquery' spec, got kind {parsed.kind!r}")
        return parsed

    def plan(self, spec: Any) -> Any:
        """The job's noise plan (:class:`functions.dpquery.planner.Plan`), computed from the spec alone:
        the dataset is never read (it need not exist yet), nor the ledger.

        ``plan.summary()`` is the human-readable part (residual sets, noise samples, predicted workload
        ``rmse``, largest per-cell standard deviation, ``privacy``); ``plan.privacy_report()`` gives ρ and ε
        at δ by CKS and by the exact Gaussian curve; ``plan.var[j]`` is the predicted per-cell variance of
        workload marginal ``j`` (attributes ``plan.marginal(j)``, indices into the schema)."""
        from functions.dpquery import planner

        return planner.plan(self.spec(spec))

    def predicted(self, spec: Any) -> dict[str, dict[str, float]]:
        """{marginal name: {"cells", "weight", "variance", "std_error"}} predicted by the plan (no data)."""
        parsed = self.spec(spec)
        from functions.dpquery import planner

        pl = planner.plan(parsed)
        names = [a.name for a in parsed.attributes]
        out: dict[str, dict[str, float]] = {}
        for j, var in enumerate(pl.var.tolist()):
            key = marginal_name([names[i] for i in pl.marginal(j)])
            out[key] = {
                "cells": int(pl.cells[j]),
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
        one column per attribute (its labels) then ``estimate``; the per-cell ``variance`` and
        ``std_error`` are in the schema metadata. ``marginals`` loads only those: names, or attributes in
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
            out[name] = table_to_array(tbl, tbl.column_names[:-1])  # the label columns, then the estimate
        return out

    def std_errors(self, result: Any) -> dict[str, float]:
        """{marginal name: per-cell standard error} (every cell of a marginal has the same variance)."""
        return {marginal_name(e["attributes"]): float(e["std_error"]) for e in self.entries(result)}

    # -- the budget ledger --------------------------------------------------------------------------------

    def budget(self, dataset_id: str, delta: float = LEDGER_REPORT_DELTA) -> dict[str, Any]:
        """The privacy-budget ledger of ``dataset_id`` on this client's store (ρ-zCDP throughout):

        * ``total``: the dataset's total ρ (None until a first job registers it);
        * ``spent``: ρ counted against the total (each finished job's actual spend, each unfinished or
          failed job's reservation: a reservation is never released);
        * ``remaining``: ``total − spent`` (None without a total);
        * ``epsilon``: ε of ``spent`` at ``delta`` by the CKS bound (zCDP composes by adding ρ);
        * ``jobs``: one entry per job: ``job_id``, ``reserved``, ``spent`` (None while unfinished).
        """
        from functions.dpquery import ledger
        from functions.dpquery.privacy import cdp_eps

        if not isinstance(dataset_id, str) or not re.fullmatch(_dataset_id_pattern(), dataset_id):
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
