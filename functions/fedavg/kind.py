"""The fedavg kind's registration: FedAvg of N client updates by byte-range shards (GradsSharding)."""

from __future__ import annotations

from functions.fedavg.spec import FedAvgJob
from functions.fedavg.workflow import WORKFLOW
from functions.kinds import JobKind

KIND = JobKind(
    name="fedavg",
    package=__package__,
    spec=FedAvgJob,
    workflow=WORKFLOW,
    sizing="functions.fedavg.sizing",
)
