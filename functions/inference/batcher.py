"""Token-budget batching (pure numpy, no torch).

Rows are sorted longest first (as sentence-transformers' ``encode`` does, so an out-of-memory error hits
the first batch) and cut greedily into batches whose *padded* size, ``len(batch) * max length in batch``,
stays within ``budget`` tokens. A row longer than the budget on its own forms a batch of one: that single
batch exceeds the budget (it cannot be split without truncating the row; the spec's ``max_tokens`` bounds
it). :func:`restore_order` puts per-batch outputs back in the rows' original order.

Sorting never pads more than input order at a fixed batch size (the k-th largest batch maximum is at
least the ``((k-1)·b+1)``-th longest row in any grouping). With a token budget the comparison is not
exact: greedy batching in input order can pad less by cutting *more, smaller* batches (lengths
``[2, 3, 0]`` at budget 4: three unpadded batches against two sorted ones with one pad token), so the
budget's guarantee is the bound, and sorting's benefit is measured at equal batch sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if arr.size and int(arr.min()) < 0:
        raise ValueError("token lengths must be >= 0")
    return arr


def token_budget_batches(lengths: Sequence[int] | np.ndarray, budget: int) -> list[np.ndarray]:
    """Row indices per batch: longest rows first, each batch's padded tokens ``<= budget``.

    A zero-length row counts as one token (a model needs ``T >= 1``). A row longer than ``budget`` forms
    its own batch, the only case where a batch's padded tokens exceed the budget.
    """
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    eff = np.maximum(_lengths(lengths), 1)
    order = np.argsort(-eff, kind="stable")
    batches: list[np.ndarray] = []
    start = 0
    n = len(order)
    while start < n:
        longest = int(eff[order[start]])  # sorted: the first row of a batch is its longest
        size = max(1, budget // longest)
        batches.append(order[start : start + size])
        start += size
    return batches


def fixed_size_batches(
    lengths: Sequence[int] | np.ndarray, batch_size: int, sort: bool = True
) -> list[np.ndarray]:
    """Row indices per batch of ``batch_size`` rows (the last may be smaller), longest rows first when
    ``sort`` (sentence-transformers' ``encode``), else in input order. The ablation baseline."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    eff = np.maximum(_lengths(lengths), 1)
    order = np.argsort(-eff, kind="stable") if sort else np.arange(len(eff))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def padded_tokens(lengths: Sequence[int] | np.ndarray, batches: Sequence[np.ndarray]) -> list[int]:
    """Padded tokens (``rows * max length``, a row counting at least one token) of each batch."""
    eff = np.maximum(_lengths(lengths), 1)
    return [int(len(b) * eff[b].max()) if len(b) else 0 for b in batches]


def padding_tokens(lengths: Sequence[int] | np.ndarray, batches: Sequence[np.ndarray]) -> int:
    """Pad tokens in total: padded tokens minus real tokens."""
    eff = np.maximum(_lengths(lengths), 1)
    return sum(padded_tokens(eff, batches)) - int(sum(eff[b].sum() for b in batches))


def restore_order(batches: Sequence[np.ndarray], outputs: Sequence[np.ndarray], rows: int) -> np.ndarray:
    """Stack per-batch outputs (``outputs[i]`` has one row per index of ``batches[i]``) in row order."""
    if len(batches) != len(outputs):
        raise ValueError(f"{len(batches)} batches but {len(outputs)} outputs")
    if not outputs:
        raise ValueError("restore_order needs at least one batch to know the output's shape")
    first = np.asarray(outputs[0])
    out = np.empty((rows, *first.shape[1:]), dtype=first.dtype)
    seen = np.zeros(rows, dtype=bool)
    for idx, y in zip(batches, outputs, strict=True):
        y = np.asarray(y)
        if len(y) != len(idx):
            raise ValueError(f"a batch of {len(idx)} rows produced {len(y)} outputs")
        out[idx] = y
        seen[idx] = True
    if not seen.all():
        raise ValueError(f"rows {np.flatnonzero(~seen)[:10].tolist()} are in no batch")
    return out
