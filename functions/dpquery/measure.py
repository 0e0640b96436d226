"""Measure residual sets: y_S = E_S x_S + N(0, σ_S² I), with the noise from OpenDP's Gaussian mechanism.

**The residual transform.** ``E_n`` (:func:`contrasts`) is the (n−1)×n Helmert contrast matrix: row k
(1-based) is (1, …, 1, −k, 0, …, 0)/√(k(k+1)) with k ones, so its rows are orthonormal and orthogonal to
the all-ones vector, and E_nᵀE_n = I − J/n. ``E_S = ⊗_{i∈S} E_{n_i}`` is applied mode-wise to the marginal
x_S (one small matrix product per axis, :func:`residual`); the Kronecker product is never formed.

**Sensitivity.** Adding or removing one record changes x_S by ±e_j, so E_S x_S moves by the j-th column of
E_S, whose squared norm is ∏_{i∈S}(1 − 1/n_i) = p_S for every j. The L2 sensitivity is √p_S, passed to
OpenDP rounded *up* (:func:`l2_sensitivity` checks it against the exact rational p_S).

**The sampler.** ``opendp.measurements.make_gaussian`` on ``vector_domain(atom_domain(T=float, nan=False),
size=k)`` with ``l2_distance(T=float)`` and output measure zero-concentrated divergence. OpenDP samples
the float vector Gaussian from a discrete Gaussian on a 2^k grid (exact arithmetic, a CSPRNG), which
defeats the floating-point attacks on textbook samplers (Mironov 2012; Haney et al. 2022); the rounding to
the grid is charged in its privacy map, so ``meas.map(√p_S)`` exceeds the ideal p_S/(2σ_S²) by a few ulps.
That map value is what we record and what the ledger spends. The constructor needs OpenDP's ``contrib``
feature (components whose proofs are written but not yet vetted by OpenDP's review); no
``floating-point`` or ``honest-but-curious`` feature is needed for this mechanism in 0.16. numpy's random
generator is never used here (a test lints this module for it).

Before any noise is drawn for a set, its map value is checked against the plan's ρ_S; since the plan
allocates ρ·(1 − RHO_SLACK), per-set maps within ρ_S·(1 + RHO_SLACK/10) keep the job's total within its
reserved ρ.

**Privacy unit.** With at most k rows per person (:mod:`functions.dpquery.unit`), x_S moves by at most
k unit vectors, so by the triangle inequality E_S x_S moves by at most k·√p_S (derivation there).

**Floating point: the rounding is charged.** x_S is exact (int64 counts, each ≤ N ≤ 2⁵³, so exact in
float64); ỹ = fl(Ẽ_S x_S) is what is released, with Ẽ the computed contrasts. Let u = 2⁻⁵³ and
γ_m = m·u/(1 − m·u) (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1). Every entry of Ẽ_n is
one square root and one division (and a product by the exact k) away from E_n: |Ẽ_n − E_n| ≤ γ_2|E_n|.
One axis is a matrix product with inner dimension n, in any summation order (BLAS, FMA):
|fl(Ẽ_n y) − Ẽ_n y| ≤ γ_n|Ẽ_n||y|, so |fl(Ẽ_n y) − E_n y| ≤ γ_{n+2}|E_n||y|. Applied axis after axis to
the exact chain, the errors compound to

    |ỹ − E_S x_S| ≤ η_S · (⊗_{i∈S}|E_{n_i}|) x_S   elementwise,   η_S = ∏_{i∈S}(1 + γ_{n_i+2}) − 1.

For x ≥ 0 with ‖x‖₁ ≤ N, ‖(⊗|E_i|) x‖₂ ≤ N · (largest column norm of ⊗|E_i|) = N·√p_S (a column of |E|
has the norm of the column of E). So ‖ỹ(x) − E_S x‖₂ ≤ η_S·N·√p_S for each dataset, and for neighbours

    ‖ỹ(x) − ỹ(x')‖₂ ≤ ‖E_S(x − x')‖₂ + 2·η_S·N·√p_S ≤ √p_S · (k + 2·η_S·N) = Δ_S.

N is a PUBLIC bound on the rows counted (the spec's ``max_rows_total``, default
:data:`functions.dpquery.spec.DEFAULT_MAX_ROWS_TOTAL`; prepare refuses a dataset that may hold more, before
any budget is spent). :func:`charged_sensitivity` gives Δ_S rounded up (exact rational arithmetic on
η_S); the planner plans with q_S = Δ_S² (:func:`charge_factor` in float64, vectorised) and this module
passes d_in = Δ_S to OpenDP's map. At N = 10⁹ per cell of a 10×10 marginal (N = 10¹¹) the charge raises
Δ by 2·η·N ≈ 5·10⁻⁴ relative, against a measured excess of ~10⁻⁷: a worst-case bound, not an estimate.
The 0-way set (the total) is exact (η = 0).

**The test seam.** :func:`measure_sets` takes ``noise=False`` to return y_S exactly (sampler id ``"none"``,
map 0). No handler passes it and no spec field reaches it: the tests call the pure core directly or patch
the core function in-process.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from importlib.metadata import version

import numpy as np

from shardfold.functions.errors import PlanError

FORMAT_VERSION = 1
# A set's map may exceed its planned ρ_S by at most this much (relative): a tenth of the plan's slack.
MAP_RTOL = 1e-10
NO_NOISE_SAMPLER = "none (test seam: noise disabled)"
_TRAILER_LEN = struct.Struct("<Q")


@lru_cache(maxsize=1)
def _opendp():
    import opendp.prelude as dp

    dp.enable_features("contrib")
    return dp


@lru_cache(maxsize=1)
def sampler_id() -> str:
    """What drew the noise: the OpenDP version and mechanism (recorded with every measurement)."""
    return (
        f"opendp {version('opendp')} make_gaussian(vector_domain(atom_domain(T=f64, nan=false)), "
        "l2_distance(T=f64)) -> ZeroConcentratedDivergence"
    )


# --- the residual transform ---------------------------------------------------------------------------------


@lru_cache(maxsize=256)
def contrasts(n: int) -> np.ndarray:
    """E_n: (n−1)×n Helmert contrasts, orthonormal rows orthogonal to 1 (read-only)."""
    if n < 2:
        raise PlanError(f"a domain needs at least 2 values, got {n}")
    k = np.arange(1, n, dtype=np.float64)
    e = np.zeros((n - 1, n), dtype=np.float64)
    mask = np.arange(n)[None, :] < k[:, None]
    e[mask] = np.repeat(1.0 / np.sqrt(k * (k + 1.0)), np.arange(1, n))
    e[np.arange(n - 1), np.arange(1, n)] = -k / np.sqrt(k * (k + 1.0))
    e.setflags(write=False)
    return e


def mode_product(mats: Sequence[np.ndarray], x: np.ndarray) -> np.ndarray:
    """(⊗ mats) x for ``x`` with one axis per factor, one matrix product per axis in axis order (the
    Kronecker product is never formed; the rounding analysis above assumes this order). Shaped result."""
    y = np.asarray(x, dtype=np.float64)
    for axis, m in enumerate(mats):
        y = np.moveaxis(np.tensordot(m, y, axes=([1], [axis])), 0, axis)
    return y


def residual(x: np.ndarray) -> np.ndarray:
    """E_S x_S for a marginal ``x`` (one axis per attribute of S): apply E_{n_a} along every axis a.
    Returns the (∏(n_i−1),) vector in C order; a 0-d ``x`` (the total) gives a 1-vector."""
    x = np.asarray(x, dtype=np.float64)
    y = mode_product([contrasts(n) for n in x.shape], x)
    return np.ascontiguousarray(y).reshape(-1)


def l2_sensitivity(sizes: Sequence[int]) -> float:
    """√p_S, p_S = ∏(n_i−1)/n_i, as the smallest float whose square is ≥ the exact rational p_S."""
    return sqrt_up(_p_exact(sizes))


def _p_exact(sizes: Sequence[int]) -> Fraction:
    p = Fraction(1)
    for n in sizes:
        p *= Fraction(int(n) - 1, int(n))
    return p


def sqrt_up(q: Fraction) -> float:
    """The smallest float whose square is ≥ the rational ``q``."""
    d = math.sqrt(float(q))
    while Fraction(d) ** 2 < q:
        d = math.nextafter(d, math.inf)
    return d


UNIT_ROUNDOFF = Fraction(1, 2**53)


def gamma(m: int) -> Fraction:
    """γ_m = m·u/(1 − m·u), exactly: the relative rounding bound of a sum of m products (Higham §3.1)."""
    return int(m) * UNIT_ROUNDOFF / (1 - int(m) * UNIT_ROUNDOFF)


def rounding_eta(sizes: Sequence[int]) -> Fraction:
    """η_S = ∏_{i∈S}(1 + γ_{n_i+2}) − 1, exactly (the relative worst-case rounding of the transform)."""
    prod = Fraction(1)
    for n in sizes:
        prod *= 1 + gamma(int(n) + 2)
    return prod - 1


def charged_sensitivity(sizes: Sequence[int], unit_rows: int = 1, rows_bound: int | None = None) -> float:
    """Δ_S = √p_S·(k + 2·η_S·N), rounded up: the L2 sensitivity of the computed measurement of S when a
    person contributes at most ``unit_rows`` (k) rows and at most ``rows_bound`` (N) rows are counted.
    ``rows_bound=None`` charges no rounding (the exact transform; tests and bare plans only)."""
    c = Fraction(int(unit_rows))
    if rows_bound is not None and sizes:
        c += 2 * rounding_eta(sizes) * int(rows_bound)
    return sqrt_up(_p_exact(sizes) * c * c)


def charged_norm(mats: Sequence[np.ndarray], unit_rows: int = 1, rows_bound: int | None = None) -> float:
    """The L2 sensitivity of the computed fl((⊗B_i) x) for one person's rows, rounded up: the largest column
    norm of ⊗B_i (∏ of each factor's, exactly in rationals, from the float matrices used) times k + 2·η·N,
    η = ∏(1 + γ_{n_i}) − 1 for the mode-wise products (the derivation above, with B_i for E_{n_i}: the
    matrices' own entries are exact here, so no +2 for rounding the contrasts). QuerySmasher's measurement
    (:mod:`functions.dpquery.smasher`)."""
    sq = Fraction(1)
    eta = Fraction(1)
    for b in mats:
        sq *= max(_exact_square_norm(b[:, j]) for j in range(b.shape[1]))
        eta *= 1 + gamma(b.shape[1])
    c = Fraction(int(unit_rows))
    if rows_bound is not None and mats:
        c += 2 * (eta - 1) * int(rows_bound)
    return sqrt_up(sq * c * c)


def _exact_square_norm(column: np.ndarray) -> Fraction:
    """Σ v² over the column, exactly: each float is n/d with d a power of two, so over the largest d every
    term is an integer (a sum of Python ints, ~20× faster than of Fractions: a dense 2-way strategy has
    millions of entries)."""
    ratios = [v.as_integer_ratio() for v in column.tolist() if v]
    if not ratios:
        return Fraction(0)
    den = max(d for _, d in ratios)
    return Fraction(sum((n * (den // d)) ** 2 for n, d in ratios), den * den)


def charge_factor(log_gamma_sum: np.ndarray, unit_rows: int, rows_bound: int | None) -> np.ndarray:
    """c_S = k + 2·η_S·N in float64, from Σ_{i∈S} log1p(γ_{n_i+2}) per set (the planner's vector form of
    :func:`charged_sensitivity`; it may fall below the exact value by a few ulps, which the plan's ρ
    slack absorbs)."""
    c = np.full(np.shape(log_gamma_sum), float(unit_rows))
    if rows_bound is not None:
        c = c + 2.0 * np.expm1(log_gamma_sum) * float(rows_bound)
    return c


def log1p_gamma(n: np.ndarray, plus: int = 2) -> np.ndarray:
    """log(1 + γ_{n+plus}) per domain size (float64): γ_{n+2} for the contrasts (:func:`rounding_eta`),
    γ_n for matrices whose entries are charged exactly (:func:`charged_norm`)."""
    m = np.asarray(n, dtype=np.float64) + float(plus)
    u = 2.0**-53
    return np.log1p(m * u / (1.0 - m * u))


# --- the sampler -------------------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def gaussian(size: int, scale: float):
    """OpenDP's Gaussian mechanism on float vectors of length ``size`` with noise std ``scale``."""
    dp = _opendp()
    domain = dp.vector_domain(dp.atom_domain(T=float, nan=False), size=int(size))
    return dp.m.make_gaussian(domain, dp.l2_distance(T=float), scale=float(scale))


def privacy_map(size: int, scale: float, d_in: float) -> float:
    """The sampler's own zCDP cost ρ of releasing a vector of L2 sensitivity ``d_in``."""
    return float(gaussian(size, scale).map(d_in))


def release(y: np.ndarray, scale: float, d_in: float) -> tuple[np.ndarray, float]:
    """y + N(0, scale² I) drawn by OpenDP, and the mechanism's map value at ``d_in``."""
    meas = gaussian(y.size, scale)
    rho = float(meas.map(d_in))
    return np.asarray(meas(y), dtype=np.float64), rho


# --- measuring a group of residual sets ---------------------------------------------------------------------


@dataclass(frozen=True)
class SetSpec:
    """One residual set to measure: its index, attributes, domain sizes, noise std and planned ρ_S."""

    index: int
    attrs: tuple[int, ...]
    sizes: tuple[int, ...]
    scale: float
    rho_planned: float
    unit_rows: int = 1  # k, the privacy unit's rows per person
    rows_bound: int | None = None  # N, the public bound on rows counted (None: rounding not charged)
    mats: tuple[np.ndarray, ...] | None = None  # B_i per attribute (general queries); None: the contrasts
    flat: bool = False  # mats is one matrix over the marginal's cells, C order (a set solved whole)


def measure_sets(
    sets: Sequence[SetSpec],
    marginal: Callable[[tuple[int, ...]], np.ndarray],
    *,
    noise: bool = True,
) -> tuple[np.ndarray, list[dict]]:
    """Measure every set: transform its marginal (``marginal(attrs)``), check the sampler's map against
    the plan, add OpenDP noise. Returns the concatenated measurements (in ``sets`` order) and one record
    per set: ``{"index", "scale", "d_in", "rho"}`` (``rho``: the sampler's map value).

    ``noise=False`` is the tests' seam (exact y_S, map 0); nothing in a job passes it."""
    out = []
    records = []
    norms: dict[tuple, float] = {}  # sets measured through the same matrices: their exact norm once
    for s in sets:
        x = marginal(s.attrs)
        if x.shape != s.sizes:
            raise PlanError(f"internal: marginal of {s.attrs} has shape {x.shape}, expected {s.sizes}")
        if s.mats is None:
            y = residual(x)
            d_in = charged_sensitivity(s.sizes, s.unit_rows, s.rows_bound)
        else:
            if s.flat:
                y = s.mats[0] @ x.reshape(-1).astype(np.float64)
            else:
                y = np.ascontiguousarray(mode_product(s.mats, x)).reshape(-1)
            key = (*map(id, s.mats), s.unit_rows, s.rows_bound)
            if key not in norms:
                norms[key] = charged_norm(s.mats, s.unit_rows, s.rows_bound)
            d_in = norms[key]
        if noise:
            cost = privacy_map(y.size, s.scale, d_in)
            if not cost <= s.rho_planned * (1.0 + MAP_RTOL):
                raise PlanError(
                    f"residual set {s.index}: the sampler's privacy map {cost!r} exceeds the planned "
                    f"{s.rho_planned!r}; no noise was drawn"
                )
            noisy, rho = release(y, s.scale, d_in)
        else:
            noisy, rho = y, 0.0
        out.append(noisy)
        records.append({"index": s.index, "scale": s.scale, "d_in": d_in, "rho": rho})
    values = np.concatenate(out) if out else np.zeros(0, dtype=np.float64)
    return values, records


# --- the measurement object ---------------------------------------------------------------------------------


def encode(values: np.ndarray, meta: dict) -> bytes:
    """Payload (float64 little-endian, sets in order) + JSON trailer + trailer length (8 bytes, LE)."""
    trailer = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    return values.astype("<f8").tobytes() + trailer + _TRAILER_LEN.pack(len(trailer))


def decode_trailer(tail: bytes) -> dict:
    """The metadata from the bytes that follow the payload (trailer + its length)."""
    (n,) = _TRAILER_LEN.unpack(tail[-_TRAILER_LEN.size :])
    if n != len(tail) - _TRAILER_LEN.size:
        raise ValueError("measurement trailer length does not match")
    return json.loads(tail[:n])


def decode_values(payload: bytes) -> np.ndarray:
    return np.frombuffer(payload, dtype="<f8").astype(np.float64)
