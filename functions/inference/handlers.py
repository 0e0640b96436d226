"""Lambda handlers of the inference job (no torch here): validate the event, call the core."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from functions.inference import pipeline
from functions.runtime import JobEvent, load_spec, parse_event


class ShardRef(BaseModel):
    shard: int = Field(ge=0)


class ShardEvent(JobEvent):
    item: ShardRef


def plan(event: dict[str, Any], context: Any = None) -> dict:
    e = parse_event(event, JobEvent)
    return pipeline.plan(load_spec(e.spec_uri, "inference"), e.job_id, e.store_root)


def preprocess(event: dict[str, Any], context: Any = None) -> dict:
    e = parse_event(event, ShardEvent)
    return pipeline.preprocess(load_spec(e.spec_uri, "inference"), e.job_id, e.store_root, e.item.shard)


def cpu_done(event: dict[str, Any], context: Any = None) -> dict:
    e = parse_event(event, JobEvent)
    return pipeline.cpu_done(load_spec(e.spec_uri, "inference"), e.job_id, e.store_root)


def reconcile(event: dict[str, Any], context: Any = None) -> dict:
    e = parse_event(event, JobEvent)
    return pipeline.reconcile(load_spec(e.spec_uri, "inference"), e.job_id, e.store_root)


def commit(event: dict[str, Any], context: Any = None) -> dict:
    e = parse_event(event, JobEvent)
    return pipeline.commit(load_spec(e.spec_uri, "inference"), e.job_id, e.store_root)
