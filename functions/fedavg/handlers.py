"""Lambda handlers of the fedavg job: validate the event, call the core, return a small dict."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from functions.fedavg import core
from functions.runtime import JobEvent, load_spec, parse_event


class ShardRef(BaseModel):
    """One element of the shard manifest."""

    shard: int = Field(ge=0)
    start: int = Field(ge=0)
    end: int = Field(ge=0)


class AggregateEvent(JobEvent):
    item: ShardRef


class PlanResult(BaseModel):
    shards: int = Field(ge=1)


class CommitEvent(JobEvent):
    plan: PlanResult


def plan(event: dict[str, Any], context: Any = None) -> dict:
    e = parse_event(event, JobEvent)
    return core.plan(load_spec(e.spec_uri, "fedavg"), e.job_id, e.store_root)


def aggregate(event: dict[str, Any], context: Any = None) -> dict:
    e = parse_event(event, AggregateEvent)
    return core.aggregate(load_spec(e.spec_uri, "fedavg"), e.job_id, e.store_root, e.item.shard)


def commit(event: dict[str, Any], context: Any = None) -> dict:
    e = parse_event(event, CommitEvent)
    return core.commit(load_spec(e.spec_uri, "fedavg"), e.job_id, e.store_root, e.plan.shards)
