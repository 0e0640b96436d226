"""dpquery: the privacy unit (contribution bounding, its sensitivity), the charged rounding of the residual
transform (public row bound; the 1e9-per-cell case), and the ledger bound to the dataset's content."""

from __future__ import annotations

import dataclasses
import io
import json
import math
from fractions import Fraction

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from shardfold.functions import ledger, store
from shardfold.functions.dpquery import core, data, unit
from shardfold.functions.dpquery import measure as mz
from shardfold.functions.dpquery.planner import plan
from shardfold.functions.dpquery.spec import DEFAULT_MAX_ROWS_TOTAL, DPQuerySpec
from shardfold.functions.errors import DatasetError, SpecError
from shardfold.functions.jobs import new_job_id
from shardfold.functions.kinds import WORKFLOWS
from shardfold.functions.specs import parse_spec
from shardfold.functions.store.uri import join
from shardfold.functions.workflow import Map, Task
from shardfold.orchestrator.local import LocalExecutor

SEED = unit.job_seed("dpquery-test")


# --- contribution bounding ----------------------------------------------------------------------------------


def test_choose_keeps_k_distinct_occurrences_depending_only_on_key_count_k(monkeypatch):
    kept = unit.choose(12345, 1000, 7)
    assert kept.size == 7 and np.unique(kept).size == 7 and kept.min() >= 0 and kept.max() < 1000
    assert np.array_equal(kept, unit.choose(12345, 1000, 7))
    assert not np.array_equal(kept, unit.choose(54321, 1000, 7))  # another person: another choice
    assert np.array_equal(unit.choose(1, 3, 7), [0, 1, 2])  # at most k rows: all kept
    monkeypatch.setattr(unit, "CHOOSE_BLOCK", 64)  # blockwise: the same k smallest priorities
    assert np.array_equal(unit.choose(12345, 1000, 7), kept)


def _ids(rows: list[str], batch: int = 5) -> list[pa.Array]:
    return [pa.array(rows[i : i + batch], pa.string()) for i in range(0, len(rows), batch)]


def _kept(rows: list[str], k: int, batch: int = 5) -> list[int]:
    bound = unit.ContributionBound("id", k, SEED)
    masks = unit.bounded_mask_all(bound, _ids(rows, batch))
    return np.flatnonzero(np.concatenate(masks)).tolist()


def test_at_most_k_rows_per_person_and_the_choice_is_stable_under_other_persons():
    rng = np.random.default_rng(0)
    persons = [f"p{i}" for i in range(30)]
    rows = [persons[i] for i in rng.integers(0, 30, 400)]
    k = 3
    kept = _kept(rows, k)
    per = {}
    for i in kept:
        per.setdefault(rows[i], []).append(i)
    assert all(len(v) == min(k, rows.count(p)) for p, v in per.items())
    assert set(per) == set(rows)
    assert _kept(rows, k, batch=7) == kept  # batching does not matter
    # removing one person changes no one else's kept rows (their occurrence numbers are their own)
    gone = "p4"
    rest = [r for r in rows if r != gone]
    positions = [i for i, r in enumerate(rows) if r != gone]
    kept_rest = {positions[i] for i in _kept(rest, k)}
    assert kept_rest == {i for i in kept if rows[i] != gone}
    # another job (seed) keeps other rows of the heavy persons
    other = unit.bounded_mask_all(unit.ContributionBound("id", k, unit.job_seed("other")), _ids(rows))
    assert np.flatnonzero(np.concatenate(other)).tolist() != kept


def test_bounded_marginals_move_by_at_most_k_rows_when_a_person_leaves(tmp_path):
    root = f"file://{tmp_path}"
    rng = np.random.default_rng(1)
    n = 600
    ids = rng.integers(0, 40, n)
    ids[:50] = 7  # one heavy person
    table = pa.table({"id": ids, "a": rng.integers(0, 3, n), "b": rng.integers(0, 2, n)})
    attrs = parse_spec(_doc("x.parquet")).attributes[:2]

    def hist(t: pa.Table, name: str) -> dict:
        buf = io.BytesIO()
        pq.write_table(t, buf)
        uri = join(root, name)
        store.put(uri, buf.getvalue())
        b = unit.ContributionBound("id", 4, SEED)
        return data.marginals(uri, "parquet", attrs, [(0, 1), (0,), ()], unit=b)

    full = hist(table, "full.parquet")
    assert int(full[()]) <= 4 * 40 and full[(0, 1)].sum() == full[()]
    unbounded = data.marginals(join(root, "full.parquet"), "parquet", attrs, [()])
    assert int(unbounded[()]) == n
    for person in (7, 3):
        without = hist(table.filter(pa.compute.not_equal(table["id"], person)), f"w{person}.parquet")
        for t in full:
            diff = np.abs(full[t] - without[t]).sum()
            assert diff <= 4, (person, t)
        assert int(full[()] - without[()]) == 4  # the heavy person and a 4+-row one: exactly k rows


# --- sensitivity and noise scale ----------------------------------------------------------------------------


def test_k_rows_per_person_multiply_every_noise_std_by_k_at_the_same_rho():
    one = plan(domains=[2, 3, 4], workload=[(0,), (0, 1), (1, 2)], rho=0.5)
    five = plan(domains=[2, 3, 4], workload=[(0,), (0, 1), (1, 2)], rho=0.5, unit_rows=5)
    assert np.allclose(five.sigma2, 25 * one.sigma2, rtol=1e-12)
    assert np.allclose(five.var, 25 * one.var, rtol=1e-12)
    assert np.allclose(five.rho_s, one.rho_s, rtol=1e-12)
    assert math.isclose(five.privacy_cost(), 2 * five.rho_planned, rel_tol=1e-12)
    assert five.privacy_report()["unit_rows"] == 5 and "one person" in five.privacy_report()["neighbouring"]
    # the sampler's map at the charged sensitivity is the planned share
    for k in range(five.num_residuals):
        sizes = [int(five.domains[a]) for a in five.residual(k)]
        d_in = mz.charged_sensitivity(sizes, 5)
        assert math.isclose(d_in, 5 * mz.l2_sensitivity(sizes), rel_tol=1e-15)
        ideal = d_in**2 / (2 * float(five.sigma2[k]))
        assert math.isclose(ideal, float(five.rho_s[k]), rel_tol=1e-12)


def test_a_spec_plans_with_its_unit_and_row_bound():
    spec = parse_spec(_doc("x.csv", privacy_unit={"id_column": "id", "max_rows": 3}, max_rows_total=2**40))
    pl = plan(spec)
    assert pl.unit_rows == 3 and pl.rows_bound == 2**40
    assert plan(parse_spec(_doc("x.csv"))).rows_bound == DEFAULT_MAX_ROWS_TOTAL
    with pytest.raises(Exception, match="max_rows"):
        parse_spec(_doc("x.csv", privacy_unit={"id_column": "id", "max_rows": 0}))
    for bad in (2**53 + 1, 2**32 - 1, 1999):  # nor below the default: a settable bound would find the count
        with pytest.raises(Exception, match="max_rows_total"):
            parse_spec(_doc("x.csv", max_rows_total=bad))


# --- the rounding of the transform: charged --------------------------------------------------------------


def _exact_residual(x: np.ndarray) -> np.ndarray:
    """E_S x in 80-bit long double (a reference 2^11 times finer than float64)."""
    y = np.asarray(x, dtype=np.longdouble)
    for axis in range(y.ndim):
        n = y.shape[axis]
        k = np.arange(1, n, dtype=np.longdouble)
        e = np.zeros((n - 1, n), dtype=np.longdouble)
        for r in range(n - 1):
            e[r, : r + 1] = 1 / np.sqrt(k[r] * (k[r] + 1))
            e[r, r + 1] = -k[r] / np.sqrt(k[r] * (k[r] + 1))
        y = np.moveaxis(np.tensordot(e, y, axes=([1], [axis])), 0, axis)
    return y.reshape(-1)


@pytest.mark.parametrize("per_cell", [10**9, 10**12])
@pytest.mark.parametrize("sizes", [(10, 10), (3, 4, 5), (7,)])
def test_the_charged_sensitivity_covers_the_measured_rounding(per_cell, sizes):
    """The issue's measurement: neighbours of a histogram with ``per_cell`` rows in every cell; the
    computed release moves by more than the ideal √p_S (ρ excess ~2e-7 at 1e9 per cell, ~2e-4 at 1e12)."""
    cells = int(np.prod(sizes))
    x = np.full(sizes, per_cell, dtype=np.int64)
    n_rows = per_cell * cells
    ideal = mz.l2_sensitivity(sizes)
    charged = mz.charged_sensitivity(sizes, 1, n_rows)
    eta = mz.rounding_eta(sizes)
    base = mz.residual(x)
    assert np.linalg.norm(base - _exact_residual(x).astype(np.float64)) <= float(eta) * n_rows * ideal
    worst = 0.0
    rng = np.random.default_rng(2)
    for j in rng.choice(cells, min(cells, 40), replace=False):
        other = x.copy().reshape(-1)
        other[j] -= 1
        moved = np.linalg.norm(base - mz.residual(other.reshape(sizes)))
        worst = max(worst, moved)
        assert moved <= charged, (j, moved, charged)
    excess = worst**2 / ideal**2 - 1
    charged_excess = charged**2 / ideal**2 - 1
    assert charged_excess >= excess and charged_excess > 0


@pytest.mark.slow  # OpenDP's maps
def test_the_plan_charges_the_rounding_and_the_sampler_map_stays_within_the_plan():
    pl = plan(domains=[10, 10, 3], workload=[(0, 1), (1, 2)], rho=0.5, rows_bound=10**11)
    exact = plan(domains=[10, 10, 3], workload=[(0, 1), (1, 2)], rho=0.5)
    assert np.all(pl.sigma2 >= exact.sigma2) and np.any(pl.sigma2 > exact.sigma2)
    assert pl.sigma2[0] / exact.sigma2[0] < 1 + 1e-2  # a small price
    for k in range(pl.num_residuals):
        sizes = [int(pl.domains[a]) for a in pl.residual(k)]
        d_in = mz.charged_sensitivity(sizes, 1, 10**11)
        cost = mz.privacy_map(int(pl.noise_count[k]), math.sqrt(float(pl.sigma2[k])), d_in)
        assert cost <= float(pl.rho_s[k]) * (1 + mz.MAP_RTOL)
    assert mz.charged_sensitivity([], 1, 10**11) == 1.0  # the total is exact
    assert mz.rounding_eta([10]) == Fraction(12, 2**53 - 12)


# --- the ledger bound to the data ---------------------------------------------------------------------------


def _identity(root: str, name: str, body: bytes) -> dict:
    uri = join(root, name)
    store.put(uri, body)
    return data.identify(uri, "csv", store.pin(uri))


def test_identify_fingerprints_the_bytes_and_bounds_csv_rows(tmp_path):
    root = f"file://{tmp_path}"
    a = _identity(root, "a.csv", b"x,y\r\n1,2\r\n3,4\r\n")
    b = _identity(root, "copy/b.csv", b"x,y\r\n1,2\r\n3,4\r\n")
    c = _identity(root, "c.csv", b"x,y\n1,2\n3,5")
    assert a["fingerprint"] == b["fingerprint"] != c["fingerprint"]
    assert a["fingerprint"].startswith("sha256:") and a["uri"] != b["uri"]
    assert a["rows_at_most"] == 2 and c["rows_at_most"] == 2  # line breaks bound the rows


def test_a_second_id_for_the_same_data_is_refused_and_one_id_for_other_data_too(tmp_path):
    root = f"file://{tmp_path}"
    first = _identity(root, "a.csv", b"x\n1\n2\n")
    copy = _identity(root, "elsewhere/a-copy.csv", b"x\n1\n2\n")
    other = _identity(root, "b.csv", b"x\n1\n3\n")
    ledger.reserve(root, "people", "j1", 0.1, 1.0, identity=first)
    ledger.reserve(root, "people", "j2", 0.1, identity=copy)  # the same bytes elsewhere: the same dataset
    with pytest.raises(SpecError, match="already registered under dataset_id 'people'") as err:
        ledger.reserve(root, "people-again", "j3", 0.1, 1.0, identity=copy)
    assert first["fingerprint"].split(":")[1] not in str(err.value)
    assert not store.list_uris(join(root, "ledger", "people-again") + "/")  # nothing opened
    with pytest.raises(SpecError, match="bound to other content") as err:
        ledger.reserve(root, "people", "j4", 0.1, identity=other)
    assert "dataset_version" in str(err.value) and other["fingerprint"][7:] not in str(err.value)
    # a deliberately new version: bound in the same ledger, sharing its budget
    summary = ledger.reserve(root, "people", "j5", 0.1, identity=other, version="2026-12")
    assert summary["versions"] == [None, "2026-12"] and summary["committed_rho"] == pytest.approx(0.3)
    ledger.reserve(root, "people", "j6", 0.1, identity=other, version="2026-12")  # bound: fine
    with pytest.raises(SpecError, match="already version '2026-12'"):
        ledger.reserve(root, "people", "j7", 0.1, identity=other, version="2027-01")
    with pytest.raises(SpecError, match="bound to other content"):
        ledger.reserve(root, "people", "j8", 0.1, identity=first, version="2026-12")
    types = [e["type"] for e in ledger.read(root, "people").entries]
    assert types == ["open", "reserve", "reserve", "bind", "reserve", "reserve"]
    opened = ledger.read(root, "people").entries[0]
    assert opened["dataset"]["uri"] == first["uri"] and "rows_at_most" not in opened["dataset"]
    index = store.get_json(ledger.index_uri(root, other["fingerprint"]))
    assert (index["dataset_id"], index["version"]) == ("people", "2026-12")


def test_a_ledger_opened_before_binding_is_bound_by_its_next_job(tmp_path):
    root = f"file://{tmp_path}"
    ledger.reserve(root, "legacy", "j1", 0.1, 1.0)  # no identity: an old ledger
    ident = _identity(root, "a.csv", b"x\n1\n")
    ledger.reserve(root, "legacy", "j2", 0.1, identity=ident)
    assert [e["type"] for e in ledger.read(root, "legacy").entries] == ["open", "reserve", "bind", "reserve"]
    with pytest.raises(SpecError, match="'legacy'"):
        ledger.reserve(root, "another", "j3", 0.1, 1.0, identity=ident)


# --- jobs ---------------------------------------------------------------------------------------------------


def _doc(dataset: str, **over) -> dict:
    doc = {
        "kind": "dpquery",
        "dataset": dataset,
        "schema": [
            {"name": "a", "categories": [0, 1, 2]},
            {"name": "b", "categories": [0, 1]},
        ],
        "workload": [{"attributes": ["a"]}, {"attributes": ["a", "b"]}],
        "budget": {"rho": 0.25},
        "dataset_id": "visits",
        "dataset_budget_rho": 1.0,
    }
    doc.update(over)
    return doc


def _visits(root: str, name: str = "visits.csv", seed: int = 0) -> tuple[str, pa.Table]:
    rng = np.random.default_rng(seed)
    n = 300
    t = pa.table(
        {
            "visitor": [f"v{i}" for i in rng.integers(0, 20, n)],
            "a": rng.integers(0, 3, n),
            "b": rng.integers(0, 2, n),
        }
    )
    buf = io.BytesIO()
    pcsv.write_csv(t, buf)
    uri = join(root, "data", name)
    store.put(uri, buf.getvalue())
    return uri, t


def _run_core(root: str, doc: dict, *, noise: bool = True) -> tuple[str, dict]:
    spec = parse_spec(doc)
    job_id = new_job_id("dpquery")
    planned = core.prepare(spec, job_id, root)
    for item in store.get_json(planned["measure"]["uri"]):
        core.measure(spec, job_id, root, item["group"], noise=noise)
    for item in store.get_json(planned["reconstruct"]["uri"]):
        core.reconstruct(spec, job_id, root, item["group"])
    core.finalize(spec, job_id, root)
    return job_id, store.get_json(join(root, "jobs", job_id, "result.json"))


def _bounded_truth(t: pa.Table, job_id: str, k: int) -> np.ndarray:
    bound = unit.ContributionBound("visitor", k, unit.job_seed(job_id))
    (mask,) = unit.bounded_mask_all(bound, [t.column("visitor").combine_chunks()])
    x = np.zeros((3, 2), dtype=np.int64)
    np.add.at(x, (t.column("a").to_numpy()[mask], t.column("b").to_numpy()[mask]), 1)
    return x


def test_core_with_a_privacy_unit_counts_k_rows_per_person_and_reports_the_unit(tmp_path):
    root = f"file://{tmp_path}"
    uri, t = _visits(root)
    doc = _doc(uri, privacy_unit={"id_column": "visitor", "max_rows": 4})
    job_id, result = _run_core(root, doc, noise=False)
    x = _bounded_truth(t, job_id, 4)
    assert x.sum() <= 4 * 20 < t.num_rows
    est = pq.read_table(io.BytesIO(store.get(result["tables"][1]["parquet"]))).column("estimate")
    assert np.allclose(est.to_numpy().reshape(3, 2), x, atol=1e-9)
    rep = result["report"]
    assert rep["privacy_unit"] == {"unit": "person", "id_column": "visitor", "max_rows": 4}
    assert "one person" in rep["neighbouring"] and rep["sensitivity"]["rows_per_unit"] == 4
    assert rep["sensitivity"]["rows_bound"] == DEFAULT_MAX_ROWS_TOTAL
    # without a unit the report says one row, and the noise std is 4x smaller at the same budget (up to
    # the rounding charge, k + 2ηN against 1 + 2ηN)
    _, plain = _run_core(root, _doc(uri), noise=False)
    assert plain["report"]["privacy_unit"] == {"unit": "row", "max_rows": 1}
    assert rep["predicted_rmse"] == pytest.approx(4 * plain["report"]["predicted_rmse"], rel=1e-4)


def test_prepare_refuses_before_the_ledger(tmp_path, monkeypatch):
    root = f"file://{tmp_path}"
    uri, _ = _visits(root)
    with pytest.raises(DatasetError, match="'nobody'") as err:
        core.prepare(
            parse_spec(_doc(uri, privacy_unit={"id_column": "nobody", "max_rows": 2})), "dpquery-x", root
        )
    # a dataset over the row bound (here a bound of 100 stands in for 2^32: a bound a spec may not give)
    monkeypatch.setattr(DPQuerySpec, "rows_bound", lambda self: 100)
    with pytest.raises(DatasetError, match="more than 100 rows") as err:
        core.prepare(parse_spec(_doc(uri)), new_job_id("dpquery"), root)
    assert "300" not in str(err.value)  # the row count is never told
    assert not store.list_uris(join(root, "ledger") + "/")
    monkeypatch.setattr(DPQuerySpec, "rows_bound", lambda self: 300)
    _run_core(root, _doc(uri), noise=False)  # the bound holds: fine
    monkeypatch.undo()
    copy = join(root, "data", "copy.csv")
    store.put(copy, store.get(uri))
    with pytest.raises(SpecError, match="already registered under dataset_id 'visits'"):
        core.prepare(parse_spec(_doc(copy, dataset_id="visits-2")), new_job_id("dpquery"), root)
    other, _ = _visits(root, "other.csv", seed=1)
    with pytest.raises(SpecError, match="bound to other content"):
        core.prepare(parse_spec(_doc(other)), new_job_id("dpquery"), root)
    _run_core(root, _doc(other, dataset_version="v2"), noise=False)
    state = ledger.read(root, "visits")
    assert list(state.bindings) == [None, "v2"] and len(state.reserved) == 2


def _thread_mode_workflows():
    wf = WORKFLOWS["dpquery"]
    steps = []
    for step in wf.steps:
        if isinstance(step, Map):
            body = tuple(
                dataclasses.replace(t, mode="thread") if isinstance(t, Task) else t for t in step.body
            )
            step = dataclasses.replace(step, body=body)
        steps.append(step)
    return {"dpquery": dataclasses.replace(wf, steps=tuple(steps))}


def test_a_job_with_a_privacy_unit_on_the_local_executor(tmp_path):
    root = f"file://{tmp_path}"
    uri, _ = _visits(root)
    doc = _doc(uri, privacy_unit={"id_column": "visitor", "max_rows": 2})
    spec = parse_spec(doc)
    job_id = new_job_id("dpquery")
    spec_uri = join(root, "jobs", job_id, "spec.json")
    store.put_json(spec_uri, spec.model_dump(mode="json", exclude_none=True))
    with LocalExecutor(store_root=root, workflows=_thread_mode_workflows(), retry_delay_scale=0) as ex:
        ex.start(job_id, "dpquery", spec_uri)
        status = ex.wait(job_id, timeout_s=180)
        assert status.state == "SUCCEEDED", status.error
    result = store.get_json(join(root, "jobs", job_id, "result.json"))
    rep = result["report"]
    assert rep["privacy_unit"]["max_rows"] == 2 and rep["sensitivity"]["rows_bound"] == DEFAULT_MAX_ROWS_TOTAL
    assert rep["rho_planned"] * (1 - 1e-12) <= rep["rho_spent"] <= rep["rho_budget"] == 0.25
    opened = ledger.read(root, "visits").entries[0]
    assert opened["dataset"]["fingerprint"].startswith("sha256:")
    # the content hash never leaves the ledger, and the ledger holds no size
    assert opened["dataset"]["fingerprint"][7:] not in json.dumps(result)
    assert set(opened["dataset"]) == {"uri", "fingerprint"}


def test_rows_without_an_id_are_never_counted_and_never_fail():
    """A null or empty id names no person: the row is left out (as ``drop`` leaves out an out-of-domain
    value), and whether or how many there are never shows as an error."""
    b = unit.ContributionBound("pid", 2, unit.job_seed("j"))
    batches = [pa.array(["a", None, "a", ""]), pa.array(["a", "b", None])]
    masks = unit.bounded_mask_all(b, batches)
    assert [m.tolist() for m in masks][0][1] is False and masks[0][3] == False  # noqa: E712
    assert masks[1][2] == False  # noqa: E712
    assert sum(int(m.sum()) for m in masks) == 3  # two of a's three rows, b's one row
    with pytest.raises(DatasetError, match="changed while it was read"):
        b2 = unit.ContributionBound("pid", 2, unit.job_seed("j"))
        for x in batches:
            b2.count(x)
        b2.finish()
        b2.keep(pa.array(["zz"]))
