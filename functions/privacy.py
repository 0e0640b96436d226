"""Privacy accounting: conversions between ρ-zCDP and (ε, δ)-DP. Pure, stdlib only.

Shared by the kinds that release through a Gaussian mechanism (a dpquery release, a DP-FedAvg round) and
by the budget ledger (:mod:`functions.ledger`). Such a release is one (correlated) Gaussian mechanism, so
three (ε, δ) statements can be made about it:

* :func:`cdp_eps` / :func:`cdp_rho` / :func:`cdp_delta` — the Canonne–Kamath–Steinke bound (arXiv:2004.00010,
  Prop. 12) for *any* ρ-zCDP mechanism: δ = inf_{α>1} exp((α−1)(αρ−ε)) / (α−1) · (1 − 1/α)^α. The budget
  ``{"epsilon", "delta"}`` of a spec is converted with :func:`cdp_rho`, and the ledger only ever counts ρ.
* :func:`gaussian_eps` / :func:`gaussian_delta` — the exact privacy curve of a Gaussian mechanism with
  μ = √(2ρ) (Balle–Wang 2018): δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2). Tightest, and exact for continuous
  noise; it assumes the whole release is *one* Gaussian mechanism (true for a single dpquery job, not for
  the composition of several jobs through the ledger, for which the CKS value is the statement to use).
* :func:`simple_eps` — ε = ρ + 2√(ρ ln(1/δ)), the classic loose bound (for comparison only).

Every inversion is a bisection that returns the *conservative* end: :func:`cdp_eps` and :func:`gaussian_eps`
never under-state ε, :func:`cdp_rho` never over-states the ρ an (ε, δ) budget allows.
"""

from __future__ import annotations

import math

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
# The largest ρ (and ε) a job may spend. Far beyond any privacy worth accounting (ε ~ ρ), and the noise
# plan and the ε reports are float64 arithmetic checked up to it (2ρ overflows near 9e307; the analytic
# Gaussian's tail series near 1e77).
MAX_RHO = 1e6
# The smallest budget a job may spend: below it the noise's scale leaves float64 (ρ = 5e-324 made OpenDP
# refuse an infinite scale mid-job, after the budget was reserved); such noise would drown any answer.
MIN_RHO = 1e-12
# The δ at which a release's ε is reported when its budget is a plain ρ (a dpquery job, a DP-FedAvg round).
REPORT_DELTA = 1e-9


def _check_rho(rho: float) -> None:
    if not (rho >= 0 and math.isfinite(rho)):
        raise ValueError(f"rho must be a finite number >= 0, got {rho}")


def _check_delta(delta: float) -> None:
    if not (0 < delta < 1):
        raise ValueError(f"delta must lie in (0, 1), got {delta}")


def _check_eps(eps: float) -> None:
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"epsilon must be a finite number >= 0, got {eps}")


def _bisect(lo: float, hi: float, lo_ok, max_iter: int = 2000) -> tuple[float, float]:
    """Shrink [lo, hi] keeping ``lo_ok(lo)`` true and ``lo_ok(hi)`` false, to adjacent floats."""
    for _ in range(max_iter):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if lo_ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def cdp_delta(rho: float, eps: float) -> float:
    """δ such that ρ-zCDP implies (ε, δ)-DP, by the CKS bound (the optimal α found by bisection).

    Any α > 1 gives a valid δ, so an imprecise search can only over-state δ (still valid).
    """
    _check_rho(rho)
    _check_eps(eps)
    if rho == 0:
        return 0.0
    # The derivative in α of the log of the bound is (2α−1)ρ − ε + log(1 − 1/α); it increases in α.
    amin = 1.01  # the optimum is >= (1 + ε/ρ)/2; below 1.01 is not an interesting regime (δ near 1)
    amax = (eps + 1.0) / (2.0 * rho) + 2.0

    def left_of_optimum(alpha: float) -> bool:
        return (2.0 * alpha - 1.0) * rho - eps + math.log1p(-1.0 / alpha) < 0

    amin, amax = _bisect(amin, amax, left_of_optimum)
    alpha = 0.5 * (amin + amax)
    log_delta = (alpha - 1.0) * (alpha * rho - eps) + alpha * math.log1p(-1.0 / alpha) - math.log(alpha - 1.0)
    return min(math.exp(min(log_delta, 0.0)), 1.0)


def cdp_eps(rho: float, delta: float) -> float:
    """The smallest ε (up to float precision, rounded up) with ρ-zCDP ⇒ (ε, δ)-DP by the CKS bound."""
    _check_rho(rho)
    _check_delta(delta)
    if rho == 0:
        return 0.0
    lo, hi = _bisect(0.0, simple_eps(rho, delta), lambda e: cdp_delta(rho, e) > delta)
    return hi


def cdp_rho(eps: float, delta: float) -> float:
    """The largest ρ (rounded down) such that ρ-zCDP ⇒ (ε, δ)-DP by the CKS bound."""
    _check_eps(eps)
    _check_delta(delta)
    if eps == 0:
        return 0.0
    lo, hi = _bisect(0.0, eps + 1.0, lambda r: cdp_delta(r, eps) <= delta)
    return lo


def simple_eps(rho: float, delta: float) -> float:
    """ε = ρ + 2√(ρ ln(1/δ)) (Bun–Steinke): valid, but looser than :func:`cdp_eps`."""
    _check_rho(rho)
    _check_delta(delta)
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def log_ndtr(x: float) -> float:
    """log Φ(x) for the standard normal CDF, accurate in the far lower tail (no scipy needed)."""
    if x > -30.0:
        return math.log(0.5 * math.erfc(-x / math.sqrt(2.0)))
    # Asymptotic series of the Mills ratio: Φ(x) = φ(x)/|x| · (1 − 1/x² + 3/x⁴ − 15/x⁶ + 105/x⁸ − …).
    x2 = x * x
    series = 1.0 - 1.0 / x2 + 3.0 / x2**2 - 15.0 / x2**3 + 105.0 / x2**4
    return -0.5 * x2 - _LOG_SQRT_2PI - math.log(-x) + math.log(series)


def gaussian_delta(rho: float, eps: float) -> float:
    """The exact δ(ε) of a Gaussian mechanism with μ = √(2ρ) (Balle–Wang analytic Gaussian curve)."""
    _check_rho(rho)
    _check_eps(eps)
    if rho == 0:
        return 0.0
    mu = math.sqrt(2.0 * rho)
    la = log_ndtr(-eps / mu + mu / 2.0)
    lb = log_ndtr(-eps / mu - mu / 2.0)
    # Φ(a) − e^ε Φ(b) = Φ(a) (1 − e^{ε + log Φ(b) − log Φ(a)}), without cancellation.
    return max(0.0, math.exp(la) * -math.expm1(min(eps + lb - la, 0.0)))


def gaussian_eps(rho: float, delta: float) -> float:
    """The smallest ε (rounded up) with δ(ε) ≤ δ on the exact Gaussian curve of μ = √(2ρ)."""
    _check_rho(rho)
    _check_delta(delta)
    if rho == 0 or gaussian_delta(rho, 0.0) <= delta:
        return 0.0
    lo, hi = _bisect(0.0, simple_eps(rho, delta), lambda e: gaussian_delta(rho, e) > delta)
    return hi
