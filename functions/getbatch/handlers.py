"""Lambda handlers of the getbatch job: each a :func:`~functions.runtime.task` around one core call
that returns a small dict."""

from __future__ import annotations

from pydantic import BaseModel, Field

from shardfold.functions.getbatch import core
from shardfold.functions.getbatch.spec import GetBatchSpec
from shardfold.functions.runtime import JobEvent, task
from shardfold.functions.workflow import Mode


class PartRef(BaseModel):
    part: int = Field(ge=0)
    first: int = Field(ge=0)
    count: int = Field(ge=1)
    of: int = Field(default=0, ge=0, description="how many parts the request has (0: not said)")
    inline: bool = Field(default=False, description="the items are the spec's own, none pinned: no part list")
    mode: Mode = Field(default="thread", description="how the local executor runs the part (Task.mode_from)")


class GatherEvent(JobEvent):
    item: PartRef


class PrepareResult(BaseModel):
    parts: int = Field(ge=1)


class AssembleEvent(JobEvent):
    prepare: PrepareResult


@task(JobEvent, kind="getbatch")
def prepare(e: JobEvent, spec: GetBatchSpec) -> dict:
    return core.prepare(spec, e.job_id, e.store_root)


@task(GatherEvent, kind="getbatch")
def gather(e: GatherEvent, spec: GetBatchSpec) -> dict:
    return core.gather(spec, e.job_id, e.store_root, e.item.part, e.item.of, e.item.inline)


@task(AssembleEvent, kind="getbatch")
def assemble(e: AssembleEvent, spec: GetBatchSpec) -> dict:
    return core.assemble(spec, e.job_id, e.store_root, e.prepare.parts)
