"""Properties of the token-budget batcher (pure numpy): each row once, order restored, budget kept."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from shardfold.functions.inference.batcher import _lengths, token_budget_batches

lengths_st = st.lists(st.integers(min_value=0, max_value=300), min_size=0, max_size=200)
budget_st = st.integers(min_value=1, max_value=4096)


# What the properties compare the batcher with (the tests' own: the job needs none of them)


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


@settings(max_examples=examples(300), deadline=None)
@given(lengths_st, budget_st)
def test_each_row_exactly_once_and_budget_kept(lengths, budget):
    batches = token_budget_batches(lengths, budget)
    flat = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    for b, padded in zip(batches, padded_tokens(lengths, batches), strict=True):
        assert len(b) >= 1
        # the documented exception: a row longer than the budget forms a batch of its own
        assert padded <= budget or (len(b) == 1 and max(lengths[b[0]], 1) > budget)


@settings(max_examples=examples(300), deadline=None)
@given(lengths_st, budget_st)
def test_restore_order(lengths, budget):
    batches = token_budget_batches(lengths, budget)
    if not batches:
        return
    # each batch's "model output" is the row's own index and length, computed from the batch members
    outputs = [np.stack([b, np.asarray(lengths, dtype=np.int64)[b]], axis=1) for b in batches]
    out = restore_order(batches, outputs, len(lengths))
    assert out[:, 0].tolist() == list(range(len(lengths)))
    assert out[:, 1].tolist() == list(lengths)


@settings(max_examples=examples(300), deadline=None)
@given(lengths_st, st.integers(min_value=1, max_value=64))
def test_sorted_padding_not_above_unsorted(lengths, batch_size):
    # A theorem for equal-size batches: contiguous chunks of the sorted order minimise padding. (A short
    # last batch breaks it: [0, 0, 2] in pairs pads less unsorted, since the long row rides alone.)
    lengths = lengths[: len(lengths) - len(lengths) % batch_size]
    sorted_batches = fixed_size_batches(lengths, batch_size, sort=True)
    unsorted = fixed_size_batches(lengths, batch_size, sort=False)
    assert [len(b) for b in sorted_batches] == [len(b) for b in unsorted]
    assert padding_tokens(lengths, sorted_batches) <= padding_tokens(lengths, unsorted)


def _cost(lengths, batches, overhead):
    return sum(padded_tokens(lengths, batches)) + overhead * len(batches)


def _best_cost_brute_force(lengths, budget, overhead):
    """The least cost over every cut of the sorted order into contiguous batches within the budget."""
    eff = sorted((max(x, 1) for x in lengths), reverse=True)
    n = len(eff)
    best = None
    for mask in range(1 << max(n - 1, 0)):
        cuts = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        batches = [eff[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        if any(len(b) > 1 and len(b) * b[0] > budget for b in batches):
            continue
        cost = sum(len(b) * b[0] + overhead for b in batches)
        best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=examples(300), deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=10),
    st.integers(min_value=1, max_value=120),
    st.integers(min_value=0, max_value=30),
)
def test_cuts_are_optimal(lengths, budget, overhead):
    batches = token_budget_batches(lengths, budget, overhead)
    assert _cost(lengths, batches, overhead) == _best_cost_brute_force(lengths, budget, overhead)


def _greedy(lengths, budget):
    """The plain greedy cut: fill each batch while one more (shorter) row fits the budget."""
    eff = np.maximum(np.asarray(lengths, dtype=np.int64), 1)
    order = np.argsort(-eff, kind="stable")
    out, start = [], 0
    while start < len(order):
        size = max(1, budget // int(eff[order[start]]))
        out.append(order[start : start + size])
        start += size
    return out


@settings(max_examples=examples(300), deadline=None)
@given(lengths_st, budget_st)
def test_never_costs_more_than_greedy_filling(lengths, budget):
    overhead = budget // 16
    assert _cost(lengths, token_budget_batches(lengths, budget), overhead) <= _cost(
        lengths, _greedy(lengths, budget), overhead
    )


def test_long_tail_row_rides_alone():
    # one long row and many short ones: greedy filling pads every short row to 150 tokens
    lengths = [150] + [40] * 26
    assert padding_tokens(lengths, _greedy(lengths, 4096)) == 26 * 110
    batches = token_budget_batches(lengths, 4096)
    assert [len(b) for b in batches] == [1, 26]
    assert padding_tokens(lengths, batches) == 0


def test_token_budget_counterexample_is_documented():
    # input order cuts three unpadded batches; sorted, with a batch overhead of one token, two batches tie
    # with three and the fewer batches win, one pad token (see the module doc); with no overhead, none
    assert padding_tokens([2, 3, 0], token_budget_batches([2, 3, 0], 4, overhead=1)) == 1
    assert padding_tokens([2, 3, 0], token_budget_batches([2, 3, 0], 4, overhead=0)) == 0


def test_examples():
    assert [b.tolist() for b in token_budget_batches([3, 10, 2, 10], 20)] == [[1, 3], [0, 2]]
    # a 50-token row under a 16-token budget: its own batch (the single-row overflow case)
    batches = token_budget_batches([4, 50, 4, 4, 4], 16)
    assert [b.tolist() for b in batches] == [[1], [0, 2, 3, 4]]
    assert padded_tokens([4, 50, 4, 4, 4], batches) == [50, 16]
    assert token_budget_batches([], 8) == []


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        token_budget_batches([1, 2], 0)
    with pytest.raises(ValueError):
        token_budget_batches([-1], 4)
    with pytest.raises(ValueError):
        token_budget_batches([1], 4, overhead=-1)
    with pytest.raises(ValueError):
        restore_order([np.array([0])], [], 1)
