"""The strategies of the residual sets that a workload asks in more than one way, as the planner
(:func:`functions.dpquery.planner._residual_sets`) merges its column sets into them (QuerySmasher,
:mod:`functions.dpquery.smasher`): a set whose attribute marginals ask as different types gets one
Kronecker strategy fitted to its summed workload (:meth:`SetStrategies.kronecker`); a set that a 2-way type
or an explicit matrix reaches is solved whole from the Gram of every piece on it
(:meth:`SetStrategies.whole`).
Pure numpy, no data.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from shardfold.functions.dpquery import smasher
from shardfold.functions.dpquery.measure import contrasts, log1p_gamma
from shardfold.functions.dpquery.spec import ATTRIBUTE_TYPES, QUERY_TYPES

_TINY = np.finfo(np.float64).tiny  # a piece of zero variance: its log stays finite


class SetStrategies:
    """The strategies :func:`_residual_sets` chooses for merged sets, with the caches that let the sets of one
    structure (every pair of a workload on [n]^d) share their solves and matrices."""

    def __init__(self, cols, n, sets, pair_grams):
        self.cols, self.n, self.sets, self.pair_grams = cols, n, sets, pair_grams
        self.names: dict[str, int] = {}  # strategy name -> id (Plan.strategy_names)
        self.solves: dict = {}  # the Grams by what they are made of, the strategies by a set's structure
        self.stored: dict[int, str] = {}  # a solved matrix (by id) -> its name in strategies
        self.inverses_of: dict[tuple[int, ...], np.ndarray] = {}
        self.lo_of: dict[tuple[int, int], float] = {}  # tr(cover · (BᵀB)⁺) by the ids of both

    def name_id(self, name: str) -> int:
        return self.names.setdefault(name, len(self.names))

    def whole(self, members, cover, ids: np.ndarray, has_pair) -> np.ndarray:
        """A set a 2-way type reaches, solved whole (:meth:`_solve`): its strategy ids into ``ids`` (the set's
        row), its column sets' coefficients rewritten; returns (BᵀB)⁺ over its cells."""
        cols, sets = self.cols, self.sets
        k = cover.shape[1]
        sizes = [int(self.n[cols.real[t]]) for t in cover[0]]
        how, mats, grams = self._solve(members, cover, sizes)
        if how == "identity":
            for pos in range(k):
                ids[pos] = self.name_id(f"identity:{sizes[pos]}")
        else:  # one matrix: an attribute's ("mixed:n") or one over the set's cells ("dense:n_axn_b")
            name = self.stored.get(id(mats[0]))
            if name is None:  # stored once, whichever sets share it
                name = self.stored[id(mats[0])] = f"{how}:{len(self.names)}"
                cols.strategies[name] = mats[0]
            ids[:k] = self.name_id(name)
            if how.startswith("dense:"):  # one product over all the cells: γ of their number
                sets.log_gamma[members] = float(log1p_gamma(np.array([math.prod(sizes)]), 0)[0])
        gram_inv = self._gram_inverse(mats)
        privacy = _log_privacy(mats)
        for u, row in zip(members, cover, strict=True):
            sets.log_p[u] = privacy
            gram, log_factor = grams[int(u)]
            pair = (id(gram), id(gram_inv))  # both shared by the sets of one structure
            if pair not in self.lo_of:
                self.lo_of[pair] = math.log(max(float(np.einsum("ij,ji->", gram, gram_inv)), _TINY))
            sets.log_lo[u] = self.lo_of[pair] + log_factor
            if has_pair[u]:
                sets.log_lo[u] -= sets.lse_a[u]
            else:
                sets.log_lo[u] -= float(cols.log_o[row].sum())
        return gram_inv

    def _gram_inverse(self, mats: list[np.ndarray]) -> np.ndarray:
        """(BᵀB)⁺ of the matrices measured, cached by their ids (the matrices live on in ``solves``)."""
        key = tuple(id(m) for m in mats)
        if key not in self.inverses_of:
            if len(mats) == 1:
                inverse = np.linalg.pinv(mats[0])
                self.inverses_of[key] = inverse @ inverse.T
            else:  # the contrasts: (⊗EᵢᵀEᵢ)⁺ = ⊗(I − J/nᵢ), a projection
                self.inverses_of[key] = smasher.kron_all([m.T @ m for m in mats])
        return self.inverses_of[key]

    def _solve(self, members, cover, sizes: list[int]) -> tuple[str, list[np.ndarray], dict]:
        """A residual set that a 2-way query type reaches, solved from the Gram of every piece on it
        (:meth:`_grams`): the best of the contrasts, the Kronecker-factored and low-rank strategies and, on
        small sets, the full convex optimum (:func:`~functions.dpquery.smasher.set_strategy`), and for one
        attribute its per-attribute optimum too (:func:`~functions.dpquery.smasher.attribute_strategy`).
        Returns (``"identity"``, ``"mixed:<n>"`` or ``"dense:<n_a>x<n_b>"``; the matrices measured, one per
        attribute or one over the cells; :meth:`_grams`' cover)."""
        solves = self.solves
        cover_grams, parts = self._grams(members, cover, sizes)
        # the best strategy is the same for any multiple of the Gram: sets of one structure solve once; a
        # miss only costs a solve
        scale = math.fsum(w * solves[made_of][1] for made_of, w, _ in parts)
        if not scale > 0:  # no piece on the set at all (abs_diff on 2 x 2 reaches neither 1-way set)
            return "identity", [contrasts(n) for n in sizes], cover_grams
        key = (tuple(sizes), tuple(sorted((made_of, round(w / scale, 12), few) for made_of, w, few in parts)))
        if key not in solves:
            total = sum(w * solves[made_of][0] for made_of, w, _ in parts)
            low = sum(w * solves[made_of][0] for made_of, w, few in parts if few)
            trace = max(float(np.trace(total)), _TINY)
            solves[key] = _best_whole(total / trace, sizes, low / trace if len(sizes) > 1 else None)
        return (*solves[key], cover_grams)

    def _grams(self, members, cover, sizes: list[int]) -> tuple[dict, list]:
        """Each column set's Gram ({column set: (the Gram of its pieces, log of the factor that makes it the
        Gram unweighted by the c_u its log_lo is taken against)}) and the set's parts (what each Gram is
        made of, its weight in the set's sum, whether a 2-way type's). The Grams are cached by what they are
        made of: the sets of one structure (every pair of a workload on [n]^d) share their Grams and their
        solve, so d(d−1)/2 pairs build no matrices of their own."""
        solves, kinds = self.solves, self.cols.kind
        grams: dict[int, tuple[np.ndarray, float]] = {}
        parts = []
        for u, row in zip(members, cover, strict=True):
            if any(kinds[t] >= len(ATTRIBUTE_TYPES) for t in row):
                sources = self.pair_grams[tuple(int(t) for t in row)]
                weight, few = float(sources[0][0]), True  # the marginals' weights, relative to the first's
                made_of = ("pair", tuple((float(w) / weight, _digest(solves, gram)) for w, gram in sources))
                if made_of not in solves:
                    solves[made_of] = _with_trace(sum(float(w) / weight * gram for w, gram in sources))
            else:
                made_of = ("kron", tuple((int(kinds[t]), int(n)) for t, n in zip(row, sizes, strict=True)))
                if made_of not in solves:
                    solves[made_of] = _with_trace(
                        smasher.kron_all([smasher.centred_gram(QUERY_TYPES[k], n) for k, n in made_of[1]])
                    )
                weight, few = math.exp(float(self.sets.lse_a[u] - self.cols.log_o[row].sum())), False
            grams[int(u)] = (solves[made_of][0], math.log(weight) if few else 0.0)
            parts.append((made_of, weight, few))
        return grams, parts

    def kronecker(self, members, cover, ids: np.ndarray) -> None:
        """A set whose attributes its marginals ask in different ways: one Kronecker strategy fitted to its
        summed workload (:func:`~functions.dpquery.smasher.kronecker_strategy`), its ids into ``ids``."""
        cols, sets, n = self.cols, self.sets, self.n
        weights = sets.lse_a[members] - cols.log_o[cover].sum(axis=1)  # log c_u = log Σ w_A ∏_{A∖S} o_i
        terms = [
            (
                math.exp(float(wu - weights.max())),
                [smasher.centred_gram(QUERY_TYPES[int(cols.kind[t])], int(n[cols.real[t]])) for t in row],
            )
            for wu, row in zip(weights, cover, strict=True)
        ]
        # an attribute every entry asks cell by cell keeps the contrasts (optimal, and no stored matrix)
        fixed = [bool(np.all(cols.kind[cover[:, pos]] == 0)) for pos in range(cover.shape[1])]
        chosen, _ = smasher.kronecker_strategy(terms, fixed=fixed)
        mats, inverses = [], []
        for pos, b in enumerate(chosen):
            size = int(n[cols.real[cover[0, pos]]])
            if fixed[pos]:
                mats.append(contrasts(size))
                inverses.append(mats[-1].T)
                continue  # ids keeps the column's "identity:n"
            mats.append(smasher.strategy_matrix(b))
            inverses.append(np.linalg.pinv(mats[-1]))
            name = f"mixed:{size}:{len(self.names)}"
            cols.strategies[name] = mats[-1]
            ids[pos] = self.name_id(name)
        privacy = _log_privacy(mats)
        for u, row in zip(members, cover, strict=True):
            sets.log_p[u] = privacy
            sets.log_lo[u] = sum(
                math.log(float(smasher.block_sums(QUERY_TYPES[int(cols.kind[t])], inv @ inv.T).sum()))
                - cols.log_o[t]
                for t, inv in zip(row, inverses, strict=True)
            )


def _log_privacy(mats: list[np.ndarray]) -> float:
    """log ∏ max diag(BᵢᵀBᵢ): the privacy factor of a set measured through ``mats``."""
    return sum(math.log(float(np.max(np.einsum("ij,ij->j", m, m)))) for m in mats)


def _digest(solves: dict, gram: np.ndarray) -> bytes:
    """A Gram's content, as a key (cached by the object: equal Grams of other pieces share their solve):
    its entries to 12 digits relative to its largest, and that scale, so that Grams of small entries (an
    explicit matrix of rates) are told apart as well as large ones."""
    key = ("digest", id(gram))
    if key not in solves:
        scale = float(np.abs(gram).max())
        shape = np.round(gram / scale, 12) if scale > 0 else gram
        content = repr(scale).encode() + np.ascontiguousarray(shape).tobytes()
        solves[key] = (hashlib.blake2b(content, digest_size=16).digest(), gram)
    return solves[key][0]  # the Gram is kept beside its digest, so its id is not reused


def _with_trace(gram: np.ndarray) -> tuple[np.ndarray, float]:
    return gram, float(np.trace(gram))


def _best_whole(total: np.ndarray, sizes: list[int], few: np.ndarray | None) -> tuple[str, list[np.ndarray]]:
    """:meth:`SetStrategies._solve`'s strategy for the summed Gram ``total`` (``few``: its 2-way types'
    part): (its kind, its matrices)."""
    chosen = smasher.set_strategy(total, sizes, few)
    if len(sizes) == 1:
        # the per-attribute solver has closed forms and no floor, but needs a Gram of full rank on the
        # residual space (a few 2-way pieces may leave most of it unasked) and may stall near one;
        # set_strategy's floors do not: the better of the two, by loss
        u = contrasts(sizes[0])
        eig = np.linalg.eigvalsh(u @ total @ u.T)
        if not eig[0] > 1e-9 * eig[-1]:
            return _one_matrix(chosen, sizes)
        own = smasher.attribute_strategy(total)
        better = smasher.strategy_loss(total, own) <= smasher.strategy_loss(total, chosen)
        return _one_matrix(own if better else chosen, sizes)
    if chosen.solver == "identity":
        return "identity", [contrasts(size) for size in sizes]
    return f"dense:{'x'.join(map(str, sizes))}", [smasher.dense_matrix(chosen.gram, sizes)]


def _one_matrix(chosen, sizes) -> tuple[str, list[np.ndarray]]:
    """_best_whole's answer for a one-attribute set measured through ``chosen``."""
    if chosen.solver == "identity":
        return "identity", [contrasts(sizes[0])]
    return f"mixed:{sizes[0]}", [smasher.strategy_matrix(chosen)]


def pair_log_var(kind, dims: tuple[int, ...], subsets: np.ndarray, log_sigma2: np.ndarray, solved) -> float:
    """log of the mean variance of the queries of a type over a marginal as a whole (a 2-way type, an
    explicit matrix): Σ_{S ⊆ A} σ_S² tr(G_S (B_SᵀB_S)⁺) over the queries (``subsets``: the residual sets of
    the subsets of A in mask order, ∅, {a}, {b}, {a, b} for two attributes)."""
    grams = smasher.pair_piece_grams(kind, *dims)
    k = len(dims)
    total = 0.0
    for mask, r in enumerate(subsets.tolist()):
        pos = tuple(p for p in range(k) if mask >> p & 1)
        if pos not in grams:  # no query has a piece there
            continue
        inv = solved.get(int(r), np.ones((1, 1)))
        total += math.exp(float(log_sigma2[int(r)])) * float(np.einsum("ij,ji->", grams[pos], inv))
    return math.log(total / smasher.pair_queries(kind, *dims).shape[0])
