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
* Workload marginals keep the order they were given in (a spec's :meth:`DPQuerySpec.marginals`), each a sorted
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

Beside this module: :mod:`functions.dpquery.workload` checks the parts, :mod:`functions.dpquery.merged`
chooses the strategies of sets asked in several ways, :mod:`functions.dpquery.schur` RP+'s split.
"""

from __future__ import annotations

import base64
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardfold.functions.dpquery.measure import charge_factor, log1p_gamma
from shardfold.functions.dpquery.merged import SetStrategies, pair_log_var
from shardfold.functions.dpquery.schur import choose_totals, column_logs, split_candidates
from shardfold.functions.dpquery.smasher import (
    AttributeFactors,
    attribute_factors,
    block_sums,
    pair_queries,
    whole_piece_grams,
)
from shardfold.functions.dpquery.spec import ATTRIBUTE_TYPES, MATRIX, MAX_PAIR_DIM, QUERY_TYPES
from shardfold.functions.dpquery.workload import Parts, checked
from shardfold.functions.errors import PlanError, SpecError
from shardfold.functions.privacy import cdp_eps, gaussian_eps, simple_eps

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
    _ARRAYS = (  # every plan's arrays, by name
        *"domains res_ptr res_attrs log_p log_q log_v log_sigma2 noise_count".split(),
        *"marg_ptr marg_attrs weights log_var cells sub_ptr sub_idx".split(),
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
    """Plan a job: ``plan(spec)`` for a :class:`functions.dpquery.spec.DPQuerySpec`, or from bare parts,
    ``plan(domains=[n_0, …], workload=[(attrs, weight) | attrs, …], rho=ρ, loss=…)`` with attrs tuples
    of attribute indices. Keyword arguments given with a spec override it (e.g. ``rho``).

    ``queries``: beside ``workload``, each marginal's ``{attribute index: query type}`` (types of
    :data:`~functions.dpquery.smasher.QUERY_TYPES`; an attribute not named is ``identity``). With any type
    other than identity the plan is QuerySmasher's (:mod:`functions.dpquery.smasher`): each residual set is
    measured through its attributes' best strategies instead of the contrasts (a set that marginals ask
    in different ways through one Kronecker strategy fitted to all of them). A 2-way type (``affine``,
    ``abs_diff``) is given for both attributes of a 2-way marginal, and an explicit
    :class:`~functions.dpquery.spec.QueryMatrix` for every attribute of a 1- or 2-way marginal; every
    residual set such a type reaches is solved whole (:mod:`functions.dpquery.merged`; {a, b} possibly
    through one matrix over its cells, :meth:`Plan.dense`), a set none of its queries reaches at a floor
    (:func:`functions.dpquery.smasher.whole_piece_grams`).

    ``unit_rows`` (k) and ``rows_bound`` (N) set the charged sensitivity (module docstring); a spec gives
    its privacy unit's ``max_rows`` (default 1) and its ``max_rows_total`` (default
    :data:`functions.dpquery.spec.DEFAULT_MAX_ROWS_TOTAL`).

    ``split_totals``: an attribute asked one way throughout (prefix or range) may be measured through RP+'s
    Schur-complement residuals where they lower the loss (:func:`~functions.dpquery.schur.choose_totals`);
    False keeps every residual orthogonal to the total (QuerySmasher's class alone: the benchmark's and
    tests' reference)."""
    given = {key: value for key, value in locals().items() if key in _FROM_SPEC}
    if spec is not None:  # a part not given comes from the spec
        given = {key: how(spec) if given[key] is None else given[key] for key, how in _FROM_SPEC.items()}
    return _plan(checked(**given), split_totals)


# how plan() reads each part from a spec, in this order
_FROM_SPEC = {
    "unit_rows": lambda spec: spec.unit_rows(),
    "rows_bound": lambda spec: spec.rows_bound(),
    "domains": lambda spec: spec.domains(),
    "workload": lambda spec: spec.marginals(),
    "rho": lambda spec: spec.rho(),
    "loss": lambda spec: spec.loss,
    "names": lambda spec: [a.name for a in spec.attributes],
    "delta": lambda spec: spec.budget.report_delta(),
    "queries": lambda spec: spec.marginal_queries(),
}


def neighbouring(unit_rows: int) -> str:
    """The neighbouring relation in words (the privacy report's ``neighbouring``)."""
    if unit_rows == 1:
        return "add or remove one record"
    return f"add or remove one person (privacy unit: at most {unit_rows} rows per person are counted)"


def _plan(parts: Parts, split_totals: bool = True) -> Plan:
    """Plan checked parts in ResidualPlanner's stages: the closure C(W) of the workload (:func:`_closure`),
    RP+'s split where it lowers the loss (:func:`_rp_plus_split`), each residual set's privacy and variance
    coefficients p_S, q_S, v_S (:func:`_residuals`), the selection of σ_S² (:func:`_select`), and each
    marginal's reconstruction variance (:func:`_variances`). ``split_totals``: whether attributes of one
    query type may be measured through RP+'s Schur-complement residuals (:func:`choose_totals`).

    The sets are enumerated over *columns*: column i < d is attribute i queried as identity, column d pads
    short rows, and column d + 1 + k is the k-th (attribute, other query type) pair of the workload. Every
    per-attribute factor is a table over columns, so general query types cost no more than identities."""
    pairs_total = int(np.sum(np.left_shift(np.int64(1), parts.sizes)))
    if pairs_total > MAX_SUBSET_PAIRS:
        raise PlanError(
            f"the workload's marginals have {pairs_total:,} (marginal, subset) pairs in all; the limit is "
            f"{MAX_SUBSET_PAIRS:,} (use fewer or smaller marginals)"
        )
    cols = _columns(parts)
    work = _workload(parts, cols)
    sets = _closure(parts, cols, work.sub_ptr)
    # the rounding of the mode-wise products: measure.charged_sensitivity's γ_{n+2} for the contrasts alone,
    # measure.charged_norm's γ_n when the sets are measured through matrices charged entry by entry
    log_gamma_ext = np.append(log1p_gamma(parts.n, 2 if parts.codes is None else 0), 0.0)[cols.real]
    sets.log_gamma = log_gamma_ext[sets.rows].sum(axis=1)
    column_names, totals = {}, {}
    if parts.codes is not None and split_totals:
        column_names, totals = _rp_plus_split(parts, cols, work, sets)
    res = _residuals(parts, cols, work, sets, column_names)
    rho_planned = parts.rho * (1.0 - RHO_SLACK)
    two_rho = 2.0 * rho_planned
    log_sigma2, solver = _select(parts, work, sets, res, two_rho)
    log_var = _variances(parts, work, res, log_sigma2)
    result = Plan(
        domains=parts.n.astype(np.int64),
        names=list(parts.names) if parts.names is not None else None,
        rho=parts.rho,
        rho_planned=rho_planned,
        loss=parts.loss,
        delta=parts.delta,
        res_ptr=res.ptr,
        res_attrs=res.attrs,
        log_p=res.log_p,
        log_q=res.log_q,
        log_v=res.log_v,
        log_sigma2=log_sigma2,
        noise_count=res.noise_count.astype(np.int64),
        marg_ptr=work.marg_ptr,
        marg_attrs=work.marg_attrs,
        weights=parts.weights,
        log_var=log_var,
        cells=work.cells.astype(np.int64),
        sub_ptr=work.sub_ptr,
        sub_idx=_ascending_subsets(res.of_pair, parts.sizes, work.sub_ptr),
        solver=solver,
        unit_rows=int(parts.unit_rows),
        rows_bound=None if parts.rows_bound is None else int(parts.rows_bound),
        res_strategy=res.strategy,
        strategy_names=res.strategy_names,
        marg_types=None if parts.codes is None else cols.kind[cols.padded][work.inside],
        num_q=work.num_q,
        strategies=cols.strategies,
        totals=totals,
    )
    cost = result.privacy_cost()
    if not abs(cost - two_rho) <= PRIVACY_CHECK_RTOL * two_rho:
        raise PlanError(f"internal: the allocation costs Σ q_S/σ_S² = {cost!r}, not 2ρ = {two_rho!r}")
    if totals and res.merged:
        # the choice counted merged sets apart: keep it only if the plan it gives is better than without
        other = _plan(parts, split_totals=False)
        if other.weighted_sse < result.weighted_sse:
            return other
    return result


@dataclass
class _Columns:
    """The planner's per-column tables (:func:`_plan`'s columns; the last entry of the identity part, d, is
    the padding). :func:`_rp_plus_split` rewrites the tables of the columns it splits."""

    log_pfac: np.ndarray  # log of the privacy factor: log((n−1)/n) for identity
    log_o: np.ndarray  # log o, o = Σ (W 1/n)², the factor of an attribute outside a set: log(1/n)
    log_nn1: np.ndarray  # log(ℓ/o), ℓ the factor inside a set: log(n(n−1)) for identity
    queries: np.ndarray  # m, the queries of a column: n for identity (1 for the padding)
    real: np.ndarray  # the attribute of each column (d: the padding)
    kind: np.ndarray  # int8, the query type code of each column
    padded: np.ndarray  # the workload's marginals over columns (as Parts.padded_a over attributes)
    extra: list[AttributeFactors] = field(default_factory=list)  # the factors of columns d + 1 + k
    strategies: dict[str, np.ndarray] = field(default_factory=dict)  # the plan's B_i by name


def _columns(parts: Parts) -> _Columns:
    """The per-column tables: an identity column's are ResidualPlanner's, another type's its factors'."""
    n, d = parts.n, int(parts.n.size)
    log_n = np.log(n.astype(np.float64))
    cols = _Columns(
        log_pfac=np.append(np.log1p(-1.0 / n.astype(np.float64)), 0.0),
        log_o=np.append(-log_n, 0.0),
        log_nn1=np.append(log_n + np.log(n.astype(np.float64) - 1.0), 0.0),
        queries=np.append(n, 1).astype(np.int64),
        real=np.arange(d + 1),
        kind=np.zeros(d + 1, dtype=np.int8),
        padded=parts.padded_a,
    )
    if parts.codes is None:
        return cols
    used = parts.codes > 0
    types = len(parts.kinds)
    slot_key = parts.padded_a.astype(np.int64) * types + parts.codes
    pair_keys = np.unique(slot_key[used])
    padded_c = np.where(used, d + 1 + np.searchsorted(pair_keys, slot_key), parts.padded_a)
    cols.padded = padded_c.astype(np.int32)
    extra_attr, extra_kind = pair_keys // types, (pair_keys % types).astype(np.int8)
    # a 2-way type's columns take the identity's factors as placeholders: every set they reach is
    # solved whole (_residual_sets) and their marginals' variances computed apart (pair_log_var)
    cols.extra = [
        attribute_factors(QUERY_TYPES[c] if c < len(ATTRIBUTE_TYPES) else "identity", int(n[i]))
        for i, c in zip(extra_attr, extra_kind, strict=True)
    ]
    cols.strategies = {f"{f.kind}:{f.n}": f.matrix for f in cols.extra if f.kind != "identity"}
    logs = np.array([column_logs(f) for f in cols.extra]).reshape(-1, 3)
    cols.log_pfac = np.append(cols.log_pfac, logs[:, 0])
    cols.log_o = np.append(cols.log_o, logs[:, 1])
    cols.log_nn1 = np.append(cols.log_nn1, logs[:, 2])
    cols.queries = np.append(cols.queries, [f.queries for f in cols.extra]).astype(np.int64)
    cols.real = np.append(cols.real, extra_attr)
    cols.kind = np.append(cols.kind, extra_kind)
    return cols


@dataclass
class _Workload:
    """The workload's marginals as the plan lists them, and log a_A, each marginal's factor in the v_S of
    its subsets: log(w_A / cells_A) for identity marginals, log(w_A ∏ o_i) under query types."""

    marg_ptr: np.ndarray  # (|W|+1,) CSR over marg_attrs
    marg_attrs: np.ndarray
    inside: np.ndarray  # (|W|, width) bool: the slots of padded_a that hold an attribute
    cells_log: np.ndarray  # log ∏_{i∈A} n_i
    cells: np.ndarray
    sub_ptr: np.ndarray  # (|W|+1,) where each marginal's 2^|A| (A, S) pairs start
    log_a: np.ndarray | None = None
    queries_log: np.ndarray | None = None  # log ∏ m_i (query types only)
    num_q: np.ndarray | None = None
    # marginal -> the type naming its queries as a whole (a 2-way type, an explicit matrix), its domain sizes
    whole: dict[int, tuple[Any, tuple[int, ...]]] = field(default_factory=dict)
    # column set -> (w_A, Gram of A's pieces there) of each 2-way marginal reaching it: the Grams are shared
    # (pair_piece_grams' cache), summed per set when it is solved, so d(d−1)/2 pairs hold no copies
    pair_grams: dict[tuple[int, ...], list[tuple[float, np.ndarray]]] = field(default_factory=dict)


def _workload(parts: Parts, cols: _Columns) -> _Workload:
    """The workload's CSR form, cells and log a_A; a PlanError names a marginal too large."""
    n, sizes, padded_a = parts.n, parts.sizes, parts.padded_a
    marg_ptr = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=marg_ptr[1:])
    inside = np.arange(padded_a.shape[1])[None, :] < sizes[:, None]
    cells_log = np.append(np.log(n.astype(np.float64)), 0.0)[padded_a].sum(axis=1)
    _refuse_large(
        parts, cells_log, "has about {:.3g} cells; a marginal may have at most", "split the marginal"
    )
    sub_ptr = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(np.left_shift(np.int64(1), sizes), out=sub_ptr[1:])
    cells = np.prod(np.append(n, 1).astype(np.int64)[padded_a], axis=1)
    work = _Workload(marg_ptr, padded_a[inside], inside, cells_log, cells, sub_ptr)  # row-major, each sorted
    if parts.codes is None:
        work.log_a = np.log(parts.weights) - cells_log  # log(w_A / cells_A)
    else:
        _typed_workload(work, parts, cols)
    return work


def _typed_workload(work: _Workload, parts: Parts, cols: _Columns) -> None:
    """Under query types: log a_A = log(w_A ∏ o_i), the marginals a type asks as a whole with their Grams,
    and each marginal's queries; a SpecError or PlanError names a marginal of too many."""
    weights = parts.weights
    work.log_a = np.log(weights) + cols.log_o[cols.padded].sum(axis=1)
    for j in np.flatnonzero(parts.codes[:, 0] >= len(ATTRIBUTE_TYPES)).tolist():
        kind = parts.kinds[int(parts.codes[j, 0])]
        dims = tuple(int(parts.n[i]) for i in parts.padded_a[j, : parts.sizes[j]])
        if math.prod(k - 1 for k in dims) > MAX_PAIR_DIM:
            raise SpecError(
                f"workload.{j}: {kind!r} on {' x '.join(map(str, dims))} values; a type over a marginal "
                f"as a whole takes at most {MAX_PAIR_DIM} for ∏(n_i − 1) (coarsen the attributes' bins)",
                [{"field": f"workload.{j}.queries", "error": "the attributes have too many values"}],
            )
        work.whole[j] = (kind, dims)
        columns = cols.padded[j, : len(dims)].tolist()
        grams = whole_piece_grams(kind, *dims)
        for pos, g in grams.items():
            key = tuple(columns[p] for p in pos)
            work.pair_grams.setdefault(key, []).append((float(weights[j]), g))
        work.log_a[j] = math.log(weights[j] * float(grams[()][0, 0]))
    work.queries_log = np.log(cols.queries.astype(np.float64))[cols.padded].sum(axis=1)
    what = "asks about {:.3g} queries; a marginal may answer at most"
    _refuse_large(parts, work.queries_log, what, "ask prefixes instead of all ranges")
    work.num_q = np.prod(cols.queries[cols.padded], axis=1)
    for j, (kind, dims) in work.whole.items():
        work.num_q[j] = pair_queries(kind, *dims).shape[0]


@dataclass
class _Closure:
    """C(W) over columns: every (A, S ⊆ A) pair of the workload (A-major, each marginal's 2^|A| subsets in
    mask order) and the unique column sets S, in (size, lexicographic) order, with their coefficients (the
    privacy factor, Σ(log ℓ − log o), the LSE of their marginals' log a, the rounding term), which
    :func:`_residual_sets` rewrites for the strategy a set is measured through."""

    pair_marg: np.ndarray  # the marginal A of each pair
    order: np.ndarray | None  # the pairs sorted by column set (dropped once read)
    starts: np.ndarray  # where each column set's pairs start in that order
    rows: np.ndarray  # (|C|, width) the column sets, padded with d
    size: np.ndarray  # (|C|,) int64 |S|
    of_pair: np.ndarray  # the column set of each pair
    log_gamma: np.ndarray | None = None
    log_p: np.ndarray | None = None
    log_lo: np.ndarray | None = None
    lse_a: np.ndarray | None = None


def _closure(parts: Parts, cols: _Columns, sub_ptr: np.ndarray) -> _Closure:
    """Enumerate every (A, S ⊆ A) pair and find the unique column sets among them (one lexsort)."""
    pairs_total = int(sub_ptr[-1])
    idx_t = np.int32 if max(int(parts.sizes.size), pairs_total) < 2**31 else np.int64
    pair_rows, pair_size, pair_marg = _subset_pairs(parts, cols.padded, sub_ptr, idx_t)
    width = pair_rows.shape[1]
    order = np.lexsort([pair_rows[:, c] for c in range(width - 1, -1, -1)] + [pair_size])  # last key primary
    sorted_rows, sorted_size = pair_rows[order], pair_size[order]
    del pair_rows, pair_size
    new = np.ones(pairs_total, dtype=bool)
    new[1:] = np.any(sorted_rows[1:] != sorted_rows[:-1], axis=1) | (sorted_size[1:] != sorted_size[:-1])
    starts = np.flatnonzero(new)
    rows = sorted_rows[starts]
    size = sorted_size[starts].astype(np.int64)
    del sorted_rows, sorted_size
    of_pair = np.empty(pairs_total, dtype=idx_t)
    of_pair[order] = np.cumsum(new, dtype=idx_t) - 1
    return _Closure(pair_marg, order, starts, rows, size, of_pair)


def _subset_pairs(parts: Parts, padded_c: np.ndarray, sub_ptr: np.ndarray, idx_t) -> tuple:
    """Every (A, S ⊆ A) pair, grouped by |A|, A-major: S's columns (padded with d), |S| and A."""
    sizes, d = parts.sizes, int(parts.n.size)
    pairs_total = int(sub_ptr[-1])
    width = max(int(sizes.max()), 1)
    pair_rows = np.empty((pairs_total, width), dtype=np.int32)  # S, padded with d
    pair_size = np.empty(pairs_total, dtype=np.int32)
    pair_marg = np.empty(pairs_total, dtype=idx_t)
    for k in np.unique(sizes).tolist():
        idx = np.flatnonzero(sizes == k)
        a_k = padded_c[idx, :k]  # (m_k, k)
        # positions of this group's pairs: the 2^k slots of each marginal, mask order
        pos = (sub_ptr[idx][:, None] + np.arange(1 << k)[None, :]).ravel()
        rows = np.full((idx.size, 1 << k, width), d, dtype=np.int32)
        for mask in range(1, 1 << k):
            picked = [b for b in range(k) if mask >> b & 1]
            rows[:, mask, : len(picked)] = a_k[:, picked]
        pair_rows[pos] = rows.reshape(-1, width)
        del rows
        pair_size[pos] = np.tile(
            np.array([bin(x).count("1") for x in range(1 << k)], dtype=np.int32), idx.size
        )
        pair_marg[pos] = np.repeat(idx, 1 << k)
    return pair_rows, pair_size, pair_marg


def _rp_plus_split(parts, cols, work, sets) -> tuple[dict[int, str], dict[str, np.ndarray]]:
    """RP+'s Schur split of the columns that qualify (:func:`split_candidates`), where it lowers the loss
    (:func:`choose_totals`): their tables rewritten in ``cols``, and ``work.log_a`` with them. Returns
    {column: its strategy's name} and {strategy name: u, the values its attribute's total is spread over}."""
    d = int(parts.n.size)
    groups = split_candidates(
        sets.rows, sets.size, cols.real, cols.kind, cols.padded, work.inside, parts.kinds, parts.n
    )
    if not groups:
        return {}, {}
    charge = 2.0 * np.log(charge_factor(sets.log_gamma, parts.unit_rows, parts.rows_bound))
    marg_sorted = sets.pair_marg[sets.order]
    log_w = np.log(parts.weights)
    whole_a = {j: float(work.log_a[j]) for j in work.whole}  # a type over a marginal as a whole: no o_i

    def log_a(o: np.ndarray) -> np.ndarray:
        """log a_A with these o_i."""
        out = log_w + o[cols.padded].sum(axis=1)
        for j, value in whole_a.items():
            out[j] = value
        return out

    def objective(pfac: np.ndarray, o: np.ndarray, nn1: np.ndarray, rows=sets.rows) -> float:
        """log Σ_u √(q_u v_u) over the column sets: the loss's root, as the plan would have it
        with these per-column tables (sets merged below are counted apart, a bound)."""
        lse = _grouped_lse(log_a(o)[marg_sorted], sets.starts)
        return _lse(0.5 * (pfac[rows].sum(axis=1) + charge + nn1[rows].sum(axis=1) + lse))

    picked = choose_totals(objective, (cols.log_pfac, cols.log_o, cols.log_nn1), groups, cols.extra, d)
    column_names: dict[int, str] = {}  # a column measured through a strategy not named "<type>:<n>"
    totals: dict[str, np.ndarray] = {}
    for (kind, size), f in picked.items():
        name = f"{kind}:{size}:schur"
        cols.strategies[name], totals[name] = f.matrix, f.total
        for col in groups[(kind, size)]:
            column_names[col] = name
            cols.log_pfac[col], cols.log_o[col], cols.log_nn1[col] = column_logs(f)
        if not any(
            f"{e.kind}:{e.n}" == f"{kind}:{size}" and d + 1 + k not in column_names
            for k, e in enumerate(cols.extra)
        ):
            cols.strategies.pop(f"{kind}:{size}", None)  # no column measures through it any more
    if picked:
        work.log_a = log_a(cols.log_o)
    return column_names, totals


@dataclass
class _Residuals:
    """The residual sets S ∈ C(W) (attributes, in (size, lexicographic) order) and their coefficients."""

    ptr: np.ndarray  # (|C|+1,) CSR over attrs
    attrs: np.ndarray
    log_p: np.ndarray
    log_q: np.ndarray
    log_v: np.ndarray
    noise_count: np.ndarray
    log_n_sum: np.ndarray  # Σ_{i∈S} log n_i
    of_pair: np.ndarray  # the residual set of each (A, S) pair
    pair_lo: np.ndarray  # each pair's Σ(log ℓ − log o): its column set's, in its residual set
    strategy: np.ndarray | None = None  # Plan.res_strategy
    strategy_names: list[str] = field(default_factory=list)
    solved: dict[int, np.ndarray] = field(default_factory=dict)  # set solved whole -> (BᵀB)⁺ over its cells
    merged: bool = False  # whether any set was merged from several column sets or solved whole


def _residuals(parts, cols, work, sets, column_names) -> _Residuals:
    """Each residual set's coefficients: p_S, v_S and the charged q_S = p_S·c_S², c_S = k + 2·η_S·N (privacy
    unit and transform rounding). Under query types the column sets of one attribute set are one residual
    set, measured once (:func:`_residual_sets`); otherwise columns are attributes."""
    rows, size = sets.rows, sets.size
    sets.log_p = cols.log_pfac[rows].sum(axis=1)
    sets.log_lo = cols.log_nn1[rows].sum(axis=1)
    sets.lse_a = _grouped_lse(work.log_a[sets.pair_marg[sets.order]], sets.starts)
    sets.order = None
    log_p, log_gamma = sets.log_p, sets.log_gamma
    noise_count = np.prod(np.append(parts.n - 1, 1).astype(np.int64)[cols.real][rows], axis=1)
    of_pair, merge = sets.of_pair, (None, [], {}, False)
    if parts.codes is None:
        log_v = sets.log_lo + sets.lse_a
    else:
        r_of_u, first, log_v, *merge = _residual_sets(cols, parts.n, sets, work.pair_grams, column_names)
        rows, size = cols.real[rows[first]], size[first]
        log_p, log_gamma, noise_count = log_p[first], log_gamma[first], noise_count[first]
        of_pair = r_of_u[sets.of_pair]
    ptr = np.zeros(size.size + 1, dtype=np.int64)
    np.cumsum(size, out=ptr[1:])
    return _Residuals(
        ptr,
        rows[np.arange(rows.shape[1])[None, :] < size[:, None]].astype(np.int32),  # row-major: each in order
        log_p,
        log_p + 2.0 * np.log(charge_factor(log_gamma, parts.unit_rows, parts.rows_bound)),
        log_v,
        noise_count,
        np.append(np.log(parts.n.astype(np.float64)), 0.0)[rows].sum(axis=1),
        of_pair,
        sets.log_lo[sets.of_pair],
        *merge,
    )


def _select(parts, work, sets, res, two_rho) -> tuple[np.ndarray, dict[str, Any]]:
    """log σ_S², and the solver's record: the closed form for sum_of_variances (also the starting point and
    scaling of max_variance), then max_variance's convex program (:func:`_max_variance`)."""
    log_g = _lse(0.5 * (res.log_q + res.log_v))
    log_sigma2 = 0.5 * (res.log_q - res.log_v) + log_g - math.log(two_rho)
    if parts.loss != "max_variance":
        return log_sigma2, {}
    return _max_variance(log_sigma2, res, sets.pair_marg, work.cells_log, parts.weights, two_rho)


def _variances(parts, work, res, log_sigma2) -> np.ndarray:
    """log Var_A, each reconstructed marginal's per-cell variance (the mean over its queries under types)."""
    sub_ptr = work.sub_ptr
    if parts.codes is None:
        # per-cell variance: Var_A = cells_A^{-2} Σ_{S⊆A} σ_S² p_S ∏_{i∈S} n_i²  (pairs are A-major)
        term = (log_sigma2 + res.log_p + 2.0 * res.log_n_sum)[res.of_pair]
        return _grouped_lse(term, sub_ptr[:-1]) - 2.0 * work.cells_log
    # mean variance of A's queries: Σ_{S⊆A} σ_S² ∏_{i∈S} ℓ_i ∏_{i∈A∖S} o_i / ∏_{i∈A} m_i
    term = log_sigma2[res.of_pair] + res.pair_lo
    log_var = _grouped_lse(term, sub_ptr[:-1]) + work.log_a - np.log(parts.weights) - work.queries_log
    for j, (kind, dims) in work.whole.items():
        subsets = res.of_pair[sub_ptr[j] : sub_ptr[j + 1]]
        log_var[j] = pair_log_var(kind, dims, subsets, log_sigma2, res.solved)
    return log_var


def _ascending_subsets(of_pair: np.ndarray, sizes: np.ndarray, sub_ptr: np.ndarray) -> np.ndarray:
    """Plan.sub_idx: each marginal's residual sets S ⊆ A in ascending order (``of_pair`` sorted in place)."""
    for k in np.unique(sizes).tolist():
        idx = np.flatnonzero(sizes == k)
        span = 1 << k
        pos = (sub_ptr[idx][:, None] + np.arange(span)[None, :]).ravel()
        of_pair[pos] = np.sort(of_pair[pos].reshape(-1, span), axis=1).ravel()
    return of_pair


def _residual_sets(cols: _Columns, n, sets: _Closure, pair_grams, column_names):
    """Group the column sets by their attributes: each group is one residual set, measured once.

    A set that marginals of one type per attribute reach keeps its columns' strategies. A set reached with
    different types for an attribute (``[age]`` and ``[age, sex]`` asking ``age`` as prefix, say) gets the
    Kronecker strategy of its summed workload (:meth:`SetStrategies.kronecker`). A set that a 2-way type
    reaches (``pair_grams``: the Gram of its pieces per column set) is solved whole from the Gram of every
    piece on it (:meth:`SetStrategies.whole`). Either way its column sets' coefficients (in ``sets``) are
    recomputed for the chosen strategy, in place, and its matrices added to ``cols.strategies``. Returns
    (the residual set of each column set, one column set per residual set, log v per residual set, the
    strategy id of each set's attributes, the strategy names, {residual set: (BᵀB)⁺ over its cells} of the
    sets solved whole, whether any set was merged or solved whole), residual sets in (size, attributes)
    order. ``column_names``: a column's strategy where it is not its type's ("<type>:<n>")."""
    rows, size = sets.rows, sets.size
    c, width = rows.shape
    real = cols.real[rows]
    order = np.lexsort([real[:, k] for k in range(width - 1, -1, -1)] + [size])
    new = np.ones(c, dtype=bool)
    new[1:] = np.any(real[order][1:] != real[order][:-1], axis=1) | (size[order][1:] != size[order][:-1])
    r_of_u = np.empty(c, dtype=np.int64)
    r_of_u[order] = np.cumsum(new) - 1
    first = order[new]
    chosen = SetStrategies(cols, n, sets, pair_grams)
    pair_col = cols.kind >= len(ATTRIBUTE_TYPES)  # a 2-way type's column: its sets are all solved whole
    ids = np.array(
        [
            -1 if col == n.size or pair_col[col] else chosen.name_id(_column_name(cols, n, column_names, col))
            for col in range(cols.real.size)
        ],
        dtype=np.int32,
    )
    set_ids = ids[rows[first]]
    groups = np.split(order, np.flatnonzero(new)[1:])
    has_pair = pair_col[rows].any(axis=1)
    mixed = np.diff(np.flatnonzero(np.append(new, True))) > 1
    whole = np.zeros(len(groups), dtype=bool)
    whole[np.unique(r_of_u[has_pair])] = True
    solved: dict[int, np.ndarray] = {}
    for r in np.flatnonzero(mixed | whole).tolist():
        members = groups[r]
        cover = rows[members, : int(size[members[0]])]
        if whole[r]:
            solved[r] = chosen.whole(members, cover, set_ids[r], has_pair)
        else:
            chosen.kronecker(members, cover, set_ids[r])
    log_v = _grouped_lse((sets.log_lo + sets.lse_a)[order], np.flatnonzero(new))
    res_ids = set_ids[np.arange(width)[None, :] < size[first][:, None]].astype(np.int32)
    if np.any(res_ids < 0):
        raise PlanError("internal: a residual set's attribute has no strategy")
    return r_of_u, first, log_v, res_ids, list(chosen.names), solved, bool(np.any(mixed | whole))


def _column_name(cols: _Columns, n, column_names, col: int) -> str:
    """The strategy a column is measured through: its type's ("<type>:<n>"), or RP+'s split of it."""
    if column_names and col in column_names:
        return column_names[col]
    return f"{QUERY_TYPES[int(cols.kind[col])]}:{int(n[cols.real[col]])}"


def _refuse_large(parts: Parts, log_size: np.ndarray, what: str, advice: str) -> None:
    """PlanError naming the first marginal whose size (cells or answers, as logs) passes
    MAX_MARGINAL_CELLS: ``what`` says which, with a {} for the size."""
    big = np.flatnonzero(log_size > math.log(MAX_MARGINAL_CELLS) + 1e-9)
    if big.size:
        j = int(big[0])
        attrs = tuple(parts.padded_a[j, : parts.sizes[j]].tolist())
        raise PlanError(
            f"workload.{j} {_label(attrs, parts.names)} {what.format(math.exp(log_size[j]))} "
            f"{MAX_MARGINAL_CELLS:,} (coarsen the attributes' bins or {advice})"
        )


def _label(attrs: tuple[int, ...], names: list[str] | None) -> str:
    if names is None:
        return str(attrs)
    return "(" + ", ".join(names[i] for i in attrs) + ")"


def _max_variance(log_sigma2_0, res: _Residuals, pair_marg, cells_log, weights, two_rho):
    """min_u max_A w_A Var_A(u) subject to Σ q_S/u_S = 2ρ (q_S: the charged squared sensitivity), as the
    convex program
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

    c = res.log_p.size
    m = cells_log.size
    q = np.exp(res.log_q - log_sigma2_0)
    q = q / q.sum()
    log_m = np.log(weights)[pair_marg] + (res.log_p + 2.0 * res.log_n_sum + log_sigma2_0)[res.of_pair]
    log_m -= 2.0 * cells_log[pair_marg]
    vals = np.exp(log_m - np.max(log_m))
    mat = sp.csr_matrix((vals, (pair_marg, res.of_pair)), shape=(m, c))
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
    log_cost = _lse(res.log_q - log_u)
    log_u = log_u + log_cost - math.log(two_rho)
    return log_u, {
        "solver": problem.solver_stats.solver_name,
        "status": problem.status,
        "seconds": round(elapsed, 3),
        "variables": int(c),
        "constraints": int(m),
    }
