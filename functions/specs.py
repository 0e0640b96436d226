"""Job specs: pydantic models that round-trip through JSON.

The CLI, the SDK and the bucket trigger all accept the same documents. A spec names its ``kind``; every
other field belongs to that kind. Validation errors become :class:`SpecError` listing every problem.
"""

from __future__ import annotations

import json
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from functions.errors import SpecError


class StrictModel(BaseModel):
    """Unknown fields are errors: a typo in a spec must not be silently ignored."""

    model_config = ConfigDict(extra="forbid")


class BatchItem(StrictModel):
    """One entry of a GetBatch request.

    ``uri`` is an object URI (``s3://bucket/key``, ``file:///abs/path``, or a key relative to the store
    root). A byte range is ``start`` plus ``length`` (``None``: to the end of the object). ``archpath``
    names a member of a TAR object; a range then applies to the member. ``name`` overrides the entry's
    name in the output archive (default: the object key, plus ``/archpath``).
    """

    uri: str = Field(min_length=1)
    start: int = Field(default=0, ge=0)
    length: int | None = Field(default=None, ge=0)
    archpath: str | None = Field(default=None, min_length=1)
    name: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _range_is_meaningful(self) -> BatchItem:
        if self.length == 0 and self.start != 0:
            raise ValueError("length 0 with a non-zero start selects nothing; omit length to read to the end")
        return self


class GetBatchJob(StrictModel):
    """Fetch many objects (or ranges, or TAR members) into one ordered TAR in the store."""

    kind: Literal["getbatch"] = "getbatch"
    items: list[BatchItem] | None = Field(default=None, description="the request, in output order")
    manifest: str | None = Field(
        default=None,
        description="URI of a JSON array (or JSON Lines) of items, for requests too big to inline",
    )
    output: str | None = Field(default=None, description="archive URI; default jobs/<id>/output/batch.tar")
    continue_on_error: bool = Field(
        default=False,
        description="missing objects become zero-byte __404__/<name> entries instead of failing",
    )
    max_soft_errors: int | None = Field(
        default=None, ge=0, description="with continue_on_error, abort once more items than this fail"
    )
    items_per_part: int = Field(default=2000, ge=1, le=100_000, description="items gathered by one task")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> GetBatchJob:
        if (self.items is None) == (self.manifest is None):
            raise ValueError("give exactly one of 'items' (inline list) or 'manifest' (URI of an item list)")
        if self.items is not None and not self.items:
            raise ValueError("'items' is empty: a GetBatch request needs at least one item")
        return self


class FedAvgClient(StrictModel):
    """One client's model update: a safetensors object and its weight (number of training examples).

    Without ``weight`` the weight is read from the file's ``__metadata__["num_examples"]``.
    """

    uri: str = Field(min_length=1)
    weight: float | None = Field(default=None, description="> 0; default: __metadata__.num_examples")

    @model_validator(mode="after")
    def _positive_weight(self) -> FedAvgClient:
        if self.weight is not None and not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"weight of {self.uri} must be a finite number > 0, got {self.weight}")
        return self


class FedAvgJob(StrictModel):
    """Average N client updates (safetensors) into one model, sharded by byte range (GradsSharding)."""

    kind: Literal["fedavg"] = "fedavg"
    clients: list[FedAvgClient] = Field(min_length=1, description="summed in this order")
    output: str | None = Field(default=None, description="default jobs/<id>/output/model.safetensors")
    aggregator: Literal["mean", "trimmed_mean", "median"] = Field(
        default="mean",
        description="weighted mean (FedAvg), or coordinate-wise robust statistics (unweighted)",
    )
    trim_fraction: float = Field(
        default=0.1,
        ge=0.0,
        lt=0.5,
        description="trimmed_mean: share of clients cut at each end per coordinate",
    )
    uniform: bool = Field(default=False, description="ignore weights: plain mean, as GradsSharding does")
    accumulate: Literal["float32", "float64"] = Field(
        default="float32", description="accumulator of float tensors (F64 tensors always use float64)"
    )
    integer_policy: Literal["mean", "first", "max"] = Field(
        default="mean",
        description=(
            "integer and BOOL tensors: 'mean' applies the aggregator in float64 and rounds half to even "
            "(BOOL: a weighted majority), 'first' keeps client 0's values, 'max' the elementwise maximum"
        ),
    )
    allow_nonfinite: bool = Field(default=False, description="accept NaN/Inf in updates instead of failing")
    shards: int | None = Field(default=None, ge=1, le=10_000, description="default: chosen from model size")

    @model_validator(mode="after")
    def _distinct_clients(self) -> FedAvgJob:
        seen: dict[str, int] = {}
        for i, c in enumerate(self.clients):
            if c.uri in seen:
                raise ValueError(
                    f"clients.{i} repeats clients.{seen[c.uri]} ({c.uri}); each update counts once"
                )
            seen[c.uri] = i
        return self


# Every job kind's spec model, by its ``kind`` tag. A new kind registers here.
KINDS: dict[str, type[StrictModel]] = {"getbatch": GetBatchJob, "fedavg": FedAvgJob}
JobSpec = GetBatchJob | FedAvgJob  # the union of KINDS' models, for type hints


def _describe(err: ValidationError) -> list[dict]:
    out = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<spec>"
        out.append({"field": loc, "error": e["msg"]})
    return out


def parse_spec(doc: dict | str | bytes) -> JobSpec:
    """Validate a job spec given as a dict or JSON text; raise :class:`SpecError` naming every bad field."""
    if isinstance(doc, bytes | str):
        try:
            doc = json.loads(doc)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SpecError(
                f"spec is not valid JSON: {exc}", [{"field": "<spec>", "error": str(exc)}]
            ) from exc
    if not isinstance(doc, dict):
        raise SpecError("spec must be a JSON object", [{"field": "<spec>", "error": "not an object"}])
    kind = doc.get("kind")
    if kind not in KINDS:
        msg = f"unknown job kind {kind!r}; expected one of {sorted(KINDS)}"
        raise SpecError(msg, [{"field": "kind", "error": msg}])
    try:
        return KINDS[kind].model_validate(doc)
    except ValidationError as exc:
        errors = _describe(exc)
        summary = "; ".join(f"{e['field']}: {e['error']}" for e in errors)
        raise SpecError(f"invalid {kind} spec: {summary}", errors) from exc
