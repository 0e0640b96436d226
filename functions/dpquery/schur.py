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
minimising tr((WᵀW + β²·11ᵀ) G⁻¹), and the planner (:func:`functions.dpquery.planner._choose_totals`)
picks β² per query type and domain size by the whole workload's loss (β² = 0 is RP+'s strategy).
"""

from __future__ import annotations

import numpy as np

from shardfold.functions.dpquery.smasher import AttributeFactors, _convex_strategy, query_gram

# β² may go below 0 (less weight on the total than the queries give it) as long as WᵀW + β²·11ᵀ stays
# positive definite: at most this share of the way to its bound −1/(1ᵀ(WᵀW)⁻¹1)
NEGATIVE_SHARE = 0.9


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
