"""DP-FedAvg's privacy: the clip factors, OpenDP's Gaussian noise and what one round costs.

**The mechanism** (McMahan et al. 2018, the uniform estimator with a fixed denominator; Flower's
server-side fixed clipping). With Δᵢ = xᵢ − base (the update itself when the spec has no ``base``), clip
norm C, noise multiplier z and denominator m (``expected_clients``, by default the clients listed)::

    cᵢ = min(1, C' / ‖Δᵢ‖₂)        (0 when ‖Δᵢ‖ is NaN or Inf: that client adds nothing)
    out = base + Σᵢ cᵢΔᵢ / m + N(0, σ²I),   σ = z·C/m

over every float tensor of the model at once (‖Δᵢ‖ is one norm over the whole model). Adding or removing
one client moves Σᵢ cᵢΔᵢ/m by at most C/m in L2, so the round is a Gaussian mechanism of L2 sensitivity
C/m and noise σ: ρ = (C/m)²/(2σ²) = 1/(2z²)-zCDP, whatever the model's size or how it is sharded (each shard
draws the noise of its own coordinates; together they are one draw of N(0, σ²I)). Integer and bool tensors
are the base's: nothing of the clients' reaches them.

**The clip margin.** The norm is computed in float64 from per-shard partial sums, and the clipped updates
are summed in float64, so the released sum may differ from the exact one by rounding: at most about
2·N²·u·C over N clients (u = 2⁻⁵³, a sum of N terms of norm ≤ C, for the dataset and its neighbour). So
updates are clipped to C' = C·(1 − :func:`clip_margin`), which leaves that much room: the sensitivity of
what is released stays at most C/m. (``clip_norm`` is at least 1e-12, so a norm's squares do not all
underflow.)

**The noise** comes from OpenDP's ``make_gaussian`` on float vectors (exact discrete Gaussian sampling on a
2^k grid with a CSPRNG, immune to the floating-point attacks on textbook samplers), drawn in blocks of
:data:`NOISE_BLOCK` coordinates, each block its own mechanism. OpenDP charges the rounding to its grid in its
privacy map: a vector of D coordinates costs (d + 2^k·√D)²/(2σ²) at L2 distance d. The blocks of a round
split one neighbour's distance C/m between them, and by Cauchy–Schwarz their maps add up to at most the map
of ONE mechanism over all D float coordinates of the model at C/m: that is what the ledger is charged. The
grid, k = ⌊log₂ σ⌋ − :data:`GRID_BITS` − ⌈log₂ √D⌉, keeps 2^k·√D below σ/2^20, so the charge is
1/(2z²) plus a few parts per million whatever the model's size. OpenDP draws about 40,000–60,000 samples per
second on one core, which the shard sizing allows for. numpy's generator is never used for noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import version

import numpy as np

CLIP_MARGIN = 1e-9  # the norm's own rounding (its partial sums), beside the sum's (clip_margin)
MAX_OPENDP_SIZE = 2**31 - 1  # OpenDP's vector_domain sizes are i32
GRID_BITS = 20
# Samples OpenDP's Gaussian draws per second on one Lambda vCPU (measured 40-60 thousand on this machine's
# cores); the shard sizing keeps a shard's noise within its share of the task timeout.
NOISE_SAMPLES_PER_S = 40_000.0
NOISE_BLOCK = 1 << 16  # elements noised per OpenDP call: its list answer holds ~70 bytes per element
NOISE_BLOCK_BYTES = 80 * NOISE_BLOCK  # what one call holds at its peak (the list, its floats, the copy)


@dataclass(frozen=True)
class Mechanism:
    """One round's noise: the clip norm, the denominator, the noise std and OpenDP's grid exponent."""

    clip_norm: float
    denominator: int
    noise_multiplier: float
    elements: int = 1  # D: the float coordinates the noise is drawn for (the model's float elements)

    @property
    def sigma(self) -> float:
        return self.noise_multiplier * self.clip_norm / self.denominator

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the clipped mean to adding or removing one client."""
        return self.clip_norm / self.denominator

    @property
    def grid(self) -> int:
        root_d = math.ceil(0.5 * math.log2(max(self.elements, 1)))  # ⌈log₂ √D⌉
        return math.floor(math.log2(self.sigma)) - GRID_BITS - root_d

    def rho(self) -> float:
        """The round's zCDP cost: OpenDP's map of one Gaussian mechanism over all D float coordinates at the
        sensitivity, which bounds the sum of its blocks' maps (module docstring). OpenDP's vectors hold at
        most 2³¹ − 1 elements; its rounding term is 2^k·√D, so a larger D is asked as ⌈D/4ʲ⌉ at grid k + j
        (the same term, or a little more)."""
        size, k = max(self.elements, 1), self.grid
        while size > MAX_OPENDP_SIZE:
            size, k = -(-size // 4), k + 1
        return float(_gaussian(size, self.sigma, k).map(self.sensitivity))

    def add_noise(self, mean: np.ndarray) -> None:
        """Add N(0, σ²) to each element of ``mean`` (float64, finite) in place, drawn by OpenDP
        :data:`NOISE_BLOCK` elements at a time (it answers a Python list: ~70 bytes per element)."""
        for lo in range(0, mean.size, NOISE_BLOCK):
            block = mean[lo : lo + NOISE_BLOCK]
            block[:] = _gaussian(block.size, self.sigma, self.grid)(block)


def sampler_id(mech: Mechanism) -> str:
    """What drew the noise (recorded in the result)."""
    return (
        f"opendp {version('opendp')} make_gaussian(vector_domain(atom_domain(T=f64, nan=false)), "
        f"l2_distance(T=f64), scale={mech.sigma!r}, k={mech.grid}) -> ZeroConcentratedDivergence"
    )


@lru_cache(maxsize=64)
def _gaussian(size: int, scale: float, k: int):
    import opendp.prelude as dp

    dp.enable_features("contrib")
    domain = dp.vector_domain(dp.atom_domain(T=float, nan=False), size=int(size))
    return dp.m.make_gaussian(domain, dp.l2_distance(T=float), scale=float(scale), k=k)


def clip_margin(clients: int) -> float:
    """How far below C updates are clipped for a round of ``clients``: the norm's rounding and the float64
    sum's over one client more (module docstring)."""
    return CLIP_MARGIN + 4.0 * (clients + 1) ** 2 * 2.0**-53


def clip_factors(squared_norms: np.ndarray, clip_norm: float) -> np.ndarray:
    """cᵢ = min(1, C'/‖Δᵢ‖) from the squared norms (float64); 0 where a norm is NaN or Inf."""
    sq = np.asarray(squared_norms, dtype=np.float64)
    norms = np.sqrt(sq)
    target = clip_norm * (1.0 - clip_margin(sq.size))
    with np.errstate(divide="ignore", invalid="ignore"):
        factors = np.where(norms > target, target / norms, 1.0)
    factors[~np.isfinite(norms)] = 0.0
    return factors
