"""Lambda handlers of the dpquery job: each a :func:`~functions.runtime.task` around one core call
that returns a small dict.

No handler can switch the noise off: :func:`functions.dpquery.core.measure`'s ``noise`` keyword is a test
seam that only tests pass (or patch in-process); no event or spec field reaches it.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from shardfold.functions.dpquery import core
from shardfold.functions.dpquery.spec import DPQuerySpec
from shardfold.functions.runtime import JobEvent, task


class GroupRef(BaseModel):
    group: int = Field(ge=0)
    start: int = Field(ge=0)
    stop: int = Field(ge=1)


class GroupEvent(JobEvent):
    item: GroupRef


@task(JobEvent, kind="dpquery")
def prepare(e: JobEvent, spec: DPQuerySpec) -> dict:
    return core.prepare(spec, e.job_id, e.store_root)


@task(GroupEvent, kind="dpquery")
def measure(e: GroupEvent, spec: DPQuerySpec) -> dict:
    return core.measure(spec, e.job_id, e.store_root, e.item.group)


@task(GroupEvent, kind="dpquery")
def reconstruct(e: GroupEvent, spec: DPQuerySpec) -> dict:
    return core.reconstruct(spec, e.job_id, e.store_root, e.item.group)


@task(JobEvent, kind="dpquery")
def finalize(e: JobEvent, spec: DPQuerySpec) -> dict:
    return core.finalize(spec, e.job_id, e.store_root)
