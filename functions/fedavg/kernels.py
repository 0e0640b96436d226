"""Numeric reducers: one piece of one tensor, aggregated over N clients fed in fixed client order.

A :class:`Rule` says how a tensor is aggregated (from its dtype and the job's options, see
:func:`rule_for`); a reducer built from it takes each client's values for the piece with ``add(i, x)``
(``i`` = 0, 1, ... in spec order; ``x`` a read-only numpy view of the fetched bytes) and ``finish()`` returns
the piece's output values in the tensor's dtype. Every operation is elementwise in a fixed order, so a
piece's result does not depend on how the tensor was cut into pieces: sharded, chunked and whole-tensor
aggregation are bitwise identical.

Formulas (``acc`` is the accumulator dtype, ``w_i`` the weights and ``W`` their total as ``acc`` scalars):

* mean: ``acc = w_0*x_0``, then ``acc = acc + w_i*x_i`` for i = 1..N-1, then ``acc / W`` (true division)
  and a cast to the output dtype (round to nearest even). Uniform weights: ``w_i = 1``, ``W = N``.
  **Weight scale.** Only the ratios of the weights matter, but a weight cast to ``acc`` as given may underflow
  to 0 (1e-50 in float32: ``0/0`` = NaN everywhere) or overflow. So the weights and ``W`` are first scaled in
  float64 by one power of two (:func:`weight_scale`): none when the largest weight lies in
  :data:`WEIGHT_RANGE` (ordinary weights, e.g. example counts: bit for bit the unscaled formula, Flower's),
  else the one that brings the largest into [1, 2). A power of two is exact, so the mean is the same
  number; only weights below ~2^-126 (float32) lose bits, and next to the largest their terms are noise.
* median: values sorted per coordinate (``np.sort``); odd N: the middle one; even N: ``(lo + hi) / 2``.
* trimmed_mean: sorted per coordinate, ``k`` values dropped at each end, the rest summed in sorted order
  and divided by ``N - 2k``.
* integer rules round the float64 result half to even (``np.rint``) before the cast; ``first`` copies
  client 0; ``max`` is an elementwise maximum in the tensor's own dtype.
* secure_sum (a secure round's masked U32 tensors): ``acc = x_0; acc += x_i`` in uint32 (mod 2³², so the
  masks cancel), then :func:`functions.fedavg.secagg.dequantise` to the float32 mean.

**Output check.** Every mean and robust reducer checks its result finite before the cast to the tensor's
dtype (block by block, in a shared scratch, so no chunk-sized temporary) and records where it is not in
``Reducer.nonfinite``; the caller decides (a non-finite aggregate is an error unless ``allow_nonfinite`` and
the inputs there were not finite).

Memory: a mean reducer holds ``count`` accumulator elements (plus the shared block scratch); a robust one
holds all N clients' values for its piece, ``N x count`` accumulator elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Literal

import numpy as np

from shardfold.functions.fedavg import secagg
from shardfold.functions.fedavg.layout import DType

Method = Literal["mean", "median", "trimmed_mean", "first", "max", "secure_sum"]

BLOCK = 1 << 16  # elements per inner step of the weighted sum (axpy): scratch stays in L2
ALIGN = 64
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
# Weights whose largest lies here are used as given (the plain formula's bits, Flower's): cast to float32 the
# largest weight and the total (any N < 2^63) stay normal and finite. Outside it they are scaled.
WEIGHT_RANGE = (2.0**-64, 2.0**64)


def weight_scale(weights: list[float]) -> int:
    """The power of two ``k`` the weights are multiplied by (``math.ldexp(w, k)``, exact) before any cast
    to an accumulator: 0 when the largest lies in :data:`WEIGHT_RANGE`, else the one that brings it into
    [1, 2)."""
    top = max(weights, default=1.0)
    if WEIGHT_RANGE[0] <= top <= WEIGHT_RANGE[1]:
        return 0
    return 1 - math.frexp(top)[1]  # top = m * 2**e with 0.5 <= m < 1


def weight_total(weights: list[float]) -> float:
    """``sum(weights)`` correctly rounded (``math.fsum``), ``inf`` when it exceeds float64's range (where
    ``math.fsum`` raises OverflowError)."""
    try:
        return math.fsum(weights)
    except OverflowError:
        k = weight_scale(weights)
        try:
            return math.ldexp(math.fsum(math.ldexp(w, k) for w in weights), -k)
        except OverflowError:
            return math.inf


@dataclass(frozen=True)
class Rule:
    """How one tensor is aggregated.

    ``acc``: the dtype values are accumulated/sorted in; ``out``: the tensor's dtype; ``rint``: round half to
    even before the cast (integer and bool tensors); ``as_bool``: read bytes as 0/1 (BOOL).
    """

    method: Method
    acc: np.dtype
    out: np.dtype
    weighted: bool = False
    rint: bool = False
    as_bool: bool = False
    check_finite: bool = False

    def acc_ratio(self, in_itemsize: int) -> float:
        """Accumulator bytes per input byte."""
        return self.acc.itemsize / in_itemsize


SECURE_SUM = Rule("secure_sum", np.dtype(np.uint32), F32)  # every tensor of a secure round


def rule_for(
    dt: DType,
    *,
    aggregator: str,
    uniform: bool,
    accumulate: str,
    integer_policy: str,
    allow_nonfinite: bool,
) -> Rule:
    """The rule for a tensor of dtype ``dt`` under the job's options (see :mod:`functions.fedavg.core`)."""
    robust = aggregator in ("median", "trimmed_mean")
    weighted = aggregator == "mean" and not uniform
    if dt.kind == "float":
        acc = F64 if (accumulate == "float64" or dt.name == "F64") else F32
        method: Method = "mean" if not robust else aggregator  # type: ignore[assignment]
        return Rule(method, acc, dt.np, weighted=weighted and not robust, check_finite=not allow_nonfinite)
    as_bool = dt.kind == "bool"
    if integer_policy == "first":
        return Rule("first", dt.np, dt.np, as_bool=as_bool)
    if integer_policy == "max":
        return Rule("max", dt.np, dt.np, as_bool=as_bool)
    method = "mean" if not robust else aggregator  # type: ignore[assignment]
    return Rule(method, F64, dt.np, weighted=weighted, rint=True, as_bool=as_bool)


class NonFinite(Exception):
    """Internal: a piece's inputs (``client`` known) or its weighted sum (``client`` None) are not finite."""

    def __init__(self, client: int | None, element: int):
        super().__init__(client, element)
        self.client = client
        self.element = element


class Arena:
    """One preallocated byte buffer carved into the current chunk's reducer buffers (no per-chunk
    allocation; it grows to the largest chunk's need and stays there)."""

    def __init__(self, nbytes: int = 0) -> None:
        self.buf = np.empty(nbytes, np.uint8)
        self.pos = 0
        self.peak = nbytes

    def reserve(self, nbytes: int) -> None:
        """Start a new chunk needing at most ``nbytes`` (sum of :func:`need` of its reducers). Size the arena
        for the largest chunk up front: growing it allocates while views of the old buffer may live."""
        if nbytes > self.buf.size:
            self.buf = np.empty(0, np.uint8)
            self.buf = np.empty(nbytes, np.uint8)
            self.peak = max(self.peak, nbytes)
        self.pos = 0

    def take(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape)) * dtype.itemsize
        start = self.pos
        self.pos = start + _aligned(n)
        if self.pos > self.buf.size:
            raise AssertionError("arena overrun: need() undercounted")
        return self.buf[start : start + n].view(dtype).reshape(shape)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def need(rule: Rule, count: int, n_clients: int) -> int:
    """Arena bytes a reducer for ``count`` elements takes."""
    acc = count * rule.acc.itemsize
    out = 0 if rule.out == rule.acc else count * rule.out.itemsize
    if rule.method in ("median", "trimmed_mean"):
        return _aligned(n_clients * acc) + _aligned(acc) + _aligned(out)
    return _aligned(acc) + _aligned(out)


@dataclass
class Params:
    """Per-task constants: the weights and their total as accumulator scalars, the trim count."""

    weights: list[float]  # one per client, > 0 (ones when unweighted)
    total: float  # sum of the weights (math.fsum), or N when unweighted
    n_clients: int
    trim: int = 0
    secure: secagg.RoundParams | None = None  # a secure round's parameters (its dequantisation)

    def __post_init__(self) -> None:
        # Scaled in float64 before the cast (see the module docstring): a power of two, so exact.
        k = weight_scale(self.weights)
        weights = [math.ldexp(w, k) for w in self.weights]
        total = math.ldexp(self.total, k)
        self._w = {F32: [np.float32(w) for w in weights], F64: [np.float64(w) for w in weights]}
        self._total_w = {F32: np.float32(total), F64: np.float64(total)}
        n = self.n_clients
        self._total_u = {F32: np.float32(n), F64: np.float64(n)}
        self.scratch = {F32: np.empty(BLOCK, F32), F64: np.empty(BLOCK, F64)}
        self.flags = np.empty(BLOCK, np.bool_)  # the output check's per-block scratch

    def w(self, acc: np.dtype, client: int) -> np.floating:
        return self._w[acc][client]

    def total_for(self, rule: Rule) -> np.floating:
        return (self._total_w if rule.weighted else self._total_u)[rule.acc]


def _as_input(rule: Rule, x: np.ndarray) -> np.ndarray:
    if rule.as_bool:
        return np.minimum(x, 1)  # bytes as 0/1 (a new small array; BOOL tensors are rare and small)
    return x


def first_nonfinite(values: np.ndarray, flags: np.ndarray) -> int | None:
    """The index of the first NaN or Inf in the 1-d ``values`` (any float dtype, ml_dtypes' too), or None;
    checked ``flags.size`` elements at a time into the bool scratch ``flags``."""
    step = flags.size
    for lo in range(0, values.size, step):
        part = values[lo : lo + step]
        ok = flags[: part.size]
        np.isfinite(part, out=ok)
        if not ok.all():
            return lo + int(np.argmin(ok))
    return None


class Reducer:
    """Base: ``add`` each client's values in client order, then ``finish``.

    After ``finish``, ``nonfinite`` is None when every output value is finite, else a bool mask of the
    output elements that are NaN or Inf (for an integer tensor: whose float result was, before the cast).
    """

    def __init__(self, rule: Rule, count: int, params: Params, arena: Arena):
        self.rule = rule
        self.count = count
        self.params = params
        self.out = arena.take(rule.out, (count,)) if rule.out != rule.acc else None
        self.nonfinite: np.ndarray | None = None

    def add(self, client: int, x: np.ndarray) -> None:
        raise NotImplementedError

    def finish(self) -> np.ndarray:
        raise NotImplementedError

    def _emit(self, values: np.ndarray, checked: bool = False) -> np.ndarray:
        """``values`` (accumulator dtype) checked finite, then as the output dtype, rounded half to even for
        integer rules. The check is on ``values``: float32/64 are fast to check, and a cast to an integer
        would hide a NaN; the cast of a finite result to a float tensor's own dtype cannot overflow, as a
        mean or order statistic lies within the range of its inputs. ``checked``: the caller found every
        value finite already."""
        if not checked and first_nonfinite(values, self.params.flags) is not None:
            self.nonfinite = ~np.isfinite(values)  # rare: only a result about to fail (or allowed)
        if self.rule.rint:
            np.rint(values, out=values)
        if self.out is None:
            return values
        np.copyto(self.out, values, casting="unsafe")
        return self.out


def axpy(acc: np.ndarray, x: np.ndarray, w: np.floating, scratch: np.ndarray) -> None:
    """``acc += w * x`` in one pass over ``acc`` and ``x``, with no temporary the size of either.

    Each product is rounded to ``acc``'s dtype, then added and rounded again: the plain formula's two
    roundings (Flower's ``x * n`` then ``np.add``), never a fused multiply-add, so the bits are those of
    ``acc + w * x`` however the pieces are cut. ``x`` is cast as it is multiplied (a float16/bfloat16/float32
    input into a float32/float64 ``acc``), block by block through ``scratch`` (``acc``'s dtype), which stays
    in cache: the product is written and read back there, and ``acc`` and ``x`` cross memory once each."""
    step = scratch.size
    n = acc.size
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        t = scratch[: hi - lo]
        np.multiply(x[lo:hi], w, out=t, casting="unsafe")
        a = acc[lo:hi]
        np.add(a, t, out=a)


def difference(x: np.ndarray, base: np.ndarray | None, out: np.ndarray) -> np.ndarray:
    """An update's difference from the base, ``float64(x) - float64(base)`` (``base`` None: ``float64(x)``),
    into the float64 ``out``: the one definition that DP-FedAvg's norms pass (the clip) and its mean share,
    so the update clipped is the update whose norm was measured."""
    np.copyto(out, x, casting="unsafe")
    if base is not None:
        np.subtract(out, base, out=out)
    return out


def axpy_difference(
    acc: np.ndarray, x: np.ndarray, base: np.ndarray | None, f: np.floating, scratch: np.ndarray
) -> None:
    """``acc += f * difference(x, base)`` for a float64 ``acc``, block by block through the float64
    ``scratch``: the same three roundings as ``d = x.astype(float64); d -= base; d *= f; acc += d``, so the
    same bits, with no chunk-sized float64 copy of ``x``."""
    step = scratch.size
    n = acc.size
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        t = difference(x[lo:hi], None if base is None else base[lo:hi], scratch[: hi - lo])
        np.multiply(t, f, out=t)
        a = acc[lo:hi]
        np.add(a, t, out=a)


class MeanReducer(Reducer):
    """``acc = w_0 x_0; acc += w_i x_i; acc / W`` (``w_i = 1`` unweighted); the weighted sum in one pass per
    client (:func:`axpy`)."""

    def __init__(self, rule: Rule, count: int, params: Params, arena: Arena):
        super().__init__(rule, count, params, arena)
        self.acc = arena.take(rule.acc, (count,))

    def add(self, client: int, x: np.ndarray) -> None:
        rule, acc = self.rule, self.acc
        x = _as_input(rule, x)
        if not rule.weighted:
            if client == 0:
                np.copyto(acc, x, casting="unsafe")
            else:
                np.add(acc, x, out=acc, casting="unsafe")
            return
        w = self.params.w(rule.acc, client)
        if client == 0:
            np.multiply(x, w, out=acc, casting="unsafe")
        else:
            axpy(acc, x, w, self.params.scratch[rule.acc])

    def finish(self) -> np.ndarray:
        """``acc / W``, checked: the weighted sum finite (else :class:`NonFinite` at its first non-finite
        element, where the rule checks), then the quotient (:meth:`Reducer._emit`'s check). One pass, block
        by block through the shared scratch (cache-sized), instead of three over the whole piece."""
        acc, flags = self.acc, self.params.flags
        total = self.params.total_for(self.rule)
        step = flags.size
        finite = True  # every quotient so far
        for lo in range(0, acc.size, step):
            a = acc[lo : lo + step]
            ok = flags[: a.size]
            if self.rule.check_finite:
                np.isfinite(a, out=ok)
                if not ok.all():
                    raise NonFinite(None, lo + int(np.argmin(ok)))
            np.divide(a, total, out=a)
            if finite:
                np.isfinite(a, out=ok)
                finite = bool(ok.all())
        return self._emit(acc, checked=finite)


class RobustReducer(Reducer):
    """Coordinate-wise median or trimmed mean over all N clients' values (unweighted).

    The values sit coordinate-major (``count x N``): client ``i`` fills column ``i``, then every row (one
    coordinate's N values, contiguous) is sorted in place. A trimmed mean sums each row's kept values in
    sorted order with ``cumsum`` (strictly sequential, unlike a pairwise ``sum``) over blocks of rows.
    """

    def __init__(self, rule: Rule, count: int, params: Params, arena: Arena):
        super().__init__(rule, count, params, arena)
        self.mat = arena.take(rule.acc, (count, params.n_clients))
        self.res = arena.take(rule.acc, (count,))

    def add(self, client: int, x: np.ndarray) -> None:
        np.copyto(self.mat[:, client], _as_input(self.rule, x), casting="unsafe")

    def finish(self) -> np.ndarray:
        mat, res, n = self.mat, self.res, self.params.n_clients
        if self.rule.check_finite:
            bad = ~np.isfinite(mat)
            if bad.any():
                client = int(np.argmax(bad.any(axis=0)))  # the first client holding one
                raise NonFinite(client, int(np.flatnonzero(bad[:, client])[0]))
            del bad
        mat.sort(axis=1)
        if self.rule.method == "median":
            m = n // 2
            if n % 2:
                np.copyto(res, mat[:, m])
            else:
                np.add(mat[:, m - 1], mat[:, m], out=res)
                np.divide(res, 2, out=res)
        else:
            k = self.params.trim
            kept = n - 2 * k
            scratch = self.params.scratch[self.rule.acc]
            rows = max(1, scratch.size // kept)
            for lo in range(0, self.count, rows):
                hi = min(lo + rows, self.count)
                sums = scratch[: (hi - lo) * kept].reshape(hi - lo, kept)
                np.cumsum(mat[lo:hi, k : n - k], axis=1, out=sums)
                np.copyto(res[lo:hi], sums[:, -1])
            np.divide(res, kept, out=res)
        return self._emit(res)


class FoldReducer(Reducer):
    """``acc = x_0``, then ``acc = op(acc, x_i)`` in the accumulator's dtype, in client order (no ``op``:
    client 0's values stay)."""

    op: np.ufunc | None = None

    def __init__(self, rule: Rule, count: int, params: Params, arena: Arena):
        super().__init__(rule, count, params, arena)
        self.acc = arena.take(rule.acc, (count,))

    def add(self, client: int, x: np.ndarray) -> None:
        if client == 0:
            np.copyto(self.acc, _as_input(self.rule, x))
        elif self.op is not None:
            self.op(self.acc, _as_input(self.rule, x), out=self.acc)

    def finish(self) -> np.ndarray:
        return self.acc


class FirstReducer(FoldReducer):
    """Client 0's values."""


class MaxReducer(FoldReducer):
    """The elementwise maximum, in the tensor's own dtype (for BOOL: logical or)."""

    op = np.maximum


class SecureSumReducer(FoldReducer):
    """A secure round's masked updates summed in uint32 (wrapping is the arithmetic mod 2³²: the masks
    cancel), then dequantised to the float32 mean, block by block (no chunk-sized float64 temporary)."""

    op = np.add

    def finish(self) -> np.ndarray:
        acc, out, n = self.acc, self.out, self.params.n_clients
        for lo in range(0, acc.size, BLOCK):
            np.copyto(out[lo : lo + BLOCK], secagg.dequantise(acc[lo : lo + BLOCK], self.params.secure, n))
        return out


_REDUCERS: dict[str, type[Reducer]] = {
    "mean": MeanReducer,
    "median": RobustReducer,
    "trimmed_mean": RobustReducer,
    "first": FirstReducer,
    "max": MaxReducer,
    "secure_sum": SecureSumReducer,
}


def reducer(rule: Rule, count: int, params: Params, arena: Arena) -> Reducer:
    return _REDUCERS[rule.method](rule, count, params, arena)


def trim_count(trim_fraction: float, n_clients: int) -> int:
    """Values dropped at each end by trimmed_mean: ``floor(beta * N)`` with ``beta`` taken as the decimal it
    was written as (so 0.29 x 100 is 29, not 28); always < N/2 since beta < 0.5."""
    return math.floor(Decimal(repr(float(trim_fraction))) * n_clients)
