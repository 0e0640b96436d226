"""dpquery with 2-way query types (``"queries": "affine"`` or ``"abs_diff"`` on a marginal of two ordered
attributes): the spec's refusals name the field; the job's planner solves every residual set such a type
reaches whole, and equals QuerySmasher's dense reference (:func:`smash_reference.plan_dense`) in
total loss and privacy cost; a job answers every query exactly with the noise seam, with the variances the
plan predicts; and under OpenDP's noise the answers are unbiased with those variances (Monte Carlo)."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from smash_reference import plan_dense
from test_dpquery_job import (
    make_dataset,
    moto_client,  # noqa: F401 - a fixture
    no_noise,
    on_both_executors,
    read_table,
    run_core,
    spec_doc,
    truth,
)

from shardfold.functions.dpquery import core, planner, smasher
from shardfold.functions.dpquery import measure as mz
from shardfold.functions.dpquery import reconstruct as rc
from shardfold.functions.errors import SpecError
from shardfold.functions.specs import parse_spec

# region as an ordered range (codes 1..3) beside age (4 bins of 10 years): two ordered attributes
SCHEMA = [
    {"name": "sex", "categories": ["f", "m"]},
    {"name": "region", "range": [1, 3]},
    {"name": "age", "range": [20, 59], "bin_width": 10},
]
WORKLOAD = [
    {"attributes": ["region", "age"], "queries": "affine"},
    {"attributes": ["age"], "queries": {"age": "prefix"}},
    {"attributes": ["sex", "age"]},
    {"attributes": ["sex", "region"], "weight": 2.0},
]


def pair_doc(dataset: str, workload=None, **over) -> dict:
    return spec_doc(dataset, schema=SCHEMA, workload=workload or WORKLOAD, **over)


# --- the spec -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "workload, words",
    [
        ([{"attributes": ["age"], "queries": "affine"}], "two attributes; the marginal has 1"),
        ([{"attributes": ["sex", "region", "age"], "queries": "abs_diff"}], "the marginal has 3"),
        ([{"attributes": ["sex", "age"], "queries": "affine"}], "attribute 'sex' has categories"),
        ([{"attributes": ["region", "age"], "queries": "median"}], "affine"),
        (
            [{"attributes": ["region", "age"], "queries": {"region": "affine", "age": "affine"}}],
            '"queries": "affine"',
        ),
    ],
)
def test_a_bad_2_way_type_is_refused_naming_the_field(workload, words):
    with pytest.raises(SpecError, match=words) as err:
        parse_spec(pair_doc("file:///x.parquet", workload))
    assert "workload.0.queries" in str(err.value)


def test_a_2_way_type_on_attributes_of_many_values_is_refused_naming_the_field():
    schema = [{"name": "a", "range": [0, 59]}, {"name": "b", "range": [0, 29]}]
    doc = spec_doc(
        "file:///x.parquet", schema=schema, workload=[{"attributes": ["a", "b"], "queries": "affine"}]
    )
    with pytest.raises(SpecError, match=r"workload\.0\.queries.*at most 1600.*here 1,711") as err:
        parse_spec(doc)
    assert "bin_width" in str(err.value)


def test_the_generator_takes_no_2_way_type():
    doc = pair_doc("file:///x.parquet", {"all_marginals_up_to": 2, "queries": {"age": "affine"}})
    with pytest.raises(SpecError, match=r"workload\.queries\.age"):
        parse_spec(doc)


def test_bare_plans_check_the_2_way_types_too():
    with pytest.raises(SpecError, match="names both attributes"):
        planner.plan(domains=[4, 5], workload=[(0,)], rho=1.0, queries=[{0: "affine"}])
    with pytest.raises(SpecError, match="names both attributes"):
        planner.plan(domains=[4, 5], workload=[(0, 1)], rho=1.0, queries=[{0: "affine", 1: "prefix"}])
    with pytest.raises(SpecError, match=r"60 x 30 values"):
        planner.plan(domains=[60, 30], workload=[(0, 1)], rho=1.0, queries=[{0: "abs_diff", 1: "abs_diff"}])


# --- the plan -----------------------------------------------------------------------------------------------


def _explicit(domains, attrs, queries) -> np.ndarray:
    """A workload entry's query matrix over its cells: a 2-way type's, or ⊗ each attribute's."""
    kinds = [queries.get(i, "identity") for i in attrs]
    if kinds and kinds[0] in smasher.PAIR_TYPES:
        return smasher.pair_queries(kinds[0], *(domains[i] for i in attrs))
    out = np.ones((1, 1))
    for i, kind in zip(attrs, kinds, strict=True):
        out = np.kron(out, smasher.attribute_queries(kind, domains[i]))
    return out


CASES = {
    "affine alone": ([5, 6], [((0, 1), 1.0)], [{0: "affine", 1: "affine"}]),
    "abs_diff alone": ([6, 6], [((0, 1), 1.0)], [{0: "abs_diff", 1: "abs_diff"}]),
    # the sets {0}, {1} and {0, 1} are reached by the 2-way type and by Kronecker entries of other types
    "mixed": (
        [6, 5, 4],
        [((0, 1), 1.0), ((0,), 2.0), ((0, 2), 0.5), ((1, 2), 1.0), ((0, 1, 2), 0.25)],
        [{0: "affine", 1: "affine"}, {}, {0: "prefix"}, {}, {1: "range"}],
    ),
}


@pytest.mark.parametrize("domains, workload, queries", CASES.values(), ids=CASES.keys())
def test_the_job_planner_equals_the_dense_reference(domains, workload, queries):
    pl = planner.plan(domains=domains, workload=workload, rho=0.5, queries=queries)
    assert pl.privacy_cost() == pytest.approx(2 * pl.rho_planned, rel=1e-12)
    entries = [(a, _explicit(domains, a, q), w) for (a, w), q in zip(workload, queries, strict=True)]
    ref = plan_dense(domains, entries, 0.5)
    # no worse than the reference, and near it: the job's planner also tries the per-attribute solver's
    # closed forms and unfloored optimum on one-attribute sets, where it may do better
    assert ref.total * 0.99 <= pl.weighted_sse <= ref.total * (1 + 1e-6)
    # each entry's mean variance: the plan's own sum, against the reference's strategies
    for j, (attrs, w, _) in enumerate(entries):
        mean = np.mean([ref.variance(q, attrs) for q in w])
        assert pl.var[j] == pytest.approx(mean, rel=2e-2), j
    pair_sets = [k for k in range(pl.num_residuals) if pl.dense(k) is not None]
    assert [pl.residual(k) for k in pair_sets] == [(0, 1)]


def test_pairs_of_one_structure_share_one_solve_whatever_their_weights():
    """Two disjoint affine pairs of other weights: the best strategy of a multiple of a Gram is the same,
    so the plan solves and stores it once, and still equals the dense reference."""
    pl = planner.plan(
        domains=[6, 6, 6, 6],
        workload=[((0, 1), 1.0), ((2, 3), 4.0)],
        rho=0.5,
        queries=[{0: "affine", 1: "affine"}, {2: "affine", 3: "affine"}],
    )
    # one matrix for the 1-way sets (a square affine pair's {a} and {b} have one Gram), one for {a, b}
    assert len(pl.strategies) == 2
    assert pl.privacy_cost() == pytest.approx(2 * pl.rho_planned, rel=1e-12)
    q = smasher.pair_queries("affine", 6, 6)
    ref = plan_dense([6, 6, 6, 6], [((0, 1), q, 1.0), ((2, 3), q, 4.0)], 0.5)
    assert ref.total * 0.99 <= pl.weighted_sse <= ref.total * (1 + 1e-6)


@pytest.mark.parametrize("kind, ratio", [("affine", 7.5), ("abs_diff", 11.0)])
def test_a_2_way_type_asked_beats_the_identity_marginal_summed(kind, ratio):
    """The 2-way queries answered from the plan of the identity marginal (their cells' estimates summed)
    have 7.5x (affine) and 11x (abs_diff) the total variance of those from the plan that asks them, at the
    same ρ (RP's contrasts are optimal for cells, not for these sums; docs/specs.md quotes the ratios)."""
    n = [8, 8]
    q = smasher.pair_queries(kind, *n)
    asked = planner.plan(domains=n, workload=[(0, 1)], rho=1.0, queries=[{0: kind, 1: kind}])
    cells = planner.plan(domains=n, workload=[(0, 1)], rho=1.0)
    index = cells.residual_index()
    # through the contrasts, a piece on S has the variance σ_S²·‖piece‖² (orthonormal rows)
    summed = sum(
        float(cells.sigma2[index[pos]]) * float(piece @ piece)
        for row in q
        for pos, piece in smasher.pieces(row, n).items()
    )
    assert float(asked.var[0]) * len(q) * ratio < summed


# --- the job ------------------------------------------------------------------------------------------------


def test_a_job_answers_every_2_way_query_exactly_with_the_plans_variance(tmp_path):
    root = f"file://{tmp_path}"
    dataset, idx = make_dataset(root)
    job_id, result = run_core(root, pair_doc(dataset), noise=False)
    _, pl = core.load_plan(root, job_id)
    assert [pl.residual(k) for k in range(pl.num_residuals) if pl.dense(k) is not None] == [(1, 2)]
    by_name = {",".join(t["attributes"]): t for t in result["tables"]}
    # the affine queries: region bin + age bin <= c, for c = 0 … 5
    t = by_name["region,age"]
    assert t["queries"] == "affine" and t["cells"] == 6
    tbl = read_table(t["parquet"])
    assert tbl.column("query").to_pylist()[:2] == ["region_bin + age_bin <= 0", "region_bin + age_bin <= 1"]
    expected = smasher.pair_queries("affine", 3, 4) @ truth(idx, ["region", "age"]).reshape(-1)
    assert np.max(np.abs(tbl.column("estimate").to_numpy() - expected)) < 1e-8
    variances = tbl.column("variance").to_numpy()
    assert variances.mean() == pytest.approx(float(pl.var[0]), rel=1e-9)  # the plan's own sum
    assert t["std_error"] == pytest.approx(math.sqrt(variances.mean()), rel=1e-12)
    assert t["max_std_error"] == pytest.approx(math.sqrt(variances.max()), rel=1e-12)
    small = core.store.get_json(t["json"])
    assert small["columns"] == ["query", "estimate", "std_error"] and len(small["rows"]) == 6
    # the other marginals read the set the affine queries share ({region, age}'s pieces on {age} and
    # {region}) and stay exact; each answer's variance sums to the plan's per-marginal mean
    for name, queries in (("age", {"age": "prefix"}), ("sex,age", {}), ("sex,region", {})):
        t = by_name[name]
        tbl = read_table(t["parquet"])
        x = truth(idx, t["attributes"]).astype(np.float64)
        for axis, attr in enumerate(t["attributes"]):
            x = smasher.answer_axis(queries.get(attr, "identity"), x, axis)
        assert np.max(np.abs(tbl.column("estimate").to_numpy() - x.reshape(-1))) < 1e-8, name
        assert tbl.column("variance").to_numpy().mean() == pytest.approx(float(pl.var[t["index"]]), rel=1e-9)
    assert result["report"]["cells"] == 6 + 4 + 8 + 6


# 4 x 5: the best of the full convex and the low-rank strategies; 13 x 12 (132 dimensions): the low-rank
@pytest.mark.parametrize("n", [(4, 5), (13, 12)])
def test_measured_through_one_matrix_the_answers_are_unbiased_with_their_variance(n):
    """OpenDP's noise on a set measured whole (the dense path of measure.measure_sets), R = 400 times: every
    affine answer's mean is within 5 standard errors of the truth, and its sample variance within 5 standard
    errors (5 v sqrt(2 / (R - 1)), 35 %) of the variance reconstruct.pair_answers states. That is the other
    Monte Carlo tests' bound, at which none of the 32 answers fails by chance; at 4 standard errors and 25 %
    one did, in about one run in a hundred."""
    pl = planner.plan(domains=list(n), workload=[(0, 1)], rho=2.0, queries=[{0: "affine", 1: "affine"}])
    rng = np.random.default_rng(3)
    x = rng.integers(0, 50, n)
    sets = []
    for k in range(pl.num_residuals):
        dense = pl.dense(k)
        mats = (dense,) if dense is not None else tuple(pl.strategy(h).matrix for h in pl.set_strategies(k))
        sizes = tuple(n[a] for a in pl.residual(k))
        sets.append(
            mz.SetSpec(
                index=k,
                attrs=pl.residual(k),
                sizes=sizes,
                scale=math.sqrt(float(pl.sigma2[k])),
                rho_planned=float(pl.rho_s[k]),
                mats=mats if sizes else None,
                flat=dense is not None,
            )
        )

    def marginal(attrs):
        return x.sum(axis=tuple(i for i in range(2) if i not in attrs)).reshape([n[i] for i in attrs])

    truth_q = smasher.pair_queries("affine", *n) @ x.reshape(-1)
    draws = []
    # one call measures the sets 400 times over, so each matrix's exact norm is taken once
    values, records = mz.measure_sets(sets * 400, marginal)
    offsets = np.cumsum([0, *(int(c) for c in pl.noise_count)])
    for draw in range(400):
        assert math.fsum(r["rho"] for r in records[draw * len(sets) : (draw + 1) * len(sets)]) <= 2.0
        one = values[draw * int(offsets[-1]) : (draw + 1) * int(offsets[-1])]
        terms = [
            (pl.residual(k), one[offsets[k] : offsets[k + 1]], float(pl.sigma2[k]), core._inverses(pl, k))
            for k in range(pl.num_residuals)
        ]
        est, var = rc.pair_answers("affine", n, terms)
        draws.append(est)
    draws = np.array(draws)
    runs = len(draws)
    assert np.all(np.abs(draws.mean(axis=0) - truth_q) < 5 * np.sqrt(var / runs))
    assert np.all(np.abs(draws.var(axis=0, ddof=1) - var) < 5 * var * math.sqrt(2 / (runs - 1)))
    assert var.mean() == pytest.approx(float(pl.var[0]), rel=1e-9)
    assert pl.privacy_cost() == pytest.approx(2 * pl.rho_planned, rel=1e-12)
    if math.prod(k - 1 for k in n) > smasher.MAX_SET_DIM:  # past the full convex solver's reach
        few = smasher.pair_piece_grams("affine", *n)[(0, 1)]
        assert smasher.set_strategy(few, list(n), few).solver == "low-rank"


def test_a_box_and_the_measurements_of_a_release_with_a_2_way_type(tmp_path, monkeypatch):
    """client.dpquery.answer sums a box's pieces through the set measured whole (exact with the noise seam;
    its variance by the pieces, independently) and, asked as weights, gives the release's own affine answers
    with their standard errors; measurements() exports that set's one matrix."""
    from shardfold.client import Client

    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    with Client() as client:
        root = client.store_root
        dataset, idx = make_dataset(root)
        doc = pair_doc(dataset)
        _, result = run_core(root, doc, noise=False)
        core.store.put_json(core.job_uri(root, result["job_id"], "spec.json"), doc)
        _, pl = core.load_plan(root, result["job_id"])
        full = truth(idx, ["sex", "region", "age"])  # region: 1, 2, 3; age: 4 bins of 10 from 20
        got = client.dpquery.answer(result, {"region": [1, 3], "age": (30, 49)})
        assert got["estimate"] == pytest.approx(float(full[:, [0, 2], 1:3].sum()), abs=1e-8)
        q = np.outer([1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]).reshape(-1)
        variance = 0.0
        for pos, piece in smasher.pieces(q, [3, 4]).items():
            k = pl.residual_index()[tuple(p + 1 for p in pos)]
            inverse = core._inverses(pl, k)
            if not isinstance(inverse, np.ndarray):  # ⊗B_i⁺ over the set's cells
                inverse = functools.reduce(np.kron, inverse, np.ones((1, 1)))
            variance += float(pl.sigma2[k]) * float(np.sum((piece @ inverse) ** 2))
        assert got["variance"] == pytest.approx(variance, rel=1e-9)
        # the release's own affine answers, asked again as weights over region x age: the same answers
        asked = np.add.outer(np.arange(3), np.arange(4))[None] <= np.arange(6)[:, None, None]
        again = client.dpquery.answer(result, on=["region", "age"], weights=asked)
        rows = read_table(result["tables"][0]["parquet"]).to_pylist()
        assert [a["estimate"] for a in again] == pytest.approx([r["estimate"] for r in rows], abs=1e-8)
        assert [a["std_error"] for a in again] == pytest.approx([r["std_error"] for r in rows], rel=1e-9)
        # tables() and arrays() take the 2-way table: one axis, its queries
        arr = client.dpquery.arrays(result, ["region,age"])["region,age"]
        assert arr.values.shape == (6,) and arr.labels["query"][-1] == "region_bin + age_bin <= 5"
        assert read_table(result["tables"][0]["parquet"]).schema.metadata[b"query_type"] == b"affine"
        (whole,) = [m for m in client.dpquery.measurements(result) if m.clique == ("region", "age")]
        x = truth(idx, ["region", "age"])
        assert np.allclose(whole.query(x), whole.noisy_measurement)  # the noise seam: y = B x exactly
        assert whole.query.factors[0].shape == (2 * 3, 12) and whole.matrix().shape == (6, 12)


def test_the_estimate_counts_the_convex_solves_of_a_2_way_type(tmp_path):
    """shardfold plan's prepare time includes the whole-set solves (PLAN_S_PER_SOLVED_DIM3 per dim³ of each
    strategy stored), which the same workload asked cell by cell does not have."""
    from shardfold.functions.dpquery.sizing import PLAN_S_PER_SOLVED_DIM3
    from shardfold.functions.estimate import estimate

    root = f"file://{tmp_path}"
    dataset, _ = make_dataset(root)
    cells = [{"attributes": ["region", "age"]}]
    prepare = {}
    for name, workload in (("affine", [{**cells[0], "queries": "affine"}]), ("cells", cells)):
        steps = estimate(parse_spec(pair_doc(dataset, workload)), root).steps
        prepare[name] = next(s.duration_s for s in steps if s.name == "prepare")
    # region x age: 3 x 4 values, {region, age} solved over (3 - 1)(4 - 1) = 6 dimensions
    assert prepare["affine"] - prepare["cells"] == pytest.approx(PLAN_S_PER_SOLVED_DIM3 * 6**3, abs=1e-6)


@pytest.mark.slow  # moto
def test_local_and_moto_executors_answer_2_way_types_alike(moto_client, tmp_path, monkeypatch):  # noqa: F811
    """The workflow on S3 (moto's ASL interpreter) and on the local store gives the same tables, exact with
    the noise seam: the set measured through one matrix goes through the same tasks on either store, and so
    does an explicit query matrix (on [sex, region])."""
    no_noise(monkeypatch)
    bucket = moto_client.store_root
    dataset, idx = make_dataset(bucket, seed=5, name="pairs.parquet")
    rows = [[1, 1, 1, 0, 0, 0], [1, -1, 0, 1, -1, 0], [0, 0, 1, 0, 0, 1]]  # over sex x region
    workload = [*WORKLOAD[:3], {"attributes": ["sex", "region"], "weight": 2.0, "queries": rows}]
    doc = pair_doc(dataset, workload, dataset_id="people-pairs")
    on_moto, on_local = on_both_executors(moto_client, tmp_path, doc)
    for a, b in zip(on_moto["tables"], on_local["tables"], strict=True):
        ta, tb = read_table(a["parquet"]), read_table(b["parquet"])
        assert ta.column_names == tb.column_names and a.get("queries") == b.get("queries")
        assert np.array_equal(ta.column("std_error").to_numpy(), tb.column("std_error").to_numpy())
        assert np.allclose(ta.column("estimate").to_numpy(), tb.column("estimate").to_numpy(), atol=1e-8)
    affine = read_table(on_moto["tables"][0]["parquet"]).column("estimate").to_numpy()
    expected = smasher.pair_queries("affine", 3, 4) @ truth(idx, ["region", "age"]).reshape(-1)
    assert on_moto["tables"][0]["queries"] == "affine" and np.max(np.abs(affine - expected)) < 1e-8
    (matrix,) = [t for t in on_moto["tables"] if t["attributes"] == ["sex", "region"]]
    got = read_table(matrix["parquet"]).column("estimate").to_numpy()
    assert matrix["queries"] == "matrix"
    assert np.max(np.abs(got - np.array(rows) @ truth(idx, ["sex", "region"]).reshape(-1))) < 1e-8
