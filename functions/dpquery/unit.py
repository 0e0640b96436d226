"""The privacy unit of ``dpquery``: contribution bounding to at most k rows per person, and the sensitivity
it implies. Pure: numpy and pyarrow only.

**Why.** By default one row is one person (neighbouring datasets differ by one row). On visit or transaction
data one person has many rows, and adding or removing that person changes the histogram by as many rows, so
the stated ρ would protect no one. With ``privacy_unit: {"id_column": c, "max_rows": k}`` the job keeps at
most k rows of every distinct value of column ``c`` (a person), and neighbouring datasets differ by adding
or removing one *person* with all of their rows.

**The choice is data-independent.** For a person with c rows, occurrence j (0-based, in file order among
THAT person's rows) gets the priority h(j) = mix64(key ⊕ j), with key = BLAKE2b(id text; keyed by the job's
seed) and mix64 the SplitMix64 finalizer (a bijection of 64-bit words, so distinct j never tie). The k
occurrences of smallest priority are kept (all of them when c ≤ k). The kept set of a person is therefore a
function of the job seed, the person's id and the person's own row count only: adding or removing another
person changes nothing about it (the global row positions would; they are never used). The seed comes from
the job id, never from the data, so every measure task of a job keeps the same rows. The seed need not be
secret: the bound below holds for every fixed seed.

**Sensitivity (the derivation the planner and measure rely on).** Let x be the bounded histogram of a
marginal and x' the one without person P. P contributes r ≤ k rows, so x − x' = Σ_{t=1}^{r} e_{j_t}
(cells j_t, repeats allowed). For a residual set S the released vector is E_S x_S with every column of E_S
of L2 norm √p_S (:mod:`functions.dpquery.measure`), so by the triangle inequality

    ‖E_S (x_S − x'_S)‖₂ ≤ Σ_t ‖E_S e_{j_t}‖₂ = r·√p_S ≤ k·√p_S,

with equality when all k rows fall in one cell (spread over distinct cells it is √k·√p_S or less; the
worst case is what we charge). No other person's kept rows change, so the L2 sensitivity of measurement S
is k·√p_S: k times the one-row value, for every S, whether or not the sets share rows. The joint release
{E_S x_S + N(0, σ_S² I)} then costs ρ = Σ_S k² p_S / (2σ_S²). The planner charges exactly that: it plans
with the privacy coefficient q_S = k² p_S (:mod:`functions.dpquery.planner`), which multiplies every noise
std by k at the same ρ; measure passes d_in = k·√p_S (plus the rounding term) to OpenDP's map.

**Memory.** Pass 1 (over the id column) keeps a dict from each distinct id (its text) to a code, the
per-code row count and a 64-bit key: about :data:`BYTES_PER_ID` bytes per distinct id, which the plan
cannot know in advance (it is data; :mod:`functions.dpquery.sizing` states it). Persons with more than k
rows also keep their k chosen occurrence indices (8·k bytes each). Choosing scans a heavy person's
occurrences in blocks of :data:`CHOOSE_BLOCK`, so one person with 10⁸ rows needs O(block), not O(rows).
A row with no id (null or empty) names no person and is not counted: leaving it out depends on that row
alone, as the out-of-domain policy ``drop`` does (:mod:`functions.dpquery.data`), and never fails the job.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardfold.functions.errors import DatasetError

BYTES_PER_ID = 200  # Python str + dict entry + count + key, for an id of ~20 characters (estimate)
CHOOSE_BLOCK = 1 << 20
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def job_seed(job_id: str) -> bytes:
    """The 32-byte seed of the job's contribution bounding (from the job id only)."""
    return hashlib.sha256(b"shardfold/dpquery/privacy-unit/" + job_id.encode()).digest()


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on uint64 words: a bijection, so distinct inputs give distinct outputs."""
    z = np.asarray(x, dtype=np.uint64).copy()
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= _M1
        z ^= z >> np.uint64(27)
        z *= _M2
        z ^= z >> np.uint64(31)
    return z


def id_key(seed: bytes, ident: str) -> int:
    """The person's 64-bit key: BLAKE2b of the id text, keyed by the job seed."""
    return int.from_bytes(hashlib.blake2b(ident.encode(), digest_size=8, key=seed[:32]).digest(), "little")


def choose(key: int, count: int, k: int) -> np.ndarray:
    """The kept occurrence indices (sorted) of a person with ``count`` rows: the k of smallest priority
    mix64(key ⊕ j), j < count. Depends on (key, count, k) only."""
    if count <= k:
        return np.arange(count, dtype=np.int64)
    best_h = np.zeros(0, dtype=np.uint64)
    best_j = np.zeros(0, dtype=np.int64)
    kw = np.uint64(key)
    for start in range(0, count, CHOOSE_BLOCK):
        j = np.arange(start, min(count, start + CHOOSE_BLOCK), dtype=np.int64)
        h = mix64(j.astype(np.uint64) ^ kw)
        h = np.concatenate([best_h, h])
        j = np.concatenate([best_j, j])
        if h.size > k:
            part = np.argpartition(h, k - 1)[:k]
            h, j = h[part], j[part]
        best_h, best_j = h, j
    return np.sort(best_j)


def _id_text(column: pa.Array | pa.ChunkedArray, name: str) -> pa.Array:
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if not (pa.types.is_string(arr.type)):
        try:
            arr = pc.cast(arr, pa.string())
        except pa.ArrowException:
            raise DatasetError(
                f"privacy_unit.id_column {name!r} has type {arr.type}, which cannot be read as an id; "
                "store it as text or integers",
                column=name,
            ) from None
    return arr


class ContributionBound:
    """At most ``max_rows`` rows per distinct value of ``id_column``, chosen by the job's ``seed``.

    Use: :meth:`count` every batch of the id column in file order (pass 1), then :meth:`finish`, then
    :meth:`keep` every batch again in the same order (pass 2): a boolean mask of the rows to count."""

    def __init__(self, id_column: str, max_rows: int, seed: bytes):
        if max_rows < 1:
            raise ValueError("max_rows must be >= 1")
        self.id_column = id_column
        self.k = int(max_rows)
        self.seed = seed
        self._codes: dict[str, int] = {}
        self._keys: list[int] = []
        self._counts = np.zeros(0, dtype=np.int64)
        self._chosen: np.ndarray | None = None  # (heavy persons, k) sorted occurrence indices
        self._heavy_rank: np.ndarray | None = None  # code -> row of _chosen, −1 when all rows are kept
        self._seen: np.ndarray | None = None

    # -- both passes ------------------------------------------------------------------------------------
    def _encode(self, column, grow: bool) -> np.ndarray:
        """Global code of every row's id (−1 for a missing one, −2 for one pass 1 never saw); pass 1 assigns
        codes to new ids."""
        text = _id_text(column, self.id_column)
        text = pc.if_else(pc.equal(pc.utf8_length(text), 0), pa.scalar(None, pa.string()), text)
        enc = pc.dictionary_encode(text)
        values = enc.dictionary.to_pylist()
        if grow:
            for v in values:
                if v not in self._codes:
                    self._codes[v] = len(self._codes)
                    self._keys.append(id_key(self.seed, v))
        lookup = np.fromiter((self._codes.get(v, -2) for v in values), dtype=np.int64, count=len(values))
        idx = enc.indices
        local = idx.to_numpy(zero_copy_only=False)
        if idx.null_count:
            valid = np.asarray(pc.is_valid(idx).to_numpy(zero_copy_only=False), dtype=bool)
            local = np.where(valid, np.nan_to_num(local, nan=0), 0).astype(np.int64)
            codes = lookup[local] if lookup.size else np.zeros(local.size, dtype=np.int64)
            codes[~valid] = -1
            return codes
        return lookup[local.astype(np.int64)]

    # -- pass 1 ---------------------------------------------------------------------------------------------
    def count(self, column) -> None:
        codes = self._encode(column, grow=True)
        bad = codes < 0  # no id: never counted
        n = len(self._codes)
        if self._counts.size < n:
            self._counts = np.concatenate([self._counts, np.zeros(n - self._counts.size, dtype=np.int64)])
        self._counts += np.bincount(codes[~bad], minlength=n)

    def finish(self) -> None:
        """Choose the kept occurrences of every person with more than k rows."""
        heavy = np.flatnonzero(self._counts > self.k)
        rank = np.full(self._counts.size, -1, dtype=np.int64)
        rank[heavy] = np.arange(heavy.size)
        chosen = np.empty((heavy.size, self.k), dtype=np.int64)
        for r, code in enumerate(heavy.tolist()):
            chosen[r] = choose(self._keys[code], int(self._counts[code]), self.k)
        self._chosen, self._heavy_rank = chosen, rank
        self._seen = np.zeros(self._counts.size, dtype=np.int64)

    # -- pass 2 ---------------------------------------------------------------------------------------------
    def keep(self, column) -> np.ndarray:
        """Which rows of this batch are counted (batches in the same order as pass 1)."""
        if self._chosen is None:
            raise RuntimeError("ContributionBound.keep before finish")
        every = self._encode(column, grow=False)
        if np.any(every == -2):  # an id pass 1 did not see: the dataset changed between the passes
            raise DatasetError(f"column {self.id_column!r} changed while it was read; submit a new job")
        named = every >= 0  # rows with no id are never counted
        mask = np.zeros(every.size, dtype=bool)
        mask[named] = self._keep_named(every[named])
        return mask

    def _keep_named(self, codes: np.ndarray) -> np.ndarray:
        # occurrence index of every row among its person's rows: earlier batches + rank within this one
        order = np.argsort(codes, kind="stable")
        sc = codes[order]
        first = np.ones(sc.size, dtype=bool)
        first[1:] = sc[1:] != sc[:-1]
        starts = np.flatnonzero(first)
        within = np.arange(sc.size) - np.repeat(starts, np.diff(np.append(starts, sc.size)))
        occ = np.empty(sc.size, dtype=np.int64)
        occ[order] = within
        occ += self._seen[codes]
        self._seen += np.bincount(codes, minlength=self._seen.size)
        rank = self._heavy_rank[codes]
        keep = rank < 0
        h = np.flatnonzero(~keep)
        if h.size:
            rows = self._chosen[rank[h]]  # (rows, k), each sorted
            j = occ[h]
            lo = np.zeros(h.size, dtype=np.int64)
            hi = np.full(h.size, self.k, dtype=np.int64)
            while np.any(lo < hi):  # vectorised binary search of j in its person's chosen row
                mid = (lo + hi) // 2
                less = np.take_along_axis(rows, np.minimum(mid, self.k - 1)[:, None], 1)[:, 0] < j
                active = lo < hi
                lo = np.where(active & less, mid + 1, lo)
                hi = np.where(active & ~less, mid, hi)
            at = np.take_along_axis(rows, np.minimum(lo, self.k - 1)[:, None], 1)[:, 0]
            keep[h] = (lo < self.k) & (at == j)
        return keep


def bounded_mask_all(bound: ContributionBound, batches: Iterable) -> list[np.ndarray]:
    """Both passes over in-memory batches of the id column (tests)."""
    batches = list(batches)
    for b in batches:
        bound.count(b)
    bound.finish()
    return [bound.keep(b) for b in batches]


def unit_report(privacy_unit, unit_rows: int, rows_bound: int | None) -> dict:
    """The privacy report's statement of WHO is protected and what sensitivity was charged: the privacy
    unit (one row, or a person of at most k rows of an id column), the neighbouring relation, and the
    public row bound N for which the float64 rounding of the residual transform was charged (Δ_S =
    √p_S·(k + 2·η_S·N), :mod:`functions.dpquery.measure`). Nothing here depends on the data."""
    if privacy_unit is None:
        unit = {"unit": "row", "max_rows": 1}
        neighbouring = "add or remove one record"
    else:
        unit = {"unit": "person", "id_column": privacy_unit.id_column, "max_rows": int(unit_rows)}
        neighbouring = (
            f"add or remove one person (all rows sharing a value of {privacy_unit.id_column!r}); at most "
            f"{unit_rows} rows per person are counted, chosen independently of the data"
        )
    return {
        "neighbouring": neighbouring,
        "privacy_unit": unit,
        "sensitivity": {
            "rows_per_unit": int(unit_rows),
            "rows_bound": rows_bound,
            "rounding": (
                "charged: the L2 sensitivity of each residual set is sqrt(p_S)*(k + 2*eta_S*N), with k the "
                "rows per unit, N the public row bound and eta_S the worst-case float64 rounding of the "
                "transform"
                if rows_bound is not None
                else "not charged (a plan written before the rounding was charged)"
            ),
        },
    }
