"""Lambda handlers of the dpquery job: validate the event, call the core, return a small dict.

No handler can switch the noise off: :func:`functions.dpquery.core.measure`'s ``noise`` keyword is a test
seam that only tests pass (or patch in-process); no event or spec field reaches it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from functions.dpquery import core
from functions.runtime import JobEvent, load_spec, parse_event


class GroupRef(BaseModel):
    group: int = Field(ge=0)
    start: int = Field(ge=0)
    stop: int = Field(ge=1)


class GroupEvent(JobEvent):
    item: GroupRef


def plan(event: dict[str, Any], context: Any = None) -> dict:
    e = parse_event(event, JobEvent)
    return core.plan(load_spec(e.spec_uri, "dpquery"), e.job_id, e.store_root)


def measure(event: dict[str, Any], context: Any = None) -> dict:
    e = parse_event(event, GroupEvent)
    return core.measure(load_spec(e.spec_uri, "dpquery"), e.job_id, e.store_root, e.item.group)


def reconstruct(event: dict[str, Any], context: Any = None) -> dict:
    e = parse_event(event, GroupEvent)
    return core.reconstruct(load_spec(e.spec_uri, "dpquery"), e.job_id, e.store_root, e.item.group)


def finalize(event: dict[str, Any], context: Any = None) -> dict:
    e = parse_event(event, JobEvent)
    return core.finalize(load_spec(e.spec_uri, "dpquery"), e.job_id, e.store_root)
