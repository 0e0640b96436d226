"""RP+'s Schur-complement residuals (functions/dpquery/schur.py) in the job's planner: on small explicit
instances the full strategy and noise matrices are built from the plan and checked against it — the
privacy cost (the largest diagonal of BᵀΣ⁻¹B is 2ρ), unbiasedness (the reconstruction maps the noiseless
measurements to the true answers) and every answer's variance (diag of LΣLᵀ) — then under OpenDP's noise
(Monte Carlo); the plan class is never worse than residuals orthogonal to the total, and reproduces RP+'s
value on one prefix attribute."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from test_dpquery_job import make_dataset, read_table, run_core, truth
from test_dpquery_queries import general_doc

from shardfold.functions.dpquery import core, planner, smasher
from shardfold.functions.dpquery import measure as mz
from shardfold.functions.dpquery.schur import beta2_floor, schur_factors
from shardfold.functions.specs import parse_spec


def test_one_prefix_attribute_gets_rp_plus_value_and_beats_orthogonal_residuals():
    """Prefix queries on 50 values at privacy cost 1: RP+'s split of the HDMM strategy (β² = 0) gives its
    authors' 2.0254; residuals orthogonal to the total give 2.1170; the planner's choice is at least as
    good as RP+'s."""
    f, _ = schur_factors("prefix", 50)
    t, dr = float(f.outside.sum()), f.privacy * float(f.inside.sum())
    assert math.sqrt((math.sqrt(t) + math.sqrt(dr)) ** 2 / 50) == pytest.approx(2.0254, abs=5e-5)
    parts = dict(domains=[50], workload=[(0,)], rho=0.5, queries=[{0: "prefix"}])
    orthogonal = planner.plan(**parts, split_totals=False)
    split = planner.plan(**parts)
    assert orthogonal.rmse == pytest.approx(2.1170, abs=5e-5)
    assert split.rmse <= 2.0254 + 5e-5 and split.totals


def test_the_split_is_exact_for_any_weight_on_the_total():
    """V B + u 1ᵀ = I (so x = u·(1ᵀx) + V(Bx)), B u = 0 and 1ᵀu = 1, down to β²'s floor."""
    rng = np.random.default_rng(0)
    for kind, n in (("prefix", 7), ("range", 6)):
        for beta2 in (beta2_floor(kind, n), 0.0, 3.0 * n):
            f, _ = schur_factors(kind, n, beta2)
            assert np.allclose(f.inverse @ f.matrix + np.outer(f.total, np.ones(n)), np.eye(n), atol=1e-10)
            assert np.abs(f.matrix @ f.total).max() < 1e-12 and f.total.sum() == pytest.approx(1.0)
            x = rng.random(n)
            assert np.allclose(f.inverse @ (f.matrix @ x) + f.total * x.sum(), x)


# small instances: (domains, workload marginals, {marginal index: {attribute: type}})
INSTANCES = {
    "one prefix attribute": ([6], [(0,)], {0: {0: "prefix"}}),
    "prefix and identity, <=2-way": (
        [5, 3, 4],
        [(), (0,), (1,), (2,), (0, 1), (0, 2), (1, 2)],
        {1: {0: "prefix"}, 4: {0: "prefix"}, 5: {0: "prefix"}},
    ),
    "a range beside an affine pair": (
        [6, 3, 4],
        [(0,), (0, 1), (0, 2), (1, 2)],
        {0: {0: "range"}, 1: {0: "range"}, 2: {0: "range"}, 3: {1: "affine", 2: "affine"}},
    ),
}


def _plan(name: str, rho: float = 0.5) -> planner.Plan:
    domains, marginals, asked = INSTANCES[name]
    queries = [asked.get(j, {}) for j in range(len(marginals))]
    return planner.plan(domains=domains, workload=[(m, 1.0) for m in marginals], rho=rho, queries=queries)


def _measure(pl: planner.Plan, k: int, x: np.ndarray) -> np.ndarray:
    """y_k for the full data array ``x``: its marginal on set k through the set's matrices."""
    attrs = pl.residual(k)
    marginal = x.sum(axis=tuple(i for i in range(x.ndim) if i not in attrs))
    if not attrs:
        return np.atleast_1d(marginal)
    dense = pl.dense(k)
    if dense is not None:
        return dense @ marginal.reshape(-1)
    return np.asarray(
        mz.mode_product([pl.strategy(h).matrix for h in pl.set_strategies(k)], marginal)
    ).reshape(-1)


def _answers(pl: planner.Plan, j: int, values: dict[int, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    kinds = pl.marginal_types(j)
    if kinds and kinds[0] in smasher.PAIR_TYPES:
        return core.whole_answers(pl, j, values, kinds[0])
    return core.general_answers(pl, j, values)


def _true_answers(pl: planner.Plan, j: int, x: np.ndarray) -> np.ndarray:
    attrs = pl.marginal(j)
    marginal = x.sum(axis=tuple(i for i in range(x.ndim) if i not in attrs))
    kinds = pl.marginal_types(j)
    if kinds and kinds[0] in smasher.PAIR_TYPES:
        return smasher.pair_queries(kinds[0], *marginal.shape) @ marginal.reshape(-1)
    for axis, kind in enumerate(kinds):
        marginal = smasher.answer_axis(kind, marginal, axis)
    return np.asarray(marginal).reshape(-1)


@pytest.mark.parametrize("name", list(INSTANCES))
def test_the_full_matrices_give_the_plans_privacy_cost_unbiasedness_and_variances(name):
    pl = _plan(name)
    assert pl.totals, "the instance exercises a Schur split"
    domains = [int(n) for n in pl.domains]
    cells = math.prod(domains)
    units = np.eye(cells).reshape(cells, *domains)
    # the full strategy: per residual set, its matrix over every cell of the schema
    strategy = [np.stack([_measure(pl, k, e) for e in units], axis=1) for k in range(pl.num_residuals)]
    sigma2 = pl.sigma2
    # privacy: a record moves the measurements by one column of B; Σ⁻¹ weighs each set by 1/σ_k²
    per_cell = sum(np.einsum("ij,ij->j", b, b) / s for b, s in zip(strategy, sigma2, strict=True))
    two_rho = 2 * pl.rho_planned
    split_only = all(not how.startswith(("dense:", "mixed:")) for how in pl.strategy_names)
    if split_only:  # every factor's diagonal peaks on one cell: the plan's sum of peaks is exact
        assert float(per_cell.max()) == pytest.approx(two_rho, rel=1e-9)
    else:
        assert two_rho * 0.9 < float(per_cell.max()) <= two_rho * (1 + 1e-9)
    assert pl.privacy_cost() == pytest.approx(two_rho, rel=1e-12)
    # reconstruction: L (answers from the stacked measurements) is linear; L·B = W (unbiased) and
    # diag(L Σ Lᵀ) = the variances the job writes, whose mean is the plan's
    sizes = [b.shape[0] for b in strategy]
    offsets = np.cumsum([0, *sizes])
    noise = np.concatenate([np.full(m, s) for m, s in zip(sizes, sigma2, strict=True)])
    full = np.concatenate(strategy, axis=0)
    for j in range(pl.num_marginals):
        needed = set(pl.subsets(j).tolist())
        columns = []
        for c in range(offsets[-1]):
            unit = np.zeros(offsets[-1])
            unit[c] = 1.0
            values = {k: unit[offsets[k] : offsets[k + 1]] for k in needed}
            columns.append(_answers(pl, j, values)[0].reshape(-1))
        lmap = np.stack(columns, axis=1)
        w = np.stack([_true_answers(pl, j, e) for e in units], axis=1)
        assert np.abs(lmap @ full - w).max() < 1e-9 * max(1.0, np.abs(w).max())
        stated = _answers(pl, j, {k: np.zeros(sizes[k]) for k in needed})[1].reshape(-1)
        assert np.einsum("ij,j,ij->i", lmap, noise, lmap) == pytest.approx(stated, rel=1e-9)
        assert stated.mean() == pytest.approx(float(pl.var[j]), rel=1e-9)


def test_under_opendp_noise_the_answers_are_unbiased_with_the_stated_variances():
    """OpenDP's noise through measure.measure_sets (the job's measure step), R = 400 times: every answer's
    mean within 5 standard errors of the truth, its sample variance within 5 standard errors
    (5 v sqrt(2 / (R - 1)), 35 %) of the variance stated (the other Monte Carlo tests' bound)."""
    pl = _plan("prefix and identity, <=2-way", rho=2.0)
    domains = [int(n) for n in pl.domains]
    x = np.random.default_rng(5).integers(0, 30, domains)
    sets = []
    for k in range(pl.num_residuals):
        attrs = pl.residual(k)
        mats = tuple(pl.strategy(h).matrix for h in pl.set_strategies(k)) if attrs else None
        sets.append(
            mz.SetSpec(
                index=k,
                attrs=attrs,
                sizes=tuple(domains[a] for a in attrs),
                scale=math.sqrt(float(pl.sigma2[k])),
                rho_planned=float(pl.rho_s[k]),
                mats=mats,
            )
        )

    def marginal(attrs):
        return x.sum(axis=tuple(i for i in range(3) if i not in attrs)).reshape([domains[i] for i in attrs])

    runs = 400
    values, records = mz.measure_sets(sets * runs, marginal)
    per_run = int(pl.noise_count.sum())  # ∅ counts one sample
    offsets = np.cumsum([0, *(int(c) for c in pl.noise_count)])
    assert per_run == offsets[-1]
    for j in range(pl.num_marginals):
        draws = []
        for r in range(runs):
            one = values[r * per_run : (r + 1) * per_run]
            assert math.fsum(rec["rho"] for rec in records[r * len(sets) : (r + 1) * len(sets)]) <= 2.0
            draws.append(_answers(pl, j, {k: one[offsets[k] : offsets[k + 1]] for k in range(len(sets))})[0])
        draws = np.array(draws).reshape(runs, -1)
        var = _answers(pl, j, {k: np.zeros(int(offsets[k + 1] - offsets[k])) for k in range(len(sets))})[1]
        var = var.reshape(-1)
        truth_j = _true_answers(pl, j, x)
        assert np.all(np.abs(draws.mean(axis=0) - truth_j) < 5 * np.sqrt(var / runs)), pl.marginal(j)
        assert np.all(np.abs(draws.var(axis=0, ddof=1) - var) < 5 * var * math.sqrt(2 / (runs - 1)))


@pytest.mark.parametrize("seed", range(4))
def test_the_wider_class_is_never_worse_and_travels_with_the_plan(seed):
    """Random workloads of prefix, range and identity marginals (some sets reached two ways, which bars the
    split there): the planner's loss is at most QuerySmasher's class alone; the totals survive the plan
    document."""
    rng = np.random.default_rng(seed)
    domains = [int(v) for v in rng.integers(3, 9, 4)]
    marginals = [m for k in (1, 2) for m in itertools.combinations(range(4), k) if rng.random() < 0.7] or [
        (0,)
    ]
    types = {i: str(rng.choice(["prefix", "range", "identity"])) for i in range(4)}
    queries = [{i: types[i] for i in m if types[i] != "identity" and rng.random() < 0.85} for m in marginals]
    parts = dict(domains=domains, workload=[(m, 1.0) for m in marginals], rho=0.5, queries=queries)
    wide = planner.plan(**parts)
    narrow = planner.plan(**parts, split_totals=False)
    assert wide.weighted_sse <= narrow.weighted_sse * (1 + 1e-12)
    again = planner.Plan.from_doc(wide.to_doc())
    assert again.totals.keys() == wide.totals.keys()
    for i in range(4):
        a, b = again.attribute_total(i), wide.attribute_total(i)
        assert (a is None) == (b is None) and (a is None or np.array_equal(a, b))


def test_identity_workloads_are_untouched():
    pl = planner.plan(domains=[5, 4, 3], workload=[(0, 1), (1, 2), (0,)], rho=0.5)
    assert pl.totals == {} and pl.attribute_total(0) is None and pl.res_strategy is None


def test_a_job_with_prefix_queries_is_exact_through_the_split(tmp_path):
    """The job's stages (plan, measure, reconstruct) with the noise seam: every prefix answer exact, each
    marginal's mean variance the plan's, and the plan measured age through a Schur split."""
    root = f"file://{tmp_path}"
    dataset, idx = make_dataset(root)
    job_id, result = run_core(root, general_doc(dataset), noise=False)
    _, pl = core.load_plan(root, job_id)
    age = [a.name for a in parse_spec(general_doc(dataset)).attributes].index("age")
    assert pl.attribute_total(age) is not None
    for t in result["tables"]:
        tbl = read_table(t["parquet"])
        x = truth(idx, t["attributes"]).astype(np.float64)
        for axis, name in enumerate(t["attributes"]):
            x = smasher.answer_axis(t.get("queries", {}).get(name, "identity"), x, axis)
        assert np.max(np.abs(tbl.column("estimate").to_numpy() - x.reshape(-1))) < 1e-8
        assert tbl.column("variance").to_numpy().mean() == pytest.approx(float(pl.var[t["index"]]), rel=1e-9)
