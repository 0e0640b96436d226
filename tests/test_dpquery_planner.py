"""dpquery planner: reference numbers, optimality against generic SDPs, privacy accounting, the spec.

Reference values come from shared/reference/dp-query.md §2.6 and §5. The SDPs are tiny (N ≤ 24 cells) so
the whole file runs in a few seconds.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from shardfold.functions.dpquery.planner import (
    MAX_MARGINAL_CELLS,
    PRIVACY_CHECK_RTOL,
    RHO_SLACK,
    Plan,
    plan,
)
from shardfold.functions.dpquery.spec import DPQuerySpec
from shardfold.functions.errors import PlanError, SpecError
from shardfold.functions.privacy import (
    MAX_RHO,
    cdp_delta,
    cdp_eps,
    cdp_rho,
    gaussian_delta,
    gaussian_eps,
    simple_eps,
)
from shardfold.functions.specs import parse_spec

HALF = 0.5  # ρ = 1/2, i.e. privacy cost 2ρ = 1, the reference's unit


def up_to(d: int, k: int) -> list[tuple[int, ...]]:
    return [c for j in range(k + 1) for c in itertools.combinations(range(d), j)]


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# ---------------------------------------------------------------------------------------------------------
# explicit matrices (independent of the planner's log-space arithmetic)


def helmert(n: int) -> np.ndarray:
    """(n−1)×n, orthonormal rows orthogonal to 1."""
    e = np.zeros((n - 1, n))
    for k in range(1, n):
        e[k - 1, :k] = 1.0
        e[k - 1, k] = -k
        e[k - 1] /= math.sqrt(k * (k + 1))
    return e


def kron(mats: list[np.ndarray]) -> np.ndarray:
    out = np.ones((1, 1))
    for m in mats:
        out = np.kron(out, m)
    return out


def marginal_matrix(domains: list[int], attrs: tuple[int, ...]) -> np.ndarray:
    return kron([np.eye(n) if i in attrs else np.ones((1, n)) for i, n in enumerate(domains)])


def residual_query(domains: list[int], s: tuple[int, ...]) -> np.ndarray:
    """B_S = ⊗_i (i ∈ S ? E_{n_i} : 1ᵀ): the orthonormal residual query on the full histogram."""
    return kron([helmert(n) if i in s else np.ones((1, n)) for i, n in enumerate(domains)])


def reconstruction_matrix(domains: list[int], a: tuple[int, ...], s: tuple[int, ...]) -> np.ndarray:
    """K_S for marginal A: ⊗_{i∈A} (i ∈ S ? E_{n_i}ᵀ : 1/n_i)."""
    return kron([helmert(domains[i]).T if i in s else np.full((domains[i], 1), 1.0 / domains[i]) for i in a])


# ---------------------------------------------------------------------------------------------------------
# reference numbers (§2.6)


@pytest.mark.parametrize(
    "d, residuals, queries, rmse",
    [(5, 26, 11_051, 3.2471), (10, 176, 124_601, 9.3481)],
)
def test_synthetic_reference(d, residuals, queries, rmse):
    p = plan(domains=[10] * d, workload=up_to(d, 3), rho=HALF)
    assert p.num_residuals == residuals
    assert p.num_queries == queries
    assert p.rmse == pytest.approx(rmse, abs=5e-5)
    # RMSE scales as 1/√(2ρ)
    q = plan(domains=[10] * d, workload=up_to(d, 3), rho=8.0)
    assert q.rmse == pytest.approx(p.rmse / 4.0, rel=1e-9)


def test_regression_case_2_3_4():
    p = plan(domains=[2, 3, 4], workload=[(0,), (0, 1), (1, 2)], rho=HALF)
    assert p.var == pytest.approx([3.6269, 1.9102, 1.5383], abs=5e-5)
    assert p.sse == pytest.approx(37.1746, abs=5e-5)
    assert [p.residual(k) for k in range(p.num_residuals)] == [(), (0,), (1,), (2,), (0, 1), (1, 2)]
    assert list(p.noise_count) == [1, 1, 2, 3, 2, 6]
    assert list(p.cells) == [2, 6, 12]
    idx = p.residual_index()
    assert [p.residual(int(k)) for k in p.subsets(1)] == [(), (0,), (1,), (0, 1)]
    assert list(p.subsets(2)) == sorted(idx[s] for s in [(), (1,), (2,), (1, 2)])


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_d100_all_3way_from_a_spec():
    spec = parse_spec(
        {
            "kind": "dpquery",
            "dataset": "data/synth.parquet",
            "schema": [{"name": f"a{i}", "range": [0, 9]} for i in range(100)],
            "workload": {"all_marginals_up_to": 3},
            "budget": {"rho": HALF},
            "dataset_id": "synth",
        }
    )
    p = plan(spec)
    assert p.num_residuals == 166_751
    assert p.num_marginals == 166_751
    assert p.total_noise_samples == 1 + 100 * 9 + 4_950 * 81 + 161_700 * 729 == 118_281_151
    assert p.num_queries == 162_196_001
    assert int(p.cells.max()) == 1000
    assert rel(p.privacy_cost(), 2 * p.rho_planned) < PRIVACY_CHECK_RTOL
    assert np.all(np.isfinite(p.log_sigma2)) and np.all(np.isfinite(p.log_var))
    assert p.names[:2] == ["a0", "a1"]
    # every S of this workload is itself a workload marginal, and the closure is ordered by (size, lex)
    assert p.residual(0) == () and p.residual(1) == (0,) and p.residual(101) == (0, 1)
    assert p.residual(p.num_residuals - 1) == (97, 98, 99)


# ---------------------------------------------------------------------------------------------------------
# optimality against generic convex programs


def sdp_weighted_sse(domains, marginals, weights) -> float:
    """min over all Gaussian matrix mechanisms at privacy cost 1: min tr(D W X⁻¹ Wᵀ) s.t. diag X ≤ 1."""
    import cvxpy as cp  # here, not at the top: 2 s to import, paid by each test worker that collects this

    rows = np.vstack(
        [math.sqrt(w) * marginal_matrix(domains, a) for a, w in zip(marginals, weights, strict=True)]
    )
    x = cp.Variable((rows.shape[1],) * 2, PSD=True)
    prob = cp.Problem(cp.Minimize(cp.matrix_frac(rows.T, x)), [cp.diag(x) <= 1])
    prob.solve(solver="CLARABEL")
    return prob.value


def sdp_max_variance(domains, marginals, weights) -> float:
    """min over all Gaussian matrix mechanisms at privacy cost 1 of max_q w_q·qᵀX⁻¹q over workload rows."""
    import cvxpy as cp

    n = int(np.prod(domains))
    x = cp.Variable((n, n), PSD=True)
    t = cp.Variable()
    cons = [cp.diag(x) <= 1]
    for a, w in zip(marginals, weights, strict=True):
        for row in marginal_matrix(domains, a):
            cons.append(w * cp.matrix_frac(row, x) <= t)
    prob = cp.Problem(cp.Minimize(t), cons)
    prob.solve(solver="CLARABEL")
    return prob.value


def singular_value_bound(domains, marginals) -> float:
    w = np.vstack([marginal_matrix(domains, a) for a in marginals])
    return float(np.sum(np.linalg.svd(w, compute_uv=False)) ** 2 / w.shape[1])


@pytest.mark.parametrize(
    "domains, marginals, weights, expected",
    [
        ([2, 3], [(0,), (1,)], None, 7.69884),
        ([2, 3], [(0, 1)], None, 6.0),
        ([3, 3, 2], [(0, 1), (0, 2), (1, 2)], None, 39.92380),
        ([2, 3, 4], [(0,), (0, 1), (1, 2)], [1.0, 3.0, 0.5], None),
    ],
)
def test_sum_of_variances_is_sdp_optimal(domains, marginals, weights, expected):
    weights = weights or [1.0] * len(marginals)
    p = plan(domains=domains, workload=list(zip(marginals, weights, strict=True)), rho=HALF)
    got = p.weighted_sse * (1 - RHO_SLACK)  # the plan spends ρ(1 − slack); the SDP spends exactly 1
    sdp = sdp_weighted_sse(domains, marginals, weights)
    assert got == pytest.approx(sdp, rel=1e-5)
    if expected is not None:
        assert got == pytest.approx(expected, abs=5e-5)
        assert got == pytest.approx(singular_value_bound(domains, marginals), rel=1e-9)


@pytest.mark.parametrize(
    "domains, marginals, weights",
    [
        ([2, 3], [(0,), (1,)], [1.0, 1.0]),
        ([2, 3], [(0, 1)], [1.0]),
        ([2, 2, 3], [(), (0,), (1, 2)], [2.0, 1.0, 1.0]),
    ],
)
def test_max_variance_is_sdp_optimal(domains, marginals, weights):
    p = plan(
        domains=domains, workload=list(zip(marginals, weights, strict=True)), rho=HALF, loss="max_variance"
    )
    assert p.solver["status"] == "optimal"
    assert rel(p.privacy_cost(), 2 * p.rho_planned) < PRIVACY_CHECK_RTOL
    got = p.max_weighted_variance * (1 - RHO_SLACK)
    assert got == pytest.approx(sdp_max_variance(domains, marginals, weights), rel=1e-5)
    # and it never does worse on its own loss than the sum-of-variances plan
    s = plan(domains=domains, workload=list(zip(marginals, weights, strict=True)), rho=HALF)
    assert p.max_weighted_variance <= s.max_weighted_variance * (1 + 1e-7)
    assert s.weighted_sse <= p.weighted_sse * (1 + 1e-9)


def test_max_variance_equalises_a_symmetric_workload():
    p = plan(domains=[4] * 5, workload=up_to(5, 2), rho=1.0, loss="max_variance")
    two_way = p.var[np.diff(p.marg_ptr) == 2]
    assert p.max_weighted_variance == pytest.approx(float(p.var.max()))
    assert np.ptp(two_way) <= 1e-6 * two_way.max()


# ---------------------------------------------------------------------------------------------------------
# privacy accounting and the predicted variances, checked with explicit matrices


@pytest.mark.parametrize("loss", ["sum_of_variances", "max_variance"])
def test_explicit_privacy_variance_and_exactness(loss):
    domains = [2, 3, 4]
    marginals = [(0,), (0, 1), (1, 2)]
    p = plan(domains=domains, workload=marginals, rho=0.3, loss=loss)
    sets = [p.residual(k) for k in range(p.num_residuals)]
    # Σ_S p_S/σ_S² = 2ρ, and Σ ρ_S = ρ (both up to the planned slack)
    assert p.privacy_cost() == pytest.approx(0.6, rel=2e-9)
    assert math.fsum(p.rho_s) == pytest.approx(0.3, rel=2e-9)
    assert rel(p.rho_planned, 0.3) == pytest.approx(RHO_SLACK, rel=1e-6)
    # the whole release is one Gaussian mechanism: the diagonal of Σ_S B_Sᵀ B_S / σ_S² is constant = 2ρ
    info = sum(
        residual_query(domains, s).T @ residual_query(domains, s) / p.sigma2[k] for k, s in enumerate(sets)
    )
    assert np.allclose(np.diag(info), 2 * p.rho_planned, rtol=1e-12)
    for k, s in enumerate(sets):  # p_S is the squared column norm of the orthonormal residual query
        assert np.allclose(np.sum(residual_query(domains, s) ** 2, axis=0), p.p[k], rtol=1e-12)
        assert residual_query(domains, s).shape[0] == p.noise_count[k]
    rng = np.random.default_rng(7)
    x = rng.integers(0, 50, size=int(np.prod(domains))).astype(np.float64)
    for j, a in enumerate(marginals):
        subs = [sets[int(k)] for k in p.subsets(j)]
        assert sorted(subs) == sorted(s for s in sets if set(s) <= set(a))
        # reconstruction from noiseless measurements is exact
        xhat = sum(reconstruction_matrix(domains, a, s) @ (residual_query(domains, s) @ x) for s in subs)
        assert np.allclose(xhat, marginal_matrix(domains, a) @ x, rtol=1e-12)
        # covariance Σ_S σ_S² K_S K_Sᵀ: every cell has the predicted variance
        cov = sum(
            p.sigma2[int(k)]
            * reconstruction_matrix(domains, a, sets[int(k)])
            @ reconstruction_matrix(domains, a, sets[int(k)]).T
            for k in p.subsets(j)
        )
        assert np.allclose(np.diag(cov), p.var[j], rtol=1e-10)


def test_log_space_survives_extreme_weights():
    base = plan(domains=[3, 5, 7, 2], workload=up_to(4, 2), rho=1.0)
    for scale in (1e-280, 1e280):
        scaled = plan(domains=[3, 5, 7, 2], workload=[(a, scale) for a in up_to(4, 2)], rho=1.0)
        assert np.allclose(scaled.log_sigma2, base.log_sigma2, rtol=0, atol=1e-9)
        assert np.allclose(scaled.var, base.var, rtol=1e-9)
    # a huge closure product: 12 attributes of 5 values, the 12-way marginal (244M cells) is refused,
    # an 11-way one (48.8M cells, 2048 residual sets) plans with p_S, v_S far outside float64 products
    with pytest.raises(PlanError, match="cells"):
        plan(domains=[5] * 12, workload=[tuple(range(12))], rho=1.0)
    p = plan(domains=[5] * 12, workload=[tuple(range(11))], rho=1.0)
    assert p.num_residuals == 2048 and int(p.cells[0]) == 5**11 < MAX_MARGINAL_CELLS
    assert rel(p.privacy_cost(), 2 * p.rho_planned) < PRIVACY_CHECK_RTOL


# ---------------------------------------------------------------------------------------------------------
# (ε, δ) conversions (§5)


def test_cks_regression_values():
    assert cdp_eps(1 / 32, 1e-3) == pytest.approx(0.6880024554878085, rel=1e-12)  # OpenDP's own test
    assert cdp_rho(1.0, 1e-9) == pytest.approx(0.014973, abs=5e-7)
    for rho, delta, cks, simple, analytic in [
        (0.5, 1e-6, 5.2215, 5.7565, 4.8866),
        (0.5, 1e-9, 6.4741, 6.9379, 6.1739),
        (0.01, 1e-6, 0.6217, 0.7534, 0.5751),
    ]:
        assert cdp_eps(rho, delta) == pytest.approx(cks, abs=5e-5)
        assert simple_eps(rho, delta) == pytest.approx(simple, abs=5e-5)
        assert gaussian_eps(rho, delta) == pytest.approx(analytic, abs=5e-5)


def test_conversions_are_conservative_inverses():
    for eps, delta in [(1.0, 1e-9), (0.1, 1e-6), (8.0, 1e-5)]:
        rho = cdp_rho(eps, delta)
        assert cdp_delta(rho, eps) <= delta
        assert cdp_eps(rho, delta) <= eps * (1 + 1e-12)
        assert cdp_eps(rho, delta) == pytest.approx(eps, rel=1e-9)
    for rho, delta in [(0.5, 1e-9), (1e-4, 1e-6), (4.0, 1e-3)]:
        e = gaussian_eps(rho, delta)
        assert gaussian_delta(rho, e) <= delta
        assert gaussian_eps(rho, delta) <= cdp_eps(rho, delta) <= simple_eps(rho, delta)
    # the exact Gaussian curve against scipy's normal CDF
    from scipy.stats import norm

    mu = math.sqrt(2 * 0.5)
    for eps in (0.0, 1.0, 5.0):
        ref = norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)
        assert gaussian_delta(0.5, eps) == pytest.approx(ref, rel=1e-9)


def test_privacy_report_at_the_budget_delta():
    spec = parse_spec(dict(SPEC, budget={"epsilon": 1.0, "delta": 1e-9}))
    p = plan(spec)
    report = p.privacy_report()
    assert report["rho"] == pytest.approx(0.014973, abs=5e-7)
    assert report["delta"] == 1e-9
    assert report["epsilon_cks"] == pytest.approx(1.0, rel=1e-9)
    assert report["epsilon_gaussian"] < report["epsilon_cks"] < report["epsilon_simple"]
    assert report["sum_rho_s"] <= report["rho"]
    assert plan(parse_spec(dict(SPEC))).delta == 1e-9  # a plain rho budget reports at δ = 1e-9


# ---------------------------------------------------------------------------------------------------------
# document form and fan-out helpers


def test_doc_round_trip_is_exact_and_compact():
    p = plan(domains=[10] * 20, workload=up_to(20, 3), rho=0.1)
    text = json.dumps(p.to_doc())
    q = Plan.from_doc(json.loads(text))
    for name in Plan._ARRAYS:
        a, b = getattr(p, name), getattr(q, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert (q.rho, q.rho_planned, q.loss, q.delta, q.names) == (
        p.rho,
        p.rho_planned,
        p.loss,
        p.delta,
        p.names,
    )
    assert q.summary() == p.summary()
    assert len(text) < 200 * p.num_residuals  # arrays, not dicts per set
    with pytest.raises(PlanError, match="version"):
        Plan.from_doc(dict(p.to_doc(), version=99))


def test_fan_out_groups():
    p = plan(domains=[10] * 12, workload=up_to(12, 3), rho=1.0)
    groups = p.residual_groups(20_000)
    assert groups[0][0] == 0 and groups[-1][1] == p.num_residuals
    assert all(a[1] == b[0] for a, b in itertools.pairwise(groups))
    counts = [int(p.noise_count[a:b].sum()) for a, b in groups]
    assert sum(counts) == p.total_noise_samples
    assert max(counts) <= 20_000 + int(p.noise_count.max())
    assert all(c >= 20_000 for c in counts[:-1])
    assert len(p.residual_groups(10**12)) == 1
    assert len(p.residual_groups(1)) == p.num_residuals

    mgroups = p.marginal_groups(50_000)
    assert mgroups[0][0] == 0 and mgroups[-1][1] == p.num_marginals
    assert all(a[1] == b[0] for a, b in itertools.pairwise(mgroups))
    start, stop = mgroups[1]
    need = p.needed_residuals(start, stop)
    assert np.array_equal(need, np.unique(np.concatenate([p.subsets(j) for j in range(start, stop)])))
    owner = Plan.group_of(need, groups)
    for r, g in zip(need, owner, strict=True):
        assert groups[g][0] <= r < groups[g][1]


# ---------------------------------------------------------------------------------------------------------
# bad input


def test_plan_parts_errors_name_the_field():
    with pytest.raises(SpecError) as err:
        plan(domains=[2, 1], workload=[(0,), (0,), (5,)], rho=0.0, loss="mean")
    fields = {e["field"] for e in err.value.errors}
    assert fields == {"domains.1", "rho", "loss", "workload.1", "workload.2"}
    with pytest.raises(SpecError, match="workload"):
        plan(domains=[2, 3], workload=[], rho=1.0)


def test_workload_errors_name_each_entry_and_what_it_repeats():
    workload = [(1, 0), ((0, 1), 2.0), (2, 2), ((1,), 0.0), (0, 1), (1,), (3,), ((1,), math.nan), ()]
    with pytest.raises(SpecError) as err:
        plan(domains=[2, 3, 4], workload=workload, rho=1.0)
    assert err.value.errors == [
        {"field": "workload.1", "error": "repeats workload.0 ((0, 1))"},  # attributes in any order, weighted
        {"field": "workload.2", "error": "bad attribute indices (2, 2) for d = 3"},
        {"field": "workload.3", "error": "weight must be finite and > 0, got 0.0"},
        {"field": "workload.4", "error": "repeats workload.0 ((0, 1))"},
        {"field": "workload.6", "error": "bad attribute indices (3,) for d = 3"},
        {"field": "workload.7", "error": "weight must be finite and > 0, got nan"},
    ]
    # the same workload less its faults plans, attributes sorted, in the order given
    p = plan(domains=[2, 3, 4], workload=[(1, 0), (1,), ()], rho=1.0)
    assert [p.marginal(j) for j in range(3)] == [(0, 1), (1,), ()]


@pytest.mark.parametrize("rho", [1e308, 5e307, 1e100, MAX_RHO * 1.01, math.inf, math.nan])
def test_a_rho_beyond_the_largest_budget_is_a_clear_error(rho):
    """ρ = 1e308 used to fail as "internal: the allocation costs … nan" (2ρ overflows), 1e100 as a bare
    OverflowError in the ε report."""
    with pytest.raises(SpecError, match=r"rho: must be a number > 0 and at most 1e\+06") as err:
        plan(domains=[2, 3], workload=[(0,), (0, 1)], rho=rho)
    assert {e["field"] for e in err.value.errors} == {"rho"}
    if math.isfinite(rho):
        with pytest.raises(SpecError, match=r"budget\.rho: .*rho .* is more than 1e\+06") as err:
            parse_spec(dict(SPEC, budget={"rho": rho}))
        assert {e["field"] for e in err.value.errors} == {"budget.rho"}


def test_the_largest_budget_plans_and_reports():
    p = plan(domains=[2, 3, 4], workload=[(0,), (0, 1), (1, 2)], rho=MAX_RHO)
    report = p.summary()["privacy"]
    assert all(math.isfinite(v) for k, v in report.items() if isinstance(v, float)), report
    assert math.isfinite(float(p.sigma2.min())) and float(p.sigma2.min()) > 0
    spec = parse_spec(dict(SPEC, budget={"epsilon": MAX_RHO, "delta": 0.5}))
    assert 0 < spec.rho() <= MAX_RHO and plan(spec).rho == spec.rho()


SPEC = {
    "kind": "dpquery",
    "dataset": "s3://bucket/people.csv",
    "schema": [
        {"name": "sex", "categories": ["F", "M"]},
        {"name": "age", "range": [0, 99], "bin_width": 10},
        {"name": "region", "categories": [1, 2, 3]},
    ],
    "workload": [{"attributes": ["sex", "age"]}, {"attributes": ["region"], "weight": 2}],
    "budget": {"rho": 0.5},
    "dataset_id": "people-2026",
}


def test_spec_parses_and_round_trips():
    spec = parse_spec(SPEC)
    assert isinstance(spec, DPQuerySpec)
    assert spec.format == "csv" and spec.loss == "sum_of_variances"
    assert spec.domains() == [2, 10, 3]
    assert spec.marginals() == [((0, 1), 1.0), ((2,), 2.0)]
    assert spec.attributes[1].labels()[:2] == ["0..9", "10..19"]
    assert parse_spec(spec.model_dump(mode="json", exclude_none=True)) == spec
    assert "schema" in spec.model_dump(mode="json")
    gen = parse_spec(dict(SPEC, workload={"all_marginals_up_to": 2, "attributes": ["region", "sex"]}))
    assert gen.marginals() == [((), 1.0), ((0,), 1.0), ((2,), 1.0), ((0, 2), 1.0)]
    assert parse_spec(dict(SPEC, dataset="d/x.PQ")).format == "parquet"
    assert parse_spec(dict(SPEC, dataset="d/x", format="parquet")).format == "parquet"
    odd = parse_spec(
        dict(
            SPEC,
            schema=[{"name": "age", "range": [0, 10], "bin_width": 5}],
            workload={"all_marginals_up_to": 1},
        )
    )
    assert odd.domains() == [3] and odd.attributes[0].labels() == ["0..4", "5..9", "10..10"]


def fields_of(doc) -> set[str]:
    with pytest.raises(SpecError) as err:
        parse_spec(doc)
    return {e["field"] for e in err.value.errors}


@pytest.mark.parametrize(
    "change, field",
    [
        ({"workload": []}, "workload"),
        ({"workload": [{"attributes": ["sex", "height"]}]}, "workload.0.attributes.1"),
        ({"workload": {"all_marginals_up_to": 2, "attributes": ["shoe"]}}, "workload.attributes.0"),
        ({"workload": [{"attributes": ["sex", "sex"]}]}, "workload.0.attributes"),
        ({"workload": [{"attributes": ["sex"]}, {"attributes": ["sex"]}]}, "workload.1.attributes"),
        ({"workload": [{"attributes": ["sex"], "weight": 0}]}, "workload.0.weight"),
        ({"workload": {"all_marginals_up_to": 4, "attributes": None}}, None),
        ({"budget": {"rho": 0}}, "budget.rho"),
        ({"budget": {"rho": -1}}, "budget.rho"),
        ({"budget": {"epsilon": 1, "delta": 0}}, "budget.delta"),
        ({"budget": {"epsilon": 1, "delta": 1}}, "budget.delta"),
        ({"budget": {"epsilon": 0, "delta": 1e-6}}, "budget.epsilon"),
        ({"budget": {"epsilon": 1e308, "delta": 1e-6}}, "budget.epsilon"),
        ({"budget": {"rho": 1e308}}, "budget.rho"),
        ({"budget": {"epsilon": 1}}, "budget"),
        ({"budget": {"rho": 1, "epsilon": 1, "delta": 1e-6}}, "budget"),
        ({"budget": {"rho": 1.0}, "dataset_budget_rho": 0.5}, "budget.rho"),
        ({"budget": {"epsilon": 5.0, "delta": 1e-6}, "dataset_budget_rho": 0.1}, "budget"),
        ({"dataset_budget_rho": 0}, "dataset_budget_rho"),
        ({"loss": "mean"}, "loss"),
        ({"dataset_id": "../other"}, "dataset_id"),
        ({"dataset": "s3://bucket/people.json"}, "format"),
        ({"schema": []}, "schema"),
        ({"schema": SPEC["schema"] + [{"name": "sex", "categories": ["x", "y"]}]}, "schema.3.name"),
        ({"schema": [{"name": "sex", "categories": ["F"]}]}, "schema.0"),
        ({"schema": [{"name": "sex", "categories": ["F", "F"]}]}, "schema.0"),
        ({"schema": [{"name": "age", "range": [9, 0]}]}, "schema.0"),
        ({"schema": [{"name": "age", "range": [0, 9], "bin_width": 10}]}, "schema.0"),
        ({"schema": [{"name": "age", "range": [0, 9], "bin_width": 0}]}, "schema.0.bin_width"),
        ({"schema": [{"name": "age", "categories": ["a", "b"], "range": [0, 9]}]}, "schema.0"),
        ({"schema": [{"name": "age", "categories": ["a", "b"], "bin_width": 2}]}, "schema.0"),
        ({"schema": [{"name": "age", "range": [0, 10**8]}]}, "schema.0"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_spec_errors_name_the_field(change, field):
    doc = {**SPEC, **change}
    if field is None:  # a generator over the 3-attribute schema: k beyond d is fine (all marginals)
        assert len(parse_spec(doc).marginals()) == 8
        return
    assert field in fields_of(doc)


def test_spec_reports_every_problem_at_once():
    doc = {
        **SPEC,
        "workload": [{"attributes": ["nope"]}, {"attributes": ["sex", "sex"]}],
        "dataset": "x.txt",
        "schema": SPEC["schema"] + [{"name": "sex", "categories": [0, 1]}],
    }
    assert fields_of(doc) == {"format", "schema.3.name", "workload.0.attributes.0", "workload.1.attributes"}


def test_huge_generator_is_refused():
    doc = {
        **SPEC,
        "schema": [{"name": f"a{i}", "categories": [0, 1]} for i in range(200)],
        "workload": {"all_marginals_up_to": 4},
    }
    assert fields_of(doc) == {"workload.all_marginals_up_to"}
