"""Lambda handlers of the getbatch job: validate the event, call the core, return a small dict."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from functions.getbatch import core
from functions.runtime import JobEvent, load_spec, parse_event


class PartRef(BaseModel):
    part: int = Field(ge=0)
    first: int = Field(ge=0)
    count: int = Field(ge=1)


class GatherEvent(JobEvent):
    item: PartRef


class PlanResult(BaseModel):
    parts: int = Field(ge=1)


class AssembleEvent(JobEvent):
    plan: PlanResult


def plan(event: dict[str, Any], context: Any = None) -> dict:
    e = parse_event(event, JobEvent)
    return core.plan(load_spec(e.spec_uri, "getbatch"), e.job_id, e.store_root)


def gather(event: dict[str, Any], context: Any = None) -> dict:
    e = parse_event(event, GatherEvent)
    return core.gather(load_spec(e.spec_uri, "getbatch"), e.job_id, e.store_root, e.item.part)


def assemble(event: dict[str, Any], context: Any = None) -> dict:
    e = parse_event(event, AssembleEvent)
    return core.assemble(load_spec(e.spec_uri, "getbatch"), e.job_id, e.store_root, e.plan.parts)
