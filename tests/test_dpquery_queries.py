"""dpquery with general query types (``queries``: prefix, range, circular_range along ordered attributes),
planned, measured and answered by QuerySmasher's Kronecker solver: the spec's refusals name the field, the
vectorised planner equals :func:`smash_reference.plan_kron`, a job answers every query exactly with the
noise seam and gives each answer the variance :func:`smash_reference.answer` derives from the pieces, the
noisy job stays within its budget, the measurements export with their strategies, and the workflow runs
the same on the local executor and on moto's ASL interpreter."""

from __future__ import annotations

import io
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
from smash_reference import Entry, SmashPlan, answer, plan_kron
from test_dpquery_job import (
    ledger_types,
    make_dataset,
    moto_client,  # noqa: F401 - a fixture
    no_noise,
    numbers,
    on_both_executors,
    read_table,
    run_core,
    spec_doc,
    truth,
)

from shardfold.functions.dpquery import core, planner, smasher
from shardfold.functions.dpquery import measure as mz
from shardfold.functions.dpquery.sizing import marginal_rows, privacy_rows
from shardfold.functions.errors import SpecError
from shardfold.functions.specs import parse_spec
from shardfold.functions.store.uri import join

# sex: 2 categories, region: 3 categories, age: a range of 4 bins (20..29, ..., 50..59)
WORKLOAD = [
    {"attributes": ["sex"]},
    {"attributes": ["sex", "age"], "queries": {"age": "prefix"}},
    {"attributes": ["region", "age"], "queries": {"age": "prefix"}},
]


def general_doc(dataset: str, workload=None, **over) -> dict:
    return spec_doc(dataset, workload=workload or WORKLOAD, **over)


# --- the spec -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "workload, field, words",
    [
        ([{"attributes": ["sex"], "queries": {"sex": "prefix"}}], "workload.0.queries.sex", "has categories"),
        ([{"attributes": ["sex"], "queries": {"age": "prefix"}}], "workload.0.queries.age", "not one of"),
        (
            [{"attributes": ["age"], "queries": {"height": "range"}}],
            "workload.0.queries.height",
            "not one of",
        ),
        ([{"attributes": ["age"], "queries": {"age": "median"}}], "workload.0.queries.age", "identity"),
        (
            {"all_marginals_up_to": 2, "queries": {"region": "range"}},
            "workload.queries.region",
            "has categories",
        ),
    ],
)
def test_a_bad_query_type_is_refused_naming_the_field(workload, field, words):
    with pytest.raises(SpecError) as err:
        parse_spec(general_doc("data/p.parquet", workload))
    assert field in str(err.value) and words in str(err.value)


def test_query_types_need_an_order_and_a_domain_the_solver_takes():
    other = general_doc("data/p.parquet", [{"attributes": ["age"], "queries": {"age": "prefix"}}])
    other["schema"][2]["out_of_domain"] = "other"
    with pytest.raises(SpecError, match=r"workload\.0\.queries\.age.*'\(other\)' bin"):
        parse_spec(other)
    wide = general_doc("data/p.parquet", [{"attributes": ["age"], "queries": {"age": "range"}}])
    wide["schema"][2] = {"name": "age", "range": [0, 5000]}
    with pytest.raises(SpecError, match=r"workload\.0\.queries\.age.*5,001 bins.*at most 1,024"):
        parse_spec(wide)


def test_max_variance_is_for_identity_marginals():
    with pytest.raises(SpecError, match="max_variance"):
        planner.plan(parse_spec(general_doc("data/p.parquet", loss="max_variance")))


# --- the plan -----------------------------------------------------------------------------------------------


CASES = [
    (
        [5, 4, 3],
        [
            ((0, 1), 1.0, {0: "prefix"}),
            ((1, 2), 2.0, {2: "range"}),
            ((0,), 1.0, {0: "prefix"}),
            ((), 1.0, {}),
        ],
    ),
    ([6, 5], [((0, 1), 1.0, {0: "circular_range", 1: "prefix"}), ((1,), 3.0, {1: "prefix"})]),
    ([4, 4, 4], [((0, 1, 2), 1.0, {0: "range", 2: "prefix"}), ((1,), 1.0, {})]),
]


@pytest.mark.parametrize("domains, entries", CASES)
def test_the_vectorised_plan_is_querysmashers(domains, entries):
    rho = 0.7
    parts = dict(
        domains=domains, workload=[(a, w) for a, w, _ in entries], rho=rho, queries=[q for *_, q in entries]
    )
    pl = planner.plan(**parts, split_totals=False)  # QuerySmasher's class: residuals orthogonal to the total
    assert planner.plan(**parts).weighted_sse <= pl.weighted_sse  # the wider class is never worse
    ref = plan_kron(domains, [Entry(a, w, q) for a, w, q in entries], rho)
    index = pl.residual_index()
    assert set(index) == set(ref.sigma2)
    for part, sigma2 in ref.sigma2.items():
        k = index[part]
        # the contrasts measure an identity attribute at privacy cost (n−1)/n, the reference's strategy at 1
        scale = math.prod(
            (domains[i] - 1) / domains[i]
            for i, how in zip(part, pl.set_strategies(k), strict=True)
            if how.startswith("identity:")
        )
        assert pl.sigma2[k] == pytest.approx(sigma2 * scale, rel=1e-8)
    assert pl.weighted_sse == pytest.approx(ref.total, rel=1e-8)
    assert pl.privacy_cost() == pytest.approx(2 * pl.rho_planned, rel=1e-12)
    again = planner.Plan.from_doc(pl.to_doc())  # the strategies travel with the plan document
    for k in range(pl.num_residuals):
        for how in pl.set_strategies(k):
            assert np.array_equal(again.strategy(how).matrix, pl.strategy(how).matrix)


def test_identity_queries_plan_as_residual_planner():
    doc = spec_doc("data/p.parquet")
    plain = planner.plan(parse_spec(doc))
    doc["workload"][2]["queries"] = {"age": "identity"}
    same = planner.plan(parse_spec(doc))
    assert same.res_strategy is None and same.to_doc() == plain.to_doc()


def test_the_plan_shows_the_rmse_of_each_query_type():
    spec = parse_spec(general_doc("data/p.parquet"))
    pl = planner.plan(spec)
    rows = dict(privacy_rows(spec, pl))
    assert rows["workload"] == "3 marginal(s), 22 answers"
    assert rows["RMSE of identity answers"].endswith("(2 answers)")
    assert rows["RMSE of prefix answers"].endswith("(20 answers)")
    title, table = marginal_rows(spec, pl)
    assert [r[0] for r in table] == ["sex", "sex,age (age: prefix)", "region,age (age: prefix)"]
    assert [r[1] for r in table] == [2, 8, 12] and "mean over its answers" in title


# --- the job ------------------------------------------------------------------------------------------------


def _answers_truth(idx, attributes, queries):
    x = truth(idx, attributes).astype(np.float64)
    for axis, name in enumerate(attributes):
        x = smasher.answer_axis(queries.get(name, "identity"), x, axis)
    return x


RANGES = [
    {"attributes": ["sex", "age"], "queries": {"age": "range"}},
    {"attributes": ["region", "age"], "queries": {"age": "range"}},
    {"attributes": ["age"], "queries": {"age": "range"}, "weight": 2.0},
]
# the residual set {age} is reached by identity, prefix and range queries of age: one Kronecker strategy
MIXED = [
    {"attributes": ["age"]},
    {"attributes": ["sex", "age"], "queries": {"age": "prefix"}},
    {"attributes": ["region", "age"], "queries": {"age": "range"}},
]


def _bins(lo: int, hi: int) -> tuple[int, int]:
    """The first and last age bin (of width 10 from 20) of an answer's bounds."""
    return (lo - 20) // 10, (hi - 20) // 10


@pytest.mark.parametrize("workload", [RANGES, MIXED], ids=["one type", "mixed types in one set"])
def test_every_answer_is_exact_with_the_noise_seam_and_has_the_variance_of_its_pieces(tmp_path, workload):
    root = f"file://{tmp_path}"
    dataset, idx = make_dataset(root)
    spec = parse_spec(general_doc(dataset, workload))
    job_id, result = run_core(root, general_doc(dataset, workload), noise=False)
    _, pl = core.load_plan(root, job_id)
    assert pl.privacy_cost() == pytest.approx(2 * pl.rho_planned, rel=1e-12)
    mixed = [pl.set_strategies(k) for k in range(pl.num_residuals) if pl.residual(k) == (2,)]
    assert (mixed[0][0].startswith("mixed:")) == (workload is MIXED)
    domains = [int(n) for n in pl.domains]
    # answer() reads each measured set's matrices and σ² only
    mats = {
        pl.residual(k): [pl.strategy(h).matrix for h in pl.set_strategies(k)] for k in range(pl.num_residuals)
    }
    sigma2 = {pl.residual(k): float(pl.sigma2[k]) for k in range(pl.num_residuals)}
    reference = SmashPlan(domains, 1.0, {}, sigma2, {}, 0.0)
    names = [a.name for a in spec.attributes]
    labels = {"sex": ["f", "m"], "region": [1, 2, 3]}
    for t in result["tables"]:
        tbl = read_table(t["parquet"])
        expected = _answers_truth(idx, t["attributes"], t.get("queries", {}))
        est = tbl.column("estimate").to_numpy()
        assert np.max(np.abs(est - expected.reshape(-1))) < 1e-8
        assert t["cells"] == expected.size == tbl.num_rows
        # each answer's variance, against answer()'s sum over the query's pieces (no noise: the value
        # is exact; the variance is the plan's)
        attrs = tuple(names.index(n) for n in t["attributes"])
        zeros = {part: np.zeros(math.prod(domains[i] for i in part)) for part in sigma2}
        variances = tbl.column("variance").to_numpy()
        for row, values in enumerate(tbl.to_pylist()):
            q = np.zeros([domains[a] for a in attrs])
            where = []
            for name in t["attributes"]:
                if name == "age":
                    a, b = _bins(values["age_lo"], values["age_hi"])
                    where.append(slice(a, b + 1))
                else:
                    where.append(labels[name].index(values[name]))
            q[tuple(where)] = 1.0
            totals = {a: pl.attribute_total(a) for a in attrs}
            _, var = answer(q.reshape(-1), attrs, domains, zeros, reference, mats, totals)
            assert variances[row] == pytest.approx(var, rel=1e-9), (t["attributes"], row)
        assert t["std_error"] == pytest.approx(math.sqrt(variances.mean()), rel=1e-12)
    if workload is RANGES:
        t = result["tables"][0]
        assert t["queries"] == {"age": "range"}
        assert t["max_std_error"] == pytest.approx(
            math.sqrt(read_table(t["parquet"]).column("variance").to_numpy().max())
        )
        ages = read_table(result["tables"][2]["parquet"])
        assert ages.column("age").to_pylist()[:5] == ["20..29", "20..39", "20..49", "20..59", "30..39"]
        assert ages.column("age_lo").to_pylist()[:5] == [20, 20, 20, 20, 30]
        assert ages.column("age_hi").to_pylist()[:5] == [29, 39, 49, 59, 39]
        small = core.store.get_json(result["tables"][0]["json"])
        assert small["columns"][-2:] == ["estimate", "std_error"] and "std_error" not in small


def test_a_noisy_job_spends_within_its_budget_and_releases_no_true_count(tmp_path):
    root = f"file://{tmp_path}"
    dataset, idx = make_dataset(root)
    job_id, result = run_core(root, general_doc(dataset))
    report = result["report"]
    assert report["rho_planned"] * (1 - 1e-12) <= report["rho_spent"] <= report["rho_budget"] == 0.5
    assert report["samplers"] == [mz.sampler_id()] and ledger_types(root) == ["open", "reserve", "spend"]
    assert len(idx[0]) not in set(numbers(result))
    assert report["cells"] == 22  # the answers released


def test_the_measurements_export_with_their_strategies(tmp_path, monkeypatch):
    from shardfold.client import Client

    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    client = Client()
    root = client.store_root
    dataset, idx = make_dataset(root)
    job_id, result = run_core(root, general_doc(dataset), noise=False)
    for m in client.dpquery.measurements(result):
        names = list(m.clique)
        x = truth(idx, names) if names else np.array(float(len(idx[0])))
        assert np.allclose(m.noisy_measurement, m.query(x), atol=1e-9)  # the seam: y_S = B_S x_S
        if "age" in names:
            assert m.query.op_norm_sq() == pytest.approx(
                np.linalg.norm(m.query.factors[names.index("age")], 2) ** 2
            )
    with pytest.raises(Exception, match="covariance\\(\\) is for releases of identity marginals"):
        client.dpquery.covariance(result, "sex")


# --- both executors -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_local_and_moto_executors_answer_general_queries_alike(moto_client, tmp_path, monkeypatch):  # noqa: F811
    no_noise(monkeypatch)
    bucket = moto_client.store_root
    dataset, idx = make_dataset(bucket, seed=7, name="general.parquet")
    doc = general_doc(dataset, dataset_id="people-general")
    on_moto, on_local = on_both_executors(moto_client, tmp_path, doc)
    for a, b in zip(on_moto["tables"], on_local["tables"], strict=True):
        ta, tb = read_table(a["parquet"]), read_table(b["parquet"])
        assert ta.column_names == tb.column_names and a.get("queries") == b.get("queries")
        for name in a["attributes"]:
            assert ta.column(name).equals(tb.column(name))
        expected = _answers_truth(idx, a["attributes"], a.get("queries", {}))
        for t in (ta, tb):
            assert np.max(np.abs(t.column("estimate").to_numpy() - expected.reshape(-1))) < 1e-8
        assert np.array_equal(ta.column("std_error").to_numpy(), tb.column("std_error").to_numpy())


# --- any box of the schema, from a release ------------------------------------------------------------------


@pytest.fixture
def client_root(tmp_path, monkeypatch):
    from shardfold.client import Client

    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    with Client() as client:
        yield client, client.store_root


def released(root: str, doc: dict) -> dict:
    """A release through the core with the noise seam, its spec recorded where a submitted job's is."""
    _, result = run_core(root, doc, noise=False)
    core.store.put_json(join(root, "jobs", result["job_id"], "spec.json"), doc)
    return result


def _query_variance(pl, attrs, vector):
    """A query's variance by answer() on its dense vector over the cells of ``attrs`` (sorted, C
    order): the pieces, independently of the client's code."""
    domains = [int(n) for n in pl.domains]
    mats, sigma2 = {}, {}
    for k in range(pl.num_residuals):
        mats[pl.residual(k)] = [pl.strategy(how).matrix for how in pl.set_strategies(k)]
        sigma2[pl.residual(k)] = float(pl.sigma2[k])
    zeros = {part: np.zeros(math.prod(domains[i] for i in part)) for part in sigma2}
    plan = SmashPlan(domains, 1.0, {}, sigma2, {}, 0.0)
    totals = {a: pl.attribute_total(a) for a in attrs}
    return answer(np.asarray(vector).reshape(-1), attrs, domains, zeros, plan, mats, totals)[1]


def _box_variance(pl, attrs, q):
    """The box's variance: :func:`_query_variance` of the product of its selections."""
    vector = np.ones(())
    for v in q:
        vector = np.multiply.outer(vector, v)
    return _query_variance(pl, attrs, vector)


@pytest.mark.parametrize("general", [False, True], ids=["identity release", "prefix release"])
def test_any_box_inside_the_release_is_answered_exactly_with_its_variance(client_root, general):
    client, root = client_root
    dataset, idx = make_dataset(root)
    result = released(root, general_doc(dataset) if general else spec_doc(dataset))
    _, pl = core.load_plan(root, result["job_id"])
    full = truth(idx, ["sex", "region", "age"])  # sex: f, m; region: 1, 2, 3; age: 4 bins of 10 from 20
    region_age = ((1, [1, 0, 1]), (2, [0, 0, 1, 0]))  # a cell of neither release's tables
    boxes = [
        ({}, full.sum(), ()),
        ({"age": (30, 49)}, full[:, :, 1:3].sum(), ((2, [0, 1, 1, 0]),)),
        ({"region": [1, 3], "age": "40..49"}, full[:, [0, 2], 2].sum(), region_age),
    ]
    if general:  # [sex, age] is a workload marginal of the prefix release only
        boxes.append(({"sex": "m", "age": (20, 39)}, full[1, :, 0:2].sum(), ((0, [0, 1]), (2, [1, 1, 0, 0]))))
    else:
        boxes.append(({"sex": "m", "region": 2}, full[1, 1, :].sum(), ((0, [0, 1]), (1, [0, 1, 0]))))
    for where, expected, dense in boxes:
        got = client.dpquery.answer(result, where)
        assert got["estimate"] == pytest.approx(float(expected), abs=1e-8), where
        attrs = tuple(i for i, _ in dense)
        assert got["variance"] == pytest.approx(
            _box_variance(pl, attrs, [np.asarray(v, float) for _, v in dense]), rel=1e-9
        ), where
    if general:  # a box that is one of the release's answers has that answer's std_error
        row = read_table(result["tables"][1]["parquet"]).to_pylist()[5]  # sex m, ages 20..39
        got = client.dpquery.answer(result, {"sex": row["sex"], "age": (row["age_lo"], row["age_hi"])})
        assert got["std_error"] == pytest.approx(row["std_error"], rel=1e-9)
        assert got["estimate"] == pytest.approx(row["estimate"], abs=1e-8)


@pytest.mark.parametrize("general", [False, True], ids=["identity release", "prefix release"])
def test_any_linear_query_is_answered_from_its_pieces_with_its_variance(client_root, general):
    """Weights over a marginal's cells, the attributes in the caller's order (age before region here, the
    schema's order reversed): exact with the noise seam, the variance answer() gives its dense vector,
    a stack answered query by query, and a box equal to its weights."""
    client, root = client_root
    dataset, idx = make_dataset(root)
    result = released(root, general_doc(dataset) if general else spec_doc(dataset))
    _, pl = core.load_plan(root, result["job_id"])
    region_age = truth(idx, ["region", "age"]).astype(float)  # 3 regions x 4 age bins
    # age_bin + region_bin <= c for c = 0..5, and a weighted query: no box and no answer of either release
    affine = (np.add.outer(np.arange(4), np.arange(3))[None] <= np.arange(6)[:, None, None]).astype(float)
    weighted = np.arange(12, dtype=float).reshape(4, 3) ** 1.5
    for w in [*affine, weighted]:
        got = client.dpquery.answer(result, on=["age", "region"], weights=w)
        assert got["estimate"] == pytest.approx(float(np.sum(w.T * region_age)), abs=1e-8)
        assert got["variance"] == pytest.approx(_query_variance(pl, (1, 2), w.T), rel=1e-9)
        assert got["std_error"] == pytest.approx(math.sqrt(got["variance"]), rel=1e-12)
    stack = client.dpquery.answer(result, on="age,region", weights=affine)
    assert [a["estimate"] for a in stack] == pytest.approx(
        [float(np.sum(w.T * region_age)) for w in affine], abs=1e-8
    )
    box = client.dpquery.answer(result, {"region": [1, 3], "age": (30, 49)})
    as_weights = client.dpquery.answer(
        result, on=["age", "region"], weights=np.outer([0, 1, 1, 0], [1, 0, 1])
    )
    assert as_weights["estimate"] == pytest.approx(box["estimate"], abs=1e-8)
    assert as_weights["variance"] == pytest.approx(box["variance"], rel=1e-12)


def test_a_query_needs_only_the_sets_its_nonzero_pieces_reach(client_root):
    """The identity release measured no [sex, age]: a query on it that varies along sex only has zero
    pieces on {age} and {sex, age} and is answered from {sex}; one that varies along both is refused."""
    client, root = client_root
    dataset, idx = make_dataset(root)
    result = released(root, spec_doc(dataset))
    by_sex = np.repeat([[0.5], [2.0]], 4, axis=1)  # (sex, age), constant along age
    got = client.dpquery.answer(result, on=["sex", "age"], weights=by_sex)
    assert got["estimate"] == pytest.approx(float(truth(idx, ["sex"]) @ [0.5, 2.0]), abs=1e-8)
    assert got["variance"] == pytest.approx(
        client.dpquery.answer(result, on=["sex"], weights=[0.5 * 4, 2.0 * 4])["variance"] / 16, rel=1e-12
    )
    with pytest.raises(Exception, match="did not measure 'sex,age'"):
        client.dpquery.answer(result, on=["sex", "age"], weights=np.outer([1, 0], [1, 1, 0, 0]))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"where": {"sex": "f"}, "on": ["sex"], "weights": [1, 0]}, "a box .* or a query .*, not both"),
        ({"on": ["sex"]}, "on and weights together"),
        ({"on": ["sex", "height"], "weights": np.ones((2, 3))}, "it has no 'height'"),
        ({"on": ["sex", "sex"], "weights": np.ones((2, 2))}, "distinct attributes"),
        (
            {"on": ["sex", "age"], "weights": np.ones((4, 2))},
            r"shape \(4, 2\); on \['sex', 'age'\] needs \(2, 4\)",
        ),
        ({"on": ["sex"], "weights": [1, float("nan")]}, "finite"),
        ({"on": ["sex"], "weights": ["f", "m"]}, "must be numbers"),
        ({"on": ["sex"], "weights": ["1", "2"]}, "must be numbers"),
        ({"on": ["sex"], "weights": np.ones((0, 2))}, "no query"),
    ],
)
def test_a_bad_linear_query_is_refused_naming_the_argument(client_root, kwargs, words):
    client, root = client_root
    dataset, _ = make_dataset(root)
    result = released(root, spec_doc(dataset))
    where = kwargs.pop("where", None)
    with pytest.raises(SpecError, match=words):
        client.dpquery.answer(result, where, **kwargs)


def test_a_box_the_release_did_not_measure_or_that_cuts_a_bin_is_refused(client_root):
    client, root = client_root
    dataset, _ = make_dataset(root)
    result = released(root, spec_doc(dataset))
    with pytest.raises(Exception, match="did not measure 'sex,age'"):
        client.dpquery.answer(result, {"sex": "f", "age": (20, 29)})
    with pytest.raises(SpecError, match=r"age \(25, 39\) does not start and end on the attribute's bins"):
        client.dpquery.answer(result, {"age": (25, 39)})
    with pytest.raises(SpecError, match="region has no value 7"):
        client.dpquery.answer(result, {"region": 7})
    with pytest.raises(SpecError, match="no attribute 'height'"):
        client.dpquery.answer(result, {"height": 3})


def test_identity_cells_read_through_a_mixed_set_get_each_its_own_variance(tmp_path):
    """Ten age bins: the [age] marginal's cells are read through the {age} set's strategy fitted to cells,
    prefixes and ranges together, whose variance differs from bin to bin; each row states its own."""
    root = f"file://{tmp_path}"
    dataset, _ = make_dataset(root)
    doc = general_doc(dataset, MIXED)
    doc["schema"][2] = {"name": "age", "range": [20, 59], "bin_width": 4}
    job_id, result = run_core(root, doc, noise=False)
    _, pl = core.load_plan(root, job_id)
    assert any(h.startswith("mixed:") for k in range(pl.num_residuals) for h in pl.set_strategies(k))
    ages = pq.read_table(io.BytesIO(core.store.get(dataset))).column("age").to_numpy()
    counts = np.bincount((ages - 20) // 4, minlength=10)
    domains = [int(n) for n in pl.domains]
    mats = {
        pl.residual(k): [pl.strategy(h).matrix for h in pl.set_strategies(k)] for k in range(pl.num_residuals)
    }
    sigma2 = {pl.residual(k): float(pl.sigma2[k]) for k in range(pl.num_residuals)}
    zeros = {part: np.zeros(math.prod(domains[i] for i in part)) for part in sigma2}
    reference = SmashPlan(domains, 1.0, {}, sigma2, {}, 0.0)
    entry = result["tables"][0]
    assert entry["attributes"] == ["age"] and "queries" not in entry
    tbl = read_table(entry["parquet"])
    assert np.max(np.abs(tbl.column("estimate").to_numpy() - counts)) < 1e-8
    variances = tbl.column("variance").to_numpy()
    expected = [answer(np.eye(10)[b], (2,), domains, zeros, reference, mats)[1] for b in range(10)]
    assert variances == pytest.approx(expected, rel=1e-9)
    assert np.ptp(variances) > 1e-3 * variances.max()  # they do differ
    assert entry["max_std_error"] == pytest.approx(math.sqrt(variances.max()))
    assert "std_error" not in core.store.get_json(entry["json"])  # per row, not once


def test_an_attribute_every_entry_asks_cell_by_cell_keeps_the_contrasts_in_a_mixed_set():
    """No dense matrix for an identity attribute of a mixed set, whatever its size."""
    pl = planner.plan(
        domains=[1500, 10, 2],
        workload=[((0, 1), 1.0), ((0, 1, 2), 1.0)],
        rho=0.5,
        queries=[{1: "prefix"}, {1: "range"}],
    )
    index = pl.residual_index()
    mixed = pl.set_strategies(index[(0, 1)])
    assert mixed[0] == "identity:1500" and mixed[1].startswith("mixed:10:")
    assert not any(name.startswith("mixed:1500") for name in pl.strategies)
    assert pl.privacy_cost() == pytest.approx(2 * pl.rho_planned, rel=1e-12)
