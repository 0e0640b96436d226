"""Work lists: the item lists a workflow's Map steps fan out over (not a getbatch request's ``manifest``,
which is the user's own item list).

A work list is a JSON array in the store. A task that writes one returns a small *work-list reference*
(:func:`worklist_ref`) in its result; a Map step names that reference by a state path. On AWS, Distributed
Map's ``ItemReader`` reads the array straight from S3 using the reference's ``bucket`` and ``key`` (Step
Functions cannot split a URI), and the local executor reads ``uri``. The items themselves never travel
through the control plane, which caps a state at 256 KiB.

What does come back is each child's output: a Distributed Map gathers them all into its result, which must
fit the same 256 KiB even under ``ResultPath: null`` (aws-cdk#24799; the execution fails with
``States.DataLimitExceeded``). The compiled children output ``{}`` (3 bytes each, a failed one ``null``), so a
work list may hold at most :data:`MAX_MAP_ITEMS` items; :func:`worklist_ref` refuses more.
"""

from __future__ import annotations

from typing import Any

from shardfold.functions import store
from shardfold.functions.errors import PlanError, StoreError
from shardfold.functions.store.uri import is_s3, split_s3

# 50,000 children of 5 bytes ("null," the largest a child adds) stay under 262,144 bytes.
MAX_MAP_ITEMS = 50_000


def worklist_ref(uri: str, count: int) -> dict[str, Any]:
    """The small reference a task returns for the work list at ``uri`` holding ``count`` items; more than
    :data:`MAX_MAP_ITEMS` raise :class:`PlanError`."""
    if count > MAX_MAP_ITEMS:
        raise PlanError(
            f"the work list {uri} has {count:,} items and a Map fans out over at most {MAX_MAP_ITEMS:,} "
            "(Step Functions gathers every child's output into 256 KiB): give each task more to do "
            "(getbatch items_per_part, inference shard_rows)"
        )
    bucket, key = split_s3(uri) if is_s3(uri) else ("", "")
    return {"uri": uri, "bucket": bucket, "key": key, "count": int(count)}


def write_worklist(uri: str, items: list[Any]) -> dict[str, Any]:
    """Write ``items`` as the work list at ``uri`` and return its reference."""
    ref = worklist_ref(uri, len(items))  # refuses too many items before anything is written
    store.put_json(uri, items)
    return ref


def is_worklist_ref(value: Any) -> bool:
    return (
        isinstance(value, dict) and isinstance(value.get("uri"), str) and "bucket" in value and "key" in value
    )


def read_worklist(ref: dict[str, Any]) -> list[Any]:
    """The items of the work list a reference points to."""
    items = store.get_json(ref["uri"])
    if not isinstance(items, list):
        raise StoreError(f"work list {ref['uri']} is not a JSON array")
    return items
