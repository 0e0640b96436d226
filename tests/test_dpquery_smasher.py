"""QuerySmasher's planning core (functions/dpquery/smasher.py): the decomposition's worked example and
theorems, the per-attribute strategies, identity workloads equal to ResidualPlanner, a prefix workload
never worse than summing ResidualPlanner's cells, and the joint privacy cost."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from smash_reference import Entry, answer, apply, plan_dense, plan_kron, reconstruct_partition

from shardfold.functions.dpquery import measure, smasher
from shardfold.functions.dpquery.planner import plan as rp_plan
from shardfold.functions.errors import PlanError, SpecError


def test_the_papers_worked_example():
    # reference §3.3 (QuerySmasher Figs. 2-3): domains [2, 3], q = [0, 1, 1, 0, 0, 1]
    got = smasher.pieces(np.array([0, 1, 1, 0, 0, 1.0]), [2, 3])
    want = {
        (): [1 / 2],
        (0,): [1 / 6, -1 / 6],
        (1,): [-1 / 2, 0, 1 / 2],
        (0, 1): [-1 / 6, 1 / 3, -1 / 6, 1 / 6, -1 / 3, 1 / 6],
    }
    assert set(got) == set(want)
    for part, piece in want.items():
        np.testing.assert_allclose(got[part], piece, atol=1e-15)


def _marginal(x: np.ndarray, part: tuple[int, ...]) -> np.ndarray:
    return x.sum(axis=tuple(i for i in range(x.ndim) if i not in part)).reshape(-1)


@pytest.mark.parametrize("domains", [[2, 3], [4], [3, 2, 5], [2, 2, 2, 3]])
def test_pieces_are_orthogonal_and_sum_to_the_answer(domains):
    rng = np.random.default_rng(len(domains))
    q = rng.normal(size=math.prod(domains))
    x = rng.integers(0, 50, size=domains).astype(np.float64)
    got = smasher.pieces(q, domains)
    assert len(got) == 2 ** len(domains)
    # Theorem 3: the answer is the sum of the pieces' answers on the marginals
    assert math.isclose(sum(got[p] @ _marginal(x, p) for p in got), q @ x.reshape(-1), rel_tol=1e-12)
    # Theorem 2: lifted back to the full cells, two different pieces are orthogonal
    lifted = {}
    for part, piece in got.items():
        full = piece.reshape([domains[i] for i in part])
        for axis in range(len(domains)):
            if axis not in part:
                full = np.expand_dims(full, axis)
        lifted[part] = np.broadcast_to(full, domains).reshape(-1)
    for a, b in itertools.combinations(lifted, 2):
        assert abs(lifted[a] @ lifted[b]) < 1e-10 * (1 + np.linalg.norm(q) ** 2)
    # each piece on A' is in the residual space of x_{A'}: it sums to 0 along every axis of A'
    for part, piece in got.items():
        shaped = piece.reshape([domains[i] for i in part])
        for axis in range(len(part)):
            np.testing.assert_allclose(shaped.sum(axis=axis), 0, atol=1e-10)


@pytest.mark.parametrize("kind", smasher.ATTRIBUTE_TYPES)
def test_query_matrices(kind):
    w = smasher.attribute_queries(kind, 4)
    rows = {"identity": 4, "prefix": 4, "range": 10, "circular_range": 13}[kind]
    assert w.shape == (rows, 4) and set(np.unique(w)) <= {0.0, 1.0}
    assert len({tuple(r) for r in w}) == rows  # no query twice
    with pytest.raises(SpecError, match="unknown query type"):
        smasher.attribute_queries("median", 4)


@pytest.mark.parametrize(
    "domains, workload",
    [
        ([2, 3, 4], [(0,), (0, 1), (1, 2)]),
        ([5, 5, 5, 5], [(0, 1), (1, 2), (2, 3), (0, 3)]),
        ([10] * 6, [c for k in range(4) for c in itertools.combinations(range(6), k)]),
        ([3, 7, 2, 9], [((0, 1, 2), 2.0), ((3,), 0.5), ((1, 3), 1.0)]),
    ],
)
def test_an_identity_workload_is_residual_planner(domains, workload):
    rho = 0.5
    rp = rp_plan(domains=domains, workload=workload, rho=rho)
    entries = [
        Entry(e[0], e[1]) if len(e) == 2 and isinstance(e[0], tuple) else Entry(tuple(e)) for e in workload
    ]
    qs = plan_kron(domains, entries, rp.rho_planned)
    sse = float(np.sum(rp.weights * rp.cells * rp.var))
    assert math.isclose(qs.total, sse, rel_tol=1e-12)
    # RP measures E_S x_S (pcost p_S); here B_S = E_S/√p_S (pcost 1): the same mechanism, σ² scaled by p_S
    for s in range(rp.num_residuals):
        p_s = math.exp(rp.log_p[s])
        assert math.isclose(qs.sigma2[rp.residual(s)] * p_s, rp.sigma2[s], rel_tol=1e-12)
    assert math.isclose(qs.privacy_cost(), 2 * rp.rho_planned, rel_tol=1e-12)


def _kron(mats):
    out = np.ones((1, 1))
    for m in mats:
        out = np.kron(out, m)
    return out


def _queries(domains, entry):
    """The entry's query rows over the cells of its attributes (C order), and each row's weight."""
    w = _kron([smasher.attribute_queries(entry.kind(i), domains[i]) for i in entry.attrs])
    return w, np.full(w.shape[0], entry.weight)


def _explicit_variance(domains, entries, qs):
    """Σ_q w_q Var(q), each query answered from its pieces with the plan's strategies and noise scales."""
    total = 0.0
    for e in entries:
        rows, weights = _queries(domains, e)
        sub = [domains[i] for i in e.attrs]
        for q, w in zip(rows, weights, strict=True):
            for pos, piece in smasher.pieces(q, sub).items():
                part = tuple(e.attrs[k] for k in pos)
                if part not in qs.sigma2:
                    assert np.allclose(piece, 0)
                    continue
                gram = _kron([qs.strategies[part][i].gram for i in part])
                total += w * qs.sigma2[part] * piece @ np.linalg.pinv(gram, rcond=1e-10) @ piece
    return total


def _residual_planner_substitute(domains, entries, rho):
    """The same queries answered by summing the cells of ResidualPlanner's identity marginals."""
    rp = rp_plan(domains=domains, workload=[(e.attrs, e.weight) for e in entries], rho=rho)
    total = 0.0
    for j, e in enumerate(entries):
        rows, weights = _queries(domains, e)
        cov = 0.0
        for s in rp.subsets(j):
            res = rp.residual(s)
            blocks = [
                np.eye(domains[i]) - 1 / domains[i]
                if i in res
                else np.full((domains[i],) * 2, 1 / domains[i] ** 2)
                for i in e.attrs
            ]
            cov = cov + rp.sigma2[s] * _kron(blocks)
        total += float(np.sum(weights * np.einsum("qi,ij,qj->q", rows, cov, rows)))
    return total, rp


PREFIX_WORKLOADS = [
    (
        [6, 2],
        [Entry((0, 1), 1.0, {0: "prefix"}), Entry((0,), 1.0, {0: "prefix"})],
    ),
    (
        [5, 4, 3],
        [
            Entry((0, 1), 1.0, {0: "prefix", 1: "prefix"}),
            Entry((1, 2), 2.0, {1: "prefix"}),
        ],
    ),
    ([7, 3], [Entry((0, 1), 1.0, {0: "range"}), Entry((1,), 1.0)]),
    ([6], [Entry((0,), 1.0, {0: "circular_range"})]),
]


@pytest.mark.parametrize("domains, entries", PREFIX_WORKLOADS)
def test_general_queries_beat_summing_residual_planner_cells(domains, entries):
    substitute, rp = _residual_planner_substitute(domains, entries, 0.5)
    qs = plan_kron(domains, entries, rp.rho_planned)
    assert math.isclose(_explicit_variance(domains, entries, qs), qs.total, rel_tol=1e-6)
    assert qs.total <= substitute * (1 + 1e-9), (qs.total, substitute)
    assert any(s.solver != "identity" for per in qs.strategies.values() for s in per.values())


@pytest.mark.parametrize("domains, entries", PREFIX_WORKLOADS)
def test_the_joint_privacy_cost_is_exactly_two_rho(domains, entries):
    rho = 0.25
    qs = plan_kron(domains, entries, rho)
    # diag(Σ_{A'} BᵀB/σ²) over every cell of the full domain: each record's squared sensitivity
    cost = np.zeros(domains)
    for part, sigma2 in qs.sigma2.items():
        diag = np.ones([domains[i] if i in part else 1 for i in range(len(domains))])
        for i in part:
            shape = [1] * len(domains)
            shape[i] = domains[i]
            diag = diag * np.diag(qs.strategies[part][i].gram).reshape(shape)
        cost = cost + diag / sigma2
    assert math.isclose(float(cost.max()), 2 * rho, rel_tol=1e-9)
    assert math.isclose(qs.privacy_cost(), 2 * rho, rel_tol=1e-12)


def test_an_attribute_queried_two_ways_is_refused_naming_the_entry():
    entries = [Entry((0, 1), 1.0, {0: "prefix"}), Entry((0,), 1.0)]
    with pytest.raises(SpecError, match=r"workload\.1: attribute 0 is queried as 'identity'"):
        plan_kron([4, 3], entries, 0.5)


# --- measure and answer -------------------------------------------------------------------------------------

MIXED = [Entry((0, 1), 1.0, {0: "prefix"}), Entry((0,), 2.0, {0: "prefix"})]


def _measured(domains, entries, rho):
    qs = plan_kron(domains, entries, rho)
    mats = {part: [smasher.strategy_matrix(per[i]) for i in part] for part, per in qs.strategies.items()}
    return qs, mats


def _marginal_shaped(x, part):
    drop = tuple(i for i in range(x.ndim) if i not in part)
    return x.sum(axis=drop) if drop else x


def test_the_charged_norm_sums_the_squares_exactly():
    """Each column's Σ v² as the exact rational (what the sensitivity is charged from), for entries of
    wildly different exponents and zeros, equal to Fraction arithmetic's."""
    from fractions import Fraction

    rng = np.random.default_rng(0)
    b = rng.standard_normal((30, 6)) * np.exp(rng.uniform(-30, 30, (30, 6)))
    b[0, 0] = b[:, 5] = 0.0
    for j in range(b.shape[1]):
        assert measure._exact_square_norm(b[:, j]) == sum(Fraction(float(v)) ** 2 for v in b[:, j])
    norms = [sum(Fraction(float(v)) ** 2 for v in b[:, j]) for j in range(b.shape[1])]
    assert measure.charged_norm([b]) == measure.sqrt_up(max(norms))


def test_without_noise_every_query_is_answered_exactly_in_or_out_of_the_workload():
    domains = [4, 3]
    qs, mats = _measured(domains, MIXED, 0.5)
    x = np.random.default_rng(3).integers(0, 40, size=domains).astype(np.float64)
    est = {
        part: reconstruct_partition(apply(mats[part], _marginal_shaped(x, part)), mats[part])
        for part in qs.sigma2
    }
    rng = np.random.default_rng(4)
    queries = [row for e in MIXED for row in _queries(domains, e)[0]] + list(rng.normal(size=(5, 12)))
    for q in queries:  # the workload's prefix sums (1- and 2-way) and arbitrary queries on both attributes
        attrs = (0, 1) if q.size == 12 else (0,)
        value, var = answer(q, attrs, domains, est, qs, mats)
        assert math.isclose(value, q @ _marginal_shaped(x, attrs).reshape(-1), rel_tol=1e-9, abs_tol=1e-9)
        assert var > 0
    # each partition's strategy is scaled to privacy cost 1: its charged sensitivity is 1, to rounding
    for part in qs.sigma2:
        assert math.isclose(measure.charged_norm(mats[part]), 1.0, rel_tol=1e-9)
        charged = measure.charged_norm(mats[part], 2, 10**9)  # k rows per person, the rounding charged
        assert charged > 2.0 if part else charged == 2.0  # the total is exact


@pytest.mark.slow  # thousands of OpenDP draws
def test_monte_carlo_unbiased_with_the_predicted_variance_under_opendp_noise():
    from shardfold.functions.dpquery import measure as mz

    runs, domains, rho = 3000, [4, 3], 0.5
    qs, mats = _measured(domains, MIXED, rho)
    x = np.random.default_rng(5).integers(0, 30, size=domains).astype(np.float64)
    draws = {}
    for part, sigma2 in qs.sigma2.items():
        y = apply(mats[part], _marginal_shaped(x, part))
        d_in = measure.charged_norm(mats[part])
        noisy, spent = mz.release(np.tile(y, runs), math.sqrt(sigma2), d_in)
        assert spent <= d_in**2 / (2 * sigma2) * (1 + 1e-9)  # the sampler's map, for R releases at once
        draws[part] = np.stack([reconstruct_partition(r, mats[part]) for r in noisy.reshape(runs, y.size)])
    for e in MIXED:
        rows, _ = _queries(domains, e)
        truth = rows @ _marginal_shaped(x, e.attrs).reshape(-1)
        for q, t in zip(rows, truth, strict=True):
            # every run's answer Σ_{A'} piece·x̂_{A'} at once; the variance is the plan's, from answer()
            _, var = answer(q, e.attrs, domains, {p: d[0] for p, d in draws.items()}, qs, mats)
            answers = sum(
                draws[tuple(e.attrs[k] for k in pos)] @ piece
                for pos, piece in smasher.pieces(q, [domains[i] for i in e.attrs]).items()
            )
            assert abs(answers.mean() - t) / math.sqrt(var / runs) < 5, (e.attrs, q)
            assert abs(answers.var(ddof=1) - var) < 5 * var * math.sqrt(2 / runs), (
                e.attrs,
                q,
                answers.var(),
                var,
            )


def _conic_optimum(a: np.ndarray, u: np.ndarray) -> float:
    """min tr(Ā M⁻¹) s.t. diag(U M Uᵀ) ≤ 1 by a generic conic solver (small domains only)."""
    import cvxpy as cp

    w, v = np.linalg.eigh(a)
    keep = w > 1e-12 * w.max()
    m = cp.Variable(a.shape, PSD=True)
    problem = cp.Problem(
        cp.Minimize(cp.matrix_frac(v[:, keep] * np.sqrt(w[keep]), m)), [cp.diag(u @ m @ u.T) <= 1]
    )
    problem.solve(solver=cp.CLARABEL)
    return float(problem.value)


@pytest.mark.parametrize("kind", ["prefix", "range", "circular_range", "identity"])
@pytest.mark.parametrize("n", [3, 5, 8])
def test_the_attribute_strategy_is_the_convex_optimum(kind, n):
    w = smasher.attribute_queries(kind, n)
    g = w - w.mean(axis=1, keepdims=True)
    u = smasher.residual_basis(n)
    a = u.T @ g.T @ g @ u
    best = _conic_optimum(a, u)
    got = smasher._convex_strategy(a, u)  # the dual solver, also on the identity (closed form below)
    assert got.loss <= best * (1 + 1e-6) and got.loss >= best * (1 - 1e-4), (got.loss, best)
    assert math.isclose(float(np.diag(got.gram).max()), 1.0, rel_tol=1e-12)
    if kind == "identity":
        assert math.isclose(smasher.attribute_strategy(g.T @ g).loss, best, rel_tol=1e-6)


@pytest.mark.parametrize("n", [4, 5, 8])  # on 3 bins circular ranges are cells' multiple: identity's form
def test_a_circulant_gram_gets_the_closed_form_fourier_optimum(n):
    """Circular ranges are unchanged by rotating the bins, so the optimum is circulant and diagonal in the
    Fourier basis: the closed form equals the conic solver's optimum, and the dual solver's."""
    g = smasher.centred_gram("circular_range", n)
    u = smasher.residual_basis(n)
    a = u.T @ g @ u
    got = smasher.attribute_strategy(g)
    assert got.solver == "fourier"
    assert math.isclose(got.loss, _conic_optimum(a, u), rel_tol=1e-6)
    assert math.isclose(got.loss, smasher._convex_strategy(a, u).loss, rel_tol=1e-9)
    assert math.isclose(smasher.strategy_loss(g, got), got.loss, rel_tol=1e-9)  # the loss it claims
    assert np.allclose(np.diag(got.gram), 1.0) and np.allclose(got.gram @ np.ones(n), 0.0, atol=1e-12)


def test_only_a_circulant_gram_takes_the_fourier_form():
    mixed = 2.0 * smasher.centred_gram("circular_range", 7) + smasher.centred_gram("identity", 7)
    assert smasher.attribute_strategy(mixed).solver == "fourier"  # identity cells are circulant too
    for kind in ("prefix", "range"):
        assert smasher.attribute_strategy(smasher.centred_gram(kind, 7)).solver == "convex"
    c = np.zeros(8)
    c[[0, 4]] = [2.0, -2.0]  # queries x_i − x_{i+4}: five of the seven frequencies never asked
    g = np.array([np.roll(c, k) for k in range(8)])
    sparse = smasher.attribute_strategy(g)
    assert sparse.solver == "fourier" and np.linalg.matrix_rank(sparse.gram) == 7  # still answers any query
    assert math.isclose(sparse.loss, smasher.strategy_loss(g, sparse), rel_tol=1e-9)
    assert math.isclose(sparse.loss, 8.0, rel_tol=1e-5)  # (Σ√λ)²/n, the optimum, all but exactly
    big = smasher.attribute_strategy(
        smasher.centred_gram("circular_range", 256)
    )  # milliseconds in closed form
    assert big.solver == "fourier" and np.allclose(np.diag(big.gram), 1.0)


# --- a residual set reached by entries of different query types ---------------------------------------------


MIXED_SETS = [
    ([4, 3], [(1.0, ("prefix", "identity")), (2.0, ("identity", "identity"))]),
    ([5, 4], [(1.0, ("prefix", "range")), (1.0, ("range", "prefix"))]),
    ([4, 4], [(3.0, ("circular_range", "identity")), (1.0, ("identity", "prefix"))]),
]


def _terms(domains, entries):
    return [
        (w, [smasher.centred_gram(k, n) for k, n in zip(kinds, domains, strict=True)]) for w, kinds in entries
    ]


def test_the_kronecker_strategy_of_one_type_per_attribute_is_each_attributes_optimum():
    terms = _terms([5, 4], [(2.0, ("prefix", "circular_range"))])
    _, loss = smasher.kronecker_strategy(terms)
    alone = [smasher.attribute_strategy(g).loss for g in terms[0][1]]
    assert math.isclose(loss, 2.0 * alone[0] * alone[1], rel_tol=1e-6)


@pytest.mark.parametrize("domains, entries", MIXED_SETS)
def test_a_mixed_set_gets_a_kronecker_strategy_between_the_full_optimum_and_any_single_types(
    domains, entries
):
    terms = _terms(domains, entries)
    strategies, loss = smasher.kronecker_strategy(terms)
    assert all(math.isclose(float(np.diag(s.gram).max()), 1.0, rel_tol=1e-9) for s in strategies)
    recomputed = sum(
        w * math.prod(smasher.strategy_loss(g, s) for g, s in zip(grams, strategies, strict=True))
        for w, grams in terms
    )
    assert math.isclose(loss, recomputed, rel_tol=1e-12)
    # no better than the best strategy over all of the set's space (a generic conic solver, small sets)
    u = _kron([smasher.residual_basis(n) for n in domains])
    gram = sum(w * _kron(grams) for w, grams in terms)
    full = _conic_optimum(u.T @ gram @ u, u)
    assert loss >= full * (1 - 1e-4)
    # and at least as good as measuring the set for any one of its entries' types
    for _, kinds in entries:
        single = [
            smasher.attribute_strategy(smasher.centred_gram(k, n))
            for k, n in zip(kinds, domains, strict=True)
        ]
        assert loss <= sum(
            w * math.prod(smasher.strategy_loss(g, s) for g, s in zip(grams, single, strict=True))
            for w, grams in terms
        ) * (1 + 1e-9)
    assert loss <= full * 1.01, (loss, full)  # the Kronecker restriction costs little (<= 0.07 % here)


# --- explicit query matrices: 2-way affine and absolute-difference queries ----------------------------------


def test_pair_queries():
    assert smasher.pair_queries("affine", 2, 3).tolist() == [  # cells (i, j) in C order; i + j <= c
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
    ]
    assert smasher.pair_queries("abs_diff", 3, 3).tolist() == [  # |i - j| <= c
        [1, 0, 0, 0, 1, 0, 0, 0, 1],
        [1, 1, 0, 1, 1, 1, 0, 1, 1],
        [1, 1, 1, 1, 1, 1, 1, 1, 1],
    ]
    with pytest.raises(ValueError, match="unknown 2-way query type 'ratio'"):
        smasher.pair_queries("ratio", 2, 2)


def _summed_cells(domains, attrs, rows, rho):
    """Variance of the queries ``rows`` answered by summing ResidualPlanner's cells of the marginal."""
    rp = rp_plan(domains=domains, workload=[(attrs, 1.0)], rho=rho)
    cov = 0.0
    for s in rp.subsets(0):
        res = rp.residual(s)
        blocks = [
            np.eye(domains[i]) - 1 / domains[i]
            if i in res
            else np.full((domains[i],) * 2, 1 / domains[i] ** 2)
            for i in attrs
        ]
        cov = cov + rp.sigma2[s] * _kron(blocks)
    return float(np.einsum("qi,ij,qj->", rows, cov, rows)), rp


def _cost_per_cell(plan) -> np.ndarray:
    """diag(Σ_{A'} BᵀB/σ²) over every cell of the full domain: each record's squared sensitivity."""
    domains = plan.domains
    cost = np.zeros(domains)
    for part, sigma2 in plan.sigma2.items():
        diag = np.diag(plan.strategies[part].gram).reshape(
            [domains[i] if i in part else 1 for i in range(len(domains))]
        )
        cost = cost + diag / sigma2
    return cost


@pytest.mark.parametrize(
    ("kind", "sizes"), [("affine", (5, 6)), ("abs_diff", (6, 6)), ("affine", (3, 2)), ("abs_diff", (4, 7))]
)
def test_a_pair_workload_is_planned_through_its_pieces(kind, sizes):
    domains = [*sizes, 3]  # a third attribute no query asks
    rows = smasher.pair_queries(kind, *sizes)
    substitute, rp = _summed_cells(domains, (0, 1), rows, 0.5)
    pl = plan_dense(domains, [((0, 1), rows, 1.0)], rp.rho_planned)
    explicit = sum(pl.variance(q, (0, 1)) for q in rows)
    assert math.isclose(explicit, pl.total, rel_tol=1e-9)  # the loss it claims is the loss it gives
    assert pl.total < substitute * 0.95, (pl.total, substitute)  # better than summing RP's cells
    # within 2 % of the best over the whole set's space (a generic conic solver; it may answer nothing else)
    g = sum(np.outer(p, p) for p in (smasher.pieces(q, sizes)[(0, 1)] for q in rows))
    u = _kron([smasher.residual_basis(n) for n in sizes])
    assert pl.loss[(0, 1)] <= _conic_optimum(u.T @ g @ u, u) * 1.02
    contrasts = np.trace(g) * math.prod((n - 1) / n for n in sizes)  # RP's loss on the set
    assert pl.loss[(0, 1)] <= contrasts * (1 + 1e-12)
    if min(sizes) > 3:  # on the smallest sets the contrasts are already optimal
        assert pl.strategies[(0, 1)].solver == "convex" and pl.loss[(0, 1)] < 0.6 * contrasts
    # the joint privacy cost is at most 2ρ: each set's strategy costs 1 where its diagonal peaks (the
    # convex ones' diagonals vary over the cells, so the peaks need not fall on one cell)
    cost = _cost_per_cell(pl)
    assert 0.9 * 2 * rp.rho_planned < float(cost.max()) <= 2 * rp.rho_planned * (1 + 1e-9)
    # any query on the schema is answerable with a finite variance, the workload's or not
    assert 0 < pl.variance(np.arange(sizes[0] * sizes[1], dtype=float), (0, 1)) < np.inf


def test_the_factored_strategy_of_a_kronecker_gram_is_the_kronecker_strategy():
    """On a Gram that is a Kronecker product, the factored solver's partial traces are each attribute's own
    Gram times the other's loss: it ends where :func:`kronecker_strategy` does."""
    terms = _terms([5, 6], [(1.0, ("prefix", "range"))])
    _, expected = smasher.kronecker_strategy(terms)
    got = smasher.factored_strategy(_kron(terms[0][1]), [5, 6])
    assert math.isclose(got.loss, expected, rel_tol=1e-6)
    assert math.isclose(float(np.diag(got.gram).max()), 1.0, rel_tol=1e-12)


def _residual(g, sizes):
    u = _kron([smasher.residual_basis(n) for n in sizes])
    return u, u.T @ g @ u


@pytest.mark.parametrize("kind", ["affine", "abs_diff"])
def test_a_pair_set_is_solved_in_its_queries_row_space_and_stays_answerable_everywhere(kind):
    """Past the full convex solver's limit a 2-way type's set is solved in the r-dimensional row space of
    its pieces (r = 9 of 20 directions for affine on 5 x 6): there the optimum is the conic solver's over
    the whole set, and the contrasts' share keeps every other direction measured at LOW_RANK_SHARE's cost."""
    sizes = [5, 6]
    g = smasher.pair_piece_grams(kind, *sizes)[(0, 1)]
    u, a = _residual(g, sizes)
    best = _conic_optimum(a, u)  # measures only the row space: answers no other query
    got = smasher.low_rank_strategy(g, g, sizes)
    assert math.isclose(float(np.diag(got.gram).max()), 1.0, rel_tol=1e-12)  # privacy cost 1
    m = u.T @ got.gram @ u
    assert np.linalg.eigvalsh(m).min() > 1e-6  # every direction measured: any query answerable
    assert math.isclose(got.loss, float(np.trace(np.linalg.solve(m, a))), rel_tol=1e-9)  # the loss it gives
    assert best * (1 - 1e-4) <= got.loss <= best / (1 - smasher.LOW_RANK_SHARE) * (1 + 1e-3), (got.loss, best)


def test_a_pair_set_other_entries_reach_too_is_near_the_full_optimum():
    """An affine pair also reached by a 2-way prefix entry: the row-space strategy of the affine pieces and
    the factored one of the rest, in the best budget split, within 5 % of the conic optimum over the whole
    set (2 % measured at 10 x 10), and better than the factored strategy alone."""
    sizes = [5, 6]
    few = smasher.pair_piece_grams("affine", *sizes)[(0, 1)]
    prefix = _kron([smasher.centred_gram("prefix", n) for n in sizes])
    g = few + prefix * np.trace(few) / np.trace(prefix)
    u, a = _residual(g, sizes)
    best = _conic_optimum(a, u)
    got = smasher.low_rank_strategy(g, few, sizes)
    assert math.isclose(float(np.diag(got.gram).max()), 1.0, rel_tol=1e-12)
    m = u.T @ got.gram @ u
    assert math.isclose(got.loss, float(np.trace(np.linalg.solve(m, a))), rel_tol=1e-9)
    assert best * (1 - 1e-4) <= got.loss <= best * 1.05, (got.loss, best)
    assert got.loss < smasher.factored_strategy(g, sizes).loss


def test_a_dense_plan_of_cells_is_residual_planner_and_of_prefixes_no_worse_than_the_kronecker_plan():
    domains = [4, 3]
    cells = _kron([np.eye(4), np.eye(3)])
    rp = rp_plan(domains=domains, workload=[((0, 1), 1.0)], rho=0.5)
    dense = plan_dense(domains, [((0, 1), cells, 1.0)], rp.rho_planned)
    assert math.isclose(dense.total, rp.weighted_sse, rel_tol=1e-9)
    assert all(s.solver == "identity" for s in dense.strategies.values())
    entries = [
        Entry((0, 1), 1.0, {0: "prefix"}),
        Entry((0,), 2.0, {0: "prefix"}),
    ]
    kron = plan_kron(domains, entries, 0.5)
    workload = [(e.attrs, _queries(domains, e)[0], e.weight) for e in entries]
    assert plan_dense(domains, workload, 0.5).total <= kron.total * (1 + 1e-6)


def test_a_lightly_weighted_partition_is_still_measured_and_a_missing_one_is_refused():
    rows = smasher.pair_queries("abs_diff", 3, 3)
    pl = plan_dense([3, 3, 3], [((0, 1), rows, 1.0), ((2,), np.eye(3), 1e-14)], 0.5)
    assert (2,) in pl.sigma2 and 0 < pl.variance(np.eye(3)[0], (2,)) < np.inf  # asked, however lightly
    only = plan_dense([3, 3, 3], [((0, 1), rows, 1.0)], 0.5)
    with pytest.raises(PlanError, match=r"measured no residual of \(2,\)"):
        only.variance(1e-9 * np.eye(3)[0], (2,))  # however small the query
    with pytest.raises(ValueError, match="ascending"):
        only.variance(rows[0], (1, 0))


def test_a_dense_workload_is_refused_naming_the_entry():
    with pytest.raises(SpecError, match=r"workload\.0: attributes must be distinct and ascending"):
        plan_dense([3, 3], [((1, 0), np.ones((1, 9)), 1.0)], 0.5)
    with pytest.raises(SpecError, match=r"workload\.1: a query matrix over 9 cells needs 9 columns"):
        plan_dense([3, 3], [((0,), np.ones((1, 3)), 1.0), ((0, 1), np.ones((1, 8)), 1.0)], 0.5)
    with pytest.raises(SpecError, match=r"workload\.0: the weight must be positive, got -1"):
        plan_dense([3, 3], [((0,), np.ones((1, 3)), -1)], 0.5)
    with pytest.raises(SpecError, match="workload: no query to plan"):
        plan_dense([3, 3], [], 0.5)
