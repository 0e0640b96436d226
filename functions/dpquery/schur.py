"""RP+'s Schur-complement residuals: one attribute's strategy over its whole domain, split into the total
and a residual that need not be orthogonal to it (the RP+ authors' code, ``resplan/utils.py``;
shared/reference/dp-query.md). Pure numpy, no data.

**The split.** Let S be a strategy over the attribute's n values with unit column norms, G = SᵀS ≻ 0.
The largest c with G − c·11ᵀ ⪰ 0 is the Schur complement c = 1/(1ᵀG⁻¹1), and R = G − c·11ᵀ has rank
n − 1, its null vector u = c·G⁻¹1 (1ᵀu = 1). So G = c·11ᵀ + BᵀB with B ((n−1) × n, B u = 0): measuring
S is measuring the total and B. In a plan the attribute's residual sets measure it through B and the sets
without it through the total, as ResidualPlanner's do with its contrasts:

* privacy: a row moves the measurement of a set S by ∏_{i∈S} ‖B_i e_{x_i}‖, and the largest value of
  each factor is reached on one cell for all of them, so charging ∏ max diag(B_iᵀB_i) per set is exact
  (a unit-norm S gives the constant diagonal 1 − c);
* reconstruction: B's rows and 1ᵀ span the values' space, V = (I − u1ᵀ)B⁺ gives V B + u1ᵀ = I, so
  x_A = Σ_{S⊆A} (⊗_{i∈S} V_i ⊗_{i∈A∖S} u_i)(⊗_{i∈S} B_i ⊗_{i∈A∖S} 1ᵀ) x_A exactly, and the estimate is
  unbiased with the variances :class:`~functions.dpquery.smasher.AttributeFactors` gives (inside
  diag(W V Vᵀ Wᵀ), outside (W u)²). These are the only unbiased estimates from the measurements (each
  set's coordinates are measured once, through an invertible map), so they are the best.

ResidualPlanner's contrasts are the case S = I (u = 1/n). With the noise of the total and of the
residual chosen apart, a strategy's two parts are worth (√t + √(d·r))² on a one-attribute workload
(t = ‖W u‖², d = max diag(BᵀB), r = tr(W V Vᵀ W ᵀ)); the strategy that minimises HDMM's
tr(WᵀW G⁻¹) subject to diag(G) ≤ 1 is optimal there, which is RP+'s choice. In a workload of many
marginals one total serves every marginal and the attribute's residual enters sets with the others,
so the best balance of t against d·r differs: :func:`schur_factors` takes a weight β² on the total,
minimising tr((WᵀW + β²·11ᵀ) G⁻¹), and :func:`choose_totals` picks β² per query type and domain size by
the whole workload's loss (β² = 0 is RP+'s strategy), for the columns :func:`split_candidates` finds.
"""

from __future__ import annotations

import math

import numpy as np

from shardfold.functions.dpquery.smasher import AttributeFactors, _convex_strategy, query_gram
from shardfold.functions.dpquery.spec import ATTRIBUTE_TYPES

# β² may go below 0 (less weight on the total than the queries give it) as long as WᵀW + β²·11ᵀ stays
# positive definite: at most this share of the way to its bound −1/(1ᵀ(WᵀW)⁻¹1)
NEGATIVE_SHARE = 0.9
# RP+'s split is tried for these types (circular ranges: their optimum is circulant, so u = 1/n already)
SPLIT_TYPES = ("prefix", "range")
SPLIT_ROUNDS = 2  # rounds of β² updates per (type, size) after RP+'s β² = 0


def beta2_floor(kind: str, n: int) -> float:
    """The lowest β² :func:`schur_factors` takes for ``kind`` on ``n`` values."""
    return -NEGATIVE_SHARE / float(np.linalg.solve(query_gram(kind, n), np.ones(n)).sum())


def schur_factors(
    kind: str, n: int, beta2: float = 0.0, start: np.ndarray | None = None
) -> tuple[AttributeFactors, np.ndarray]:
    """The Schur split (module doc) of the convex optimum over all ``n`` values for ``kind``'s queries with
    weight ``beta2`` on the total, as :class:`AttributeFactors` with its own ``total``; and the solver's
    multipliers (a warm ``start`` for a nearby β²)."""
    a = query_gram(kind, n) + float(beta2) * np.ones((n, n))
    strategy = _convex_strategy(a, np.eye(n), start)
    g = strategy.gram  # max diagonal 1
    ones = np.ones(n)
    c = 1.0 / float(np.linalg.solve(g, ones).sum())
    w, v = np.linalg.eigh(g - c * np.outer(ones, ones))
    # the smallest eigenvalue is R's null direction, u ∝ G⁻¹1: B is the rest, so B u = 0 to rounding
    b = (v[:, 1:] * np.sqrt(np.clip(w[1:], 0.0, None))).T
    total = v[:, 0] / v[:, 0].sum()
    b.setflags(write=False)
    return AttributeFactors.of(kind, b, orthonormal=False, total=total), strategy.__dict__["_multipliers"]


def column_logs(f: AttributeFactors) -> tuple[float, float, float]:
    """A column's planner tables from its factors: log d (privacy), log t (Σ outside), log r − log t."""
    t = float(f.outside.sum())
    return math.log(f.privacy), math.log(t), math.log(float(f.inside.sum())) - math.log(t)


def split_candidates(uniq_rows, uniq_size, real_ext, kind_ext, padded_c, inside_a, kinds, n) -> dict:
    """The columns that may be measured through a Schur split: {(type, n): [column, …]}. An attribute
    qualifies when it is asked one way throughout (one column, a type of :data:`SPLIT_TYPES`) and no set
    holding it is merged or solved whole (so its u is the same in every set that measures it, which
    unbiased reconstruction needs, and no other solve sees it)."""
    d = int(n.size)  # the padding column
    used = np.unique(padded_c[inside_a])
    per_attr = np.bincount(real_ext[used], minlength=d + 1)
    real = real_ext[uniq_rows]
    keyed = np.column_stack([uniq_size, real])
    _, inverse, counts = np.unique(keyed, axis=0, return_inverse=True, return_counts=True)
    whole = kind_ext[uniq_rows] >= len(ATTRIBUTE_TYPES)
    shared = (counts[inverse.reshape(-1)] > 1) | whole.any(axis=1)
    barred = set(np.unique(real[shared]).tolist())
    groups: dict[tuple[str, int], list[int]] = {}
    for col in used.tolist():
        if col <= d or int(kind_ext[col]) >= len(ATTRIBUTE_TYPES):
            continue
        kind, attr = kinds[int(kind_ext[col])], int(real_ext[col])
        if kind in SPLIT_TYPES and per_attr[attr] == 1 and attr not in barred:
            groups.setdefault((kind, int(n[attr])), []).append(col)
    return groups


def choose_totals(objective, tables, groups, extra, d) -> dict[tuple[str, int], AttributeFactors]:
    """Which (type, size) groups of columns to measure through a Schur split, and with which β²
    (the module doc), by the workload's loss: ``objective(pfac, o, nn1)`` is its log root
    given the per-column tables (``tables``, not changed here). Each group starts from today's strategy
    (its columns' factors in ``extra``), tries RP+'s split (β² = 0), then moves β² to where the loss's
    slopes in t = ‖W u‖² and in d·r meet those of the split's own objective (√(t + β²) + √(d·r))², from
    multipliers of the last solve, keeping only what lowers the loss. So no workload gets a worse plan than
    without the split. Returns {(type, size): factors} of the groups that changed."""
    work = [t.copy() for t in tables]
    best = objective(*work)
    picked: dict[tuple[str, int], AttributeFactors] = {}
    current = {key: extra[cols[0] - d - 1] for key, cols in groups.items()}
    starts: dict[tuple[str, int], np.ndarray] = {}

    def trial(key, f: AttributeFactors) -> tuple[float, list[np.ndarray]]:
        tried = [t.copy() for t in work]
        for col in groups[key]:
            tried[0][col], tried[1][col], tried[2][col] = column_logs(f)
        return objective(*tried), tried

    def slope(key, which: int, h: float = 1e-4) -> float:
        """∂ log-root / ∂ log t (which 1: o up, nn1 down: r kept) or ∂ / ∂ log(d·r) (which 0)."""
        out = []
        for step in (h, -h):
            tried = [t.copy() for t in work]
            for col in groups[key]:
                tried[which][col] += step
                if which == 1:
                    tried[2][col] -= step
            out.append(objective(*tried))
        return (out[0] - out[1]) / (2 * h)

    for rnd in range(SPLIT_ROUNDS + 1):
        for key in groups:
            kind, size = key
            if rnd == 0:
                beta2 = 0.0
            else:
                f = current[key]
                t, dr = float(f.outside.sum()), f.privacy * float(f.inside.sum())
                s_t, s_dr = slope(key, 1) / t, slope(key, 0) / dr  # ∂/∂t and ∂/∂(d·r)
                # the split's objective has slopes ∝ (1/√(t + β²), 1/√(d·r)): match their ratio
                beta2 = dr * (s_dr / s_t) ** 2 - t if s_t > 0 else 1e6 * t
                beta2 = min(max(beta2, beta2_floor(kind, size)), 1e6 * t)
            f, starts[key] = schur_factors(kind, size, beta2, starts.get(key))
            value, tried = trial(key, f)
            if value < best:
                best, work = value, tried
                current[key] = picked[key] = f
    return picked
