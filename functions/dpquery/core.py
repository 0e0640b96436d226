"""Pure core of the ``dpquery`` job: plan → measure (fan-out over residual sets) → reconstruct (fan-out over
workload marginals) → finalize.

* **plan** (:func:`plan`): the noise allocation (:mod:`functions.dpquery.planner`, no data), then ONE scan
  of the dataset that checks the public facts (columns, Parquet types, that the file can be read) and never
  fails on a row's contents (:func:`functions.dpquery.data.scan`: values outside the domain follow the
  schema's ``out_of_domain`` policy), then the budget reservation on the dataset's ledger
  (:mod:`functions.ledger`). Only then are the plan document and the two work lists written. Every
  bad input therefore fails before any budget is spent, and whether it fails depends on no row.
* **measure** (:func:`measure`): one contiguous range of residual sets (about equal noise-sample counts):
  count the covering marginals in one pass over the needed columns, transform, add OpenDP noise, and write
  ONE object with put-if-absent at ``jobs/<id>/dpquery/measurements/<group>.bin``. If that object exists
  (a retry, a redrive, a duplicate attempt) it is read back and no noise is drawn. A task that died before
  writing released nothing, so its retry may draw afresh.
* **reconstruct** (:func:`reconstruct`): one contiguous range of workload marginals; ranged reads of the
  measurements they need; x̂_A and its per-cell variance; a Parquet table per marginal (JSON too for small
  ones). Post-processing only.
* **finalize** (:func:`finalize`): ρ spent = Σ of the sampler's map values over every measurement; the
  ledger's ``spend`` entry; ``jobs/<id>/result.json`` with the tables and the report.

Nothing here logs, writes or returns a row, a true count, the row count or a proxy of it (the dataset's
byte size): task results, logs and the plan document carry indices, sizes of the plan, ρ values, URIs and
the dataset's fingerprint (a hash of its pin, :meth:`functions.store.Pin.fingerprint`) only. The
histograms live in memory in measure tasks and are dropped.

Store layout (under ``jobs/<id>/dpquery/``): ``plan.json`` (the plan document, first writer wins),
``measure.json`` and ``reconstruct.json`` (work lists), ``measurements/<g>.bin`` (the released
measurements: float64 payload in residual order + JSON trailer), ``tables/<g>.json`` (per reconstruct
group, the tables it wrote). Tables go to ``spec.output`` or ``jobs/<id>/output/`` as
``<index>-<attributes>.parquet`` (+ ``.json``), and ``tables.json`` lists them all.
"""

from __future__ import annotations

import io
import json
import math
import threading
from typing import Any, NamedTuple

import numpy as np
import pyarrow.parquet as pq

from shardfold.functions import access, ledger, store
from shardfold.functions.dpquery import data, planner
from shardfold.functions.dpquery import measure as mz
from shardfold.functions.dpquery import reconstruct as rc
from shardfold.functions.dpquery.planner import Plan
from shardfold.functions.dpquery.spec import MATRIX, WHOLE_TYPES, DPQuerySpec
from shardfold.functions.dpquery.unit import ContributionBound, job_seed, unit_report
from shardfold.functions.errors import DatasetError, InputChanged, PlanError, StoreError
from shardfold.functions.log import logger
from shardfold.functions.privacy import cdp_eps, gaussian_eps, simple_eps
from shardfold.functions.store.uri import join
from shardfold.functions.worklist import write_worklist

STAGE = "dpquery"
INLINE_TABLES_MAX = 2000  # result.json lists the tables inline up to this many marginals
COALESCE_GAP_BYTES = 1 << 20  # ranged reads of one measurement object closer than this are merged


# --- keys ---------------------------------------------------------------------------------------------------


def job_uri(store_root: str, job_id: str, *parts: str) -> str:
    return join(store_root, "jobs", job_id, *parts)


def plan_uri(store_root: str, job_id: str) -> str:
    return job_uri(store_root, job_id, STAGE, "plan.json")


def measurement_uri(store_root: str, job_id: str, group: int) -> str:
    return job_uri(store_root, job_id, STAGE, "measurements", f"{group:05d}.bin")


def _tables_uri(store_root: str, job_id: str, group: int) -> str:
    return job_uri(store_root, job_id, STAGE, "tables", f"{group:05d}.json")


def output_prefix(spec: DPQuerySpec, store_root: str, job_id: str) -> str:
    if spec.output:
        return access.output_uri(spec.output, store_root, "output", job_id).rstrip("/")
    return job_uri(store_root, job_id, "output")


# --- the plan document, cached per process ---------------------------------------------------------------

_cache_lock = threading.Lock()
_cache: dict[str, tuple[dict, Plan]] = {}


def load_plan(store_root: str, job_id: str) -> tuple[dict, Plan]:
    """The job's plan document and its :class:`Plan` (decoded once per process)."""
    uri = plan_uri(store_root, job_id)
    with _cache_lock:
        hit = _cache.get(uri)
    if hit is not None:
        return hit
    doc = store.get_json(uri)
    value = (doc, Plan.from_doc(doc["plan"]))
    with _cache_lock:
        if len(_cache) > 8:
            _cache.clear()
        _cache[uri] = value
    return value


def _payload_offsets(pl: Plan) -> np.ndarray:
    """Global sample offset of every residual set (in residual order), and the total at the end."""
    off = np.zeros(pl.num_residuals + 1, dtype=np.int64)
    np.cumsum(pl.noise_count, out=off[1:])
    return off


# --- plan ---------------------------------------------------------------------------------------------------


def prepare(spec: DPQuerySpec, job_id: str, store_root: str) -> dict:
    """Plan the job, validate the dataset, reserve the budget, write the plan and the work lists.

    Order matters: the allocation and the dataset scan raise on bad input BEFORE the ledger is touched,
    and nothing is measured until the reservation is on the ledger."""
    pl = planner.plan(spec)
    dataset = access.input_uri(spec.dataset, store_root, "dataset")
    access.not_an_input(
        output_prefix(spec, store_root, job_id), [("dataset", dataset)], "output", prefix=True
    )
    # pinned before the scan, so a dataset changed during it fails the measure steps (None: the scan names
    # the missing dataset)
    pin = store.pins([dataset])[dataset]
    data.scan(dataset, spec.format, spec.attributes)  # public facts only; row contents never fail it
    pin = pin or store.pin(dataset)
    if spec.privacy_unit is not None:  # the id column exists and its type holds ids
        _check_unit(spec, dataset, job_id)
    identity = data.identify(dataset, spec.format, pin)
    store.verify(dataset, pin)  # the bytes fingerprinted are the bytes pinned (and scanned)
    _check_rows_bound(spec, dataset, identity)
    summary = ledger.reserve(
        store_root,
        spec.dataset_id,
        job_id,
        spec.rho(),
        spec.dataset_budget_rho,
        identity=identity,
        version=spec.dataset_version,
    )
    doc = {
        "job_id": job_id,
        "dataset": dataset,
        "format": spec.format,
        # a hash of the pin, not the pin: the pin holds the byte size, a proxy of the row count, and the
        # job folder may be readable by more people than the dataset
        "dataset_fingerprint": pin.fingerprint(),
        "measure_groups": [list(g) for g in pl.residual_groups(spec.noise_samples_per_task)],
        "reconstruct_groups": [list(g) for g in pl.marginal_groups(spec.cells_per_task)],
        "plan": pl.to_doc(),
    }
    uri = plan_uri(store_root, job_id)
    if not store.put_if_absent(uri, json.dumps(doc, sort_keys=True).encode()):
        doc = store.get_json(uri)  # a retried plan: the first plan stands (measurements may rely on it)
        pl = Plan.from_doc(doc["plan"])
    offsets = _payload_offsets(pl)
    measure_items = [
        {"group": g, "start": s, "stop": t, "samples": int(offsets[t] - offsets[s])}
        for g, (s, t) in enumerate(doc["measure_groups"])
    ]
    reconstruct_items = [
        {"group": g, "start": s, "stop": t, "cells": int(pl.cells[s:t].sum())}
        for g, (s, t) in enumerate(doc["reconstruct_groups"])
    ]
    m_ref = write_worklist(job_uri(store_root, job_id, STAGE, "measure.json"), measure_items)
    r_ref = write_worklist(job_uri(store_root, job_id, STAGE, "reconstruct.json"), reconstruct_items)
    logger.info(
        "planned dpquery",
        extra={
            "job_id": job_id,
            "residual_sets": pl.num_residuals,
            "marginals": pl.num_marginals,
            "noise_samples": pl.total_noise_samples,
            "measure_tasks": len(measure_items),
            "reconstruct_tasks": len(reconstruct_items),
            "rho": pl.rho,
        },
    )
    return {
        "measure": m_ref,
        "reconstruct": r_ref,
        "residual_sets": pl.num_residuals,
        "marginals": pl.num_marginals,
        "noise_samples": pl.total_noise_samples,
        "rho": pl.rho,
        "rmse": pl.rmse,
        "ledger": summary,
    }


def _bound(spec: DPQuerySpec, job_id: str) -> ContributionBound | None:
    """The job's contribution bounding (None: one row is one person), seeded from the job id."""
    u = spec.privacy_unit
    return None if u is None else ContributionBound(u.id_column, u.max_rows, job_seed(job_id))


def _check_unit(spec: DPQuerySpec, dataset: str, job_id: str) -> None:
    """Pass 1 of the contribution bounding at plan time: the id column is present and readable as ids (its
    type: a public fact), before any budget is reserved. Rows without an id are never counted, never an
    error."""
    bound = _bound(spec, job_id)
    for batch in data.record_batches(dataset, spec.format, [bound.id_column]):
        bound.count(batch.column(0))
    bound.finish()


def _check_rows_bound(spec: DPQuerySpec, dataset: str, identity: dict) -> None:
    """Refuse (before the ledger) a dataset that may hold more rows than the public bound N the rounding
    is charged for. The message states the bound, never the count."""
    bound = spec.rows_bound()
    if identity["rows_at_most"] > bound:
        raise DatasetError(
            f"dataset {dataset} may hold more than {bound:,} rows, the public row bound "
            f"({'max_rows_total' if spec.max_rows_total is not None else 'the default of max_rows_total'}) "
            "for which the rounding of the transform is charged; give a larger 'max_rows_total' (at most "
            "2^53). Nothing was reserved"
        )


# --- measure ------------------------------------------------------------------------------------------------


def _trailer(uri: str, payload_bytes: int) -> dict:
    return mz.decode_trailer(store.get(uri, payload_bytes))


def measure(
    spec: DPQuerySpec, job_id: str, store_root: str, group: int, *, noise: bool = True
) -> dict[str, Any]:
    """Measure one group of residual sets and write it once (put-if-absent). A measurement already in the
    store is read back, never redrawn. ``noise=False`` is the tests' seam: handlers never pass it."""
    doc, pl = load_plan(store_root, job_id)
    start, stop = doc["measure_groups"][group]
    offsets = _payload_offsets(pl)
    payload_bytes = 8 * int(offsets[stop] - offsets[start])
    uri = measurement_uri(store_root, job_id, group)
    if store.exists(uri):
        meta = _trailer(uri, payload_bytes)
        logger.info("measurement exists; reused", extra={"job_id": job_id, "group": group})
        return _measure_result(group, meta, reused=True)
    dataset = doc["dataset"]
    _check_unchanged(dataset, doc)
    sigma2 = pl.sigma2
    rho_s = pl.rho_s
    sets = []
    for k in range(start, stop):
        attrs = pl.residual(k)
        mats = None  # the contrasts (ResidualPlanner), else each attribute's query type's strategy
        dense = pl.dense(k)
        if dense is not None:  # one matrix over the set's cells (a set that a 2-way type reaches)
            mats = (dense,)
        elif pl.res_strategy is not None:
            mats = tuple(pl.strategy(name).matrix for name in pl.set_strategies(k))
        sets.append(
            mz.SetSpec(
                index=k,
                attrs=attrs,
                sizes=tuple(int(pl.domains[a]) for a in attrs),
                scale=math.sqrt(float(sigma2[k])),
                rho_planned=float(rho_s[k]),
                unit_rows=pl.unit_rows,
                rows_bound=pl.rows_bound,
                mats=mats,
                flat=dense is not None,
            )
        )
    hist = data.marginals(
        dataset, doc["format"], spec.attributes, [s.attrs for s in sets], unit=_bound(spec, job_id)
    )
    values, records = mz.measure_sets(sets, hist.__getitem__, noise=noise)
    del hist
    if values.size * 8 != payload_bytes:
        raise PlanError(
            f"internal: group {group} measured {values.size} samples, expected {payload_bytes // 8}"
        )
    meta = {
        "version": mz.FORMAT_VERSION,
        "job_id": job_id,
        "group": group,
        "start": start,
        "stop": stop,
        "samples": int(values.size),
        "sampler": mz.sampler_id() if noise else mz.NO_NOISE_SAMPLER,
        "rho": math.fsum(r["rho"] for r in records),
        "sets": [[r["index"], r["scale"], r["d_in"], r["rho"]] for r in records],
    }
    if not store.put_if_absent(uri, mz.encode(values, meta)):
        # another attempt released its measurement first: ours was never published, theirs stands
        meta = _trailer(uri, payload_bytes)
        return _measure_result(group, meta, reused=True)
    logger.info("measured", extra={"job_id": job_id, "group": group, "sets": stop - start})
    return _measure_result(group, meta, reused=False)


def _check_unchanged(dataset: str, doc: dict) -> None:
    """Raise :class:`InputChanged` if the dataset is not the one planned, by fingerprint; the message
    names the dataset and states no size (plans written before fingerprints hold a pin or a size)."""
    now = store.pins([dataset])[dataset]
    if "dataset_fingerprint" in doc:
        same = now is not None and now.fingerprint() == doc["dataset_fingerprint"]
    elif "dataset_pin" in doc:
        same = now == store.Pin(**doc["dataset_pin"])
    else:
        same = now is not None and now.size == doc["dataset_bytes"]
    if not same:
        raise InputChanged(
            f"input {dataset} changed since the job was planned; submit a new job to use the new content",
            uri=dataset,
        )


def _measure_result(group: int, meta: dict, reused: bool) -> dict[str, Any]:
    return {
        "group": group,
        "sets": meta["stop"] - meta["start"],
        "samples": meta["samples"],
        "rho": meta["rho"],
        "reused": reused,
    }


# --- reconstruct --------------------------------------------------------------------------------------------


def read_residuals(
    store_root: str, job_id: str, doc: dict, pl: Plan, needed: np.ndarray
) -> dict[int, np.ndarray]:
    """y_S for every residual index in ``needed`` (sorted), by coalesced ranged reads of the measurements."""
    offsets = _payload_offsets(pl)
    groups = [tuple(g) for g in doc["measure_groups"]]
    owner = Plan.group_of(needed, groups)
    spans: list[tuple[int, int, int, list[int]]] = []  # (group, first byte, end byte, residual indices)
    for k, g in zip(needed.tolist(), owner.tolist(), strict=True):
        base = int(offsets[groups[g][0]])
        lo, hi = 8 * (int(offsets[k]) - base), 8 * (int(offsets[k + 1]) - base)
        if spans and spans[-1][0] == g and lo - spans[-1][2] <= COALESCE_GAP_BYTES:
            spans[-1] = (g, spans[-1][1], hi, spans[-1][3] + [k])
        else:
            spans.append((g, lo, hi, [k]))
    items = [
        {"uri": measurement_uri(store_root, job_id, g), "start": lo, "length": hi - lo}
        for g, lo, hi, _ in spans
    ]
    out: dict[int, np.ndarray] = {}
    for entry, (g, lo, _hi, ks) in zip(store.get_batch(items), spans, strict=True):
        buf = mz.decode_values(entry.data)
        base = int(offsets[groups[g][0]])
        for k in ks:
            a = int(offsets[k]) - base - lo // 8
            out[k] = buf[a : a + int(pl.noise_count[k])]
    return out


def _inverses(pl: Plan, k: int) -> list[np.ndarray] | np.ndarray:
    """What maps residual set k's measurement back to its cells: B_i⁺ per attribute, or one B⁺."""
    if pl.dense(k) is not None:
        return pl.dense_inverse(k)
    return [pl.strategy(name).inverse for name in pl.set_strategies(k)]


def answer_pieces(
    pl: Plan, values: dict[int, np.ndarray], pieces: dict[int, np.ndarray]
) -> tuple[float, float]:
    """A linear query's estimate Σ_k p_k·x̂_k and its exact variance Σ_k σ_k² ‖p_k B_k⁺‖², from its piece p_k
    on each residual set k it reaches (QuerySmasher's decomposition, :func:`smasher.pieces`: an array over
    the set's cells, C order) and the sets' noisy measurements ``values`` (y_k). x̂_k = B_k⁺ y_k, through the
    set's one matrix where it was measured whole, else mode-wise through its per-attribute strategies.
    Post-processing: no data, no budget."""
    estimate = variance = 0.0
    for k, piece in pieces.items():
        inverse = _inverses(pl, k)
        y = np.asarray(values[k], dtype=np.float64)
        if isinstance(inverse, np.ndarray):
            flat = np.asarray(piece, dtype=np.float64).reshape(-1)
            estimate += float(flat @ (inverse @ y))
            spread = float(np.sum((flat @ inverse) ** 2))
        else:
            shaped = np.asarray(piece, dtype=np.float64).reshape([b.shape[0] for b in inverse])
            x_k = mz.mode_product(inverse, y.reshape([b.shape[1] for b in inverse]))
            estimate += float(np.sum(shaped * x_k))
            spread = float(np.sum(mz.mode_product([b.T for b in inverse], shaped) ** 2))
        variance += float(pl.sigma2[k]) * spread
    return estimate, variance


def whole_answers(
    pl: Plan, j: int, values: dict[int, np.ndarray], kind: Any
) -> tuple[np.ndarray, np.ndarray]:
    """Workload marginal j's answers under a type over the marginal as a whole (a 2-way type, an explicit
    matrix: ``kind``) and each one's variance, from the residual measurements ``values`` (y_k by index)."""
    attrs = pl.marginal(j)
    at = {a: k for k, a in enumerate(attrs)}
    terms = [
        (tuple(at[a] for a in pl.residual(k)), values[k], float(pl.sigma2[k]), _inverses(pl, k))
        for k in pl.subsets(j).tolist()
    ]
    return rc.pair_answers(kind, [int(pl.domains[a]) for a in attrs], terms)


def general_answers(pl: Plan, j: int, values: dict[int, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Workload marginal j's answers under per-attribute query types (one axis per attribute, its queries)
    and each one's variance, from the residual measurements ``values`` (y_k by residual index)."""
    attrs = pl.marginal(j)
    kinds = pl.marginal_types(j)
    at = {a: k for k, a in enumerate(attrs)}
    terms = []
    for k in pl.subsets(j).tolist():
        pos = tuple(at[a] for a in pl.residual(k))
        inverses = _inverses(pl, k)
        if isinstance(inverses, np.ndarray):  # one matrix over the set's cells
            sizes = [int(pl.domains[attrs[p]]) for p in pos]
            insides = rc.dense_inside([kinds[p] for p in pos], sizes, inverses)
        else:
            how = pl.set_strategies(k)
            insides = [pl.inside(kinds[p], name) for p, name in zip(pos, how, strict=True)]
        terms.append((pos, values[k], float(pl.sigma2[k]), inverses, insides))
    totals = [pl.attribute_total(a) for a in attrs]
    return rc.answers(kinds, [int(pl.domains[a]) for a in attrs], terms, totals)


def reconstruct(spec: DPQuerySpec, job_id: str, store_root: str, group: int) -> dict[str, Any]:
    """Reconstruct one group of workload marginals and write their tables."""
    doc, pl = load_plan(store_root, job_id)
    start, stop = doc["reconstruct_groups"][group]
    values = read_residuals(store_root, job_id, doc, pl, pl.needed_residuals(start, stop))
    prefix = output_prefix(spec, store_root, job_id)
    release = rc.release_info(doc, pl.rho, pl.delta, spec)
    release_meta = rc.parquet_metadata(release)
    var = pl.var
    asked_whole: list = []  # each marginal's queries as the spec gives them, read for an explicit matrix only
    entries = []
    for j in range(start, stop):
        names = [spec.attributes[a].name for a in pl.marginal(j)]
        meta = {**release_meta, "job_id": job_id, "attributes": json.dumps(names), "marginal": str(j)}
        if pl.marg_types is None:  # identity marginals: every cell has the plan's variance
            out = _identity_table(spec, pl, j, values, meta, names, float(var[j]))
        elif names and pl.marginal_types(j)[0] in WHOLE_TYPES:  # a 2-way type, a matrix: a list of answers
            out = _whole_table(spec, pl, j, values, meta, names, asked_whole)
        else:  # general queries: each answer has its own variance
            out = _general_table(spec, pl, j, values, meta, names)
        entries.append(_write_table(out, j, names, float(pl.weights[j]), prefix, release))
    store.put_json(_tables_uri(store_root, job_id, group), entries)
    return {"group": group, "marginals": stop - start}


class _Table(NamedTuple):
    """A reconstructed marginal: its table, estimates, mean variance, each answer's variance (where they
    differ: ``per_answer``), and the query types asked (per attribute, or a 2-way type's name)."""

    table: Any
    estimate: np.ndarray
    variance: float
    cell_var: np.ndarray | None
    asked: dict[str, str] | str
    per_answer: bool


def _identity_table(spec: DPQuerySpec, pl: Plan, j: int, values: dict, meta: dict, names, v: float) -> _Table:
    """An identity marginal's cells, every one of the plan's variance ``v``."""
    attrs, attributes = pl.marginal(j), spec.attributes
    terms = [(pl.residual(int(k)), values[int(k)]) for k in pl.subsets(j)]
    estimate = rc.reconstruct([int(pl.domains[a]) for a in attrs], attrs, terms)
    labels = [attributes[a].labels() for a in attrs]
    bounds = [rc.attribute_bounds(attributes[a]) for a in attrs]
    tbl = rc.table(estimate, names, labels, v, meta, bounds)
    return _Table(tbl, estimate, v, None, {}, False)


def _whole_table(spec: DPQuerySpec, pl: Plan, j: int, values: dict, meta: dict, names, asked_whole) -> _Table:
    """The answers of a type over the marginal as a whole (a 2-way type, an explicit matrix: the spec's
    matrices are read into ``asked_whole`` the first time one is needed), each with its variance."""
    attrs = pl.marginal(j)
    kind = asked = pl.marginal_types(j)[0]
    if kind == MATRIX:
        if not asked_whole:
            asked_whole.extend(spec.marginal_queries())
        kind = next(iter(asked_whole[j].values()))
    estimate, cell_var = whole_answers(pl, j, values, kind)
    labels = rc.pair_labels(kind, names, [int(pl.domains[a]) for a in attrs])
    tbl = rc.table(estimate, ["query"], [labels], cell_var, {**meta, "query_type": asked})
    return _Table(tbl, estimate, float(cell_var.mean()), cell_var, asked, True)


def _general_table(spec: DPQuerySpec, pl: Plan, j: int, values: dict, meta: dict, names) -> _Table:
    """Per-attribute query types' answers, each with its variance."""
    attrs, kinds = pl.marginal(j), pl.marginal_types(j)
    estimate, cell_var = general_answers(pl, j, values)
    axes = [rc.query_labels(spec.attributes[a], t) for a, t in zip(attrs, kinds, strict=True)]
    asked = {n: t for n, t in zip(names, kinds, strict=True) if t != "identity"}
    v = float(cell_var.mean())
    # cells of one variance (identity cells measured through the contrasts) get it once; a set
    # measured through a strategy fitted to several query types gives each cell its own
    per_answer = bool(np.ptp(cell_var) > 1e-12 * float(cell_var.max()))
    cells_var = cell_var if per_answer else v
    tbl = rc.table(estimate, names, [a[0] for a in axes], cells_var, meta, [a[1] for a in axes])
    return _Table(tbl, estimate, v, cell_var, asked, per_answer)


def _write_table(out: _Table, j: int, names: list[str], weight: float, prefix: str, release: dict) -> dict:
    """Write marginal j's table (Parquet; JSON too when small) and return its entry in the result."""
    stem = rc.file_stem(j, names)
    buf = io.BytesIO()
    pq.write_table(out.table, buf)
    parquet_uri = f"{prefix}/{stem}.parquet"
    store.put(parquet_uri, buf.getvalue())
    v = out.variance
    entry = {
        "index": j,
        "attributes": names,
        "cells": int(out.estimate.size),
        "variance": v,
        "std_error": math.sqrt(v),
        "weight": weight,
        "parquet": parquet_uri,
    }
    if out.asked:  # the types asked: per attribute, or a 2-way type's name
        entry["queries"] = out.asked
    if out.per_answer:  # variance and std_error: the mean over the answers (the RMSE); each row has its own
        entry["max_std_error"] = math.sqrt(float(out.cell_var.max()))
    if out.estimate.size <= rc.JSON_MAX_CELLS:
        json_uri = f"{prefix}/{stem}.json"
        store.put_json(json_uri, rc.json_doc(out.table, None if out.per_answer else v, names, release))
        entry["json"] = json_uri
    return entry


# --- finalize -----------------------------------------------------------------------------------------------


def finalize(spec: DPQuerySpec, job_id: str, store_root: str) -> dict[str, Any]:
    """Sum the sampler maps, record the spend on the ledger, write ``result.json``."""
    result_uri = job_uri(store_root, job_id, "result.json")
    if store.exists(result_uri):  # a retried finalize after success: the committed result stands
        return _small(store.get_json(result_uri), result_uri)
    doc, pl = load_plan(store_root, job_id)
    offsets = _payload_offsets(pl)
    groups = doc["measure_groups"]
    # each read starts where the group's payload ends: the trailer holds the sampler's map values
    items = [
        {"uri": measurement_uri(store_root, job_id, g), "start": 8 * int(offsets[t] - offsets[s])}
        for g, (s, t) in enumerate(groups)
    ]
    rho_terms: list[float] = []
    samplers: set[str] = set()
    sets_seen = 0
    for entry in store.get_batch(items):
        meta = mz.decode_trailer(entry.data)
        rho_terms.extend(float(r[3]) for r in meta["sets"])
        samplers.add(meta["sampler"])
        sets_seen += len(meta["sets"])
    if sets_seen != pl.num_residuals:
        raise StoreError(f"job {job_id}: {sets_seen} residual sets measured, the plan has {pl.num_residuals}")
    rho_spent = math.fsum(rho_terms)
    ledger_summary = ledger.spend(store_root, spec.dataset_id, job_id, rho_spent)
    tables: list[dict] = []
    for g in range(len(doc["reconstruct_groups"])):
        tables.extend(store.get_json(_tables_uri(store_root, job_id, g)))
    prefix = output_prefix(spec, store_root, job_id)
    index_uri = f"{prefix}/tables.json"
    store.put_json(index_uri, tables)
    delta = pl.delta
    report = {
        "rho_budget": pl.rho,
        "rho_planned": pl.rho_planned,
        "rho_spent": rho_spent,
        "delta": delta,
        "epsilon_cks": cdp_eps(rho_spent, delta),
        "epsilon_gaussian": gaussian_eps(rho_spent, delta),
        "epsilon_simple": simple_eps(rho_spent, delta),
        "epsilon_note": (
            "epsilon_cks holds for any rho-zCDP mechanism (Canonne-Kamath-Steinke); epsilon_gaussian is the "
            "exact curve of this release as one Gaussian mechanism (continuous-noise analysis, this job only)"
        ),
        **unit_report(spec.privacy_unit, pl.unit_rows, pl.rows_bound),
        "samplers": sorted(samplers),
        "loss": pl.loss,
        "residual_sets": pl.num_residuals,
        "noise_samples": pl.total_noise_samples,
        "marginals": pl.num_marginals,
        "cells": pl.num_queries,
        "predicted_sse": pl.sse,
        "predicted_rmse": pl.rmse,
        "predicted_weighted_sse": pl.weighted_sse,
        "predicted_max_weighted_variance": pl.max_weighted_variance,
        "measure_tasks": len(groups),
        "reconstruct_tasks": len(doc["reconstruct_groups"]),
    }
    result = {
        "job_id": job_id,
        "kind": "dpquery",
        "dataset_id": spec.dataset_id,
        "output": prefix,
        "tables_index": index_uri,
        "report": report,
        "release": rc.release_info(doc, pl.rho, delta, spec),
        "ledger": ledger_summary,
    }
    if len(tables) <= INLINE_TABLES_MAX:
        result["tables"] = tables
    store.put_json(result_uri, result)
    logger.info("dpquery finalized", extra={"job_id": job_id, "rho_spent": rho_spent})
    return _small(result, result_uri)


def _small(result: dict, uri: str) -> dict[str, Any]:
    """What the finalize task returns to the workflow (the full result is in the store)."""
    return {
        "job_id": result["job_id"],
        "result": uri,
        "marginals": result["report"]["marginals"],
        "rho_spent": result["report"]["rho_spent"],
    }
