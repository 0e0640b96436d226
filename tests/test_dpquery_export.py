"""dpquery outputs for downstream tools: the tables' error columns, bin bounds and release metadata (what SQL
users and pandas read), ``client.dpquery.measurements`` (the noisy residual measurements in the form
Private-PGM's ``LinearMeasurement`` takes), the covariance between reconstructed marginals, and a Private-PGM
(``mbi``) fit on the exported measurements (skipped where ``mbi`` is absent: ``pip install .[bench]``)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_dpquery_job import make_dataset, run_core, spec_doc

from shardfold.client import Client
from shardfold.client.dpquery import KroneckerQuery, ResidualMeasurement
from shardfold.functions import store
from shardfold.functions.dpquery import core, planner
from shardfold.functions.dpquery import measure as mz
from shardfold.functions.dpquery import reconstruct as rc
from shardfold.functions.dpquery.spec import TOTAL_NAME
from shardfold.functions.errors import ShardfoldError
from shardfold.functions.specs import parse_spec
from shardfold.functions.store.uri import join

REPO = Path(__file__).resolve().parent.parent
AGE_LO, AGE_HI = [20, 30, 40, 50], [29, 39, 49, 59]


@pytest.fixture
def client(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SHARDFOLD_BACKEND", raising=False)
    with Client() as c:
        yield c


def read_table(uri: str) -> pa.Table:
    return pq.read_table(io.BytesIO(store.get(uri)))


def truth(idx: np.ndarray, attrs: tuple[int, ...], sizes=(2, 3, 4)) -> np.ndarray:
    full = np.zeros(sizes)
    np.add.at(full, tuple(idx), 1)
    return full.sum(axis=tuple(i for i in range(len(sizes)) if i not in attrs))


# --- the tables ---------------------------------------------------------------------------------------------


def test_tables_carry_error_columns_bin_bounds_and_release_metadata(tmp_path):
    root = f"file://{tmp_path}"
    dataset, idx = make_dataset(root)
    job_id, result = run_core(root, spec_doc(dataset))  # real OpenDP noise
    pl = planner.plan(parse_spec(spec_doc(dataset)))
    release = result["release"]
    assert release["mechanism"] == "gaussian, zCDP" and release["rho"] == 0.5
    assert release["privacy_unit"] == "one row" and release["dataset_id"] == "people"
    fingerprint = release["dataset_fingerprint"]
    assert fingerprint.startswith("sha256:") and len(fingerprint) == 7 + 64
    size = store.size(dataset)
    for j, entry in enumerate(result["tables"]):
        tbl = read_table(entry["parquet"])
        names = entry["attributes"]
        std = tbl.column("std_error").to_numpy()
        var = tbl.column("variance").to_numpy()
        assert tbl.schema.field("std_error").type == pa.float64() == tbl.schema.field("variance").type
        assert np.all(var == pl.var[j]) and np.all(std == math.sqrt(pl.var[j]))
        assert var == pytest.approx(std**2, rel=1e-12) and entry["variance"] == pytest.approx(pl.var[j])
        meta = {k.decode(): v.decode() for k, v in tbl.schema.metadata.items()}
        assert meta["mechanism"] == "gaussian, zCDP" and float(meta["rho"]) == 0.5
        assert meta["privacy_unit"] == "one row" and meta["dataset_fingerprint"] == fingerprint
        assert meta["value_column"] == "estimate" and json.loads(meta["attributes"]) == names
        assert str(size) not in json.dumps(meta)  # the file size (data-dependent) is hashed, never shown
        if "age" in names:
            assert tbl.schema.field("age_lo").type == pa.int64() == tbl.schema.field("age_hi").type
            rows = tbl.to_pylist()
            for row in rows:  # the label "a..b" and the bounds agree: both inclusive
                a, b = row["age"].split("..")
                assert (row["age_lo"], row["age_hi"]) == (int(a), int(b))
            assert (
                sorted({r["age_lo"] for r in rows}) == AGE_LO
                and sorted({r["age_hi"] for r in rows}) == AGE_HI
            )
        else:
            assert not any(c.endswith(("_lo", "_hi")) for c in tbl.column_names)
        if "json" in entry:
            doc = store.get_json(entry["json"])
            assert doc["release"] == release and doc["columns"][-1] == "estimate"
            assert doc["std_error"] == pytest.approx(math.sqrt(pl.var[j]))
    # pandas (and SQL engines through it) see plain numeric columns
    pd = pytest.importorskip("pandas")
    frame = pd.read_parquet(io.BytesIO(store.get(result["tables"][2]["parquet"])))
    assert list(frame.columns) == ["region", "age", "age_lo", "age_hi", "estimate", "std_error", "variance"]
    assert str(frame["age_lo"].dtype) == "int64" and str(frame["std_error"].dtype) == "float64"
    assert frame.loc[frame["age_lo"] >= 40, "age_hi"].min() == 49
    ci = frame["estimate"] + 1.96 * frame["std_error"]
    assert np.all(ci > frame["estimate"])


def test_duckdb_reads_the_error_columns_as_numbers(tmp_path):
    duckdb = pytest.importorskip("duckdb")
    root = f"file://{tmp_path}"
    dataset, _ = make_dataset(root)
    _, result = run_core(root, spec_doc(dataset), noise=False)
    path = store.resolve(result["tables"][2]["parquet"]).removeprefix("file://")
    row = duckdb.sql(f"SELECT min(age_lo), max(age_hi), max(variance - std_error * std_error) FROM '{path}'")
    lo, hi, gap = row.fetchone()
    assert (lo, hi) == (20, 59) and abs(gap) < 1e-9


def test_bin_bounds_and_column_names():
    lo, hi = rc.bin_bounds(18, 89, 10)
    assert lo.tolist() == [18, 28, 38, 48, 58, 68, 78, 88] and hi.tolist()[-2:] == [
        87,
        89,
    ]  # last is narrower
    lo, hi = rc.bin_bounds(0, 3, 1)
    assert lo.tolist() == hi.tolist() == [0, 1, 2, 3]
    # generated names never take an attribute's name
    cols = rc.column_names(["age", "age_lo", "std_error"], [True, False, False])
    assert cols["bounds"]["age"] == ("age_lo_", "age_hi")
    assert (
        cols["estimate"] == "estimate"
        and cols["std_error"] == "std_error_"
        and cols["variance"] == "variance"
    )
    est = np.arange(8.0).reshape(2, 2, 2)
    tbl = rc.table(
        est,
        ["age", "age_lo", "std_error"],
        [["0..1", "2..3"], [1, 2], ["x", "y"]],
        4.0,
        {},
        [
            rc.bin_bounds(0, 3, 2),
            None,
            None,
        ],
    )
    assert tbl.column_names == [
        "age",
        "age_lo_",
        "age_hi",
        "age_lo",
        "std_error",
        "estimate",
        "std_error_",
        "variance",
    ]
    assert tbl.column("age_lo_").to_pylist() == [0] * 4 + [2] * 4
    assert tbl.schema.metadata[b"value_column"] == b"estimate"


def test_privacy_unit_and_fingerprint_lookups_are_tolerant():
    class Spec:
        dataset_id = "d"

    assert rc.privacy_unit(Spec()) == "one row"
    unit = Spec()
    unit.privacy_unit = {"column": "household", "max_rows": 4}
    assert json.loads(rc.privacy_unit(unit)) == {"column": "household", "max_rows": 4}
    doc = {"dataset": "s3://b/k.csv", "dataset_pin": {"size": 123, "etag": '"abc"'}}
    fp = rc.dataset_fingerprint(doc)
    assert fp.startswith("sha256:") and "123" not in fp
    assert rc.dataset_fingerprint({**doc, "dataset_pin": {"size": 124, "etag": '"abc"'}}) != fp
    assert rc.dataset_fingerprint({**doc, "dataset_fingerprint": "sha256:given"}) == "sha256:given"
    assert rc.dataset_fingerprint({"dataset": "x"}) is None


# --- the measurements ---------------------------------------------------------------------------------------


def test_measurements_reproduce_the_released_tables(client, tmp_path):
    root = client.store_root
    dataset, idx = make_dataset(root)
    _, result = run_core(root, spec_doc(dataset))  # real OpenDP noise
    pl = planner.plan(parse_spec(spec_doc(dataset)))
    ms = client.dpquery.measurements(result)
    assert [m.index for m in ms] == list(range(pl.num_residuals)) and ms[0].clique == ()
    assert [m.clique for m in ms][1:4] == [("sex",), ("region",), ("age",)]
    for m in ms:
        assert isinstance(m, ResidualMeasurement) and m.noisy_measurement.shape == (pl.noise_count[m.index],)
        assert m.stddev == pytest.approx(math.sqrt(pl.sigma2[m.index]), rel=1e-12) and m.rho > 0
        assert [f.shape for f in m.factors] == [(n - 1, n) for n in m.sizes]
    # the job's own reconstruction is a linear function of exactly these numbers
    by_attrs = {m.attrs: m.noisy_measurement for m in ms}
    for j, entry in enumerate(result["tables"]):
        a = pl.marginal(j)
        est = rc.reconstruct(
            [pl.domains[i] for i in a], a, [(pl.residual(k), by_attrs[pl.residual(k)]) for k in pl.subsets(j)]
        )
        released = read_table(entry["parquet"]).column("estimate").to_numpy()
        assert np.max(np.abs(est.reshape(-1) - released)) < 1e-9
    with pytest.raises(ShardfoldError, match="reads at most 3"):
        client.dpquery.measurements(result, max_samples=3)


def test_the_exported_query_is_the_measured_one(client):
    """With the noise seam the measurement is the query applied to the true marginal: mode-wise, as a dense
    matrix, and as the Kronecker product of the factors."""
    root = client.store_root
    dataset, idx = make_dataset(root)
    _, result = run_core(root, spec_doc(dataset), noise=False)
    for m in client.dpquery.measurements(result):
        x = truth(idx, m.attrs)
        assert np.allclose(m.query(x), m.noisy_measurement, atol=1e-9)
        assert np.allclose(m.query(x), mz.residual(x), atol=1e-9)
        assert np.allclose(m.matrix() @ x.reshape(-1), m.noisy_measurement, atol=1e-9)
        assert m.query.op_norm_sq() == 1.0 and np.allclose(
            m.matrix() @ m.matrix().T, np.eye(m.matrix().shape[0])
        )
    assert client.dpquery.measurements(result)[0].noisy_measurement.tolist() == [idx.shape[1]]  # the total
    q = KroneckerQuery(("a", "b"), (3, 4))
    assert q != KroneckerQuery(("a", "b"), (3, 4)) and hash(q) == id(q)  # identity, as mbi's static queries


# --- covariance ---------------------------------------------------------------------------------------------


def linear_map(pl, j: int) -> np.ndarray:
    """x̂_A as a matrix over all residual samples, built with the job's reconstruction on unit vectors."""
    offsets = np.concatenate([[0], np.cumsum(pl.noise_count)])
    a = pl.marginal(j)
    sizes = [int(pl.domains[i]) for i in a]
    cols = []
    for t in range(int(offsets[-1])):
        e = np.zeros(int(offsets[-1]))
        e[t] = 1.0
        terms = [(pl.residual(k), e[offsets[k] : offsets[k + 1]]) for k in pl.subsets(j)]
        cols.append(rc.reconstruct(sizes, a, terms).reshape(-1))
    return np.stack(cols, axis=1)


def test_covariance_between_marginals_matches_the_reconstruction(client):
    doc = spec_doc(
        "data/nowhere.parquet",
        workload=[
            {"attributes": []},
            {"attributes": ["sex"]},
            {"attributes": ["sex", "region"]},
            {"attributes": ["region", "age"]},
        ],
    )
    pl = client.dpquery.plan(doc)
    noise = np.repeat(pl.sigma2, pl.noise_count)
    maps = [linear_map(pl, j) for j in range(pl.num_marginals)]
    names = ["(total)", "sex", "sex,region", "region,age"]
    for ja, a in enumerate(names):
        for jb, b in enumerate(names):
            want = maps[ja] @ np.diag(noise) @ maps[jb].T
            got = client.dpquery.covariance(pl, a, b)
            assert got.shape == want.shape and np.allclose(got, want, atol=1e-9), (a, b)
        assert np.allclose(np.diag(client.dpquery.covariance(pl, a)), pl.var[ja])
    # marginals sharing an attribute have correlated errors; the total and a marginal too
    assert np.abs(client.dpquery.covariance(pl, "sex", "sex,region")).max() > 0
    assert client.dpquery.covariance(pl, ["region", "sex"], "sex").shape == (6, 2)
    assert client.dpquery.covariance(pl, TOTAL_NAME, "region,age").shape == (1, 12)
    with pytest.raises(ShardfoldError, match="not in this release"):
        client.dpquery.covariance(pl, "age")


def test_covariance_is_refused_for_large_marginals(client):
    doc = spec_doc(
        "data/nowhere.parquet",
        schema=[{"name": "x", "range": [0, 2999]}, {"name": "y", "categories": ["a", "b"]}],
        workload=[{"attributes": ["x", "y"]}],
    )
    pl = client.dpquery.plan(doc)
    with pytest.raises(ShardfoldError, match="at most 4,000,000"):
        client.dpquery.covariance(pl, "x,y")


def test_covariance_of_a_finished_job(client):
    root = client.store_root
    dataset, _ = make_dataset(root)
    _, result = run_core(root, spec_doc(dataset), noise=False)
    cov = client.dpquery.covariance(result, "sex,region", "sex")
    assert cov.shape == (6, 2) and np.allclose(
        np.diag(client.dpquery.covariance(result, "sex")), result["tables"][0]["variance"]
    )


# --- Private-PGM --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_private_pgm_fits_the_exported_measurements(client):
    """mbi (Private-PGM 2.0) fitted on the exported measurements answers the workload within 10 % of the
    job's own reconstruction (workload RMSE against the true marginals; the example people.csv and spec).

    The measurements are the job's own (its noise seam: exact y_S, with the plan's σ_S), perturbed here
    with seeded N(0, σ_S²) noise, so the comparison is reproducible; averaged over 3 draws."""
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    mbi = pytest.importorskip("mbi")
    from shardfold.client.dpquery import to_mbi

    root = client.store_root
    dataset = join(root, "data", "people.csv")
    store.put(dataset, (REPO / "events" / "data" / "dpquery" / "people.csv").read_bytes())
    doc = {**json.loads((REPO / "events" / "dpquery.json").read_text()), "dataset": dataset}
    _, result = run_core(root, doc, noise=False)
    exact = client.dpquery.measurements(result)
    pl = core.load_plan(root, result["job_id"])[1]
    truth_tables = {
        tuple(e["attributes"]): read_table(e["parquet"]).column("estimate").to_numpy()
        for e in result["tables"]
    }
    rng = np.random.default_rng(20260611)
    ratios = []
    for _ in range(3):
        noisy = [
            ResidualMeasurement(
                **{
                    **m.__dict__,
                    "noisy_measurement": m.noisy_measurement
                    + rng.normal(0, m.stddev, m.noisy_measurement.shape),
                }
            )
            for m in exact
        ]
        by_index = {m.index: m.noisy_measurement for m in noisy}
        domain, lms = to_mbi(noisy)
        assert all(isinstance(m, mbi.LinearMeasurement) for m in lms)
        # 500 iterations: the ratios agree with 1,500 to 2e-3 (0.998, 0.906, 0.922)
        model = mbi.estimation.MirrorDescent().estimate(domain, lms, iters=500)
        err_sf, err_pgm = [], []
        for j, e in enumerate(result["tables"]):
            a = pl.marginal(j)
            x = truth_tables[tuple(e["attributes"])]
            sf = rc.reconstruct(
                [pl.domains[i] for i in a], a, [(pl.residual(k), by_index[int(k)]) for k in pl.subsets(j)]
            )
            pgm = np.asarray(model.project(tuple(e["attributes"])).datavector()).reshape(-1)
            err_sf.append(sf.reshape(-1) - x)
            err_pgm.append(pgm - x)
        rmse_sf = math.sqrt(np.mean(np.concatenate(err_sf) ** 2))
        rmse_pgm = math.sqrt(np.mean(np.concatenate(err_pgm) ** 2))
        ratios.append(rmse_pgm / rmse_sf)
    assert np.mean(ratios) <= 1.10, ratios
    # what the exported measurements add: a model that answers marginals outside the workload
    age_sex = np.asarray(model.project(("age", "sex")).datavector(flatten=False))
    assert age_sex.shape == (8, 2) and np.all(age_sex >= 0)


def test_the_other_cell_of_a_range_has_no_bin_bounds():
    """Under out_of_domain "other" a range attribute gets one more cell after its bins: null bounds."""
    from shardfold.functions.dpquery.spec import DPAttribute

    attr = DPAttribute.model_validate(
        {"name": "age", "range": [0, 3], "bin_width": 2, "out_of_domain": "other"}
    )
    lo, hi = rc.attribute_bounds(attr)
    assert lo == [0, 2, None] and hi == [1, 3, None] and len(lo) == len(attr.labels())
    tbl = rc.table(np.arange(3.0), ["age"], [attr.labels()], 1.0, {}, [(lo, hi)])
    assert tbl.column("age_lo").to_pylist() == [0, 2, None] and tbl.column("age").to_pylist()[-1] == "(other)"
