"""The getbatch kind's registration: many objects fetched in one ordered, fault-tolerant request."""

from __future__ import annotations

from shardfold.functions.access import Right
from shardfold.functions.getbatch.spec import GetBatchSpec
from shardfold.functions.getbatch.workflow import WORKFLOW
from shardfold.functions.kinds import JobKind

KIND = JobKind(
    name="getbatch",
    package=__package__,
    spec=GetBatchSpec,
    workflow=WORKFLOW,
    sizing="shardfold.functions.getbatch.sizing",
    rights=frozenset({Right.INPUTS, Right.OUTPUTS}),
    # items and bytes gathered, where the executors count parts
    progress="shardfold.functions.getbatch.progress:progress",
)
