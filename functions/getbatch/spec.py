"""The getbatch spec: many objects (or ranges, or TAR members) fetched into one ordered TAR."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shardfold.functions.specs import BatchItem, InputUri, JobOptions, OutputUri


class GetBatchSpec(JobOptions):
    """Fetch many objects (or ranges, or TAR members) into one ordered TAR in the store."""

    kind: Literal["getbatch"] = "getbatch"
    items: list[BatchItem] | None = Field(default=None, description="the request, in output order")
    manifest: InputUri | None = Field(
        default=None,
        description="URI of a JSON array (or JSON Lines) of items, for requests too big to inline",
    )
    output: OutputUri | None = Field(
        default=None, description="archive URI; default jobs/<id>/output/batch.tar"
    )
    continue_on_error: bool = Field(
        default=False,
        description="missing objects become zero-byte __404__/<name> entries instead of failing",
    )
    max_soft_errors: int | None = Field(
        default=None, ge=0, description="with continue_on_error, abort once more items than this fail"
    )
    items_per_part: int = Field(default=2000, ge=1, le=100_000, description="items gathered by one task")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> GetBatchSpec:
        if (self.items is None) == (self.manifest is None):
            raise ValueError("give exactly one of 'items' (inline list) or 'manifest' (URI of an item list)")
        if self.items is not None and not self.items:
            raise ValueError("'items' is empty: a GetBatch request needs at least one item")
        return self
