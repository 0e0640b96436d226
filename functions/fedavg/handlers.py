"""Lambda handlers of the fedavg job: each a :func:`~functions.runtime.task` around one core call
that returns a small dict."""

from __future__ import annotations

from pydantic import BaseModel, Field

from shardfold.functions.fedavg import core
from shardfold.functions.fedavg.spec import FedAvgSpec
from shardfold.functions.runtime import JobEvent, task


class ShardRef(BaseModel):
    """One element of the shard work list."""

    shard: int = Field(ge=0)
    start: int = Field(ge=0)
    end: int = Field(ge=0)


class AggregateEvent(JobEvent):
    item: ShardRef


class LastLook(BaseModel):
    """The polling step's previous result (the state machine's, not the submitter's)."""

    deadline: float = Field(allow_inf_nan=False)
    looks: int = Field(ge=1)


class AwaitEvent(JobEvent):
    await_updates: LastLook | None = None


class PrepareResult(BaseModel):
    shards: int = Field(ge=1)


class CommitEvent(JobEvent):
    prepare: PrepareResult


@task(AwaitEvent, kind="fedavg")
def await_updates(e: AwaitEvent, spec: FedAvgSpec) -> dict:
    return core.await_updates(spec, e.store_root, e.await_updates and e.await_updates.model_dump())


@task(JobEvent, kind="fedavg")
def prepare(e: JobEvent, spec: FedAvgSpec) -> dict:
    return core.prepare(spec, e.job_id, e.store_root)


@task(AggregateEvent, kind="fedavg")
def aggregate(e: AggregateEvent, spec: FedAvgSpec) -> dict:
    return core.aggregate(spec, e.job_id, e.store_root, e.item.shard)


@task(AggregateEvent, kind="fedavg")
def norms(e: AggregateEvent, spec: FedAvgSpec) -> dict:
    return core.norms(spec, e.job_id, e.store_root, e.item.shard)


@task(JobEvent, kind="fedavg")
def clip(e: JobEvent, spec: FedAvgSpec) -> dict:
    return core.clip(spec, e.job_id, e.store_root)


@task(CommitEvent, kind="fedavg")
def commit(e: CommitEvent, spec: FedAvgSpec) -> dict:
    return core.commit(spec, e.job_id, e.store_root, e.prepare.shards)


@task(JobEvent, kind="fedavg")
def scrub(e: JobEvent, spec: FedAvgSpec) -> dict:
    return core.scrub(spec, e.job_id, e.store_root)
