"""The ``dpquery`` plan: ResidualPlanner noise allocation, computed without touching data. Pure, no store.

Notation (see shared/reference/dp-query.md §1–2): attributes 0..d−1 with domain sizes n_i ≥ 2; a workload W
of marginals A (sorted tuples of attribute indices) with weights w_A > 0; its closure
C(W) = {S : S ⊆ A for some A ∈ W}, which always holds ∅ (the total count).

For every residual set S ∈ C(W) the plan fixes a noise variance σ_S². Measuring S means releasing
y_S = E_S x_S + N(0, σ_S² I), with E_S = ⊗_{i∈S} E_{n_i} and E_n an (n−1)×n matrix of orthonormal rows
orthogonal to 1 (e.g. Helmert contrasts). Its L2 sensitivity is √p_S, with p_S = ∏_{i∈S}(n_i−1)/n_i, so it
costs ρ_S = p_S/(2σ_S²), it needs ∏_{i∈S}(n_i−1) noise samples, and Σ_S ρ_S is the job's ρ.
A marginal A is reconstructed as x̂_A = Σ_{S⊆A} (⊗_{i∈A} (i∈S ? E_{n_i}ᵀ : 1/n_i)) y_S; every cell has the
variance Var_A = Σ_{S⊆A} σ_S² p_S ∏_{i∈A∖S} 1/n_i².

Allocation (``loss``):
* ``sum_of_variances`` minimises Σ_A w_A·cells_A·Var_A in closed form:
  σ_S² = √(p_S/v_S) · Σ_T √(p_T v_T) / (2ρ), with v_S = Σ_{A⊇S} w_A ∏_{i∈S}(n_i−1) ∏_{i∈A∖S} 1/n_i.
* ``max_variance`` minimises max_A w_A·Var_A: a convex program in |C| variables solved with cvxpy
  (imported only then), scaled by the closed-form solution for conditioning.

**Conventions** (what the measure/reconstruct stages rely on):

* Residual sets are indexed 0..|C|−1 in the order (size, then lexicographic); index 0 is always ∅. A set is a
  tuple of attribute indices in increasing order: :meth:`Plan.residual`.
* Workload marginals keep the order they were given in (a spec's :meth:`DPQueryJob.marginals`), each a sorted
  tuple: :meth:`Plan.marginal`; :meth:`Plan.subsets` lists the residual indices S ⊆ A (ascending).
* Coefficients are held as **natural logarithms** (``log_p``, ``log_v``, ``log_sigma2``, ``log_var``): a
  product over 100 attributes under- or overflows float64. They are finite (never −inf): every p_S, v_S,
  σ_S², Var_A is > 0. :attr:`Plan.sigma2`, :attr:`Plan.rho_s`, :attr:`Plan.var` give linear values.
* Counts are exact int64: :attr:`Plan.noise_count` (∏(n_i−1) over S), :attr:`Plan.cells` (∏ n_i over A).
* The plan spends ``rho_planned`` = ρ·(1 − RHO_SLACK), not ρ: a floating-point-safe sampler's own privacy map
  may exceed the ideal q_S/(2σ_S²) by a rounding term, and the slack keeps the sum of the maps within ρ.

**Charged sensitivity** (``log_q``). p_S is the squared L2 sensitivity of the exact transform for one row.
The plan charges q_S = Δ_S² = p_S·(k + 2·η_S·N)² instead
(:func:`functions.dpquery.measure.charged_sensitivity` has the derivation): k, the privacy unit's rows per
person (:mod:`functions.dpquery.unit`: a person moves x_S by at most k unit vectors, so E_S x_S by at most
k·√p_S), and 2·η_S·N, the worst-case float64 rounding of the transform on data of at most N rows. Privacy
uses q_S (ρ_S = q_S/(2σ_S²), Σ_S q_S/σ_S² = 2ρ); accuracy keeps p_S (Var_A = Σ σ_S² p_S ∏ 1/n_i² is
geometry). The closed form is the same with q_S as the privacy coefficient: σ_S² = √(q_S/v_S)·Σ_T √(q_T
v_T)/(2ρ), so with k rows per person every σ_S grows by about k at the same ρ (exactly k when the rounding
is not charged). Bare plans (no spec) charge neither unless ``unit_rows``/``rows_bound`` are given.

**Fan-out** helpers: :meth:`Plan.residual_groups` cuts the residual sets into contiguous index ranges of
roughly equal noise-sample counts (measure tasks); :meth:`Plan.marginal_groups` cuts the workload into
contiguous ranges of roughly equal reconstruction work (reconstruct tasks); :meth:`Plan.needed_residuals`
and :meth:`Plan.group_of` map a reconstruct group to the residuals, and measure groups, it reads.

**Document form** (:meth:`Plan.to_doc` / :meth:`Plan.from_doc`): a JSON-safe dict with scalars in clear and
every array as ``{"dtype", "shape", "zb64"}`` (base64 of zlib-compressed little-endian bytes; exact). Flat
arrays with CSR pointers (``ptr``) hold the sets, never one dict per set: d = 100 with all ≤3-way
marginals (166,751 residual sets) is a few MB. :meth:`Plan.summary` is the small human-readable part.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardfold.functions.dpquery.measure import charge_factor, contrasts, log1p_gamma
from shardfold.functions.dpquery.smasher import (
    AttributeFactors,
    attribute_factors,
    attribute_strategy,
    block_sums,
    centred_gram,
    dense_matrix,
    kron_all,
    kronecker_strategy,
    pair_piece_grams,
    pair_queries,
    set_strategy,
    strategy_loss,
    strategy_matrix,
    whole_piece_grams,
)
from shardfold.functions.dpquery.spec import (
    ATTRIBUTE_TYPES,
    MATRIX,
    MAX_MATRICES,
    MAX_PAIR_DIM,
    PAIR_TYPES,
    QUERY_TYPES,
    QueryMatrix,
)
from shardfold.functions.errors import PlanError, SpecError
from shardfold.functions.privacy import MAX_RHO, REPORT_DELTA, cdp_eps, gaussian_eps, simple_eps

DOC_VERSION = 1
# The plan spends ρ·(1 − RHO_SLACK): room for the sampler's rounding term in its privacy map.
RHO_SLACK = 1e-9
# Σ_S p_S/σ_S² must equal 2·rho_planned to this relative tolerance, or planning fails.
PRIVACY_CHECK_RTOL = 1e-9
# The largest marginal a task may materialise (float64 cells); bounds every task's memory.
MAX_MARGINAL_CELLS = 100_000_000
# Σ_A 2^|A| (the (marginal, subset) pairs the plan enumerates) may not exceed this.
MAX_SUBSET_PAIRS = 50_000_000
# Default fan-out sizes.
DEFAULT_SAMPLES_PER_TASK = 2_000_000
DEFAULT_CELLS_PER_TASK = 20_000_000
# The largest public row bound N: counts up to 2^53 are exact in float64 (the transform's input).
MAX_ROWS_BOUND = 2**53
LOSSES = ("sum_of_variances", "max_variance")


# ---------------------------------------------------------------------------------------------------------
# array helpers


def _lse(x: np.ndarray) -> float:
    """log Σ exp(x) of a 1-D array."""
    m = float(np.max(x))
    return m + math.log(float(np.sum(np.exp(x - m))))


def _grouped_lse(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """log Σ exp over the consecutive groups of ``values`` beginning at ``starts`` (sorted, starts[0] = 0)."""
    m = np.maximum.reduceat(values, starts)
    counts = np.diff(np.append(starts, values.size))
    s = np.add.reduceat(np.exp(values - np.repeat(m, counts)), starts)
    return m + np.log(s)


def _encode(a: np.ndarray) -> dict[str, Any]:
    a = np.ascontiguousarray(a)
    dt = a.dtype.newbyteorder("<") if a.dtype.byteorder not in ("|", "<", "=") else a.dtype
    raw = a.astype(dt.newbyteorder("<"), copy=False).tobytes()
    return {
        "dtype": np.dtype(dt).newbyteorder("<").str,
        "shape": list(a.shape),
        "zb64": base64.b64encode(zlib.compress(raw, 1)).decode("ascii"),
    }


def _decode(doc: dict[str, Any]) -> np.ndarray:
    raw = zlib.decompress(base64.b64decode(doc["zb64"]))
    return np.frombuffer(raw, dtype=np.dtype(doc["dtype"])).reshape(doc["shape"]).copy()


def _ranges_by_cost(cost: np.ndarray, target: float) -> list[tuple[int, int]]:
    """Cut 0..len(cost) into contiguous [start, stop) ranges of total cost about ``target`` each.

    Greedy on the running sum: a range closes as soon as it reaches ``target``, so each holds at most
    target + (its largest single cost), and only the last may hold less.
    """
    n = int(cost.size)
    if n == 0:
        return []
    target = max(float(target), 1.0)
    cum = np.cumsum(cost, dtype=np.float64)
    out = []
    start = 0
    base = 0.0
    while start < n:
        # first index whose running sum (from start) reaches the target
        stop = int(np.searchsorted(cum, base + target, side="left")) + 1
        stop = min(max(stop, start + 1), n)
        out.append((start, stop))
        base = float(cum[stop - 1])
        start = stop
    return out


# ---------------------------------------------------------------------------------------------------------
# the plan


@dataclass
class Plan:
    """A complete noise allocation for one dpquery job (see the module docstring for conventions)."""

    domains: np.ndarray  # (d,) int64, n_i
    names: list[str] | None  # attribute names, or None when planned from bare parts
    rho: float  # the job's budget (zCDP)
    rho_planned: float  # what the allocation spends: rho·(1 − RHO_SLACK)
    loss: str
    delta: float  # the δ at which the report states ε
    # residual sets, CSR over res_attrs; index 0 is ∅
    res_ptr: np.ndarray  # (|C|+1,) int64
    res_attrs: np.ndarray  # (Σ|S|,) int32
    log_p: np.ndarray  # (|C|,) float64
    log_q: np.ndarray  # (|C|,) float64, the charged squared sensitivity (privacy coefficient)
    log_v: np.ndarray  # (|C|,) float64, weighted sum-of-variance coefficients
    log_sigma2: np.ndarray  # (|C|,) float64
    noise_count: np.ndarray  # (|C|,) int64, ∏_{i∈S}(n_i−1)
    # workload marginals, in the given order, CSR over marg_attrs
    marg_ptr: np.ndarray  # (|W|+1,) int64
    marg_attrs: np.ndarray  # (Σ|A|,) int32
    weights: np.ndarray  # (|W|,) float64
    log_var: np.ndarray  # (|W|,) float64, per-cell variance of x̂_A
    cells: np.ndarray  # (|W|,) int64, ∏_{i∈A} n_i
    sub_ptr: np.ndarray  # (|W|+1,) int64, CSR over sub_idx
    sub_idx: np.ndarray  # (Σ 2^|A|,) int32 (int64 beyond 2^31 residual sets): S ⊆ A, ascending
    solver: dict[str, Any] = field(default_factory=dict)  # max_variance: cvxpy status, solver, time
    unit_rows: int = 1  # k: rows one person may contribute (the privacy unit; 1 = a row is a person)
    rows_bound: int | None = None  # N: the public bound on rows counted (None: rounding not charged)
    # General linear queries (QuerySmasher): beside res_attrs, the strategy each set measures each attribute
    # through (an index of strategy_names: "identity:n" the contrasts, "prefix:n" ... a type's own strategy,
    # "mixed:n:i" a set's Kronecker strategy for several types); beside marg_attrs, each attribute's query
    # type code (an index of QUERY_TYPES); the queries each marginal answers; and the measured B_i of every
    # strategy but the contrasts. None / empty: every query is an identity (a ResidualPlanner plan).
    res_strategy: np.ndarray | None = None  # (Σ|S|,) int32
    strategy_names: list[str] = field(default_factory=list)
    marg_types: np.ndarray | None = None  # (Σ|A|,) int8
    num_q: np.ndarray | None = None  # (|W|,) int64, ∏_{i∈A} m_i
    strategies: dict[str, np.ndarray] = field(default_factory=dict)
    # beside a strategy of strategies, its u (the values its attribute's total is spread over) where it
    # is not 1/n: RP+'s Schur-complement residuals (functions/dpquery/schur.py), whose rows are not ⊥ 1
    totals: dict[str, np.ndarray] = field(default_factory=dict)

    # ---- sizes and accessors ------------------------------------------------------------------------
    @property
    def num_residuals(self) -> int:
        return int(self.res_ptr.size - 1)

    @property
    def num_marginals(self) -> int:
        return int(self.marg_ptr.size - 1)

    def residual(self, k: int) -> tuple[int, ...]:
        """Attribute indices of residual set k (ascending; () is ∅)."""
        return tuple(int(i) for i in self.res_attrs[self.res_ptr[k] : self.res_ptr[k + 1]])

    def marginal(self, j: int) -> tuple[int, ...]:
        """Attribute indices of workload marginal j (ascending)."""
        return tuple(int(i) for i in self.marg_attrs[self.marg_ptr[j] : self.marg_ptr[j + 1]])

    def subsets(self, j: int) -> np.ndarray:
        """Residual indices S ⊆ A_j, ascending (so ∅ = 0 first)."""
        return self.sub_idx[self.sub_ptr[j] : self.sub_ptr[j + 1]]

    def set_strategies(self, k: int) -> tuple[str, ...]:
        """The strategy each attribute of residual set k is measured through (see ``res_strategy``)."""
        a, b = int(self.res_ptr[k]), int(self.res_ptr[k + 1])
        if self.res_strategy is None:
            return tuple(f"identity:{int(self.domains[i])}" for i in self.res_attrs[a:b])
        return tuple(self.strategy_names[int(x)] for x in self.res_strategy[a:b])

    def dense(self, k: int) -> np.ndarray | None:
        """The one matrix residual set k is measured through, over the cells of its marginal (C order):
        a set that a 2-way query type reaches, solved whole; None where it is measured attribute by
        attribute (:meth:`set_strategies`)."""
        how = self.set_strategies(k)
        return self.strategies[how[0]] if how and how[0].startswith("dense:") else None

    def dense_inverse(self, k: int) -> np.ndarray:
        """B⁺ (cells × rows) of :meth:`dense` (cached): what maps the set's measurement to its cells."""
        how = self.set_strategies(k)[0]
        cache = self.__dict__.setdefault("_dense_inverse", {})
        if how not in cache:
            cache[how] = np.linalg.pinv(self.strategies[how])
        return cache[how]

    def marginal_types(self, j: int) -> tuple[str, ...]:
        """The query type of each attribute of workload marginal j."""
        a, b = int(self.marg_ptr[j]), int(self.marg_ptr[j + 1])
        if self.marg_types is None:
            return ("identity",) * (b - a)
        return tuple(QUERY_TYPES[int(c)] if c < len(QUERY_TYPES) else MATRIX for c in self.marg_types[a:b])

    def strategy(self, name: str) -> AttributeFactors:
        """A strategy by name: its matrix B_i (what measure applies) and pseudo-inverse (what reconstruct
        applies), as :class:`~functions.dpquery.smasher.AttributeFactors` of the type it was made for."""
        cache = self.__dict__.setdefault("_strategies", {})
        if name not in cache:
            kind, _, rest = name.partition(":")
            if kind == "identity":
                cache[name] = attribute_factors("identity", int(rest))
            elif kind in QUERY_TYPES:
                total = self.totals.get(name)
                cache[name] = AttributeFactors.of(kind, self.strategies[name], orthonormal=False, total=total)
            else:  # a mixed set's strategy answers no one type: Plan.inside takes its factors per type
                cache[name] = AttributeFactors.of("identity", self.strategies[name], orthonormal=False)
        return cache[name]

    def attribute_total(self, i: int) -> np.ndarray | None:
        """u_i, the values attribute i's total is spread over in reconstruction (the same in every set:
        the strategy of its 1-way set), where it is not 1/n_i; None where it is."""
        if not self.totals:
            return None
        cache = self.__dict__.get("_attribute_totals")
        if cache is None:
            cache = {}
            for k in range(1, self.num_residuals):  # the 1-way sets come right after ∅
                attrs = self.residual(k)
                if len(attrs) != 1:
                    break
                name = self.set_strategies(k)[0]
                if name in self.totals:
                    cache[attrs[0]] = self.totals[name]
            self.__dict__["_attribute_totals"] = cache
        return cache.get(i)

    def inside(self, kind: str, name: str) -> np.ndarray:
        """diag(W P Wᵀ) of ``kind`` queries measured through strategy ``name``: each one's variance factor
        when its attribute is in the measured set."""
        cache = self.__dict__.setdefault("_inside", {})
        if (kind, name) not in cache:
            f = self.strategy(name)
            same = f.kind == kind and not name.startswith("mixed:")
            cache[(kind, name)] = f.inside if same else block_sums(kind, f.inverse @ f.inverse.T)
        return cache[(kind, name)]

    def residual_index(self) -> dict[tuple[int, ...], int]:
        """{attribute tuple: residual index} (builds a dict of |C| entries: use for small plans/tests)."""
        return {self.residual(k): k for k in range(self.num_residuals)}

    # ---- linear values --------------------------------------------------------------------------------
    @property
    def sigma2(self) -> np.ndarray:
        """σ_S², the variance of each noise sample of residual set S."""
        return np.exp(self.log_sigma2)

    @property
    def p(self) -> np.ndarray:
        """p_S = ∏(n_i−1)/n_i: the squared L2 sensitivity of the orthonormal residual query E_S x_S."""
        return np.exp(self.log_p)

    @property
    def q(self) -> np.ndarray:
        """q_S = Δ_S² = p_S·(k + 2η_S·N)²: the squared sensitivity charged for S (privacy unit, rounding)."""
        return np.exp(self.log_q)

    @property
    def rho_s(self) -> np.ndarray:
        """ρ_S = q_S / (2σ_S²), the zCDP cost of measuring S (Σ_S ρ_S = rho_planned)."""
        return np.exp(self.log_q - self.log_sigma2 - math.log(2.0))

    @property
    def var(self) -> np.ndarray:
        """Predicted per-cell variance of each reconstructed workload marginal (under general query types,
        the mean over its queries: a range query's variance depends on the range)."""
        return np.exp(self.log_var)

    # ---- error and privacy summaries ---------------------------------------------------------------
    @property
    def queries(self) -> np.ndarray:
        """The queries each workload marginal answers: its cells, or ∏ m_i under general query types."""
        return self.cells if self.num_q is None else self.num_q

    @property
    def num_queries(self) -> int:
        """Queries (cells, for identity marginals) over all workload marginals."""
        return int(self.queries.sum())

    @property
    def sse(self) -> float:
        """Σ_A m_A·Var_A: expected total squared error of the workload (unweighted)."""
        return float(math.fsum((self.queries.astype(np.float64) * self.var).tolist()))

    @property
    def rmse(self) -> float:
        """√(SSE / #queries), the workload's root mean squared error per cell."""
        return math.sqrt(self.sse / self.num_queries)

    @property
    def weighted_sse(self) -> float:
        """Σ_A w_A·m_A·Var_A: the ``sum_of_variances`` objective."""
        return float(math.fsum((self.weights * self.queries.astype(np.float64) * self.var).tolist()))

    @property
    def max_weighted_variance(self) -> float:
        """max_A w_A·Var_A: the ``max_variance`` objective."""
        return float(np.max(self.weights * self.var))

    @property
    def total_noise_samples(self) -> int:
        return int(self.noise_count.sum())

    def privacy_cost(self) -> float:
        """Σ_S q_S/σ_S², which the allocation makes equal to 2·rho_planned."""
        return math.exp(_lse(self.log_q - self.log_sigma2))

    def privacy_report(self) -> dict[str, Any]:
        """ρ, its per-residual split, and ε at ``delta`` by CKS, by the exact Gaussian curve, and the
        simple bound. The release is one Gaussian mechanism with μ = √(2ρ), so the Gaussian value is exact
        for continuous noise (it assumes this job alone; across jobs compose ρ and use CKS)."""
        rho = self.rho
        return {
            "rho": rho,
            "rho_planned": self.rho_planned,
            "sum_rho_s": float(math.fsum(self.rho_s.tolist())),
            "privacy_cost": self.privacy_cost(),  # = 2·rho_planned
            "delta": self.delta,
            "epsilon_cks": cdp_eps(rho, self.delta),
            "epsilon_gaussian": gaussian_eps(rho, self.delta),
            "epsilon_simple": simple_eps(rho, self.delta),
            "neighbouring": neighbouring(self.unit_rows),
            "unit_rows": self.unit_rows,
            "rows_bound": self.rows_bound,
            "max_sensitivity_factor": float(np.max(np.exp(0.5 * (self.log_q - self.log_p)))),
        }

    def summary(self) -> dict[str, Any]:
        """The small, human-readable part of the plan (what ``shardfold plan`` prints)."""
        sizes = np.diff(self.marg_ptr)
        out: dict[str, Any] = {
            "attributes": int(self.domains.size),
            "loss": self.loss,
            "workload_marginals": self.num_marginals,
            "max_marginal_size": int(sizes.max()) if sizes.size else 0,
            "largest_marginal_cells": int(self.cells.max()),
            "residual_sets": self.num_residuals,
            "noise_samples": self.total_noise_samples,
            "queries": self.num_queries,
            "sse": self.sse,
            "rmse": self.rmse,
            "weighted_sse": self.weighted_sse,
            "max_weighted_variance": self.max_weighted_variance,
            "max_cell_stddev": float(math.sqrt(float(self.var.max()))),
            "privacy": self.privacy_report(),
        }
        if self.solver:
            out["solver"] = self.solver
        split = [i for i in range(int(self.domains.size)) if self.attribute_total(i) is not None]
        if split:  # attributes measured through RP+'s Schur split (their residuals not ⊥ the total)
            out["split_totals"] = [self.names[i] if self.names else i for i in split]
        return out

    # ---- fan-out ----------------------------------------------------------------------------------------
    def residual_groups(self, samples_per_task: int | None = None) -> list[tuple[int, int]]:
        """Contiguous [start, stop) residual-index ranges of about ``samples_per_task`` noise samples each
        (a group exceeds it by at most one residual set's samples). In (size, lexicographic) order, so a
        group's sets share leading attributes and need few dataset columns."""
        target = samples_per_task or DEFAULT_SAMPLES_PER_TASK
        # a residual set also costs a histogram/transform: count each as at least one sample
        return _ranges_by_cost(np.maximum(self.noise_count, 1), target)

    def marginal_groups(self, cells_per_task: int | None = None) -> list[tuple[int, int]]:
        """Contiguous [start, stop) workload-index ranges of about ``cells_per_task`` reconstruction work
        each, the work of marginal A being cells_A·2^|A| (one Kronecker-vector product per S ⊆ A; its
        answers instead of its cells when it asks more, prefixes or ranges)."""
        target = cells_per_task or DEFAULT_CELLS_PER_TASK
        work = np.maximum(self.cells, self.queries).astype(np.float64) * np.diff(self.sub_ptr).astype(
            np.float64
        )
        return _ranges_by_cost(work, target)

    def needed_residuals(self, start: int, stop: int) -> np.ndarray:
        """Sorted unique residual indices that marginals start..stop−1 reconstruct from."""
        return np.unique(self.sub_idx[self.sub_ptr[start] : self.sub_ptr[stop]])

    @staticmethod
    def group_of(residuals: np.ndarray, groups: list[tuple[int, int]]) -> np.ndarray:
        """For each residual index, the index of the ``residual_groups`` range that holds it."""
        starts = np.array([g[0] for g in groups], dtype=np.int64)
        return np.searchsorted(starts, np.asarray(residuals), side="right") - 1

    # ---- document form ---------------------------------------------------------------------------------
    _ARRAYS = (
        "domains",
        "res_ptr",
        "res_attrs",
        "log_p",
        "log_q",
        "log_v",
        "log_sigma2",
        "noise_count",
        "marg_ptr",
        "marg_attrs",
        "weights",
        "log_var",
        "cells",
        "sub_ptr",
        "sub_idx",
    )
    _GENERAL = ("res_strategy", "marg_types", "num_q")  # present when a query type is not identity

    def to_doc(self) -> dict[str, Any]:
        """A JSON-safe dict that :meth:`from_doc` turns back into an identical plan."""
        return {
            "version": DOC_VERSION,
            "names": self.names,
            "rho": self.rho,
            "rho_planned": self.rho_planned,
            "loss": self.loss,
            "delta": self.delta,
            "solver": self.solver,
            "unit_rows": self.unit_rows,
            "rows_bound": self.rows_bound,
            "summary": self.summary(),
            "arrays": {
                name: _encode(getattr(self, name))
                for name in (*self._ARRAYS, *self._GENERAL)
                if getattr(self, name) is not None
            },
            "strategies": {key: _encode(b) for key, b in sorted(self.strategies.items())},
            **({"totals": {k: _encode(u) for k, u in sorted(self.totals.items())}} if self.totals else {}),
            **({"strategy_names": self.strategy_names} if self.strategy_names else {}),
        }

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> Plan:
        if doc.get("version") != DOC_VERSION:
            raise PlanError(f"plan document version {doc.get('version')!r}; this code reads {DOC_VERSION}")
        # a plan written before the charged sensitivity (log_q) charged p_S itself
        arrays = {
            name: _decode(doc["arrays"][name])
            for name in (*cls._ARRAYS, *cls._GENERAL)
            if name in doc["arrays"]
        }
        arrays.setdefault("log_q", arrays["log_p"].copy())
        return cls(
            names=doc["names"],
            rho=float(doc["rho"]),
            rho_planned=float(doc["rho_planned"]),
            loss=doc["loss"],
            delta=float(doc["delta"]),
            solver=dict(doc.get("solver") or {}),
            unit_rows=int(doc.get("unit_rows", 1)),
            rows_bound=None if doc.get("rows_bound") is None else int(doc["rows_bound"]),
            strategies={key: _decode(b) for key, b in (doc.get("strategies") or {}).items()},
            totals={key: _decode(u) for key, u in (doc.get("totals") or {}).items()},
            strategy_names=list(doc.get("strategy_names") or []),
            **arrays,
        )


# ---------------------------------------------------------------------------------------------------------
# planning


def plan(
    spec: Any = None,
    *,
    domains: list[int] | None = None,
    workload: list | None = None,
    rho: float | None = None,
    loss: str | None = None,
    names: list[str] | None = None,
    delta: float | None = None,
    unit_rows: int | None = None,
    rows_bound: int | None = None,
    queries: list | None = None,
    split_totals: bool = True,
) -> Plan:
    """Plan a job: ``plan(spec)`` for a :class:`functions.dpquery.spec.DPQueryJob`, or from bare parts,
    ``plan(domains=[n_0, …], workload=[(attrs, weight) | attrs, …], rho=ρ, loss=…)`` with attrs tuples
    of attribute indices. Keyword arguments given with a spec override it (e.g. ``rho``).

    ``queries``: beside ``workload``, each marginal's ``{attribute index: query type}`` (types of
    :data:`~functions.dpquery.smasher.QUERY_TYPES`; an attribute not named is ``identity``). With any type
    other than identity the plan is QuerySmasher's (:mod:`functions.dpquery.smasher`): each residual set is
    measured through its attributes' best strategies instead of the contrasts (a set that marginals ask
    in different ways through one Kronecker strategy fitted to all of them). A 2-way type (``affine``,
    ``abs_diff``) is given for both attributes of a 2-way marginal, and an explicit
    :class:`~functions.dpquery.spec.QueryMatrix` for every attribute of a 1- or 2-way marginal; every
    residual set such a type reaches is solved whole (:func:`_solve_whole`; {a, b} possibly through one
    matrix over its cells, :meth:`Plan.dense`), a set none of its queries reaches at a floor
    (:func:`functions.dpquery.smasher.whole_piece_grams`).

    ``unit_rows`` (k) and ``rows_bound`` (N) set the charged sensitivity (module docstring); a spec gives
    its privacy unit's ``max_rows`` (default 1) and its ``max_rows_total`` (default
    :data:`functions.dpquery.spec.DEFAULT_MAX_ROWS_TOTAL`).

    ``split_totals``: an attribute asked one way throughout (prefix or range) may be measured through RP+'s
    Schur-complement residuals where they lower the loss (:func:`_choose_totals`); False keeps every
    residual orthogonal to the total (QuerySmasher's class alone: the benchmark's and tests' reference)."""
    if spec is not None:
        unit_rows = spec.unit_rows() if unit_rows is None else unit_rows
        rows_bound = spec.rows_bound() if rows_bound is None else rows_bound
        domains = spec.domains() if domains is None else domains
        workload = spec.marginals() if workload is None else workload
        rho = spec.rho() if rho is None else rho
        loss = spec.loss if loss is None else loss
        names = [a.name for a in spec.attributes] if names is None else names
        delta = spec.budget.report_delta() if delta is None else delta
        queries = spec.marginal_queries() if queries is None else queries
    if domains is None or workload is None or rho is None:
        raise SpecError("plan needs a spec, or domains, workload and rho")
    loss = loss or "sum_of_variances"
    delta = REPORT_DELTA if delta is None else float(delta)
    n = np.asarray(domains, dtype=np.int64)
    sizes, padded_a, weights = _check_parts(n, workload, float(rho), loss, names)
    typed = _type_codes(queries, padded_a, sizes, loss, n)
    codes, kinds = typed if typed is not None else (None, QUERY_TYPES)
    unit_rows = 1 if unit_rows is None else int(unit_rows)
    if unit_rows < 1:
        raise SpecError(f"unit_rows must be >= 1, got {unit_rows}")
    if rows_bound is not None and not (1 <= int(rows_bound) <= MAX_ROWS_BOUND):
        raise SpecError(f"rows_bound must lie in [1, 2^53], got {rows_bound}")
    return _plan(
        n,
        sizes,
        padded_a,
        weights,
        float(rho),
        loss,
        names,
        delta,
        unit_rows,
        rows_bound,
        codes,
        kinds,
        split_totals,
    )


def neighbouring(unit_rows: int) -> str:
    """The neighbouring relation in words (the privacy report's ``neighbouring``)."""
    if unit_rows == 1:
        return "add or remove one record"
    return f"add or remove one person (privacy unit: at most {unit_rows} rows per person are counted)"


def _check_parts(n, workload, rho, loss, names) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The workload as (sizes, padded, weights): each marginal's size, its attributes sorted and padded with
    d to the widest, and its weight; a SpecError names every entry at fault. Checked on arrays, not entry by
    entry: a d = 100 workload of all ≤3-way marginals has 166,751 entries."""
    errors = []
    if n.ndim != 1 or n.size == 0:
        errors.append({"field": "domains", "error": "give one domain size per attribute"})
    elif np.any(n < 2):
        j = int(np.argmax(n < 2))
        errors.append({"field": f"domains.{j}", "error": f"domain size {int(n[j])}; at least 2 needed"})
    if not (0 < rho <= MAX_RHO):
        errors.append({"field": "rho", "error": f"must be a number > 0 and at most {MAX_RHO:g}, got {rho}"})
    if loss not in LOSSES:
        errors.append({"field": "loss", "error": f"{loss!r}; expected one of {list(LOSSES)}"})
    if names is not None and len(names) != n.size:
        errors.append({"field": "names", "error": f"{len(names)} names for {n.size} attributes"})
    if not workload:
        errors.append({"field": "workload", "error": "the workload is empty"})
    d = int(n.size)
    # an entry is (attrs, weight) with attrs a tuple/list, or bare attrs (weight 1)
    attrs_of, weight_of = [], []
    for entry in workload or []:
        if isinstance(entry, tuple | list) and len(entry) == 2 and isinstance(entry[0], tuple | list):
            attrs_of.append(entry[0])
            weight_of.append(entry[1])
        else:
            attrs_of.append(entry)
            weight_of.append(1.0)
    m = len(attrs_of)
    sizes = np.fromiter(map(len, attrs_of), dtype=np.int64, count=m)
    width = max(int(sizes.max(initial=0)), 1)
    flat = np.fromiter(itertools.chain.from_iterable(attrs_of), dtype=np.int64, count=int(sizes.sum()))
    padded = np.full((m, width), d, dtype=np.int64)
    padded[np.arange(width)[None, :] < sizes[:, None]] = flat  # row-major: each entry's attributes in order
    padded.sort(axis=1)
    inside = np.arange(width)[None, :] < sizes[:, None]
    out_of_range = np.any(inside & ((padded < 0) | (padded >= d)), axis=1)
    repeated = np.any(inside[:, 1:] & (padded[:, 1:] == padded[:, :-1]), axis=1)
    weights = np.asarray(weight_of, dtype=np.float64)
    bad_weight = ~(np.isfinite(weights) & (weights > 0))
    bad = out_of_range | repeated
    for j in np.flatnonzero(bad | bad_weight):
        j = int(j)
        if bad[j]:
            attrs = tuple(int(i) for i in padded[j, : sizes[j]])
            errors.append({"field": f"workload.{j}", "error": f"bad attribute indices {attrs} for d = {d}"})
        else:
            errors.append(
                {"field": f"workload.{j}", "error": f"weight must be finite and > 0, got {weight_of[j]}"}
            )
    ok = np.flatnonzero(~(bad | bad_weight))
    if ok.size > 1:  # the same marginal twice: refer each repeat to its first entry
        rows = padded[ok]
        order = np.lexsort([rows[:, c] for c in range(width - 1, -1, -1)] + [sizes[ok]])
        same = np.zeros(ok.size, dtype=bool)
        same[1:] = np.all(rows[order][1:] == rows[order][:-1], axis=1) & (
            sizes[ok][order][1:] == sizes[ok][order][:-1]
        )
        if same.any():
            first = ok[order][np.maximum.accumulate(np.where(~same, np.arange(ok.size), 0))]
            for j, f in sorted(zip(ok[order][same].tolist(), first[same].tolist(), strict=True)):
                attrs = tuple(int(i) for i in padded[j, : sizes[j]])
                errors.append({"field": f"workload.{j}", "error": f"repeats workload.{min(j, f)} ({attrs})"})
    if errors:
        errors.sort(key=_error_order)
        raise SpecError("cannot plan: " + "; ".join(f"{e['field']}: {e['error']}" for e in errors), errors)
    return sizes, padded.astype(np.int32), weights


def _type_codes(queries, padded_a, sizes, loss, domain_of) -> tuple[np.ndarray, tuple] | None:
    """Each workload slot's query type code, aligned with ``padded_a`` (0, identity, for the padding), and
    the type of each code: QUERY_TYPES, then the workload's explicit matrices (:class:`QueryMatrix`). None
    when every query is an identity."""
    if not queries or not any(q for q in queries):
        return None
    if len(queries) != sizes.size:
        raise SpecError(f"queries: {len(queries)} entries for a workload of {sizes.size} marginals")
    if loss != "sum_of_variances":
        raise SpecError(
            "loss 'max_variance' is for identity marginals; with query types other than identity the plan "
            "minimises the weighted sum of variances",
            [{"field": "loss", "error": "max_variance needs identity queries"}],
        )
    codes = np.zeros(padded_a.shape, dtype=np.int8)
    code_of: dict[str | QueryMatrix, int] = {kind: c for c, kind in enumerate(QUERY_TYPES)}
    for j, q in enumerate(queries):
        if not q:
            continue
        row = padded_a[j, : sizes[j]].tolist()
        if any(isinstance(k, QueryMatrix) for k in q.values()):
            if len(row) not in (1, 2) or set(q) != set(row) or len(set(q.values())) != 1:
                raise SpecError(
                    f"workload.{j}: an explicit query matrix names every attribute of a marginal of one or "
                    "two attributes, and no other type",
                    [{"field": f"workload.{j}.queries", "error": "a matrix needs a 1- or 2-way marginal"}],
                )
            kind = next(iter(q.values()))
            cells = int(np.prod([int(domain_of[i]) for i in row]))
            if kind.rows.ndim != 2 or kind.rows.shape[1] != cells:
                raise SpecError(
                    f"workload.{j}: an explicit query matrix of {kind.rows.shape[-1]} columns on a "
                    f"marginal of {cells} cells",
                    [{"field": f"workload.{j}.queries", "error": "one weight per cell in every row"}],
                )
            if kind not in code_of:
                if len(code_of) >= len(QUERY_TYPES) + MAX_MATRICES:
                    raise SpecError(f"workload: more than {MAX_MATRICES} explicit query matrices")
                code_of[kind] = len(code_of)
            codes[j, : len(row)] = code_of[kind]
            continue
        pair = set(q.values()) & set(PAIR_TYPES)
        if pair and (len(row) != 2 or set(q) != set(row) or len(set(q.values())) != 1):
            raise SpecError(
                f"workload.{j}: a 2-way query type ({', '.join(sorted(pair))}) names both attributes of a "
                f"2-way marginal, and no other type",
                [{"field": f"workload.{j}.queries", "error": "a 2-way type needs a 2-way marginal"}],
            )
        for i, kind in q.items():
            if kind not in code_of:
                raise SpecError(
                    f"workload.{j}: unknown query type {kind!r}; expected one of {list(QUERY_TYPES)}",
                    [{"field": f"workload.{j}.queries", "error": f"unknown query type {kind!r}"}],
                )
            pos = row.index(i) if i in row else None
            if pos is None:
                raise SpecError(
                    f"workload.{j}: a query type for attribute {i}, which the marginal does not hold",
                    [{"field": f"workload.{j}.queries", "error": f"attribute {i} is not in the marginal"}],
                )
            codes[j, pos] = code_of[kind]
    return (codes, tuple(code_of)) if codes.any() else None


def _error_order(error: dict[str, str]) -> tuple[int, int]:
    """Errors of the whole (domains, rho, ...) first, then the workload's by entry."""
    field = error["field"]
    if field.startswith("workload."):
        return (1, int(field.split(".")[1]))
    return (0, 0)


def _plan(
    n,
    sizes,
    padded_a,
    weights,
    rho,
    loss,
    names,
    delta,
    unit_rows=1,
    rows_bound=None,
    codes=None,
    kinds=QUERY_TYPES,
    split_totals=True,
) -> Plan:
    """``sizes``, ``padded_a`` and ``weights`` as :func:`_check_parts` returns them, ``codes`` and ``kinds``
    (the type of each code) as :func:`_type_codes` does. ``split_totals``: whether attributes of one query
    type may be measured through RP+'s Schur-complement residuals (:func:`_choose_totals`).

    The sets are enumerated over *columns*: column i < d is attribute i queried as identity, column d pads
    short rows, and column d + 1 + k is the k-th (attribute, other query type) pair of the workload. Every
    per-attribute factor is a table over columns, so general query types cost no more than identities."""
    d = int(n.size)
    m = int(sizes.size)
    kmax = int(sizes.max())
    pairs_total = int(np.sum(np.left_shift(np.int64(1), sizes)))
    if pairs_total > MAX_SUBSET_PAIRS:
        raise PlanError(
            f"the workload's marginals have {pairs_total:,} (marginal, subset) pairs in all; the limit is "
            f"{MAX_SUBSET_PAIRS:,} (use fewer or smaller marginals)"
        )
    log_n = np.log(n.astype(np.float64))
    # per-attribute tables, with one extra entry (index d) for the padding of short sets
    log_n_ext = np.append(log_n, 0.0)
    n_ext = np.append(n, 1).astype(np.int64)
    # per-column tables (see above): an identity column's are ResidualPlanner's
    log_pfac_ext = np.append(np.log1p(-1.0 / n.astype(np.float64)), 0.0)  # log p: log((n−1)/n)
    log_nn1_ext = np.append(log_n + np.log(n.astype(np.float64) - 1.0), 0.0)  # log(ℓ/o): log(n(n−1))
    log_o_ext = np.append(-log_n, 0.0)  # log Σ (W 1/n)²: log(1/n)
    m_ext = n_ext  # m: the queries of a column, n for identity (1 for the padding)
    real_ext = np.arange(d + 1)  # the attribute of each column (d: the padding)
    kind_ext = np.zeros(d + 1, dtype=np.int8)
    strategies: dict[str, np.ndarray] = {}
    padded_c = padded_a
    if codes is not None:
        used = codes > 0
        types = len(kinds)
        slot_key = padded_a.astype(np.int64) * types + codes
        pair_keys = np.unique(slot_key[used])
        padded_c = np.where(used, d + 1 + np.searchsorted(pair_keys, slot_key), padded_a).astype(np.int32)
        extra_attr, extra_kind = pair_keys // types, (pair_keys % types).astype(np.int8)
        # a 2-way type's columns take the identity's factors as placeholders: every set they reach is
        # solved whole (_residual_sets) and their marginals' variances computed apart (_pair_variances)
        extra = [
            attribute_factors(QUERY_TYPES[c] if c < len(ATTRIBUTE_TYPES) else "identity", int(n[i]))
            for i, c in zip(extra_attr, extra_kind, strict=True)
        ]
        strategies = {f"{f.kind}:{f.n}": f.matrix for f in extra if f.kind != "identity"}
        logs = np.array([_column_logs(f) for f in extra]).reshape(-1, 3)
        log_pfac_ext = np.append(log_pfac_ext, logs[:, 0])
        log_o_ext = np.append(log_o_ext, logs[:, 1])
        log_nn1_ext = np.append(log_nn1_ext, logs[:, 2])
        m_ext = np.append(m_ext, [f.queries for f in extra]).astype(np.int64)
        real_ext = np.append(real_ext, extra_attr)
        kind_ext = np.append(kind_ext, extra_kind)
    n1_ext = np.append(n - 1, 1).astype(np.int64)[real_ext]  # the noise samples of a column: n − 1

    marg_ptr = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(sizes, out=marg_ptr[1:])
    inside_a = np.arange(padded_a.shape[1])[None, :] < sizes[:, None]
    marg_attrs = padded_a[inside_a]  # row-major, each sorted
    cells_log = log_n_ext[padded_a].sum(axis=1)
    _refuse_large(
        cells_log,
        padded_a,
        sizes,
        names,
        "has about {:.3g} cells; a marginal may have at most",
        "split the marginal",
    )
    cells = np.prod(n_ext[padded_a], axis=1)
    num_q = None
    # marginal -> the type naming its queries as a whole (a 2-way type, an explicit matrix), its domain sizes
    pairs: dict[int, tuple[str | QueryMatrix, tuple[int, ...]]] = {}
    # column set -> (w_A, Gram of A's pieces there) of each 2-way marginal reaching it: the Grams are shared
    # (pair_piece_grams' cache), summed per set when it is solved, so d(d−1)/2 pairs hold no copies
    pair_grams: dict[tuple[int, ...], list[tuple[float, np.ndarray]]] = {}
    if codes is None:
        log_a = np.log(weights) - cells_log  # log(w_A / cells_A)
    else:
        log_a = np.log(weights) + log_o_ext[padded_c].sum(axis=1)  # log(w_A ∏ o_i)
        for j in np.flatnonzero(codes[:, 0] >= len(ATTRIBUTE_TYPES)).tolist():
            kind = kinds[int(codes[j, 0])]
            dims = tuple(int(n[i]) for i in padded_a[j, : sizes[j]])
            if math.prod(k - 1 for k in dims) > MAX_PAIR_DIM:
                raise SpecError(
                    f"workload.{j}: {kind!r} on {' x '.join(map(str, dims))} values; a type over a marginal "
                    f"as a whole takes at most {MAX_PAIR_DIM} for ∏(n_i − 1) (coarsen the attributes' bins)",
                    [{"field": f"workload.{j}.queries", "error": "the attributes have too many values"}],
                )
            pairs[j] = (kind, dims)
            cols = padded_c[j, : len(dims)].tolist()
            grams = whole_piece_grams(kind, *dims)
            for pos, g in grams.items():
                key = tuple(cols[p] for p in pos)
                pair_grams.setdefault(key, []).append((float(weights[j]), g))
            log_a[j] = math.log(weights[j] * float(grams[()][0, 0]))
        queries_log = np.log(m_ext.astype(np.float64))[padded_c].sum(axis=1)
        _refuse_large(
            queries_log,
            padded_a,
            sizes,
            names,
            "asks about {:.3g} queries; a marginal may answer at most",
            "ask prefixes instead of all ranges",
        )
        num_q = np.prod(m_ext[padded_c], axis=1)
        for j, (kind, dims) in pairs.items():
            num_q[j] = pair_queries(kind, *dims).shape[0]

    # ---- enumerate every (A, S ⊆ A) pair, grouped by |A|, A-major ---------------------------------------
    sub_ptr = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(np.left_shift(np.int64(1), sizes), out=sub_ptr[1:])
    width = max(kmax, 1)
    pair_rows = np.empty((pairs_total, width), dtype=np.int32)  # S, padded with d
    pair_size = np.empty(pairs_total, dtype=np.int32)
    idx_t = np.int32 if max(m, pairs_total) < 2**31 else np.int64
    pair_marg = np.empty(pairs_total, dtype=idx_t)
    for k in np.unique(sizes):
        k = int(k)
        idx = np.flatnonzero(sizes == k)
        a_k = padded_c[idx, :k]  # (m_k, k)
        masks = np.arange(1 << k)
        # positions of this group's pairs: the 2^k slots of each marginal, mask order
        pos = (sub_ptr[idx][:, None] + masks[None, :]).ravel()
        rows = np.full((idx.size, 1 << k, width), d, dtype=np.int32)
        for mask in range(1 << k):
            cols = [b for b in range(k) if mask >> b & 1]
            if cols:
                rows[:, mask, : len(cols)] = a_k[:, cols]
        pair_rows[pos] = rows.reshape(-1, width)
        pair_size[pos] = np.tile(
            np.array([bin(x).count("1") for x in range(1 << k)], dtype=np.int32), idx.size
        )
        pair_marg[pos] = np.repeat(idx, 1 << k)
        del rows

    # ---- unique residual sets, ordered by (size, lexicographic) -----------------------------------------
    keys = [pair_rows[:, c] for c in range(width - 1, -1, -1)] + [pair_size]
    order = np.lexsort(keys)  # last key is primary
    del keys
    sorted_rows = pair_rows[order]
    del pair_rows
    sorted_size = pair_size[order]
    del pair_size
    new = np.ones(pairs_total, dtype=bool)
    new[1:] = np.any(sorted_rows[1:] != sorted_rows[:-1], axis=1) | (sorted_size[1:] != sorted_size[:-1])
    starts = np.flatnonzero(new)
    uniq_rows = sorted_rows[starts]
    uniq_size = sorted_size[starts].astype(np.int64)
    c = int(starts.size)
    del sorted_rows, sorted_size
    res_of_pair = np.empty(pairs_total, dtype=idx_t)
    res_of_pair[order] = np.cumsum(new, dtype=idx_t) - 1
    del new

    # the rounding of the mode-wise products: measure.charged_sensitivity's γ_{n+2} for the contrasts alone,
    # measure.charged_norm's γ_n when the sets are measured through matrices charged entry by entry
    log_gamma_ext = np.append(log1p_gamma(n, 2 if codes is None else 0), 0.0)[real_ext]
    log_gamma = log_gamma_ext[uniq_rows].sum(axis=1)
    column_names: dict[int, str] = {}  # a column measured through a strategy not named "<type>:<n>"
    totals: dict[str, np.ndarray] = {}
    chosen = False
    if codes is not None and split_totals:
        groups = _split_candidates(uniq_rows, uniq_size, real_ext, kind_ext, padded_c, inside_a, kinds, n)
        if groups:
            tables = (log_pfac_ext, log_o_ext, log_nn1_ext)
            charge = 2.0 * np.log(charge_factor(log_gamma, unit_rows, rows_bound))
            marg_sorted = pair_marg[order]
            log_w = np.log(weights)
            whole_a = {j: float(log_a[j]) for j in pairs}  # a type over a marginal as a whole: no o_i

            def objective(pfac: np.ndarray, o: np.ndarray, nn1: np.ndarray, rows=uniq_rows) -> float:
                """log Σ_u √(q_u v_u) over the column sets: the loss's root, as the plan would have it
                with these per-column tables (sets merged below are counted apart, a bound)."""
                la = log_w + o[padded_c].sum(axis=1)
                for j, value in whole_a.items():
                    la[j] = value
                lse = _grouped_lse(la[marg_sorted], starts)
                return _lse(0.5 * (pfac[rows].sum(axis=1) + charge + nn1[rows].sum(axis=1) + lse))

            picked = _choose_totals(objective, tables, groups, extra, d)
            for (kind, size), f in picked.items():
                name = f"{kind}:{size}:schur"
                strategies[name], totals[name] = f.matrix, f.total
                for col in groups[(kind, size)]:
                    column_names[col] = name
                    log_pfac_ext[col], log_o_ext[col], log_nn1_ext[col] = _column_logs(f)
                if not any(
                    f"{e.kind}:{e.n}" == f"{kind}:{size}" and d + 1 + k not in column_names
                    for k, e in enumerate(extra)
                ):
                    strategies.pop(f"{kind}:{size}", None)  # no column measures through it any more
            chosen = bool(picked)
            if chosen:
                log_a = log_w + log_o_ext[padded_c].sum(axis=1)
                for j, value in whole_a.items():
                    log_a[j] = value
    # per column set u: the privacy factor, Σ(log ℓ − log o), the weights' LSE, the rounding charge
    log_p = log_pfac_ext[uniq_rows].sum(axis=1)
    log_lo = log_nn1_ext[uniq_rows].sum(axis=1)
    lse_a = _grouped_lse(log_a[pair_marg[order]], starts)
    del order
    noise_count = np.prod(n1_ext[uniq_rows], axis=1)
    res_strategy = None
    strategy_names: list[str] = []
    if codes is None:  # columns are attributes: each column set is a residual set
        r_of_u = np.arange(c, dtype=idx_t)
        log_v = log_lo + lse_a
    else:  # column sets of one attribute set are one residual set, measured once (_residual_sets)
        merged = _residual_sets(
            uniq_rows,
            uniq_size,
            real_ext,
            kind_ext,
            n,
            log_o_ext,
            log_lo,
            log_p,
            lse_a,
            strategies,
            pair_grams,
            log_gamma,
            column_names,
        )
        r_of_u, first, log_v, res_strategy, strategy_names, solved, merges = merged
        uniq_rows, uniq_size = real_ext[uniq_rows[first]], uniq_size[first]
        log_p, log_gamma, noise_count = log_p[first], log_gamma[first], noise_count[first]
        c = int(first.size)
    # charged sensitivity: q_S = p_S·c_S², c_S = k + 2·η_S·N (privacy unit and transform rounding)
    log_q = log_p + 2.0 * np.log(charge_factor(log_gamma, unit_rows, rows_bound))
    res_ptr = np.zeros(c + 1, dtype=np.int64)
    np.cumsum(uniq_size, out=res_ptr[1:])
    col = np.arange(width)[None, :]
    res_attrs = real_ext[uniq_rows[col < uniq_size[:, None]]].astype(np.int32)  # row-major: each set in order
    log_n_sum_s = log_n_ext[real_ext[uniq_rows]].sum(axis=1)  # Σ_{i∈S} log n_i
    del uniq_rows
    pair_lo = log_lo[res_of_pair]  # each pair's Σ(log ℓ − log o): its column set's, in its residual set
    res_of_pair = r_of_u[res_of_pair]

    rho_planned = rho * (1.0 - RHO_SLACK)
    two_rho = 2.0 * rho_planned
    solver: dict[str, Any] = {}
    # closed form for sum_of_variances (also the starting point and scaling of max_variance)
    half = 0.5 * (log_q + log_v)
    log_g = _lse(half)
    log_sigma2 = 0.5 * (log_q - log_v) + log_g - math.log(two_rho)
    if loss == "max_variance":
        log_sigma2, solver = _max_variance(
            log_sigma2, log_p, log_n_sum_s, res_of_pair, pair_marg, cells_log, weights, two_rho, log_q
        )

    if codes is None:
        # per-cell variance: Var_A = cells_A^{-2} Σ_{S⊆A} σ_S² p_S ∏_{i∈S} n_i²  (pairs are A-major)
        term = (log_sigma2 + log_p + 2.0 * log_n_sum_s)[res_of_pair]
        log_var = _grouped_lse(term, sub_ptr[:-1]) - 2.0 * cells_log
    else:
        # mean variance of A's queries: Σ_{S⊆A} σ_S² ∏_{i∈S} ℓ_i ∏_{i∈A∖S} o_i / ∏_{i∈A} m_i
        term = log_sigma2[res_of_pair] + pair_lo
        log_var = _grouped_lse(term, sub_ptr[:-1]) + log_a - np.log(weights) - queries_log
        for j, (kind, dims) in pairs.items():
            subsets = res_of_pair[sub_ptr[j] : sub_ptr[j + 1]]
            log_var[j] = _pair_log_var(kind, dims, subsets, log_sigma2, solved)

    # S ⊆ A lists in ascending residual order, per marginal
    sub_idx = res_of_pair  # reordered in place below: ascending within each marginal
    for k in np.unique(sizes):
        idx = np.flatnonzero(sizes == k)
        span = 1 << int(k)
        pos = (sub_ptr[idx][:, None] + np.arange(span)[None, :]).ravel()
        sub_idx[pos] = np.sort(sub_idx[pos].reshape(-1, span), axis=1).ravel()

    result = Plan(
        domains=n.astype(np.int64),
        names=list(names) if names is not None else None,
        rho=rho,
        rho_planned=rho_planned,
        loss=loss,
        delta=delta,
        res_ptr=res_ptr,
        res_attrs=res_attrs,
        log_p=log_p,
        log_q=log_q,
        log_v=log_v,
        log_sigma2=log_sigma2,
        noise_count=noise_count.astype(np.int64),
        marg_ptr=marg_ptr,
        marg_attrs=marg_attrs,
        weights=weights,
        log_var=log_var,
        cells=cells.astype(np.int64),
        sub_ptr=sub_ptr,
        sub_idx=sub_idx,
        solver=solver,
        unit_rows=int(unit_rows),
        rows_bound=None if rows_bound is None else int(rows_bound),
        res_strategy=res_strategy,
        strategy_names=strategy_names,
        marg_types=None if codes is None else kind_ext[padded_c][inside_a],
        num_q=num_q,
        strategies=strategies,
        totals=totals,
    )
    cost = result.privacy_cost()
    if not abs(cost - two_rho) <= PRIVACY_CHECK_RTOL * two_rho:
        raise PlanError(f"internal: the allocation costs Σ q_S/σ_S² = {cost!r}, not 2ρ = {two_rho!r}")
    if chosen and merges:
        # the choice counted merged sets apart: keep it only if the plan it gives is better than without
        args = (n, sizes, padded_a, weights, rho, loss, names, delta, unit_rows, rows_bound, codes, kinds)
        other = _plan(*args, split_totals=False)
        if other.weighted_sse < result.weighted_sse:
            return other
    return result


def _residual_sets(
    uniq_rows,
    uniq_size,
    real_ext,
    kind_ext,
    n,
    log_o_ext,
    log_lo,
    log_p,
    lse_a,
    strategies,
    pair_grams,
    log_gamma,
    column_names=None,
):
    """Group the column sets by their attributes: each group is one residual set, measured once.

    A set that marginals of one type per attribute reach keeps its columns' strategies. A set reached with
    different types for an attribute (``[age]`` and ``[age, sex]`` asking ``age`` as prefix, say) gets the
    Kronecker strategy of its summed workload (:func:`functions.dpquery.smasher.kronecker_strategy`). A set
    that a 2-way type reaches (``pair_grams``: the Gram of its pieces per column set) is solved whole from
    the Gram of every piece on it (:func:`_solve_whole`). Either way its column sets' ``log_lo`` and
    ``log_p`` (and ``log_gamma``, for a set measured through one dense matrix) are recomputed for the
    chosen strategy, in place, and its matrices added to ``strategies``. Returns (the residual set of each
    column set, one column set per residual set, log v per residual set, the strategy id of each set's
    attributes, the strategy names, {residual set: (BᵀB)⁺ over its cells} of the sets solved whole, whether
    any set was merged or solved whole), residual sets in (size, attributes) order. ``column_names``: a
    column's strategy where it is not its type's ("<type>:<n>")."""
    c, width = uniq_rows.shape
    d = int(n.size)
    real = real_ext[uniq_rows]
    order = np.lexsort([real[:, k] for k in range(width - 1, -1, -1)] + [uniq_size])
    new = np.ones(c, dtype=bool)
    new[1:] = np.any(real[order][1:] != real[order][:-1], axis=1) | (
        uniq_size[order][1:] != uniq_size[order][:-1]
    )
    r_of_u = np.empty(c, dtype=np.int64)
    r_of_u[order] = np.cumsum(new) - 1
    first = order[new]
    names: dict[str, int] = {}

    def name_id(name: str) -> int:
        return names.setdefault(name, len(names))

    def column_name(col: int) -> str:
        if column_names and col in column_names:
            return column_names[col]
        return f"{QUERY_TYPES[int(kind_ext[col])]}:{int(n[real_ext[col]])}"

    pair_col = kind_ext >= len(ATTRIBUTE_TYPES)  # a 2-way type's column: its sets are all solved whole
    ids = np.array(
        [-1 if col == d or pair_col[col] else name_id(column_name(col)) for col in range(real_ext.size)],
        dtype=np.int32,
    )
    set_ids = ids[uniq_rows[first]]
    groups = np.split(order, np.flatnonzero(new)[1:])
    has_pair = pair_col[uniq_rows].any(axis=1)
    mixed = np.diff(np.flatnonzero(np.append(new, True))) > 1
    whole = np.zeros(len(groups), dtype=bool)
    whole[np.unique(r_of_u[has_pair])] = True
    solved: dict[int, np.ndarray] = {}
    solves: dict = {}  # _solve_whole's cache
    stored: dict[int, str] = {}  # a solved matrix (by id) -> its name in strategies
    inverses_of: dict[tuple[int, ...], np.ndarray] = {}
    lo_of: dict[tuple[int, int], float] = {}  # tr(cover · (BᵀB)⁺) by the ids of both
    for r in np.flatnonzero(mixed | whole):
        members = groups[int(r)]
        k = int(uniq_size[members[0]])
        cols = uniq_rows[members, :k]
        if whole[r]:
            sizes = [int(n[real_ext[t]]) for t in cols[0]]
            how, mats, cover = _solve_whole(
                members, cols, sizes, kind_ext, log_o_ext, lse_a, pair_grams, solves
            )
            if how == "identity":
                for pos in range(k):
                    set_ids[int(r), pos] = name_id(f"identity:{sizes[pos]}")
            else:  # one matrix: an attribute's ("mixed:n") or one over the set's cells ("dense:n_axn_b")
                name = stored.get(id(mats[0]))
                if name is None:  # stored once, whichever sets share it
                    name = stored[id(mats[0])] = f"{how}:{len(names)}"
                    strategies[name] = mats[0]
                set_ids[int(r), :k] = name_id(name)
                if how.startswith("dense:"):  # one product over all the cells: γ of their number
                    log_gamma[members] = float(log1p_gamma(np.array([math.prod(sizes)]), 0)[0])
            key = tuple(id(m) for m in mats)  # the matrices live in `solves` (or contrasts' cache)
            if key not in inverses_of:
                if len(mats) == 1:
                    inverse = np.linalg.pinv(mats[0])
                    inverses_of[key] = inverse @ inverse.T
                else:  # the contrasts: (⊗EᵢᵀEᵢ)⁺ = ⊗(I − J/nᵢ), a projection
                    inverses_of[key] = kron_all([m.T @ m for m in mats])
            gram_inv = inverses_of[key]
            solved[int(r)] = gram_inv
            privacy = sum(math.log(float(np.max(np.einsum("ij,ij->j", m, m)))) for m in mats)
            for u, row in zip(members, cols, strict=True):
                log_p[u] = privacy
                gram, log_factor = cover[int(u)]
                pair = (id(gram), id(gram_inv))  # both shared by the sets of one structure
                if pair not in lo_of:
                    lo_of[pair] = math.log(max(float(np.einsum("ij,ji->", gram, gram_inv)), _TINY))
                log_lo[u] = lo_of[pair] + log_factor
                if has_pair[u]:
                    log_lo[u] -= lse_a[u]
                else:
                    log_lo[u] -= float(log_o_ext[row].sum())
            continue
        weights = lse_a[members] - log_o_ext[cols].sum(axis=1)  # log c_u = log Σ w_A ∏_{A∖S} o_i
        terms = [
            (
                math.exp(float(wu - weights.max())),
                [centred_gram(QUERY_TYPES[int(kind_ext[t])], int(n[real_ext[t]])) for t in row],
            )
            for wu, row in zip(weights, cols, strict=True)
        ]
        # an attribute every entry asks cell by cell keeps the contrasts (optimal, and no stored matrix)
        fixed = [bool(np.all(kind_ext[cols[:, pos]] == 0)) for pos in range(k)]
        chosen, _ = kronecker_strategy(terms, fixed=fixed)
        mats, inverses = [], []
        for pos, b in enumerate(chosen):
            size = int(n[real_ext[cols[0, pos]]])
            if fixed[pos]:
                mats.append(contrasts(size))
                inverses.append(mats[-1].T)
                continue  # set_ids keeps the column's "identity:n"
            mats.append(strategy_matrix(b))
            inverses.append(np.linalg.pinv(mats[-1]))
            name = f"mixed:{size}:{len(names)}"
            strategies[name] = mats[-1]
            set_ids[int(r), pos] = name_id(name)
        privacy = sum(math.log(float(np.max(np.einsum("ij,ij->j", m, m)))) for m in mats)
        for u, row in zip(members, cols, strict=True):
            log_p[u] = privacy
            log_lo[u] = sum(
                math.log(float(block_sums(QUERY_TYPES[int(kind_ext[t])], inv @ inv.T).sum())) - log_o_ext[t]
                for t, inv in zip(row, inverses, strict=True)
            )
    log_v = _grouped_lse((log_lo + lse_a)[order], np.flatnonzero(new))
    width_mask = np.arange(width)[None, :] < uniq_size[first][:, None]
    res_ids = set_ids[width_mask].astype(np.int32)
    if np.any(res_ids < 0):
        raise PlanError("internal: a residual set's attribute has no strategy")
    return r_of_u, first, log_v, res_ids, list(names), solved, bool(np.any(mixed | whole))


_TINY = np.finfo(np.float64).tiny  # a piece of zero variance: its log stays finite
# RP+'s split is tried for these types (circular ranges: their optimum is circulant, so u = 1/n already)
SPLIT_TYPES = ("prefix", "range")
SPLIT_ROUNDS = 2  # rounds of β² updates per (type, size) after RP+'s β² = 0


def _column_logs(f: AttributeFactors) -> tuple[float, float, float]:
    """A column's planner tables from its factors: log d (privacy), log t (Σ outside), log r − log t."""
    t = float(f.outside.sum())
    return math.log(f.privacy), math.log(t), math.log(float(f.inside.sum())) - math.log(t)


def _split_candidates(uniq_rows, uniq_size, real_ext, kind_ext, padded_c, inside_a, kinds, n) -> dict:
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


def _choose_totals(objective, tables, groups, extra, d) -> dict[tuple[str, int], AttributeFactors]:
    """Which (type, size) groups of columns to measure through a Schur split, and with which β²
    (:mod:`functions.dpquery.schur`), by the workload's loss: ``objective(pfac, o, nn1)`` is its log root
    given the per-column tables (``tables``, not changed here). Each group starts from today's strategy
    (its columns' factors in ``extra``), tries RP+'s split (β² = 0), then moves β² to where the loss's
    slopes in t = ‖W u‖² and in d·r meet those of the split's own objective (√(t + β²) + √(d·r))², from
    multipliers of the last solve, keeping only what lowers the loss. So no workload gets a worse plan than
    without the split. Returns {(type, size): factors} of the groups that changed."""
    from shardfold.functions.dpquery.schur import beta2_floor, schur_factors

    work = [t.copy() for t in tables]
    best = objective(*work)
    picked: dict[tuple[str, int], AttributeFactors] = {}
    current = {key: extra[cols[0] - d - 1] for key, cols in groups.items()}
    starts: dict[tuple[str, int], np.ndarray] = {}

    def trial(key, f: AttributeFactors) -> tuple[float, list[np.ndarray]]:
        tried = [t.copy() for t in work]
        for col in groups[key]:
            tried[0][col], tried[1][col], tried[2][col] = _column_logs(f)
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


def _solve_whole(members, cols, sizes, kind_ext, log_o_ext, lse_a, pair_grams, solves):
    """A residual set that a 2-way query type reaches, solved from the Gram of every piece on it: the
    Kronecker column sets' (c_u ⊗ Ḡ_i) and the 2-way types' (``pair_grams``): the best of the contrasts,
    the Kronecker-factored and low-rank strategies and, on small sets, the full convex optimum
    (:func:`~functions.dpquery.smasher.set_strategy`), and for one attribute its per-attribute optimum
    too (:func:`~functions.dpquery.smasher.attribute_strategy`). Returns
    (``"identity"``, ``"mixed:<n>"`` or ``"dense:<n_a>x<n_b>"``; the matrices measured, one per attribute
    or one over the cells; {column set: (a Gram of its pieces, log of the factor that makes it the Gram
    unweighted by the c_u its log_lo is taken against)}).
    ``solves`` caches the Grams (with their traces) by what they are made of, and the strategy by the set's
    structure."""
    # each column set's Gram, cached by what it is made of: the sets of one structure (every pair of a
    # workload on [n]^d) share their Grams and their solve, so d(d−1)/2 pairs build no matrices of their own
    cover: dict[int, np.ndarray] = {}
    parts = []  # (what the Gram is made of, its weight in the set's sum, whether a 2-way type's)
    for u, row in zip(members, cols, strict=True):
        if any(kind_ext[t] >= len(ATTRIBUTE_TYPES) for t in row):
            sources = pair_grams[tuple(int(t) for t in row)]
            weight, few = float(sources[0][0]), True  # the marginals' weights, relative to the first's
            made_of = ("pair", tuple((float(w) / weight, _digest(solves, gram)) for w, gram in sources))
            if made_of not in solves:
                solves[made_of] = _with_trace(sum(float(w) / weight * gram for w, gram in sources))
        else:
            made_of = (
                "kron",
                tuple((int(kind_ext[t]), int(size)) for t, size in zip(row, sizes, strict=True)),
            )
            if made_of not in solves:
                solves[made_of] = _with_trace(
                    kron_all([centred_gram(QUERY_TYPES[k], size) for k, size in made_of[1]])
                )
            weight, few = math.exp(float(lse_a[u] - log_o_ext[row].sum())), False
        cover[int(u)] = (solves[made_of][0], math.log(weight) if few else 0.0)
        parts.append((made_of, weight, few))
    # the best strategy is the same for any multiple of the Gram: sets of one structure solve once; a miss
    # only costs a solve
    scale = math.fsum(w * solves[made_of][1] for made_of, w, _ in parts)
    if (
        not scale > 0
    ):  # no piece on the set at all (abs_diff on 2 x 2 reaches neither 1-way set): nothing to fit
        return "identity", [contrasts(n) for n in sizes], cover
    key = (tuple(sizes), tuple(sorted((made_of, round(w / scale, 12), few) for made_of, w, few in parts)))
    if key not in solves:
        total = sum(w * solves[made_of][0] for made_of, w, _ in parts)
        low = sum(w * solves[made_of][0] for made_of, w, few in parts if few)
        trace = max(float(np.trace(total)), _TINY)
        solves[key] = _best_whole(total / trace, sizes, low / trace if len(sizes) > 1 else None)
    return (*solves[key], cover)


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
    """:func:`_solve_whole`'s strategy for the summed Gram ``total`` (``few``: its 2-way types' part): (its
    kind, its matrices)."""
    chosen = set_strategy(total, sizes, few)
    if len(sizes) == 1:
        # the per-attribute solver has closed forms and no floor, but needs a Gram of full rank on the
        # residual space (a few 2-way pieces may leave most of it unasked) and may stall near one;
        # set_strategy's floors do not: the better of the two, by loss
        u = contrasts(sizes[0])
        eig = np.linalg.eigvalsh(u @ total @ u.T)
        if not eig[0] > 1e-9 * eig[-1]:
            return _one_matrix(chosen, sizes)
        own = attribute_strategy(total)
        better = strategy_loss(total, own) <= strategy_loss(total, chosen)
        return _one_matrix(own if better else chosen, sizes)
    if chosen.solver == "identity":
        return "identity", [contrasts(size) for size in sizes]
    return f"dense:{'x'.join(map(str, sizes))}", [dense_matrix(chosen.gram, sizes)]


def _one_matrix(chosen, sizes) -> tuple[str, list[np.ndarray]]:
    """_best_whole's answer for a one-attribute set measured through ``chosen``."""
    if chosen.solver == "identity":
        return "identity", [contrasts(sizes[0])]
    return f"mixed:{sizes[0]}", [strategy_matrix(chosen)]


def _pair_log_var(kind, dims: tuple[int, ...], subsets: np.ndarray, log_sigma2: np.ndarray, solved) -> float:
    """log of the mean variance of the queries of a type over a marginal as a whole (a 2-way type, an
    explicit matrix): Σ_{S ⊆ A} σ_S² tr(G_S (B_SᵀB_S)⁺) over the queries (``subsets``: the residual sets of
    the subsets of A in mask order, ∅, {a}, {b}, {a, b} for two attributes)."""
    grams = pair_piece_grams(kind, *dims)
    k = len(dims)
    total = 0.0
    for mask, r in enumerate(subsets.tolist()):
        pos = tuple(p for p in range(k) if mask >> p & 1)
        if pos not in grams:  # no query has a piece there
            continue
        inv = solved.get(int(r), np.ones((1, 1)))
        total += math.exp(float(log_sigma2[int(r)])) * float(np.einsum("ij,ji->", grams[pos], inv))
    return math.log(total / pair_queries(kind, *dims).shape[0])


def _refuse_large(log_size, padded_a, sizes, names, what: str, advice: str) -> None:
    """PlanError naming the first marginal whose size (cells or answers, as logs) passes
    MAX_MARGINAL_CELLS: ``what`` says which, with a {} for the size."""
    big = np.flatnonzero(log_size > math.log(MAX_MARGINAL_CELLS) + 1e-9)
    if big.size:
        j = int(big[0])
        attrs = tuple(padded_a[j, : sizes[j]].tolist())
        raise PlanError(
            f"workload.{j} {_label(attrs, names)} {what.format(math.exp(log_size[j]))} "
            f"{MAX_MARGINAL_CELLS:,} (coarsen the attributes' bins or {advice})"
        )


def _label(attrs: tuple[int, ...], names: list[str] | None) -> str:
    if names is None:
        return str(attrs)
    return "(" + ", ".join(names[i] for i in attrs) + ")"


def _max_variance(
    log_sigma2_0, log_p, log_n_sum_s, res_of_pair, pair_marg, cells_log, weights, two_rho, log_q=None
):
    """min_u max_A w_A Var_A(u) subject to Σ q_S/u_S = 2ρ (q_S: the charged squared sensitivity; p_S when
    ``log_q`` is None), as the convex program
    min Σ r_S/t_S s.t. M t ≤ 1, in the variables t = u/u⁰ (u⁰: the closed-form sum-of-variances solution),
    with r_S = q_S/u⁰_S and M_{A,S} = w_A p_S ∏_{A∖S} 1/n_i² u⁰_S. Rescaling its optimum to cost 2ρ gives
    the allocation (dp-query.md §2.4; the objective is P*/(2ρ), not P*·2ρ)."""
    import time

    try:
        import cvxpy as cp
        import scipy.sparse as sp
    except ImportError as exc:  # pragma: no cover - cvxpy is installed where max_variance is offered
        raise PlanError(
            "loss 'max_variance' needs cvxpy (pip install cvxpy); 'sum_of_variances' does not"
        ) from exc

    if log_q is None:
        log_q = log_p
    c = log_p.size
    m = cells_log.size
    q = np.exp(log_q - log_sigma2_0)
    q = q / q.sum()
    log_m = np.log(weights)[pair_marg] + (log_p + 2.0 * log_n_sum_s + log_sigma2_0)[res_of_pair]
    log_m -= 2.0 * cells_log[pair_marg]
    vals = np.exp(log_m - np.max(log_m))
    mat = sp.csr_matrix((vals, (pair_marg, res_of_pair)), shape=(m, c))
    row_max = float(np.max(mat @ np.ones(c)))
    mat = mat / row_max
    t = cp.Variable(c, pos=True)
    problem = cp.Problem(cp.Minimize(q @ cp.inv_pos(t)), [mat @ t <= 1.0])
    started = time.perf_counter()
    errors = []
    for name in ("CLARABEL", "SCS"):
        if name not in cp.installed_solvers():
            continue
        try:
            problem.solve(solver=name)
        except cp.error.SolverError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if problem.status in ("optimal", "optimal_inaccurate") and t.value is not None:
            break
        errors.append(f"{name}: {problem.status}")
    else:
        raise PlanError("max_variance: the convex program was not solved (" + "; ".join(errors) + ")")
    elapsed = time.perf_counter() - started
    tv = np.maximum(np.asarray(t.value, dtype=np.float64), 1e-300)
    log_u = log_sigma2_0 + np.log(tv)
    # scale so that Σ p_S/u_S = 2ρ exactly
    log_cost = _lse(log_q - log_u)
    log_u = log_u + log_cost - math.log(two_rho)
    return log_u, {
        "solver": problem.solver_stats.solver_name,
        "status": problem.status,
        "seconds": round(elapsed, 3),
        "variables": int(c),
        "constraints": int(m),
    }
