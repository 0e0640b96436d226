"""The SVD lower bound (functions/dpquery/bounds.py): equal to the nuclear norm of the workload built whole on
small instances, equal to ResidualPlanner's optimal error on identity workloads (where RP is optimal), and
below every plan the planner makes."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from shardfold.functions.dpquery import smasher
from shardfold.functions.dpquery.bounds import TooLarge, svd_bound_rmse
from shardfold.functions.dpquery.planner import plan


def whole_workload(domains, kinds, sets) -> np.ndarray:
    blocks = []
    for a in sets:
        factors = [
            smasher.attribute_queries(kinds[i], n) if i in a else np.ones((1, n))
            for i, n in enumerate(domains)
        ]
        blocks.append(smasher.kron_all(factors))
    return np.vstack(blocks)


def bound_of_whole(domains, kinds, sets, privacy_cost=1.0) -> float:
    w = whole_workload(domains, kinds, sets)
    nuclear = np.linalg.svd(w, compute_uv=False).sum()
    return math.sqrt(nuclear**2 / math.prod(domains) / privacy_cost / w.shape[0])


@pytest.mark.parametrize(
    ("domains", "kinds", "ways"),
    [
        ([6], ["prefix"], (1,)),
        ([5, 4, 3], ["prefix", "identity", "identity"], (0, 1, 2)),
        ([4, 5, 3], ["prefix", "range", "identity"], (1, 2)),
        ([4, 3, 3, 2], ["prefix", "identity", "range", "identity"], (0, 1, 2, 3)),
        ([5, 4, 3], ["identity", "identity", "identity"], (2,)),
    ],
)
def test_the_bound_is_the_nuclear_norm_of_the_whole_workload(domains, kinds, ways):
    sets = [c for k in ways for c in itertools.combinations(range(len(domains)), k)]
    got = svd_bound_rmse(domains, kinds, sets, privacy_cost=0.5)
    assert got == pytest.approx(bound_of_whole(domains, kinds, sets, privacy_cost=0.5), rel=1e-10)


def test_identity_workloads_bound_equals_residual_planners_optimal_error():
    domains = [3, 4, 5, 2]
    for ways in [(1,), (2,), (0, 1, 2)]:
        sets = [c for k in ways for c in itertools.combinations(range(4), k)]
        rp = plan(domains=domains, workload=[(a, 1.0) for a in sets], rho=0.5)
        assert svd_bound_rmse(domains, ["identity"] * 4, sets) == pytest.approx(rp.rmse, rel=1e-9)


def test_every_plan_of_a_prefix_workload_is_at_or_above_the_bound():
    domains, ordinal = [12, 8, 3, 2], 2
    for ways in [(1,), (2,), (0, 1, 2)]:
        sets = [c for k in ways for c in itertools.combinations(range(4), k)]
        kinds = ["prefix"] * ordinal + ["identity"] * 2
        asked = [{i: "prefix" for i in a if i < ordinal} for a in sets]
        ours = plan(domains=domains, workload=[(a, 1.0) for a in sets], rho=0.5, queries=asked).rmse
        assert ours >= svd_bound_rmse(domains, kinds, sets) * (1 - 1e-12)


def test_a_span_past_the_limit_is_refused_with_its_size():
    sets = [(0, 1)]
    with pytest.raises(TooLarge, match="10,000 dimensions"):
        svd_bound_rmse([100, 100], ["prefix", "prefix"], sets, max_dim=6000)
