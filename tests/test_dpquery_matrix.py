"""dpquery with explicit query matrices (``"queries": [[...], ...]`` on a marginal of one or two attributes,
one weight per cell): the spec's refusals name the field; a matrix's columns follow the attributes as
listed; the planner solves the sets it reaches whole, equals QuerySmasher's dense reference, and plans a
named 2-way type given as its matrix exactly as the type; a job answers every row exactly with the noise
seam, with the variance its pieces give; and rows that reach no piece of a set (contrasts, a query constant
along an attribute) still leave every set measured."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from smash_reference import plan_dense
from test_dpquery_job import make_dataset, read_table, run_core, spec_doc, truth

from shardfold.functions.dpquery import core, planner, smasher
from shardfold.functions.dpquery.sizing import rmse_by_query_type
from shardfold.functions.dpquery.spec import QueryMatrix
from shardfold.functions.errors import SpecError
from shardfold.functions.specs import parse_spec

RNG = np.random.default_rng(7)
# over [age, region] as listed (4 x 3 cells, region varying fastest): five arbitrary weighted sums
AGE_REGION = RNG.integers(-2, 3, (5, 12)).astype(float)
AGE_STEPS = [[1, -1, 0, 0], [0, 1, -1, 0], [0, 0, 1, -1]]  # differences of neighbouring age bins: sum 0
BY_AGE = np.kron([[1.0, 1.0]], np.eye(4))  # on [sex, age], constant along sex: the age bins again
WORKLOAD = [
    {"attributes": ["age", "region"], "queries": AGE_REGION.tolist()},
    {"attributes": ["age"], "queries": AGE_STEPS},
    {"attributes": ["sex", "age"], "queries": BY_AGE.tolist()},
    {"attributes": ["sex"]},
    {"attributes": []},  # the total: a marginal with no attribute, so no type to read
]


# --- the spec -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry, field, words",
    [
        ({"attributes": ["sex", "region", "age"], "queries": [[1] * 24]}, "queries", "the marginal has 3"),
        (
            {"attributes": ["age", "region"], "queries": [[1] * 12, [1] * 11]},
            "queries.1",
            "11 entries.*12 cells",
        ),
        ({"attributes": ["age"], "queries": [[0, 0, 0, 0]]}, "queries", "asks nothing"),
        ({"attributes": ["age"], "queries": []}, "queries", "at least one row"),
        ({"attributes": ["age"], "queries": [[1, "2", 0, 0]]}, "queries", "row 0, entry 1 is not 0 or"),
        ({"attributes": ["age"], "queries": [[1, True, 0, 0]]}, "queries", "row 0, entry 1 is not 0 or"),
        ({"attributes": ["age"], "queries": [1, 0, 0, 0]}, "queries", "row 0 is not a list"),
        ({"attributes": ["age"], "queries": [[10**400, 0, 0, 1]]}, "queries", "row 0, entry 0 is not 0 or"),
        ({"attributes": ["age"], "queries": [[1e200, 0, 0, 1]]}, "queries", "magnitude 1e-12 to 1e\\+12"),
        ({"attributes": ["age"], "queries": [[1, -1e-200, 0, 0]]}, "queries", "row 0, entry 1 is not 0 or"),
    ],
)
def test_a_bad_matrix_is_refused_naming_the_field(entry, field, words):
    with pytest.raises(SpecError, match=words) as err:
        parse_spec(spec_doc("file:///x.parquet", workload=[entry]))
    assert f"workload.0.{field}" in str(err.value)


def test_a_matrix_on_attributes_of_many_values_is_refused():
    schema = [{"name": "a", "range": [0, 59]}, {"name": "b", "range": [0, 29]}]
    doc = spec_doc(
        "file:///x.parquet", schema=schema, workload=[{"attributes": ["a", "b"], "queries": [[1]]}]
    )
    with pytest.raises(SpecError, match=r"workload\.0\.queries.*60 x 30 values.*at most 1600.*here 1,711"):
        parse_spec(doc)


def test_the_columns_follow_the_attributes_as_listed():
    """[age, region] as listed is region-fastest; the plan's cells are schema order (region, age)."""
    spec = parse_spec(spec_doc("file:///x.parquet", workload=WORKLOAD))
    (matrix,) = set(spec.marginal_queries()[0].values())
    assert isinstance(matrix, QueryMatrix) and matrix.rows.shape == (5, 12)
    listed = AGE_REGION.reshape(5, 4, 3)  # [query, age, region]
    np.testing.assert_array_equal(matrix.rows, listed.transpose(0, 2, 1).reshape(5, 12))
    assert spec.marginal_queries()[1] == {2: QueryMatrix(AGE_STEPS)}


# --- the plan -----------------------------------------------------------------------------------------------


def test_the_planner_equals_the_dense_reference_and_a_named_type_given_as_its_matrix():
    domains = [5, 4, 3]
    two = QueryMatrix(RNG.normal(size=(7, 20)))
    one = QueryMatrix(RNG.normal(size=(3, 3)))
    workload = [((0, 1), 1.0), ((2,), 2.0), ((1, 2), 0.5)]
    queries = [{0: two, 1: two}, {2: one}, {2: "prefix"}]
    pl = planner.plan(domains=domains, workload=workload, rho=0.5, queries=queries)
    assert pl.privacy_cost() == pytest.approx(2 * pl.rho_planned, rel=1e-12)
    assert pl.marginal_types(0) == ("matrix", "matrix") and pl.marginal_types(2) == ("identity", "prefix")
    prefix = np.kron(np.eye(4), smasher.attribute_queries("prefix", 3))
    entries = [((0, 1), two.rows, 1.0), ((2,), one.rows, 2.0), ((1, 2), prefix, 0.5)]
    ref = plan_dense(domains, entries, 0.5)
    assert ref.total * 0.99 <= pl.weighted_sse <= ref.total * (1 + 1e-6)
    for j, (attrs, w, _) in enumerate(entries):
        assert pl.var[j] == pytest.approx(np.mean([ref.variance(q, attrs) for q in w]), rel=2e-2), j
    # "affine" and its own matrix are one workload: the same plan
    affine = QueryMatrix(smasher.pair_queries("affine", 5, 4))
    named = planner.plan(domains=[5, 4], workload=[(0, 1)], rho=0.5, queries=[{0: "affine", 1: "affine"}])
    given = planner.plan(domains=[5, 4], workload=[(0, 1)], rho=0.5, queries=[{0: affine, 1: affine}])
    assert given.weighted_sse == pytest.approx(named.weighted_sse, rel=1e-9)
    np.testing.assert_allclose(given.sigma2, named.sigma2, rtol=1e-9)


def test_a_pairs_cells_and_its_affine_queries_are_one_matrix():
    """A marginal is listed once: its cells and its affine queries together are one matrix of both."""
    both = QueryMatrix(np.vstack([np.eye(20), smasher.pair_queries("affine", 5, 4)]))
    pl = planner.plan(domains=[5, 4], workload=[(0, 1)], rho=0.5, queries=[{0: both, 1: both}])
    ref = plan_dense([5, 4], [((0, 1), both.rows, 1.0)], 0.5)
    assert ref.total * 0.99 <= pl.weighted_sse <= ref.total * (1 + 1e-6)
    assert int(pl.queries[0]) == 20 + 8


def test_matrices_of_small_weights_are_planned_as_their_multiples():
    """Two 1-way matrices of rates (weights ~1e-7): each set gets its own solve, and the variances are the
    weights' scale squared times those of the same matrices at scale 1 (their Grams once shared a key)."""

    def variances(s):
        a, b = QueryMatrix([[s, s, 0, 0, 0]]), QueryMatrix([[s, 3 * s, 0, 0, 0]])
        return planner.plan(domains=[5, 5], workload=[(0,), (1,)], rho=1.0, queries=[{0: a}, {1: b}]).var

    np.testing.assert_allclose(variances(1e-7) / 1e-14, variances(1.0), rtol=1e-6)


def test_named_types_are_not_floored():
    """abs_diff on 2 x 2 has no piece on {a} or {b}: as a named type its plan spends nothing there, and
    solves nothing there either (a fit to a zero Gram overflowed and divided by zero)."""
    import warnings

    assert smasher.whole_piece_grams("abs_diff", 2, 2) is smasher.pair_piece_grams("abs_diff", 2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pl = planner.plan(
            domains=[2, 2], workload=[(0, 1)], rho=1.0, queries=[{0: "abs_diff", 1: "abs_diff"}]
        )
    index = pl.residual_index()
    assert float(pl.rho_s[index[(0,)]]) < 1e-12 and float(pl.rho_s[index[(1,)]]) < 1e-12
    assert float(pl.var[0]) == pytest.approx(0.6545, abs=1e-4)  # 0.6636 with those sets floored


def test_bare_plans_check_the_matrices_too():
    m = QueryMatrix(np.ones((1, 4)))
    with pytest.raises(SpecError, match="names every attribute"):
        planner.plan(domains=[4, 5], workload=[(0, 1)], rho=1.0, queries=[{0: m}])
    with pytest.raises(SpecError, match="4 columns on a marginal of 5 cells"):
        planner.plan(domains=[4, 5], workload=[(1,)], rho=1.0, queries=[{1: m}])
    with pytest.raises(SpecError, match=r"60 x 30 values"):
        big = QueryMatrix(np.ones((1, 1800)))
        planner.plan(domains=[60, 30], workload=[(0, 1)], rho=1.0, queries=[{0: big, 1: big}])


# --- the job ------------------------------------------------------------------------------------------------


def test_a_job_answers_every_row_exactly_with_the_variance_of_its_pieces(tmp_path):
    root = f"file://{tmp_path}"
    dataset, idx = make_dataset(root)
    job_id, result = run_core(root, spec_doc(dataset, workload=WORKLOAD), noise=False)
    _, pl = core.load_plan(root, job_id)
    by_name = {",".join(t["attributes"]): t for t in result["tables"]}
    region_age = truth(idx, ["region", "age"]).astype(float)
    cases = [
        ("region,age", AGE_REGION, (1, 2), AGE_REGION.reshape(5, 4, 3).transpose(0, 2, 1).reshape(5, 12)),
        ("age", np.array(AGE_STEPS, float), (2,), np.array(AGE_STEPS, float)),
        ("sex,age", BY_AGE, (0, 2), BY_AGE),
    ]
    expected = {
        "region,age": AGE_REGION @ region_age.T.reshape(-1),  # the matrix's cells: age-major, as listed
        "age": np.array(AGE_STEPS) @ truth(idx, ["age"]),
        "sex,age": BY_AGE @ truth(idx, ["sex", "age"]).reshape(-1),
    }
    index = pl.residual_index()
    for name, rows, attrs, schema_rows in cases:
        t = by_name[name]
        assert t["queries"] == "matrix" and t["cells"] == len(rows)
        tbl = read_table(t["parquet"])
        assert tbl.schema.metadata[b"query_type"] == b"matrix"
        assert tbl.column("query").to_pylist() == [f"row {r}" for r in range(len(rows))]
        assert np.max(np.abs(tbl.column("estimate").to_numpy() - expected[name])) < 1e-8, name
        # each row's variance by its pieces through the plan's strategies, computed apart
        sizes = [int(pl.domains[a]) for a in attrs]
        want = np.zeros(len(rows))
        for r, q in enumerate(schema_rows):
            for pos, piece in smasher.pieces(q, sizes).items():
                k = index[tuple(attrs[p] for p in pos)]  # every set is measured, zero pieces' too
                inverse = core._inverses(pl, k)
                if not isinstance(inverse, np.ndarray):
                    inverse = functools.reduce(np.kron, inverse, np.ones((1, 1)))
                want[r] += float(pl.sigma2[k]) * float(np.sum((piece @ inverse) ** 2))
        np.testing.assert_allclose(tbl.column("variance").to_numpy(), want, rtol=1e-9, atol=1e-12)
        assert float(pl.var[t["index"]]) == pytest.approx(want.mean(), rel=1e-9)
    # a set no row reaches (the contrasts' total, sex under [sex, age]) is measured for little: 1e-4 of the
    # load, about 1 % of the budget, so any query stays answerable
    assert math.isfinite(pl.weighted_sse)
    assert any(row[0] == "RMSE of matrix answers" for row in rmse_by_query_type(pl))  # `shardfold plan`
    assert {(0,), (0, 2)} <= set(index)


def test_the_estimate_prices_a_matrix_solve_at_the_full_rank_rate(tmp_path):
    """A set past the full convex solver (11 x 10 dimensions) that a matrix reaches may be solved in its
    whole space, not an affine type's few directions: shardfold plan's prepare time says so."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardfold.functions import store
    from shardfold.functions.dpquery import sizing
    from shardfold.functions.estimate import estimate
    from shardfold.functions.store.uri import join

    root = f"file://{tmp_path}"
    uri = join(root, "data", "ab.parquet")
    buf = io.BytesIO()
    pq.write_table(pa.table({"a": np.arange(100) % 12, "b": np.arange(100) % 11}), buf)
    store.put(uri, buf.getvalue())
    schema = [{"name": "a", "range": [0, 11]}, {"name": "b", "range": [0, 10]}]
    affine = smasher.pair_queries("affine", 12, 11)
    prepare = {}
    for name, queries in (("affine", "affine"), ("matrix", affine.tolist())):
        doc = spec_doc(uri, schema=schema, workload=[{"attributes": ["a", "b"], "queries": queries}])
        steps = estimate(parse_spec(doc), root).steps
        prepare[name] = next(s.duration_s for s in steps if s.name == "prepare")
    rates = sizing.PLAN_S_PER_FULL_RANK_DIM15 - sizing.PLAN_S_PER_LOW_RANK_DIM15
    assert prepare["matrix"] - prepare["affine"] == pytest.approx(rates * 110**1.5, rel=1e-3)
