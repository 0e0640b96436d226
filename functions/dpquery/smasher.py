"""QuerySmasher's divide and conquer for workloads of linear queries on marginals (arXiv:2604.00868;
shared/reference/dp-query.md §3.3). Pure numpy, no store, no data: the planning half.

**Decompose.** A query q̄ on the cells of attributes A (C order) splits into one piece per A′ ⊆ A:
q̄^{⇒A′} = q̄ Q_{A′}, Q_{A′} = ⊗_{i∈A} (i ∈ A′ ? I − J/n_i : 1_{n_i}/n_i). The pieces of two different A′ are
orthogonal and q̄·x_A = Σ_{A′} q̄^{⇒A′}·x_{A′} (:func:`pieces`). Each piece lies in the residual space of the
marginal x_{A′}, so the partitions are measured independently and any query, in the workload or not, is
answered as the sum of its pieces' answers.

**Solve a partition.** A workload entry here is a Kronecker family: attributes A, a query matrix W_i per
attribute (:func:`attribute_queries`: identity, prefix, range, circular_range) and a weight w. Its pieces on
A′ are ⊗_{i∈A′} W_i(I − J/n_i) scaled by ∏_{i∈A∖A′} W_i 1/n_i, so their summed variance under a Kronecker
strategy B = ⊗_{i∈A′} B_i (noise N(0, σ² I)) is w·∏_{i∈A∖A′} ‖W_i 1/n_i‖²·∏_{i∈A′} tr(G_iᵀG_i (B_iᵀB_i)^+),
G_i = W_i(I − J/n_i), and its privacy cost is pcost = ∏_{i∈A′} max diag(B_iᵀB_i) (a record moves x_{A′} by
one unit vector). With one query type per attribute across the entries that reach A′ the loss separates:
each attribute is one convex problem of size n_i − 1 (:func:`attribute_strategy`):
minimise tr(Ā M⁻¹) subject to diag(U M Uᵀ) ≤ 1, M ≻ 0, with U an orthonormal basis of 1^⊥ and
Ā = Uᵀ G_iᵀ G_i U. For the identity the optimum is M = n/(n−1)·I (RP's Helmert strategy) in closed form.
Entries asking an attribute different ways make the partition's Gram a weighted sum of Kronecker products;
:func:`kronecker_strategy` then fits one Kronecker strategy to the sum, a per-attribute problem at a time.

**Explicit queries.** A query that is not a Kronecker product (the 2-way ``affine`` and ``abs_diff``
queries, :func:`pair_queries`, or any matrix on a small marginal) is split into its pieces the same way;
a partition's pieces are solved together, as the best of ResidualPlanner's contrasts and the full convex
optimum over the partition's residual space ⊗U_i (:func:`set_strategy`, small partitions only), and
the partitions are fused as below. The job's planner (:mod:`functions.dpquery.planner`) solves the
partitions that 2-way queries reach this way, each from the summed Gram of every piece on it (the Kronecker
entries' too); the tests check it against reference planners by partition (tests/smash_reference.py).

**Assemble.** With L_{A′} the partition's loss at privacy cost 1, the total privacy cost c = 2ρ is split as
σ²_{A′} = (Σ √L)/(c·√L_{A′}), and the weighted sum of variances is (Σ_{A′} √L_{A′})²/c: ResidualPlanner's
formula with each partition's own optimum in place of RP's fixed p_S, v_S. For an identity workload it *is*
ResidualPlanner's plan.

**Measure, answer.** A partition's strategy is applied mode-wise as a float matrix B̃_i per attribute
(:func:`strategy_matrix`); the sensitivity is that of the matrix actually used: Δ = ∏ max column norm of
B̃_i, rounded up exactly, times (k + 2·η·N) for the rounding of the products, as
:mod:`functions.dpquery.measure` derives it for the Helmert contrasts (:func:`charged_norm`). The noisy
y_{A′} is post-processed into x̂_{A′} = ⊗ B̃_i⁺ y_{A′}, and any query q on attributes A is answered as
Σ_{A′⊆A} q^{⇒A′}·x̂_{A′} with variance Σ σ²_{A′}·q^{⇒A′}(⊗ B̃_iᵀB̃_i)⁺q^{⇒A′}ᵀ
(:mod:`functions.dpquery.reconstruct`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from shardfold.functions.dpquery.measure import contrasts
from shardfold.functions.dpquery.spec import ATTRIBUTE_TYPES, MAX_QUERY_DOMAIN, PAIR_TYPES, QueryMatrix
from shardfold.functions.errors import PlanError, SpecError


def intervals(kind: str, n: int) -> list[tuple[int, int]]:
    """The queries of one attribute with ``n`` ordered values as intervals ``(a, b)`` of value indices, in
    the order of :func:`attribute_queries`' rows: ``identity`` (a, a); ``prefix`` (0, t); ``range`` every
    (a, b), a ≤ b; ``circular_range`` every arc from a of 1 … n−1 values ((a, b) with b < a wraps past the
    last value), then the whole circle once as (0, n − 1)."""
    if n < 2:
        raise SpecError(f"a query type needs a domain of at least 2 values, got {n}")
    if kind == "identity":
        return [(t, t) for t in range(n)]
    if kind == "prefix":
        return [(0, t) for t in range(n)]
    if kind == "range":
        return [(a, b) for a in range(n) for b in range(a, n)]
    if kind == "circular_range":
        return [(a, (a + length - 1) % n) for a in range(n) for length in range(1, n)] + [(0, n - 1)]
    raise SpecError(f"unknown query type {kind!r}; expected one of {list(ATTRIBUTE_TYPES)}")


def attribute_queries(kind: str, n: int) -> np.ndarray:
    """The query matrix of one attribute with ``n`` ordered values, a row per interval of :func:`intervals`:
    ``identity`` (each value), ``prefix`` (values ≤ t, for every t), ``range`` (every interval [a, b]) or
    ``circular_range`` (every interval of the values arranged on a circle, whole circle once)."""
    if kind == "identity":
        return np.eye(n)
    spans = intervals(kind, n)
    out = np.zeros((len(spans), n))
    for r, (a, b) in enumerate(spans):
        if a <= b:
            out[r, a : b + 1] = 1.0
        else:  # an arc past the last value
            out[r, a:] = 1.0
            out[r, : b + 1] = 1.0
    return out


def _blocks(kind: str, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each query as one or two contiguous blocks of values (an arc past the last value is two): the first
    and last value of every query's first block, then (first, last, query) of the second blocks."""
    spans = np.asarray(intervals(kind, n), dtype=np.int64)
    a, b = spans[:, 0], spans[:, 1]
    wrap = b < a
    first = np.stack([a, np.where(wrap, n - 1, b)], axis=1)  # [a, n−1] for an arc, else [a, b]
    second = np.stack([np.zeros(int(wrap.sum()), dtype=np.int64), b[wrap]], axis=1)  # [0, b] of an arc
    return first, second, np.flatnonzero(wrap), a


def _block_pairs(kind: str, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(first row, last row, first column, last column) of every block × block of a query with itself,
    with the query each belongs to: the rectangles whose sums make WᵀW and each query's diag(W P Wᵀ)."""
    first, second, wrapped, _ = _blocks(kind, n)
    q = np.arange(first.shape[0])
    rows = [first, first[wrapped], second, second]
    cols = [first, second, first[wrapped], second]
    owner = [q, wrapped, wrapped, wrapped]
    r, c = np.concatenate(rows), np.concatenate(cols)
    return r[:, 0], r[:, 1], np.stack([c[:, 0], c[:, 1]], axis=1), np.concatenate(owner)


def query_gram(kind: str, n: int) -> np.ndarray:
    """WᵀW of one attribute's queries without forming W (a range workload on 1,024 values has 524,800 rows):
    entry (u, v) counts the queries that hold both u and v, summed over each query's block rectangles."""
    if kind == "identity":
        return np.eye(n)
    r0, r1, c, _ = _block_pairs(kind, n)
    diff = np.zeros((n + 1, n + 1))
    for rows, cols, sign in ((r0, c[:, 0], 1.0), (r0, c[:, 1] + 1, -1.0), (r1 + 1, c[:, 0], -1.0)):
        np.add.at(diff, (rows, cols), sign)
    np.add.at(diff, (r1 + 1, c[:, 1] + 1), 1.0)
    return diff.cumsum(axis=0).cumsum(axis=1)[:n, :n]


def block_sums(kind: str, p: np.ndarray) -> np.ndarray:
    """diag(W P Wᵀ) of one attribute's queries for an n × n matrix ``p``: per query, the sum of ``p`` over
    its values × its values, from 2-D prefix sums (no W)."""
    n = p.shape[0]
    if kind == "identity":
        return np.diag(p).copy()
    r0, r1, c, owner = _block_pairs(kind, n)
    s = np.zeros((n + 1, n + 1))
    s[1:, 1:] = p.cumsum(axis=0).cumsum(axis=1)
    rect = s[r1 + 1, c[:, 1] + 1] - s[r0, c[:, 1] + 1] - s[r1 + 1, c[:, 0]] + s[r0, c[:, 0]]
    return np.bincount(owner, weights=rect, minlength=len(intervals(kind, n)))


def query_lengths(kind: str, n: int) -> np.ndarray:
    """How many values each query sums (W 1)."""
    spans = np.asarray(intervals(kind, n), dtype=np.int64)
    a, b = spans[:, 0], spans[:, 1]
    return np.where(b >= a, b - a + 1, n - a + b + 1)


def answer_axis(kind: str, x: np.ndarray, axis: int) -> np.ndarray:
    """W x along ``axis`` of ``x`` (one attribute's values there), from prefix sums: an interval [a, b] is
    c[b+1] − c[a], an arc past the last value adds c[n]."""
    if kind == "identity":
        return x
    n = x.shape[axis]
    spans = np.asarray(intervals(kind, n), dtype=np.int64)
    a, b = spans[:, 0], spans[:, 1]
    zero = np.zeros_like(np.take(x, [0], axis=axis))
    c = np.concatenate([zero, np.cumsum(x, axis=axis)], axis=axis)
    out = np.take(c, b + 1, axis=axis) - np.take(c, a, axis=axis)
    wrap = b < a
    if wrap.any():
        shape = [1] * x.ndim
        shape[axis] = a.size
        out = out + wrap.reshape(shape) * np.take(c, [n], axis=axis)
    return out


def pieces(
    q: np.ndarray, domains: Sequence[int], totals: Sequence[np.ndarray | None] | None = None
) -> dict[tuple[int, ...], np.ndarray]:
    """QuerySmasher's decomposition of the row vector ``q`` over the cells of ``domains`` (C order): for
    every subset A′ of the attribute positions (tuples, ascending), the piece over the cells of A′:
    q (⊗_{i∈A′} (I − u_i1ᵀ) ⊗_{i∉A′} u_i), so that q·x = Σ_{A′} piece_{A′}·x_{A′}. ``totals``: each
    attribute's u_i (1ᵀu_i = 1), the values its total is spread over (:class:`AttributeFactors`); None,
    or a None entry, is 1/n_i, and the pieces are orthogonal."""
    sizes = [int(n) for n in domains]
    shares = [None if totals is None else totals[k] for k in range(len(sizes))]
    q = np.asarray(q, dtype=np.float64).reshape(sizes)
    out = {}
    for k in range(len(sizes) + 1):
        for subset in itertools.combinations(range(len(sizes)), k):
            piece = q
            for axis in range(len(sizes) - 1, -1, -1):  # high axes first: lower axis numbers stay put
                u = shares[axis]
                along = piece.mean(axis=axis) if u is None else np.tensordot(piece, u, axes=([axis], [0]))
                if axis in subset:
                    piece = piece - np.expand_dims(along, axis)
                else:
                    piece = along
            out[subset] = piece.reshape(-1)
    return out


def kron_all(mats: Sequence[np.ndarray]) -> np.ndarray:
    """⊗ mats, in order (the 1 × 1 identity for none)."""
    return functools.reduce(np.kron, mats, np.ones((1, 1)))


def residual_basis(n: int) -> np.ndarray:
    """U: n × (n−1), orthonormal columns orthogonal to 1 (the Helmert contrasts, transposed)."""
    return contrasts(n).T


@dataclass(frozen=True)
class AttributeStrategy:
    """The strategy of one attribute on its residual space: B_iᵀB_i = U M Uᵀ, scaled to pcost 1, and the
    loss tr(Ā M⁻¹) it gives."""

    gram: np.ndarray  # B_iᵀB_i (n × n), max diagonal 1
    loss: float
    solver: str


def attribute_strategy(g: np.ndarray) -> AttributeStrategy:
    """The best B_iᵀB_i for the query Gram ``g`` = Σ w GᵀG (n × n, rows and columns summing to 0): minimise
    tr(Ā M⁻¹) s.t. diag(U M Uᵀ) ≤ 1 (module doc). Closed form for a multiple of I − J/n, else convex."""
    n = g.shape[0]
    u = residual_basis(n)
    a = u.T @ g @ u
    a = (a + a.T) / 2
    scale = np.trace(a) / (n - 1)
    if scale > 0 and np.allclose(a, scale * np.eye(n - 1), rtol=1e-12, atol=1e-12 * scale):
        m = n / (n - 1) * np.eye(n - 1)  # diag(U M Uᵀ) = n/(n−1)·(n−1)/n = 1
        return AttributeStrategy(u @ m @ u.T, float(scale * (n - 1) * (n - 1) / n), "identity")
    if _circulant(g):
        return _fourier_strategy(g)
    if n > MAX_QUERY_DOMAIN:
        raise PlanError(
            f"a query type other than identity on a domain of {n} values: the per-attribute convex problem "
            f"is solved up to {MAX_QUERY_DOMAIN} values (coarsen the attribute's bins)"
        )
    return _convex_strategy(a, u)


def _circulant(g: np.ndarray) -> bool:
    """Whether ``g`` is unchanged by a cyclic shift of the values (circular ranges, and their mixes with
    identity queries): each row the one above it rotated by one."""
    scale = float(np.abs(g).max())
    return scale > 0 and np.allclose(g, np.roll(g, (1, 1), axis=(0, 1)), rtol=0, atol=1e-12 * scale)


def _fourier_strategy(g: np.ndarray) -> AttributeStrategy:
    """The optimum for a circulant Gram, in closed form (WFF's Fourier strategy). The problem is unchanged
    by cyclic shifts and convex, so a circulant M is optimal; the Fourier vectors diagonalise it with g,
    whose eigenvalues are λ_k = FFT of its first row, and diag(M) = mean of M's eigenvalues μ_k. So:
    min Σ λ_k/μ_k s.t. Σ μ_k ≤ n, whose solution is μ_k = n √λ_k / Σ √λ_j, of loss (Σ √λ_k)² / n."""
    n = g.shape[0]
    lam = np.clip(np.fft.fft(g[0]).real, 0.0, None)
    lam[0] = 0.0  # the constant vector: not in the residual space (rows of g sum to 0)
    # a frequency no query has still gets a little, so that every other query stays answerable
    roots = np.sqrt(np.maximum(lam, 1e-12 * lam.max()))
    roots[0] = 0.0
    mu = n * roots / roots.sum()
    row = np.fft.ifft(mu).real
    gram = row[(np.arange(n)[None, :] - np.arange(n)[:, None]) % n]  # row k: the first rotated by k
    gram = (gram + gram.T) / 2
    loss = float(np.sum(lam[1:] / mu[1:]))
    return AttributeStrategy(gram / float(np.diag(gram).max()), loss, "fourier")


def strategy_loss(g: np.ndarray, strategy: AttributeStrategy | SetStrategy) -> float:
    """tr(Ḡ (BᵀB)⁺): the summed variance, at privacy cost 1, of the queries whose centred Gram is ``g``
    when the attribute (or residual set) is measured through ``strategy``."""
    return float(np.einsum("ij,ji->", g, _pinv(strategy)))


def _pinv(strategy: AttributeStrategy | SetStrategy) -> np.ndarray:
    cached = strategy.__dict__.get("_pinv")
    if cached is None:
        cached = np.linalg.pinv(strategy.gram, hermitian=True)
        object.__setattr__(strategy, "_pinv", cached)
    return cached


def kronecker_strategy(
    terms: Sequence[tuple[float, Sequence[np.ndarray]]],
    rounds: int = 8,
    rtol: float = 1e-6,
    fixed: Sequence[bool] | None = None,
) -> tuple[list[AttributeStrategy], float]:
    """The best Kronecker strategy ⊗B_i, each factor of privacy cost 1, for a residual set that workload
    entries of different query types reach: its queries' Gram is Σ_e w_e ⊗_i Ḡ_{e,i} (``terms``: (w_e,
    [Ḡ_{e,1}, …, Ḡ_{e,k}]), the Grams centred, one per attribute of the set), and the loss of ⊗B_i is
    Σ_e w_e ∏_i tr(Ḡ_{e,i} (B_iᵀB_i)⁺).

    Block-coordinate descent: with the other factors fixed the loss is linear in one attribute's
    tr(· (B_iᵀB_i)⁺), so each step is one per-attribute problem (:func:`attribute_strategy`) on
    Σ_e w_e ∏_{j≠i} tr(Ḡ_{e,j} (B_jᵀB_j)⁺) Ḡ_{e,i}. It starts from the identity strategies
    (ResidualPlanner's), stops when a round gains less than ``rtol``, and returns the best strategies seen
    and their loss. With one term it is that term's per-attribute optimum. ``fixed`` attributes keep the
    identity strategy (one every term asks cell by cell: it is already optimal, and costs no matrix)."""
    if not terms:
        raise PlanError("internal: a residual set that no workload entry reaches")
    k = len(terms[0][1])
    sizes = [int(g.shape[0]) for g in terms[0][1]]

    def loss(strategies: list[AttributeStrategy]) -> float:
        return math.fsum(
            w * math.prod(strategy_loss(g, b) for g, b in zip(grams, strategies, strict=True))
            for w, grams in terms
        )

    def weighted(i: int, current: list[AttributeStrategy]) -> np.ndarray:
        return sum(
            w * math.prod(strategy_loss(g, current[j]) for j, g in enumerate(grams) if j != i) * grams[i]
            for w, grams in terms
        )

    free = [i for i in range(k) if not (fixed and fixed[i])]
    return _coordinate_descent(sizes, free, weighted, loss, rounds, rtol)


def _coordinate_descent(
    sizes: Sequence[int],
    free: Sequence[int],
    weighted: Callable[[int, list[AttributeStrategy]], np.ndarray],
    loss: Callable[[list[AttributeStrategy]], float],
    rounds: int,
    rtol: float,
) -> tuple[list[AttributeStrategy], float]:
    """Block-coordinate descent over per-attribute strategies, from the contrasts (ResidualPlanner's): each
    step replaces attribute i's (for i in ``free``) by the optimum for the Gram ``weighted(i, current)``;
    it stops when a round gains less than ``rtol`` and returns the best strategies seen and their loss."""
    current = [attribute_strategy(np.eye(n) - 1.0 / n) for n in sizes]
    best, best_loss = list(current), loss(current)
    for _ in range(rounds):
        for i in free:
            current[i] = attribute_strategy(weighted(i, current))
        now = loss(current)
        gained = best_loss - now
        if now < best_loss:
            best, best_loss = list(current), now
        if gained <= rtol * best_loss:
            break
    return best, best_loss


def _convex_strategy(
    a: np.ndarray, u: np.ndarray, start: np.ndarray | None = None, h_form: bool = True
) -> AttributeStrategy:
    """min tr(Ā M⁻¹) s.t. diag(U M Uᵀ) ≤ 1 (``u``: U, whose rows are the constraint vectors; the identity
    for a strategy over the whole domain) through its dual, a smooth concave problem in n multipliers:
    with K = Uᵀ diag(λ) U and H = Ā^{1/2} K Ā^{1/2} = Fᵀ diag(λ) F (F = U Ā^{1/2}), the minimising M is
    Ā^{1/2} H^{-1/2} Ā^{1/2} (the PSD solution of M K M = Ā), the dual value g(λ) = 2 tr(H^{1/2}) − Σλ and
    ∂g/∂λ_i = diag(U M Uᵀ)_i − 1 = f_iᵀ H^{-1/2} f_i − 1: one eigendecomposition per step (a nearly singular
    Ā, or an H left nearly singular by multipliers at their bound, takes the equivalent form in K and
    K^{1/2} Ā K^{1/2}: two per step). L-BFGS-B
    maximises g from ``start`` (multipliers of a nearby problem) or the optimum for Ā = scale·I; the M it
    ends on is scaled to be feasible (max diagonal exactly 1), so the loss returned is achieved, and it is
    within the duality gap of the optimum (checked against a conic solver in the tests)."""
    from scipy.optimize import minimize  # deferred: only general query types need it

    n = u.shape[0]
    wa, va = np.linalg.eigh((a + a.T) / 2)
    h_form = h_form and wa[0] > WELL_CONDITIONED * wa[-1]
    if h_form:  # H's form: one eigendecomposition per step
        a_half = (va * np.sqrt(wa)) @ va.T
        f = u @ a_half

        def parts(lam: np.ndarray) -> tuple[float, np.ndarray, Callable[[], np.ndarray]]:
            wh, vh = np.linalg.eigh((f.T * lam) @ f)
            wh = np.clip(wh, _TINY, None)
            z = (f @ vh) * wh**-0.25
            g = 2.0 * float(np.sum(np.sqrt(wh))) - float(lam.sum())
            return g, np.einsum("ij,ij->i", z, z), lambda: a_half @ ((vh * wh**-0.5) @ vh.T) @ a_half

    else:  # a (nearly) singular Ā: K's form, M = K^{-1/2} (K^{1/2} Ā K^{1/2})^{1/2} K^{-1/2}, no Ā^{-1/2}

        def parts(lam: np.ndarray) -> tuple[float, np.ndarray, Callable[[], np.ndarray]]:
            wk, vk = np.linalg.eigh((u.T * lam) @ u)
            wk = np.clip(wk, 1e-300, None)
            k_half = (vk * np.sqrt(wk)) @ vk.T
            k_ihalf = (vk / np.sqrt(wk)) @ vk.T
            c = k_half @ a @ k_half
            wc, vc = np.linalg.eigh((c + c.T) / 2)
            wc = np.clip(wc, 0.0, None)
            m = k_ihalf @ ((vc * np.sqrt(wc)) @ vc.T) @ k_ihalf
            g = 2.0 * float(np.sum(np.sqrt(wc))) - float(lam.sum())
            return g, np.einsum("ij,ij->i", u @ m, u), lambda: m

    def negative(lam: np.ndarray) -> tuple[float, np.ndarray]:
        g, diag, _ = parts(lam)
        return -g, -(diag - 1.0)

    scale = np.trace(a) / max(a.shape[0], 1)
    x0 = np.full(n, scale * ((n - 1) / n) ** 2) if start is None else np.asarray(start, dtype=np.float64)
    res = minimize(
        negative,
        x0,
        jac=True,
        method="L-BFGS-B",
        bounds=[(1e-12 * scale, None)] * n,
        options={"maxiter": 5000, "ftol": 1e-15, "gtol": 1e-12},
    )
    _, diag, solution = parts(res.x)
    m = solution() / float(diag.max())  # feasible: max diag(U M Uᵀ) = 1
    m = (m + m.T) / 2
    if h_form and not np.linalg.eigvalsh(m)[0] > 0:
        # many multipliers at their bound leave H nearly singular and H^{-1/2} lost to rounding (a set
        # whose queries reach few directions): K's form
        return _convex_strategy(a, u, start, h_form=False)
    loss = float(np.trace(np.linalg.solve(m, a)))
    out = AttributeStrategy(u @ m @ u.T, loss, "convex")
    object.__setattr__(out, "_multipliers", res.x)  # a warm start for a nearby problem
    return out


_TINY = np.finfo(np.float64).tiny
WELL_CONDITIONED = 1e-8  # Ā's smallest eigenvalue over its largest above which H's form is used


@dataclass(frozen=True)
class AttributeFactors:
    """One attribute's query type as a job uses it: the matrix B_i measured, the matrix that maps its
    measurement back to the attribute's values (``inverse``), and per query of W_i its variance factor
    when the attribute is in the measured partition (``inside``: diag(W_i V_i V_iᵀ W_iᵀ)) and when it is
    not (``outside``: (W_i u_i)²), so a query's variance is Σ_{A′} σ²_{A′} ∏_{i∈A′} inside_i
    ∏_{i∈A∖A′} outside_i, and its squared column norm bound ``privacy`` = max diag(B_iᵀB_i).

    ``total``: u_i, the values the total's estimate is spread over (1ᵀu_i = 1, B_i u_i = 0); None is 1/n_i,
    B_i's rows orthogonal to 1 (ResidualPlanner's and QuerySmasher's residuals) and V_i = B_i⁺. With a u_i
    of its own (RP+'s Schur-complement residuals, :mod:`functions.dpquery.schur`) V_i = (I − u_i1ᵀ)B_i⁺:
    V_iB_i + u_i1ᵀ = I, so x = u_i·(1ᵀx) + V_i(B_ix) and the reconstruction stays exact and unbiased.
    ``identity`` is ResidualPlanner's: B_i the Helmert contrasts."""

    kind: str
    matrix: np.ndarray  # B_i, (n−1) × n
    inverse: np.ndarray  # V_i, n × (n−1)
    inside: np.ndarray  # (m_i,)
    outside: np.ndarray  # (m_i,)
    privacy: float
    total: np.ndarray | None = None  # u_i, (n,); None: 1/n_i

    @property
    def n(self) -> int:
        return int(self.matrix.shape[1])

    @property
    def queries(self) -> int:
        return int(self.inside.size)

    @classmethod
    def of(
        cls, kind: str, matrix: np.ndarray, orthonormal: bool | None = None, total: np.ndarray | None = None
    ) -> AttributeFactors:
        """The factors of measuring ``kind``'s queries through ``matrix`` (a plan's stored B_i), whose rows
        are ``orthonormal`` (default: for identity, whose strategy is the contrasts) or not, with the
        total spread over ``total`` (None: evenly, the rows orthogonal to 1)."""
        b = np.asarray(matrix, dtype=np.float64)
        n = b.shape[1]
        if orthonormal is None:
            orthonormal = kind == "identity" and total is None
        inverse = b.T if orthonormal else np.linalg.pinv(b)
        if total is None:
            outside = (query_lengths(kind, n) / n) ** 2
        else:
            total = np.array(total, dtype=np.float64)
            inverse = inverse - np.outer(total, inverse.sum(axis=0))  # (I − u1ᵀ)B⁺: 1ᵀV = 0
            outside = answer_axis(kind, total, 0) ** 2
        inside = block_sums(kind, inverse @ inverse.T)  # diag(W V Vᵀ Wᵀ)
        privacy = float(np.max(np.einsum("ij,ij->j", b, b)))
        for a in (b, inverse, inside, outside, *([] if total is None else [total])):
            a.setflags(write=False)
        return cls(kind, b, inverse, inside, outside, privacy, total)


@functools.lru_cache(maxsize=64)
def attribute_factors(kind: str, n: int) -> AttributeFactors:
    """The best strategy for one attribute's ``kind`` queries on ``n`` values (:func:`attribute_strategy`),
    as :class:`AttributeFactors` (identity: ResidualPlanner's contrasts)."""
    if kind == "identity":
        return AttributeFactors.of(kind, contrasts(n))
    return AttributeFactors.of(kind, strategy_matrix(attribute_strategy(centred_gram(kind, n))))


def centred_gram(kind: str, n: int) -> np.ndarray:
    """GᵀG, G = W(I − J/n): the Gram of one attribute's queries on its residual space."""
    c = np.eye(n) - 1.0 / n
    return c @ query_gram(kind, n) @ c


# --- queries that are not Kronecker products: explicit matrices on small domains -------------------------

# the full convex solver's largest residual space, ∏(n_i − 1): 44 s for 19 × 19, against 3 s for the
# low-rank strategy within 2.5 % of its loss (docs/benchmarks.md)
MAX_SET_DIM = 100
PIECE_ROUNDING = 1e-12  # a query's piece this small against its largest entry is rounding, not a piece
_FLOORS = (1e-2, 1e-3, 1e-4)  # of the mean eigenvalue, added to a set's Gram for the full convex solve


def pair_queries(kind: str | QueryMatrix, *sizes: int) -> np.ndarray:
    """The queries of a type that names a marginal's queries as a whole, one row per query over its cells
    (C order): an explicit :class:`QueryMatrix`'s rows, or the 2-way type ``kind`` on an n1 × n2 marginal:
    ``affine`` counts the cells with i + j ≤ c for c = 0 … n1 + n2 − 2, ``abs_diff`` those with |i − j| ≤ c
    for c = 0 … max(n1, n2) − 1 (the last row of each is the whole table)."""
    if isinstance(kind, QueryMatrix):
        if kind.rows.shape[1] != math.prod(sizes):
            raise ValueError(f"{kind!r} is not over the {math.prod(sizes)} cells of {sizes}")
        return kind.rows
    n1, n2 = sizes
    i, j = np.indices((n1, n2))
    if kind == "affine":
        score, top = i + j, n1 + n2 - 1
    elif kind == "abs_diff":
        score, top = np.abs(i - j), max(n1, n2)
    else:
        raise ValueError(f"unknown 2-way query type {kind!r}; one of {', '.join(PAIR_TYPES)}")
    return (score.reshape(1, -1) <= np.arange(top).reshape(-1, 1)).astype(np.float64)


@functools.lru_cache(maxsize=32)
def pair_piece_grams(kind: str | QueryMatrix, *sizes: int) -> dict[tuple[int, ...], np.ndarray]:
    """Σ_q q^{⇒A′}ᵀ q^{⇒A′} over the queries of ``kind`` on a marginal of ``sizes`` (:func:`pair_queries`),
    for each A′ of the attribute positions: the Gram of its pieces over the cells of A′ (read-only)."""
    out: dict[tuple[int, ...], np.ndarray] = {}
    for q in pair_queries(kind, *sizes):
        for pos, piece in pieces(q, sizes).items():
            g = out.setdefault(pos, np.zeros((piece.size, piece.size)))
            g += np.outer(piece, piece)
    for g in out.values():
        g.setflags(write=False)
    return out


# a residual set no row of an explicit matrix reaches is solved for this much of the largest per-cell load
ZERO_PIECE_FLOOR = 1e-4


@functools.lru_cache(maxsize=32)
def whole_piece_grams(kind: str | QueryMatrix, *sizes: int) -> dict[tuple[int, ...], np.ndarray]:
    """:func:`pair_piece_grams` as the planner solves them: where no row of an explicit matrix has a piece
    (a matrix constant along an attribute, or whose rows sum to zero), ResidualPlanner's contrasts at
    :data:`ZERO_PIECE_FLOOR` of the largest per-cell trace instead of zero, so that every residual set of
    the marginal is measured (any query on it stays answerable) for about 1 % of the budget. The variances
    the plan states come from the exact Grams."""
    exact = pair_piece_grams(kind, *sizes)
    if isinstance(kind, str):  # a named type's plan stays as it is (abs_diff on 2 × 2 has no 1-way pieces)
        return exact
    load = max(float(np.trace(g)) / g.shape[0] for g in exact.values())
    if not load > 0:
        raise PlanError(f"{kind!r} has no piece anywhere: it asks nothing")
    tiny = PIECE_ROUNDING * max(float(np.abs(g).max()) for g in exact.values())
    out = {}
    for pos, g in exact.items():
        if np.abs(g).max() > tiny:
            out[pos] = g
            continue
        floor = ZERO_PIECE_FLOOR * load * _contrasts_gram([sizes[p] for p in pos])
        floor.setflags(write=False)
        out[pos] = floor
    return out


def dense_matrix(gram: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
    """B (∏(n_i − 1) × ∏n_i, rows in the set's residual space) with BᵀB = ``gram`` (to rounding): a
    :class:`SetStrategy` as the matrix a measurement applies to the flattened marginal (as
    :func:`strategy_matrix` does for one attribute)."""
    u = kron_all([residual_basis(int(n)) for n in sizes])
    m = u.T @ gram @ u
    w, v = np.linalg.eigh((m + m.T) / 2)
    b = (v * np.sqrt(np.clip(w, 0.0, None))).T @ u.T
    b.setflags(write=False)
    return b


@dataclass(frozen=True)
class SetStrategy:
    """A residual set's strategy over the cells of its marginal, not necessarily a Kronecker product:
    BᵀB (∏n × ∏n, rows and columns in the set's residual space, max diagonal 1) and its loss at cost 1."""

    gram: np.ndarray
    loss: float
    solver: str


def set_strategy(g: np.ndarray, sizes: Sequence[int], few: np.ndarray | None = None) -> SetStrategy:
    """The best strategy for a residual set of attributes of ``sizes`` whose queries' pieces have the Gram
    ``g`` (over the set's cells): ResidualPlanner's Kronecker product of contrasts; for several attributes
    the Kronecker-factored optimum (:func:`factored_strategy`) and, where ``few`` (the part of ``g`` from
    2-way query types, which reach few directions) is given, :func:`low_rank_strategy`; and the full convex
    optimum over the set's residual space (⊗U_i, when it has at most :data:`MAX_SET_DIM` dimensions)."""
    if not sizes:  # the empty set: the total count, measured as itself
        return SetStrategy(np.ones((1, 1)), float(g[0, 0]), "identity")
    rp = _contrasts_gram(sizes)
    # (BᵀB)⁺ = ⊗ (n−1)/n·(I − J/n), and g lies in the set's residual space
    best = SetStrategy(rp, float(np.trace(g)) * math.prod((n - 1) / n for n in sizes), "identity")
    if len(sizes) > 1:
        found = [factored_strategy(g, sizes)]
        if few is not None:
            found.append(low_rank_strategy(g, few, sizes))
        best = min([best, *found], key=lambda s: s.loss)
    dim = math.prod(n - 1 for n in sizes)
    if dim <= MAX_SET_DIM:
        u = kron_all([residual_basis(n) for n in sizes])
        a = u.T @ g @ u
        a = (a + a.T) / 2
        # A few 2-way queries leave most of the residual space unasked (affine: n1 + n2 − 1 of them), and
        # the optimum for a singular Ā measures nothing there: no other query could be answered, and the
        # dual solver does not converge. Some weight on every direction keeps M invertible; the best of a
        # few weights is kept, by its loss on the queries themselves.
        for floor in _FLOORS:
            convex = _convex_strategy(a + floor * np.trace(a) / a.shape[0] * np.eye(a.shape[0]), u)
            m = u.T @ convex.gram @ u
            loss = float(np.trace(np.linalg.solve((m + m.T) / 2, a)))
            if loss < best.loss:
                best = SetStrategy(convex.gram, loss, "convex")
    return best


def _contrasts_gram(sizes: Sequence[int]) -> np.ndarray:
    """⊗ n/(n−1)·(I − J/n): BᵀB of ResidualPlanner's contrasts over a set's cells, max diagonal 1."""
    return kron_all([n / (n - 1) * (np.eye(n) - 1.0 / n) for n in sizes])


LOW_RANK_SHARE = 1e-2  # of the budget the low-rank strategy leaves to every other direction when alone


def low_rank_strategy(g: np.ndarray, few: np.ndarray, sizes: Sequence[int]) -> SetStrategy:
    """A strategy for a set whose Gram ``g`` holds a part ``few`` of low rank (the pieces of 2-way query
    types: an affine workload on n_a × n_b reaches n_a + n_b − 1 of its (n_a − 1)(n_b − 1) directions).

    The convex problem restricted to the row space of ``few`` has as many unknowns as the set has cells
    but r × r matrices (r: the rank), so it is solved exactly where the full one is out of reach; it
    measures nothing outside that space. The rest of ``g`` (pieces of Kronecker entries) gets its
    Kronecker-factored optimum, or, where there is none, the contrasts with :data:`LOW_RANK_SHARE` of the
    budget, so any query on the set stays answerable. The two are measured together, scaled to privacy
    cost 1, in the budget split of least exact loss on ``g``: a bounded 1-D search around the split that
    minimises the bound l₁/α + l₂/(1 − α) of their losses. The loss returned is that exact loss."""
    u = kron_all([residual_basis(int(n)) for n in sizes])
    a_few = u.T @ few @ u
    w, v = np.linalg.eigh((a_few + a_few.T) / 2)
    keep = w > 1e-10 * max(float(w[-1]), _TINY)
    part = _convex_strategy(np.diag(w[keep]), u @ v[:, keep])
    rest = g - few
    a = u.T @ g @ u
    a = (a + a.T) / 2
    m_part = u.T @ part.gram @ u
    diag_part = np.diag(part.gram)
    if float(np.trace(rest)) > 1e-12 * float(np.trace(g)):
        other = factored_strategy(rest, sizes)
        # the bound's split, l₁/α + l₂/(1 − α) at its minimum, then the exact loss's minimum near it
        start = math.sqrt(other.loss) / (math.sqrt(part.loss) + math.sqrt(other.loss))
        bounds = (start / 4, min(1.0 - (1.0 - start) / 4, 1.0 - 1e-9))
    else:  # nothing else asked: every other direction gets a small fixed share
        other = SetStrategy(_contrasts_gram(sizes), 0.0, "identity")
        bounds = (LOW_RANK_SHARE, LOW_RANK_SHARE)
    m_other = u.T @ other.gram @ u
    diag_other = np.diag(other.gram)

    def loss(share: float) -> float:
        scale = float(np.max((1.0 - share) * diag_part + share * diag_other))
        m = ((1.0 - share) * m_part + share * m_other) / scale
        return float(np.trace(np.linalg.solve((m + m.T) / 2, a)))

    if bounds[0] == bounds[1]:
        share = bounds[0]
    else:
        from scipy.optimize import minimize_scalar  # deferred, as in _convex_strategy

        found = minimize_scalar(loss, bounds=bounds, method="bounded", options={"xatol": 1e-3})
        share = float(found.x)
    gram = (1.0 - share) * part.gram + share * other.gram
    gram /= float(np.diag(gram).max())
    loss_at = loss(share)
    return SetStrategy(gram, loss_at, "low-rank")


def factored_strategy(
    g: np.ndarray, sizes: Sequence[int], rounds: int = 8, rtol: float = 1e-6
) -> SetStrategy:
    """The best Kronecker product ⊗B_i (each factor of privacy cost 1) for a residual set whose pieces'
    Gram ``g`` (over its cells) is not a Kronecker product, as 2-way query types give: the Kronecker-factored
    solver, one per-attribute problem of size n_i − 1 at a time, for sets too large for the full convex one.

    Block-coordinate descent, as :func:`kronecker_strategy` does for a sum of Kronecker terms: the loss
    tr(g ⊗P_j), P_j = (B_jᵀB_j)⁺, is linear in P_i with the others fixed, with the partial trace of g
    against them as the attribute's Gram (positive semidefinite, since g is). It starts from the contrasts
    (ResidualPlanner's), stops when a round gains less than ``rtol`` and returns the best product seen."""
    k = len(sizes)
    tensor = g.reshape(*sizes, *sizes)
    rows, cols = "abcdefgh"[:k], "ijklmnop"[:k]  # g's row and column index of each attribute

    def loss(strategies: list[AttributeStrategy]) -> float:
        spec = ",".join(f"{c}{r}" for r, c in zip(rows, cols, strict=True))
        return float(np.einsum(f"{rows}{cols},{spec}->", tensor, *map(_pinv, strategies)))

    def weighted(i: int, current: list[AttributeStrategy]) -> np.ndarray:
        others = [j for j in range(k) if j != i]
        spec = ",".join(f"{cols[j]}{rows[j]}" for j in others)
        part = np.einsum(
            f"{rows}{cols},{spec}->{rows[i]}{cols[i]}", tensor, *(_pinv(current[j]) for j in others)
        )
        part = (part + part.T) / 2
        # a direction no piece reaches would get no measurement (and the dual solver no optimum): a
        # little weight on each keeps every query answerable, as set_strategy's floors do
        n = sizes[i]
        return part + _FLOORS[-1] * max(float(np.trace(part)), _TINY) / (n - 1) * (np.eye(n) - 1.0 / n)

    best, best_loss = _coordinate_descent(sizes, range(k), weighted, loss, rounds, rtol)
    return SetStrategy(kron_all([b.gram for b in best]), best_loss, "factored")


# --- measure --------------------------------------------------------------------------------------------


def strategy_matrix(strategy: AttributeStrategy) -> np.ndarray:
    """B̃_i ((n−1) × n, rows ⊥ 1) with B̃_iᵀB̃_i = the strategy's Gram (to rounding): M^{1/2}Uᵀ."""
    return dense_matrix(strategy.gram, [strategy.gram.shape[0]])
