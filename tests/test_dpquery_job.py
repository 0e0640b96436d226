"""The dpquery job end to end: the pure core (exact with the noise seam, a retried measure task reusing its
measurement, bad inputs refused before any budget is spent, the ledger refusing over-budget jobs, also
racing ones) and the workflow on both executors (local and compiled ASL on moto's interpreter)."""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardfold.client import Client
from shardfold.functions import ledger, store
from shardfold.functions.dpquery import core, handlers
from shardfold.functions.dpquery import measure as mz
from shardfold.functions.errors import BudgetExceeded, DatasetError, SpecError
from shardfold.functions.jobs import new_job_id
from shardfold.functions.kinds import WORKFLOWS
from shardfold.functions.specs import parse_spec
from shardfold.functions.store.uri import join
from shardfold.functions.workflow import Map, Task
from shardfold.orchestrator.local import LocalExecutor

WAIT_S = 180  # a deadline, not a timing assumption
SIZES = [2, 3, 4]


@pytest.fixture(scope="module")
def moto_client(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDFOLD_HOME", str(tmp_path_factory.mktemp("moto-home")))
        with Client(backend="moto") as c:
            yield c


def make_dataset(
    root: str, rows: int = 4000, seed: int = 0, name: str = "people.parquet"
) -> tuple[str, np.ndarray]:
    """A Parquet dataset in the store (sex: categories, region: integer codes, age: a binned range) and the
    domain index of every row (to compute the true marginals)."""
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.integers(0, n, rows) for n in SIZES])
    age = 20 + 10 * idx[2] + rng.integers(0, 10, rows)
    t = pa.table(
        {
            "sex": np.array(["f", "m"])[idx[0]],
            "region": idx[1] + 1,
            "age": age,
            "id": np.arange(rows),
            "tags": pa.array([[int(i)] for i in idx[0]]),  # a list column: no attribute can use it
        }
    )
    buf = io.BytesIO()
    pq.write_table(t, buf)
    uri = join(root, "data", name)
    store.put(uri, buf.getvalue())
    return uri, idx


def spec_doc(dataset: str, **over) -> dict:
    doc = {
        "kind": "dpquery",
        "dataset": dataset,
        "schema": [
            {"name": "sex", "categories": ["f", "m"]},
            {"name": "region", "categories": [1, 2, 3]},
            {"name": "age", "range": [20, 59], "bin_width": 10},
        ],
        "workload": [
            {"attributes": ["sex"]},
            {"attributes": ["sex", "region"]},
            {"attributes": ["region", "age"]},
        ],
        "budget": {"rho": 0.5},
        "dataset_id": "people",
        "dataset_budget_rho": 1.0,
        "noise_samples_per_task": 4,  # several measure tasks even for 15 samples
        "cells_per_task": 30,
    }
    doc.update(over)
    return doc


def truth(idx: np.ndarray, names: list[str]) -> np.ndarray:
    order = ["sex", "region", "age"]
    attrs = tuple(order.index(n) for n in names)
    full = np.zeros(SIZES, dtype=np.int64)
    np.add.at(full, tuple(idx), 1)
    drop = tuple(i for i in range(3) if i not in attrs)
    return full.sum(axis=drop) if drop else full


def submit(executor, root: str, doc: dict) -> str:
    """Record a spec and start the job (what Client.submit does, minus the plan estimate)."""
    spec = parse_spec(doc)
    job_id = new_job_id("dpquery")
    spec_uri = join(root, "jobs", job_id, "spec.json")
    store.put_json(spec_uri, spec.model_dump(mode="json", exclude_none=True))
    executor.start(job_id, "dpquery", spec_uri)
    return job_id


def finished(executor, root: str, doc: dict) -> dict:
    """Submit ``doc`` to ``executor``, wait for it to succeed and return its result."""
    job_id = submit(executor, root, doc)
    status = executor.wait(job_id, timeout_s=WAIT_S)
    assert status.state == "SUCCEEDED", status.error
    return store.get_json(join(root, "jobs", job_id, "result.json"))


def on_both_executors(moto_client, tmp_path, doc: dict) -> tuple[dict, dict]:
    """``doc`` run to success on moto (its ASL interpreter over S3) and on the local executor over a local
    store, its tasks on threads so that a patched core (the noise seam) reaches them: the two results."""
    on_moto = finished(moto_client.executor, moto_client.store_root, doc)
    root = f"file://{tmp_path}/local"
    with LocalExecutor(store_root=root, workflows=thread_mode_workflows(), retry_delay_scale=0) as ex:
        return on_moto, finished(ex, root, doc)


def run_core(root: str, doc: dict, *, noise: bool = True) -> tuple[str, dict]:
    """Every stage of a job through the pure core, in order; returns the job id and its result."""
    spec = parse_spec(doc)
    job_id = new_job_id("dpquery")
    planned = core.prepare(spec, job_id, root)
    for item in store.get_json(planned["measure"]["uri"]):
        core.measure(spec, job_id, root, item["group"], noise=noise)
    for item in store.get_json(planned["reconstruct"]["uri"]):
        core.reconstruct(spec, job_id, root, item["group"])
    core.finalize(spec, job_id, root)
    return job_id, store.get_json(join(root, "jobs", job_id, "result.json"))


def read_table(uri: str) -> pa.Table:
    return pq.read_table(io.BytesIO(store.get(uri)))


def assert_exact(result: dict, idx: np.ndarray) -> None:
    assert [t["attributes"] for t in result["tables"]] == [["sex"], ["sex", "region"], ["region", "age"]]
    for t in result["tables"]:
        tbl = read_table(t["parquet"])
        est = tbl.column("estimate").to_numpy().reshape(truth(idx, t["attributes"]).shape)
        assert np.max(np.abs(est - truth(idx, t["attributes"]))) < 1e-9
        assert json.loads(tbl.schema.metadata[b"attributes"]) == t["attributes"]
    # every row's labels name the cell its estimate belongs to
    labels = {"sex": ["f", "m"], "region": [1, 2, 3], "age": ["20..29", "30..39", "40..49", "50..59"]}
    t = result["tables"][2]
    x = truth(idx, t["attributes"])
    for row in read_table(t["parquet"]).to_pylist():
        cell = tuple(labels[a].index(row[a]) for a in t["attributes"])
        assert abs(row["estimate"] - x[cell]) < 1e-9
    first = store.get_json(result["tables"][1]["json"])
    assert first["columns"] == ["sex", "region", "estimate"]
    assert first["rows"][0][:2] == ["f", 1] and first["rows"][-1][:2] == ["m", 3]
    ages = read_table(result["tables"][2]["parquet"]).column("age").to_pylist()
    assert ages[:4] == ["20..29", "30..39", "40..49", "50..59"]
    assert result["report"]["rho_spent"] == 0.0 and result["report"]["samplers"] == [mz.NO_NOISE_SAMPLER]


def numbers(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from numbers(v)
    elif isinstance(node, list):
        for v in node:
            yield from numbers(v)
    elif isinstance(node, int | float) and not isinstance(node, bool):
        yield node


def ledger_types(root: str, dataset_id: str = "people") -> list[str]:
    return [e["type"] for e in ledger.read(root, dataset_id).entries]


# --- the pure core ------------------------------------------------------------------------------------------


def test_core_is_exact_with_the_noise_seam(tmp_path):
    root = f"file://{tmp_path}"
    dataset, idx = make_dataset(root)
    job_id, result = run_core(root, spec_doc(dataset), noise=False)
    assert_exact(result, idx)
    report = result["report"]
    assert report["residual_sets"] == 6 and report["noise_samples"] == 15 and report["measure_tasks"] >= 3
    # the reference case, plus the charge for the transform's rounding at the default row bound (~2e-5)
    assert math.isclose(report["predicted_sse"], 37.1746, rel_tol=5e-5)
    assert [t["variance"] for t in result["tables"]] == pytest.approx([3.6269, 1.9102, 1.5383], abs=1e-4)
    assert ledger_types(root) == ["open", "reserve", "spend"]
    # the result holds no true count: the row count appears nowhere among its numbers
    assert len(idx[0]) not in set(numbers(result))


def test_noisy_job_reports_the_sampler_map_and_charges_the_ledger_once(tmp_path):
    root = f"file://{tmp_path}"
    dataset, _ = make_dataset(root)
    job_id, result = run_core(root, spec_doc(dataset))
    report = result["report"]
    assert report["samplers"] == [mz.sampler_id()] and "opendp 0.16" in report["samplers"][0]
    assert report["rho_planned"] * (1 - 1e-12) <= report["rho_spent"] <= report["rho_budget"] == 0.5
    assert report["epsilon_gaussian"] < report["epsilon_cks"] < report["epsilon_simple"]
    state = ledger.read(root, "people")
    assert [e["type"] for e in state.entries] == ["open", "reserve", "spend"]
    assert state.spent[job_id] == report["rho_spent"] and state.reserved[job_id] == 0.5
    core.finalize(parse_spec(spec_doc(dataset)), job_id, root)  # a retried finalize
    assert ledger_types(root) == ["open", "reserve", "spend"]


def test_a_retried_measure_task_reuses_its_measurement(tmp_path, monkeypatch):
    root = f"file://{tmp_path}"
    dataset, _ = make_dataset(root)
    spec = parse_spec(spec_doc(dataset))
    job_id = new_job_id("dpquery")
    core.prepare(spec, job_id, root)
    first = core.measure(spec, job_id, root, 1)
    uri = core.measurement_uri(root, job_id, 1)
    blob = store.get(uri)
    assert first["reused"] is False

    def no_draw(*a, **k):
        raise AssertionError("a retried task drew fresh noise")

    with monkeypatch.context() as m:
        m.setattr(mz, "release", no_draw)
        again = core.measure(spec, job_id, root, 1)
    assert again["reused"] is True and again["rho"] == first["rho"]
    assert store.get(uri) == blob

    # a duplicate attempt that did not see the object before drawing: its draw is discarded, never written
    real_exists = store.exists
    with monkeypatch.context() as m:
        m.setattr(core.store, "exists", lambda u: False if u == uri else real_exists(u))
        dup = core.measure(spec, job_id, root, 1)
    assert dup["reused"] is True and store.get(uri) == blob


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"schema": [{"name": "height", "range": [0, 3]}]}, DatasetError, ["no column 'height'"]),
        ({"schema": [{"name": "tags", "categories": ["a", "b"]}]}, DatasetError, ["'tags'", "has type list"]),
        ({"workload": [{"attributes": ["sex", "income"]}]}, SpecError, ["unknown attribute 'income'"]),
        ({"workload": []}, SpecError, ["workload is empty"]),
        ({"budget": {"rho": 0}}, SpecError, ["budget.rho"]),
        ({"budget": {"rho": -1.0}}, SpecError, ["budget.rho"]),
        ({"budget": {"epsilon": 1.0, "delta": 1.0}}, SpecError, ["budget.delta"]),
        ({"budget": {"epsilon": 1.0, "delta": 0.0}}, SpecError, ["budget.delta"]),
    ],
)
def test_bad_input_fails_before_any_budget_is_spent(tmp_path, change, error, words):
    root = f"file://{tmp_path}"
    dataset, idx = make_dataset(root)
    doc = spec_doc(dataset)
    if "schema" in change:  # replace one attribute, keep the others
        doc["schema"] = change["schema"] + doc["schema"][1:]
        doc["workload"] = [{"attributes": [change["schema"][0]["name"]]}]
    else:
        doc.update(change)
    # the spec goes to the store unvalidated, as a bucket drop would; the plan handler validates it
    job_id = new_job_id("dpquery")
    spec_uri = join(root, "jobs", job_id, "spec.json")
    store.put_json(spec_uri, doc)
    with pytest.raises(error) as err:
        handlers.prepare({"job_id": job_id, "spec_uri": spec_uri, "store_root": root})
    for w in words:
        assert w in str(err.value)
    assert ledger_types(root) == []  # no reservation, no ledger at all
    assert not store.exists(core.plan_uri(root, job_id))


def test_an_over_budget_job_is_refused_before_measuring(tmp_path):
    root = f"file://{tmp_path}"
    dataset, _ = make_dataset(root)
    run_core(root, spec_doc(dataset, budget={"rho": 0.6}))
    spec = parse_spec(spec_doc(dataset, budget={"rho": 0.6}, dataset_budget_rho=None))
    job_id = new_job_id("dpquery")
    with pytest.raises(BudgetExceeded, match="exceeds the remaining budget"):
        core.prepare(spec, job_id, root)
    assert not store.list_uris(join(root, "jobs", job_id) + "/")
    assert ledger_types(root) == ["open", "reserve", "spend"]
    # an (epsilon, delta) budget is charged as its CKS rho
    small = parse_spec(spec_doc(dataset, budget={"epsilon": 1.0, "delta": 1e-9}, dataset_budget_rho=None))
    _, result = run_core(root, small.model_dump(mode="json", exclude_none=True))
    assert result["report"]["rho_budget"] == pytest.approx(0.014973, abs=1e-6)


def test_racing_jobs_never_overdraw_the_ledger(tmp_path):
    root = f"file://{tmp_path}"
    dataset, _ = make_dataset(root)
    ledger.reserve(root, "people", "seed-job", 0.1, total_rho=1.0)
    barrier = threading.Barrier(6)
    outcomes: list[str] = []

    def plan_one() -> None:
        spec = parse_spec(spec_doc(dataset, budget={"rho": 0.3}, dataset_budget_rho=None))
        barrier.wait()
        try:
            core.prepare(spec, new_job_id("dpquery"), root)
            outcomes.append("planned")
        except BudgetExceeded:
            outcomes.append("refused")

    threads = [threading.Thread(target=plan_one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["planned"] * 3 + ["refused"] * 3
    state = ledger.read(root, "people")
    assert len(state.reserved) == 4 and state.committed() == pytest.approx(1.0) and state.committed() <= 1.0


# --- both executors ----------------------------------------------------------------------------------------


def thread_mode_workflows():
    """The dpquery workflow with measure on threads, so an in-process patch (the noise seam) reaches it."""
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


def no_noise(monkeypatch):
    monkeypatch.setattr(core, "measure", functools.partial(core.measure, noise=False))


@pytest.mark.slow
def test_local_and_moto_executors_agree(moto_client, tmp_path, monkeypatch):
    """Noise on: both backends produce the same tables (names, labels, cells, variances), the same ρ spent
    (the maps are deterministic) and charge their ledger once."""
    bucket = moto_client.store_root
    dataset, _ = make_dataset(bucket)
    doc = spec_doc(dataset, dataset_id="people-noisy")
    moto_job = submit(moto_client.executor, bucket, doc)
    status = moto_client.executor.wait(moto_job, timeout_s=WAIT_S)
    assert status.state == "SUCCEEDED", status.error
    on_moto = store.get_json(join(bucket, "jobs", moto_job, "result.json"))

    root = f"file://{tmp_path}/local"
    with LocalExecutor(store_root=root, processes=2, retry_delay_scale=0) as ex:  # measure in processes
        local_job = submit(ex, root, doc)  # the dataset stays in the moto bucket
        status = ex.wait(local_job, timeout_s=WAIT_S)
        assert status.state == "SUCCEEDED", status.error
        assert ex.max_state_bytes(local_job) < 8 * 1024
    on_local = store.get_json(join(root, "jobs", local_job, "result.json"))

    for key in ("rho_spent", "residual_sets", "noise_samples", "predicted_rmse", "epsilon_cks", "samplers"):
        assert on_moto["report"][key] == on_local["report"][key], key
    assert on_moto["report"]["samplers"] == [mz.sampler_id()]
    for a, b in zip(on_moto["tables"], on_local["tables"], strict=True):
        assert (a["attributes"], a["cells"], a["variance"]) == (b["attributes"], b["cells"], b["variance"])
        ta, tb = read_table(a["parquet"]), read_table(b["parquet"])
        assert ta.schema.names == tb.schema.names and ta.num_rows == tb.num_rows
        for name in a["attributes"]:
            assert ta.column(name).equals(tb.column(name))
    assert ledger_types(bucket, "people-noisy") == ["open", "reserve", "spend"]
    assert ledger_types(root, "people-noisy") == ["open", "reserve", "spend"]


@pytest.mark.slow
def test_both_executors_are_exact_with_the_noise_seam(moto_client, tmp_path, monkeypatch):
    """The seam is a keyword of the core that handlers never pass; the test patches the core in-process,
    which reaches moto's in-process Lambda dispatch and the local executor's threads."""
    no_noise(monkeypatch)
    bucket = moto_client.store_root
    dataset, idx = make_dataset(bucket, seed=5, name="exact.parquet")
    doc = spec_doc(dataset, dataset_id="people-exact")
    for result in on_both_executors(moto_client, tmp_path, doc):
        assert_exact(result, idx)


@pytest.mark.slow
def test_a_dataset_that_cannot_hold_the_schema_fails_on_moto_without_touching_the_ledger(moto_client):
    """A column whose declared type cannot hold the attribute (a fact of the file's schema, not of its rows)
    fails the job before the ledger is touched; values outside the domain never do (they are dropped)."""
    bucket = moto_client.store_root
    dataset, _ = make_dataset(bucket, name="short.parquet")
    doc = spec_doc(dataset, dataset_id="people-bad")
    doc["schema"][2] = {"name": "tags", "range": [0, 9]}
    doc["workload"] = [{"attributes": ["tags"]}]
    job = submit(moto_client.executor, bucket, doc)
    status = moto_client.executor.wait(job, timeout_s=WAIT_S)
    assert status.state == "FAILED"
    assert "DatasetError" in status.error and "'tags'" in status.error
    assert ledger_types(bucket, "people-bad") == []


def test_a_dataset_replaced_after_the_plan_fails_measure_naming_it(tmp_path):
    """The same bytes written again (a new file: same size, new inode and mtime) after the plan: a size
    check alone passed it; the pin refuses it, before anything is measured."""
    from shardfold.functions.errors import InputChanged

    root = f"file://{tmp_path}"
    dataset, _ = make_dataset(root)
    spec = parse_spec(spec_doc(dataset))
    job_id = new_job_id("dpquery")
    core.prepare(spec, job_id, root)
    core.measure(spec, job_id, root, 0)  # unchanged: measured
    store.put(dataset, store.get(dataset))
    with pytest.raises(InputChanged, match=f"{dataset} changed since the job was planned"):
        core.measure(spec, job_id, root, 1)
    assert not store.exists(core.measurement_uri(root, job_id, 1))
