"""fedtree: ⌈√N⌉ leaf tasks, each reading its group's updates whole and summing them (weighted, float32, as
lambda-FL's aggregators do with ``np.load`` and ``+=``), then one root task summing the leaves' partial sums
and dividing by the total weight. Float32 models only (the benchmark's)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shardfold.functions.access import Right
from shardfold.functions.kinds import JobKind
from shardfold.functions.specs import InputUri, StrictModel
from shardfold.functions.workflow import Map, Task, Workflow


class TreeClient(StrictModel):
    uri: InputUri
    weight: float = Field(gt=0)


class FedTreeSpec(StrictModel):
    kind: Literal["fedtree"] = "fedtree"
    clients: list[TreeClient] = Field(min_length=1)


GROUP = Task("group", "fedtree.group", memory_mb=1024)
LEAF_TASK = Task("leaf_task", "fedtree.leaf", mode="process", memory_mb=10240, timeout_s=900)
LEAVES = Map("leaves", items="$.group.manifest", body=(LEAF_TASK,))
ROOT = Task("root", "fedtree.root", mode="process", memory_mb=10240, timeout_s=900)
WORKFLOW = Workflow(kind="fedtree", steps=(GROUP, LEAVES, ROOT))

KIND = JobKind(
    name="fedtree",
    package=__package__,
    spec=FedTreeSpec,
    workflow=WORKFLOW,
    sizing="fedtree.sizing",
    rights=frozenset({Right.INPUTS}),  # reads the clients' updates; writes its job's folder only
)
