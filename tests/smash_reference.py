"""Reference planners of QuerySmasher (arXiv:2604.00868), by partition and by dict: the independent plans
the job's vectorised planner (functions/dpquery/planner.py) is checked against, and what
bench/qs_reference.py runs as ours beside the authors' code. :func:`plan_kron` plans Kronecker workload
entries, :func:`plan_dense` explicit query matrices (their pieces solved together per partition,
:func:`functions.dpquery.smasher.set_strategy`); :func:`reconstruct_partition` and :func:`answer`
post-process a partition's measurement and answer any query from the partitions' estimates."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from shardfold.functions.dpquery.measure import mode_product
from shardfold.functions.dpquery.smasher import (
    PIECE_ROUNDING,
    AttributeStrategy,
    SetStrategy,
    attribute_strategy,
    centred_gram,
    pieces,
    query_lengths,
    set_strategy,
)
from shardfold.functions.errors import PlanError, SpecError


@dataclass(frozen=True)
class Entry:
    """One workload entry: the Kronecker family ⊗_{i∈attrs} W_i, each attribute's query type
    (``identity`` unless ``queries`` says otherwise), with a weight."""

    attrs: tuple[int, ...]
    weight: float = 1.0
    queries: Mapping[int, str] = field(default_factory=dict)

    def kind(self, i: int) -> str:
        return self.queries.get(i, "identity")


@dataclass
class SmashPlan:
    """Per partition A′ (a sorted tuple): its loss at privacy cost 1, its noise scale σ²_{A′}, and each
    attribute's strategy; the total weighted sum of variances at privacy cost ``cost`` (= 2ρ)."""

    domains: list[int]
    cost: float
    loss: dict[tuple[int, ...], float]
    sigma2: dict[tuple[int, ...], float]
    strategies: dict[tuple[int, ...], dict[int, AttributeStrategy]]
    total: float

    def privacy_cost(self) -> float:
        """Σ_{A′} pcost(B_{A′})/σ²_{A′}: every strategy has pcost 1, so Σ 1/σ²."""
        return float(sum(1.0 / s for s in self.sigma2.values()))


def plan_kron(domains: Sequence[int], entries: Sequence[Entry], rho: float) -> SmashPlan:
    """QuerySmasher's plan for Kronecker workload entries at zCDP ``rho`` (module doc). An attribute must
    have one query type across the entries that reach a partition holding it."""
    n = [int(x) for x in domains]
    cost = 2.0 * rho
    # per partition: Σ over entries A ⊇ A′ of w_A ∏_{i∈A∖A′} ‖W_i 1/n_i‖², and each attribute's query type
    outer: dict[tuple[int, ...], float] = {}
    kinds: dict[tuple[int, ...], dict[int, str]] = {}
    for j, e in enumerate(entries):
        attrs = tuple(sorted(e.attrs))
        norms = {i: float(np.sum((query_lengths(e.kind(i), n[i]) / n[i]) ** 2)) for i in attrs}
        for k in range(len(attrs) + 1):
            for part in itertools.combinations(attrs, k):
                rest = [i for i in attrs if i not in part]
                outer[part] = outer.get(part, 0.0) + e.weight * math.prod(norms[i] for i in rest)
                seen = kinds.setdefault(part, {})
                for i in part:
                    if seen.setdefault(i, e.kind(i)) != e.kind(i):
                        raise SpecError(
                            f"workload.{j}: attribute {i} is queried as {e.kind(i)!r} here and as "
                            f"{seen[i]!r} by another entry; give it one query type"
                        )
    cache: dict[tuple[int, str], AttributeStrategy] = {}
    loss, strategies = {}, {}
    for part, weight in outer.items():
        per = {}
        for i in part:
            key = (n[i], kinds[part][i])
            if key not in cache:
                cache[key] = attribute_strategy(centred_gram(key[1], key[0]))
            per[i] = cache[key]
        strategies[part] = per
        loss[part] = weight * math.prod(s.loss for s in per.values())
    # a partition no query reaches with any weight (loss 0) needs no measurement
    roots = {part: math.sqrt(v) for part, v in loss.items() if v > 0}
    total_root = sum(roots.values())
    sigma2 = {part: total_root / (cost * r) for part, r in roots.items()}
    return SmashPlan(n, cost, loss, sigma2, strategies, total_root**2 / cost)


@dataclass
class DensePlan:
    """QuerySmasher's plan of explicit query matrices: per partition A′ its strategy, loss at cost 1 and
    noise scale σ²_{A′}; the total weighted sum of variances at privacy cost ``cost`` (= 2ρ)."""

    domains: list[int]
    cost: float
    loss: dict[tuple[int, ...], float]
    sigma2: dict[tuple[int, ...], float]
    strategies: dict[tuple[int, ...], SetStrategy]
    total: float

    def variance(self, q: np.ndarray, attrs: Sequence[int]) -> float:
        """The variance of the answer to the query ``q`` over the cells of ``attrs`` (ascending), in the
        workload or not: Σ_{A′} σ²_{A′} q^{⇒A′} (B_{A′}ᵀB_{A′})⁺ q^{⇒A′}ᵀ."""
        attrs = tuple(int(i) for i in attrs)
        if list(attrs) != sorted(set(attrs)):
            raise ValueError(f"attributes must be distinct and ascending, got {list(attrs)}")
        q = np.asarray(q, dtype=np.float64)
        total = 0.0
        for pos, piece in pieces(q, [self.domains[i] for i in attrs]).items():
            part = tuple(attrs[k] for k in pos)
            if part in self.sigma2:
                inverse = np.linalg.pinv(self.strategies[part].gram, hermitian=True)
                total += self.sigma2[part] * float(piece @ inverse @ piece)
            elif np.abs(piece).max() > PIECE_ROUNDING * np.abs(q).max():
                raise PlanError(f"the plan measured no residual of {part}, which the query needs")
        return total


def plan_dense(
    domains: Sequence[int], workload: Sequence[tuple[Sequence[int], np.ndarray, float]], rho: float
) -> DensePlan:
    """QuerySmasher's plan at zCDP ``rho`` for a workload of explicit query matrices: each entry (attributes
    ascending, W over their cells in C order, weight). Each query is split into its pieces; a partition's
    pieces are solved together (:func:`set_strategy`) and the partitions fused as :func:`plan_kron` does."""
    n = [int(x) for x in domains]
    if not workload:
        raise SpecError("workload: no query to plan")
    grams: dict[tuple[int, ...], np.ndarray] = {}
    for j, (attrs, w, weight) in enumerate(workload):
        if not weight > 0:
            raise SpecError(f"workload.{j}: the weight must be positive, got {weight}")
        attrs = tuple(int(i) for i in attrs)
        if list(attrs) != sorted(set(attrs)):
            raise SpecError(f"workload.{j}: attributes must be distinct and ascending, got {list(attrs)}")
        w = np.atleast_2d(np.asarray(w, dtype=np.float64))
        cells = math.prod(n[i] for i in attrs)
        if w.shape[1] != cells:
            raise SpecError(f"workload.{j}: a query matrix over {cells} cells needs {cells} columns")
        for q in w:
            for pos, piece in pieces(q, [n[i] for i in attrs]).items():
                if np.abs(piece).max() <= PIECE_ROUNDING * np.abs(q).max():
                    continue  # no piece on this partition, only the rounding of the others'
                part = tuple(attrs[k] for k in pos)
                gram = grams.setdefault(part, np.zeros((piece.size, piece.size)))
                gram += weight * np.outer(piece, piece)
    strategies = {part: set_strategy(g, [n[i] for i in part]) for part, g in grams.items()}
    loss = {part: s.loss for part, s in strategies.items()}
    roots = {part: math.sqrt(v) for part, v in loss.items() if v > 0}
    total_root = sum(roots.values())
    sigma2 = {part: total_root / (2.0 * rho * r) for part, r in roots.items()}
    kept = {part: strategies[part] for part in roots}
    return DensePlan(n, 2.0 * rho, loss, sigma2, kept, total_root**2 / (2.0 * rho))


def apply(mats: Sequence[np.ndarray], x: np.ndarray) -> np.ndarray:
    """(⊗ mats) x for ``x`` shaped one axis per factor, in C order (:func:`measure.mode_product`)."""
    return np.ascontiguousarray(mode_product(mats, x)).reshape(-1)


def reconstruct_partition(y: np.ndarray, mats: Sequence[np.ndarray]) -> np.ndarray:
    """x̂_{A′}: the residual of the marginal on A′ that the measurement ``y`` estimates, ⊗ B̃_i⁺ y."""
    shape = [b.shape[0] for b in mats]
    return apply([np.linalg.pinv(b) for b in mats], np.asarray(y).reshape(shape))


def answer(
    q: np.ndarray,
    attrs: Sequence[int],
    domains: Sequence[int],
    estimates: Mapping[tuple[int, ...], np.ndarray],
    plan: SmashPlan,
    mats: Mapping[tuple[int, ...], Sequence[np.ndarray]],
    totals: Mapping[int, np.ndarray | None] | None = None,
) -> tuple[float, float]:
    """The estimate of the query ``q`` over the cells of ``attrs`` (sorted, C order) and its exact variance,
    from each partition's x̂ (``estimates``) and strategy matrices (``mats``), with ``totals``: u_i of
    the attributes whose total is not spread evenly (:class:`AttributeFactors`). A piece is projected by
    I − u_i1ᵀ on its attributes, which V_i = (I − u_i1ᵀ)B_i⁺ leaves unchanged, so its variance is
    piece·(⊗ (B_iᵀB_i)⁺)·pieceᵀ either way."""
    attrs = tuple(attrs)
    value, var = 0.0, 0.0
    shares = [None if totals is None else totals.get(i) for i in attrs]
    for pos, piece in pieces(q, [domains[i] for i in attrs], shares).items():
        part = tuple(attrs[k] for k in pos)
        if part not in plan.sigma2:  # no query of the workload reaches this partition: none may use it
            if np.any(np.abs(piece) > 1e-12 * (1 + np.abs(q).max())):
                raise PlanError(f"the query needs partition {part}, which the plan does not measure")
            continue
        value += float(piece @ estimates[part])
        shaped = piece.reshape([domains[i] for i in part]) if part else piece.reshape(())
        inv = apply([np.linalg.pinv(b.T @ b) for b in mats[part]], shaped)
        var += plan.sigma2[part] * float(piece @ inv)
    return value, var
