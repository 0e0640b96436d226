"""fedtree's task loads: a leaf holds two whole updates (one read while the other is summed), the scratch
for the weighted one and the accumulator (λ-FL's aggregator holds whole objects); the root a partial and
the accumulator."""

from __future__ import annotations

import math

from fedtree.kind import GROUP, LEAF_TASK, LEAVES, ROOT
from shardfold.functions import store
from shardfold.functions.estimate import Loads, MiB, Probe, TaskLoad

RUNTIME = 160 * MiB


def probe(spec, store_root, budget):
    return Probe(facts={"clients": len(spec.clients), "model": store.size(spec.clients[0].uri)})


def loads(spec, probed):
    n, model = probed.facts["clients"], probed.facts["model"]
    leaves = math.ceil(n / math.ceil(math.sqrt(n)))
    return Loads(
        items=n,
        tasks={
            GROUP: TaskLoad(RUNTIME),
            LEAF_TASK: TaskLoad(RUNTIME + 4 * model, gets=math.ceil(math.sqrt(n)), puts=2),
            ROOT: TaskLoad(RUNTIME + 3 * model, gets=2 * leaves + 1, puts=2),
        },
        map_items={LEAVES: leaves},
    )
