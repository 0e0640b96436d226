"""The getbatch kind's registration: many objects fetched in one ordered, fault-tolerant request."""

from __future__ import annotations

from functions.getbatch.spec import GetBatchJob
from functions.getbatch.workflow import WORKFLOW
from functions.kinds import JobKind

KIND = JobKind(
    name="getbatch",
    package=__package__,
    spec=GetBatchJob,
    workflow=WORKFLOW,
    sizing="functions.getbatch.sizing",
)
