"""The SVD (factorization) lower bound on a query workload's error under the Gaussian mechanism.

For any strategy A answering W = X A, the total variance at privacy cost ‖A‖²₁→₂/(2ρ) = 1 is
‖X‖²_F ‖A‖²₁→₂ ≥ ‖W‖²_* / N (Li and Miklau; N the domain's size, ‖W‖_* the sum of W's singular values), so
no plan, ours or any published one, has an RMSE = sqrt(total variance / queries) below
sqrt(‖W‖²_* / (N · 2ρ · queries)). The gap between a plan and this bound is where its error could still go.

W stacks, for each marginal A of the workload, ⊗_{i∈A} Q_i ⊗_{j∉A} 1ᵀ (Q_i the attribute's queries). Its
singular values are the square roots of WᵀW's eigenvalues, WᵀW = Σ_A ⊗_{i∈A} G_i ⊗_{j∉A} 11ᵀ, found without
forming it: each attribute's space splits into the constant vector e = 1/√n and its complement U. An
identity attribute (G = I) keeps the split, so WᵀW is block-diagonal over which identity attributes sit in
U (a block repeated Π(n_i − 1) times); a query attribute (prefix, range, …) mixes e and U, so within a
block the query attributes' parts are coupled, on the span of ⊗_{p∈S} U_p ⊗_{p∉S} e over the sets S of
query attributes the marginals reach. That span's size, Σ_S Π_{p∈S}(n_p − 1), decides the cost: a
workload whose marginals reach two query attributes of 100 values needs an eigendecomposition of ~10⁴.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from shardfold.functions.dpquery import smasher


class TooLarge(ValueError):
    """The workload's coupled span is larger than the bound may compute."""


def svd_bound_rmse(
    domains: Sequence[int],
    kinds: Sequence[str],
    sets: Sequence[Sequence[int]],
    privacy_cost: float = 1.0,
    max_dim: int = 6000,
) -> float:
    """The SVD lower bound on the RMSE over every query of the workload (``sets``: the marginals, each a
    tuple of attributes; ``kinds``: each attribute's query type, ``identity`` for plain counts) at privacy
    cost 2ρ = ``privacy_cost``. :class:`TooLarge` when a block's coupled span exceeds ``max_dim``."""
    d = len(domains)
    query_attrs = [i for i in range(d) if kinds[i] != "identity"]
    identity = [i for i in range(d) if kinds[i] == "identity"]
    parts = {}
    for p in query_attrs:
        g = smasher.query_gram(kinds[p], domains[p])
        n = domains[p]
        e = np.full(n, 1 / math.sqrt(n))
        u = smasher.residual_basis(n)
        parts[p] = (float(e @ g @ e), u.T @ g @ e, u.T @ g @ u)
    nuclear = 0.0
    for r in range(len(identity) + 1):
        for in_u in itertools.combinations(identity, r):  # identity attributes in their U part
            terms = [
                (frozenset(a) & frozenset(query_attrs), math.prod(domains[j] for j in identity if j not in a))
                for a in map(set, sets)
                if set(in_u) <= a
            ]
            if not terms:
                continue
            block = _coupled_block(domains, query_attrs, parts, terms, max_dim)
            lam = np.linalg.eigvalsh(block)
            repeat = math.prod(domains[i] - 1 for i in in_u)
            nuclear += repeat * float(np.sqrt(np.clip(lam, 0.0, None)).sum())
    queries = sum(
        math.prod(smasher.attribute_queries(kinds[i], domains[i]).shape[0] for i in a) for a in sets
    )
    return math.sqrt(nuclear**2 / math.prod(domains) / privacy_cost / queries)


def _coupled_block(
    domains: Sequence[int],
    query_attrs: list[int],
    parts: dict[int, tuple[float, np.ndarray, np.ndarray]],
    terms: list[tuple[frozenset[int], int]],
    max_dim: int,
) -> np.ndarray:
    """Σ over ``terms`` (each the marginal's query attributes and its coefficient from the identity
    attributes) of ⊗_p (G_p if p is in it, else 11ᵀ) on the span of ⊗_{p∈S} U_p ⊗_{p∉S} e, S running over
    every subset of a term's query attributes."""
    spans = sorted(
        {
            frozenset(s)
            for t, _ in terms
            for k in range(len(t) + 1)
            for s in itertools.combinations(sorted(t), k)
        },
        key=lambda s: (len(s), sorted(s)),
    )
    sizes = [math.prod(domains[p] - 1 for p in s) for s in spans]
    dim = sum(sizes)
    if dim > max_dim:
        raise TooLarge(f"the coupled span has {dim:,} dimensions, over {max_dim:,}")
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    out = np.zeros((dim, dim))
    for (i, s1), (j, s2) in itertools.product(enumerate(spans), repeat=2):
        if j < i:
            continue
        acc = np.zeros((sizes[i], sizes[j]))
        for t, coef in terms:
            if not (s1 | s2) <= t:
                continue
            factors = []
            for p in query_attrs:
                a, b, c = parts[p]
                if p not in t:
                    factors.append(np.array([[float(domains[p])]]))  # eᵀ 11ᵀ e
                elif p in s1 and p in s2:
                    factors.append(c)
                elif p in s1:
                    factors.append(b[:, None])
                elif p in s2:
                    factors.append(b[None, :])
                else:
                    factors.append(np.array([[a]]))
            acc += coef * smasher.kron_all(factors)
        out[offsets[i] : offsets[i + 1], offsets[j] : offsets[j + 1]] = acc
        out[offsets[j] : offsets[j + 1], offsets[i] : offsets[i + 1]] = acc.T
    return out
