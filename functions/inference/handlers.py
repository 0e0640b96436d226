"""Lambda handlers of the inference job (no torch here): each a :func:`~functions.runtime.task`
around one pipeline call."""

from __future__ import annotations

from pydantic import BaseModel, Field

from shardfold.functions.inference import pipeline
from shardfold.functions.inference.spec import InferenceSpec
from shardfold.functions.runtime import JobEvent, task


class ShardRef(BaseModel):
    shard: int = Field(ge=0)


class ShardEvent(JobEvent):
    item: ShardRef


@task(JobEvent, kind="inference")
def prepare(e: JobEvent, spec: InferenceSpec) -> dict:
    return pipeline.prepare(spec, e.job_id, e.store_root)


@task(ShardEvent, kind="inference")
def preprocess(e: ShardEvent, spec: InferenceSpec) -> dict:
    return pipeline.preprocess(spec, e.job_id, e.store_root, e.item.shard)


@task(JobEvent, kind="inference")
def cpu_done(e: JobEvent, spec: InferenceSpec) -> dict:
    return pipeline.cpu_done(spec, e.job_id, e.store_root)


@task(JobEvent, kind="inference")
def reconcile(e: JobEvent, spec: InferenceSpec) -> dict:
    return pipeline.reconcile(spec, e.job_id, e.store_root)


@task(JobEvent, kind="inference")
def commit(e: JobEvent, spec: InferenceSpec) -> dict:
    return pipeline.commit(spec, e.job_id, e.store_root)
