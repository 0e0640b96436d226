"""The user's side of dpquery: ``client.dpquery`` (plan without data, run, tables/arrays, budget), the
``shardfold plan`` estimator and its privacy/accuracy tables, the shipped example on the CLI, and the demo's
data generator. The job itself on both executors is tested in tests/test_dpquery_job.py."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner

from shardfold.client import Client
from shardfold.client.cli import cli
from shardfold.client.demo import PEOPLE_SCHEMA, people_csv, synthetic_people
from shardfold.client.dpquery import table_to_array
from shardfold.client.errors import JobFailed
from shardfold.functions import store
from shardfold.functions.dpquery import core
from shardfold.functions.dpquery.spec import TOTAL_NAME, marginal_name
from shardfold.functions.errors import ShardfoldError, SpecError
from shardfold.functions.estimate import estimate
from shardfold.functions.kinds import WORKFLOWS
from shardfold.functions.privacy import cdp_rho
from shardfold.functions.specs import parse_spec
from shardfold.functions.store.uri import join
from shardfold.functions.workflow import Map, Task
from shardfold.orchestrator.local import LocalExecutor

REPO = Path(__file__).resolve().parent.parent
EVENTS = REPO / "events"
WAIT_S = 180  # a deadline, not a timing assumption
SEX, REGION, AGE = ["f", "m"], [1, 2, 3], [20, 59]
AGE_LABELS = ["20..29", "30..39", "40..49", "50..59"]


@pytest.fixture
def home(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("SHARDFOLD_BACKEND", raising=False)
    return f"file://{tmp_path}/home"


@pytest.fixture
def client(home):
    with Client() as c:
        yield c


def invoke(*args: str, ok: bool = True):
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def spec_doc(dataset: str, **over) -> dict:
    doc = {
        "kind": "dpquery",
        "dataset": dataset,
        "schema": [
            {"name": "sex", "categories": SEX},
            {"name": "region", "categories": REGION},
            {"name": "age", "range": AGE, "bin_width": 10},
            {"name": "member", "categories": [True, False]},
        ],
        "workload": [
            {"attributes": ["sex"]},
            {"attributes": ["region", "sex"]},  # output axes follow the schema: (sex, region)
            {"attributes": ["region", "age"]},
            {"attributes": []},
            {"attributes": ["member", "sex"]},
        ],
        "budget": {"rho": 0.5},
        "dataset_id": "people",
        "dataset_budget_rho": 2.0,
    }
    doc.update(over)
    return doc


def write_dataset(root: str, rows: int = 3000, seed: int = 0) -> tuple[str, np.ndarray]:
    """A CSV in the store with skewed counts (so a mislabelled cell is far off) and every row's indices."""
    rng = np.random.default_rng(seed)
    idx = np.stack(
        [
            rng.choice(2, rows, p=[0.8, 0.2]),
            rng.choice(3, rows, p=[0.6, 0.3, 0.1]),
            rng.choice(4, rows, p=[0.5, 0.25, 0.15, 0.1]),
            rng.choice(2, rows, p=[0.3, 0.7]),
        ]
    )
    age = 20 + 10 * idx[2] + rng.integers(0, 10, rows)
    lines = ["id,sex,region,age,member"]  # an extra column the schema does not name: never read
    for i in range(rows):
        member = ["true", "False"][idx[3, i]]  # booleans match in any case
        lines.append(f"{i},{SEX[idx[0, i]]},{REGION[idx[1, i]]},{age[i]},{member}")
    uri = join(root, "data", "people.csv")
    store.put(uri, ("\n".join(lines) + "\n").encode())
    return uri, idx


def truth(idx: np.ndarray, attrs: list[int]) -> np.ndarray:
    shape = [[2, 3, 4, 2][a] for a in attrs]
    if not attrs:
        return np.array(float(idx.shape[1]))
    flat = np.ravel_multi_index(tuple(idx[a] for a in attrs), shape)
    return np.bincount(flat, minlength=math.prod(shape)).reshape(shape).astype(float)


ATTRS = {"sex": 0, "region": 1, "age": 2, "member": 3}


def thread_mode(client: Client) -> None:
    """Run the client's dpquery jobs with measure on threads, so an in-process patch (the core's noise
    seam, which no handler or spec can reach) applies to them."""
    wf = WORKFLOWS["dpquery"]
    steps = []
    for step in wf.steps:
        if isinstance(step, Map):
            body = tuple(
                dataclasses.replace(t, mode="thread") if isinstance(t, Task) else t for t in step.body
            )
            step = dataclasses.replace(step, body=body)
        steps.append(step)
    client.executor.close()
    client.executor = LocalExecutor(
        store_root=client.store_root,
        workflows={"dpquery": dataclasses.replace(wf, steps=tuple(steps))},
        retry_delay_scale=0,
    )


# --- plan: no data ------------------------------------------------------------------------------------------


def test_plan_reads_no_data_and_matches_the_reference(client, monkeypatch):
    """client.dpquery.plan needs only the spec: the dataset may not exist, and the store is never touched.
    Domains [2, 3, 4], W = {(0), (0,1), (1,2)}, 2ρ = 1: the reference's regression numbers."""

    def no_store(*a, **k):
        raise AssertionError("client.dpquery.plan touched the store")

    for name in ("get", "get_json", "size", "exists", "list_uris", "put", "put_json", "get_batch"):
        monkeypatch.setattr(store, name, no_store)
    doc = spec_doc(
        "data/missing.csv",
        schema=spec_doc("")["schema"][:3],
        workload=[
            {"attributes": ["sex"]},
            {"attributes": ["sex", "region"]},
            {"attributes": ["region", "age"]},
        ],
    )
    pl = client.dpquery.plan(doc)
    assert pl.var.tolist() == pytest.approx([3.6269, 1.9102, 1.5383], abs=1e-4)
    # + the charge for the transform's rounding at the default row bound (~2e-5 relative)
    assert pl.sse == pytest.approx(37.1746, rel=5e-5) and pl.num_residuals == 6
    summary = pl.summary()
    assert summary["privacy"]["rho"] == 0.5 and summary["rmse"] == pytest.approx(
        math.sqrt(37.1746 / 20), 1e-5
    )
    rep = pl.privacy_report()
    assert rep["epsilon_gaussian"] < rep["epsilon_cks"] < rep["epsilon_simple"]
    predicted = client.dpquery.predicted(doc)
    assert list(predicted) == ["sex", "sex,region", "region,age"]
    assert predicted["sex,region"]["cells"] == 6
    assert predicted["region,age"]["std_error"] == pytest.approx(math.sqrt(1.5383), abs=1e-4)


def test_plan_resolves_the_example_dataset_next_to_its_spec(client):
    spec = client.dpquery.spec(EVENTS / "dpquery.json")
    assert spec.dataset == (EVENTS / "data" / "dpquery" / "people.csv").as_uri()
    assert spec.rho() == pytest.approx(cdp_rho(1.0, 1e-6))
    with pytest.raises(SpecError, match="needs a 'dpquery' spec"):
        client.dpquery.plan(EVENTS / "getbatch.json")


def test_estimator_counts_tasks_and_reports_privacy(client):
    doc = spec_doc("data/missing.csv", noise_samples_per_task=4, cells_per_task=10)
    report = estimate(parse_spec(doc), client.store_root).check()
    pl = client.dpquery.plan(doc)
    steps = {s.name: s for s in report.steps}
    assert steps["measure_group"].tasks == len(pl.residual_groups(4)) > 1
    assert steps["reconstruct_group"].tasks == len(pl.marginal_groups(10)) > 1
    assert all(s.fits for s in report.steps) and report.cost_usd["total"] > 0
    # one measurement per measure task; a Parquet and a JSON table per marginal, one list per reconstruct task
    assert steps["measure_group"].puts == steps["measure_group"].tasks
    assert steps["reconstruct_group"].puts == 2 * pl.num_marginals + steps["reconstruct_group"].tasks
    privacy, marginals = report.details
    rows = dict(privacy.rows)
    assert rows["ρ (zCDP)"].startswith("0.5 (zCDP, as given)")
    assert rows["ε at δ = 1e-09, CKS"].startswith(f"{pl.privacy_report()['epsilon_cks']:.6g}")
    assert rows["workload RMSE (per cell)"].startswith(f"{pl.rmse:.6g}")
    assert "this job opens the ledger" in rows["dataset budget ρ"]
    assert [r[0] for r in marginals.rows] == ["sex", "sex,region", "region,age", TOTAL_NAME, "sex,member"]
    assert [r[3] for r in marginals.rows] == pytest.approx(pl.var.tolist())
    assert any("the job will fail at its prepare step" in n for n in report.notes)  # the dataset is missing


def test_estimator_shows_the_largest_variances_of_a_big_workload(client):
    doc = {
        "kind": "dpquery",
        "dataset": "data/x.parquet",
        "schema": [{"name": f"a{i}", "range": [0, 9]} for i in range(12)],
        "workload": {"all_marginals_up_to": 2},
        "budget": {"epsilon": 1.0, "delta": 1e-6},
        "dataset_id": "wide",
        "dataset_budget_rho": 1.0,
    }
    report = estimate(parse_spec(doc), client.store_root).check()
    title, rows = report.details[1].title, report.details[1].rows
    assert "the 20 of 79 marginals with the largest per-cell variance" in title
    assert rows[0][0] == TOTAL_NAME and len(rows) == 20  # the total count is the noisiest here
    assert [r[3] for r in rows] == sorted((r[3] for r in rows), reverse=True)
    assert dict(report.details[0].rows)["ρ (zCDP)"].startswith(f"{cdp_rho(1.0, 1e-6):.6g} (from ε 1, δ 1e-06")


def test_plan_cli_prints_the_privacy_and_accuracy_plan(home, tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec_doc("./nowhere/people.csv")))
    out = invoke("plan", str(path)).output
    for words in ("measure_group", "privacy and accuracy plan", "ε at δ = 1e-09, CKS", "exact Gaussian"):
        assert words in out
    assert "workload RMSE (per cell)" in out and "predicted error per marginal" in out
    assert "sex,region" in out and "the job will fail at its prepare step" in out
    as_json = json.loads(invoke("plan", str(path), "--json").output)
    assert [d["title"] for d in as_json["details"]][0] == "privacy and accuracy plan"


# --- run, tables, arrays, budget ----------------------------------------------------------------------------


@pytest.mark.slow
def test_run_is_exact_with_the_noise_seam_and_loads_as_tables_and_arrays(client, monkeypatch):
    thread_mode(client)
    monkeypatch.setattr(core, "measure", functools.partial(core.measure, noise=False))
    dataset, idx = write_dataset(client.store_root)
    result = client.dpquery.run(spec_doc("data/people.csv", cells_per_task=8, noise_samples_per_task=5))
    assert result["report"]["rho_spent"] == 0.0  # the seam: no noise drawn, nothing spent

    tables = client.dpquery.tables(result)
    assert list(tables) == ["sex", "sex,region", "region,age", TOTAL_NAME, "sex,member"]
    t = tables["sex,region"]
    assert t.column_names == ["sex", "region", "estimate", "std_error", "variance"]
    assert t.column("sex").to_pylist() == ["f"] * 3 + ["m"] * 3 and t.column("region").type == pa.int64()
    meta = t.schema.metadata
    assert float(meta[b"variance"]) == pytest.approx(result["tables"][1]["variance"])
    assert tables["region,age"].column("age").to_pylist()[:4] == AGE_LABELS
    assert tables["region,age"].column_names[:4] == ["region", "age", "age_lo", "age_hi"]

    arrays = client.dpquery.arrays(result)
    for entry in result["tables"]:
        name = marginal_name(entry["attributes"])
        values, labels = arrays[name]
        want = truth(idx, [ATTRS[a] for a in entry["attributes"]])
        assert values.shape == want.shape and np.max(np.abs(values - want)) < 1e-9, name
        assert list(labels) == entry["attributes"]
    assert arrays["sex,region"].labels == {"sex": SEX, "region": REGION}
    assert arrays["region,age"].labels["age"] == AGE_LABELS
    assert arrays["sex,member"].labels["member"] == [True, False]
    assert arrays[TOTAL_NAME].values.shape == () and arrays[TOTAL_NAME].labels == {}

    # a subset, by name (spaces allowed) or by attributes in any order; a job id works as the result
    some = client.dpquery.arrays(result["job_id"], marginals=["region, sex", ["age", "region"]])
    assert list(some) == ["sex,region", "region,age"]
    with pytest.raises(ShardfoldError, match="is not in this result"):
        client.dpquery.tables(result, marginals=["age"])
    assert client.dpquery.std_errors(result)["sex"] == pytest.approx(result["tables"][0]["std_error"])


@pytest.mark.slow
def test_noisy_runs_spend_the_ledger_and_an_over_budget_run_is_refused(client):
    """Real OpenDP noise (measure in processes): estimates within 7 standard errors of the truth, and the
    ledger, read through client.dpquery.budget, charges every job once."""
    dataset, idx = write_dataset(client.store_root, rows=4000, seed=1)
    doc = spec_doc("data/people.csv", budget={"rho": 0.75})
    first = client.dpquery.run(doc)
    arrays = client.dpquery.arrays(first)
    std = client.dpquery.std_errors(first)
    for entry in first["tables"]:
        name = marginal_name(entry["attributes"])
        err = arrays[name].values - truth(idx, [ATTRS[a] for a in entry["attributes"]])
        assert np.max(np.abs(err)) <= 7 * std[name], name
    assert std["sex"] == pytest.approx(math.sqrt(client.dpquery.plan(doc).var[0]))

    second = client.dpquery.run({**doc, "dataset_budget_rho": None})  # later jobs may omit the total
    budget = client.dpquery.budget("people")
    spent = first["report"]["rho_spent"] + second["report"]["rho_spent"]
    assert budget["total"] == 2.0 and budget["spent"] == pytest.approx(spent)
    assert budget["remaining"] == pytest.approx(2.0 - spent) and budget["epsilon"] > 0
    assert [j["job_id"] for j in budget["jobs"]] == [first["job_id"], second["job_id"]]
    assert all(j["spent"] <= j["reserved"] == 0.75 for j in budget["jobs"])

    with pytest.raises(JobFailed, match="exceeds the remaining budget"):
        client.dpquery.run(doc)  # 0.75 more would pass 2.0: refused at plan, nothing measured
    after = client.dpquery.budget("people")
    assert after["spent"] == budget["spent"] and len(after["jobs"]) == 2

    # the estimator reads the ledger and says so before anything runs
    report = estimate(parse_spec(doc), client.store_root)
    assert any("would be refused at its prepare step (BudgetExceeded)" in n for n in report.notes)
    assert "does NOT fit" in dict(report.details[0].rows)["remaining ρ"]


def test_budget_of_an_unknown_dataset_and_bad_ids(client):
    assert client.dpquery.budget("never-used") == {
        "dataset_id": "never-used",
        "total": None,
        "spent": 0.0,
        "remaining": None,
        "delta": 1e-9,
        "epsilon": 0.0,
        "jobs": [],
    }
    for bad in ("../x", "a/b", "", "-x"):
        with pytest.raises(SpecError, match="dataset_id"):
            client.dpquery.budget(bad)


def test_table_to_array_refuses_a_table_that_is_not_a_full_grid():
    tbl = pa.table({"a": ["x", "y", "x"], "b": [1, 1, 2], "estimate": [1.0, 2.0, 3.0]})
    with pytest.raises(ShardfoldError, match="not a dpquery output table"):
        table_to_array(tbl, ["a", "b"])
    grid = pa.table({"a": ["x", "x", "y", "y"], "b": [1, 2, 1, 2], "estimate": [1.0, 2.0, 3.0, 4.0]})
    values, labels = table_to_array(grid, ["a", "b"])
    assert values.tolist() == [[1.0, 2.0], [3.0, 4.0]] and labels == {"a": ["x", "y"], "b": [1, 2]}


# --- the shipped example on the CLI -----------------------------------------------------------------------


def test_example_data_is_the_generators_output():
    """events/data/dpquery/people.csv is synthetic_people(2000, seed=2026), first five columns; the example
    spec's schema is the demo's."""
    spec = json.loads((EVENTS / "dpquery.json").read_text())
    names = [a["name"] for a in spec["schema"]]
    assert spec["schema"] == PEOPLE_SCHEMA[:5]
    want = people_csv(synthetic_people(2000, seed=2026), names)
    assert (EVENTS / "data" / "dpquery" / "people.csv").read_bytes() == want


@pytest.mark.slow
def test_cli_runs_the_example_twice_and_plans_it(home):
    outs = [invoke("run", str(EVENTS / "dpquery.json")).output for _ in range(2)]
    for out in outs:
        assert "SUCCEEDED" in out and "released tables" in out and "age,education" in out
    assert "(2 job(s))" in outs[1]  # the example's dataset has ρ 1 in all: about 40 runs
    job_id = next(w for w in outs[1].split() if w.startswith("dpquery-"))
    with Client() as c:
        budget = c.dpquery.budget("example-people")
        tables = c.dpquery.tables(job_id)
    rho = cdp_rho(1.0, 1e-6)
    assert budget["total"] == 1.0 and len(budget["jobs"]) == 2
    assert budget["spent"] == pytest.approx(2 * rho, rel=1e-8)
    assert tables["age,education"].num_rows == 8 * 7
    res = invoke("result", job_id).output
    assert "ε at δ 1e-06: 1 (CKS)" in res and "00003-age-education.parquet" in res
    plan = invoke("plan", str(EVENTS / "dpquery.json")).output
    assert "2 job(s)" in plan and "privacy and accuracy plan" in plan
    assert json.loads(invoke("result", job_id, "--json").output)["report"]["rho_spent"] <= rho


def test_no_job_is_submitted_from_a_bootstrapping_worker(client, monkeypatch):
    """A script without a main guard is re-run by every process multiprocessing spawns (a user's own pool; the
    local executor's workers no longer import it); a dpquery job submitted from there would reserve budget
    again. It is refused before the ledger is touched."""
    import multiprocessing

    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(ShardfoldError, match='if __name__ == "__main__"'):
        client.dpquery.submit(spec_doc("data/people.csv"))
    assert client.dpquery.budget("people")["jobs"] == []
