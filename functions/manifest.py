"""Manifests: the item lists a workflow's Map steps fan out over.

A manifest is a JSON array in the store. A task that writes one returns a small *manifest reference*
(:func:`manifest_ref`) in its result; a Map step names that reference by a state path. On AWS, Distributed
Map's ``ItemReader`` reads the array straight from S3 using the reference's ``bucket`` and ``key`` (Step
Functions cannot split a URI), and the local executor reads ``uri``. The items themselves never travel
through the control plane, which caps a state at 256 KiB.
"""

from __future__ import annotations

from typing import Any

from functions import store
from functions.errors import StoreError
from functions.store.uri import is_s3, split_s3


def manifest_ref(uri: str, count: int) -> dict[str, Any]:
    """The small reference a task returns for the manifest at ``uri`` holding ``count`` items."""
    bucket, key = split_s3(uri) if is_s3(uri) else ("", "")
    return {"uri": uri, "bucket": bucket, "key": key, "count": int(count)}


def write_manifest(uri: str, items: list[Any]) -> dict[str, Any]:
    """Write ``items`` as the manifest at ``uri`` and return its reference."""
    store.put_json(uri, items)
    return manifest_ref(uri, len(items))


def is_manifest_ref(value: Any) -> bool:
    return (
        isinstance(value, dict) and isinstance(value.get("uri"), str) and "bucket" in value and "key" in value
    )


def read_manifest(ref: dict[str, Any]) -> list[Any]:
    """The items of the manifest a reference points to."""
    items = store.get_json(ref["uri"])
    if not isinstance(items, list):
        raise StoreError(f"manifest {ref['uri']} is not a JSON array")
    return items
