"""Properties of the token-budget batcher (pure numpy): each row once, order restored, budget kept."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from functions.inference.batcher import (
    fixed_size_batches,
    padded_tokens,
    padding_tokens,
    restore_order,
    token_budget_batches,
)

lengths_st = st.lists(st.integers(min_value=0, max_value=300), min_size=0, max_size=200)
budget_st = st.integers(min_value=1, max_value=4096)


@settings(max_examples=300, deadline=None)
@given(lengths_st, budget_st)
def test_each_row_exactly_once_and_budget_kept(lengths, budget):
    batches = token_budget_batches(lengths, budget)
    flat = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    for b, padded in zip(batches, padded_tokens(lengths, batches), strict=True):
        assert len(b) >= 1
        # the documented exception: a row longer than the budget forms a batch of its own
        assert padded <= budget or (len(b) == 1 and max(lengths[b[0]], 1) > budget)


@settings(max_examples=300, deadline=None)
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


@settings(max_examples=300, deadline=None)
@given(lengths_st, st.integers(min_value=1, max_value=64))
def test_sorted_padding_not_above_unsorted(lengths, batch_size):
    # A theorem for equal-size batches: contiguous chunks of the sorted order minimise padding. (A short
    # last batch breaks it: [0, 0, 2] in pairs pads less unsorted, since the long row rides alone.)
    lengths = lengths[: len(lengths) - len(lengths) % batch_size]
    sorted_batches = fixed_size_batches(lengths, batch_size, sort=True)
    unsorted = fixed_size_batches(lengths, batch_size, sort=False)
    assert [len(b) for b in sorted_batches] == [len(b) for b in unsorted]
    assert padding_tokens(lengths, sorted_batches) <= padding_tokens(lengths, unsorted)


@settings(max_examples=300, deadline=None)
@given(lengths_st, budget_st)
def test_token_budget_batches_are_full(lengths, budget):
    """Greedy packing: a batch ends only when one more row (the next longest) would break the budget."""
    eff = np.maximum(np.asarray(lengths, dtype=np.int64), 1)
    batches = token_budget_batches(lengths, budget)
    for b in batches[:-1]:
        assert (len(b) + 1) * eff[b].max() > budget


def test_token_budget_counterexample_is_documented():
    # input order cuts three unpadded batches; sorted cuts two with one pad token (see the module doc)
    assert padding_tokens([2, 3, 0], token_budget_batches([2, 3, 0], 4)) == 1


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
        restore_order([np.array([0])], [], 1)
