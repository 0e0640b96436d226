"""A fedavg round's progress in bytes: how much of the averaged model the aggregate tasks have written.

The executors count the aggregate step's shards; each shard is a byte range of the model, folded from every
client, so the bytes done are the shards' ranges whose part object exists. Read from the shard work list and
one listing of the parts, then from the result once the round has it (the scratch is gone then).
"""

from __future__ import annotations

import re
from typing import Any

from shardfold.functions import store
from shardfold.functions.fedavg.core import STAGE, job_uri, worklist_uri
from shardfold.functions.kinds import counted, counter

_PART = re.compile(r"/(\d{5})\.bin$")  # jobs/<id>/fedavg/parts/<shard:05d>.bin, as core.part_uri names it


def progress(store_root: str, job_id: str) -> dict[str, dict[str, Any]]:
    """``aggregated_bytes``: the model's data bytes in finished shards, of all of them. Empty until the
    round is planned."""
    return counted(_from_result, _from_parts, store_root, job_id)


def _from_result(store_root: str, job_id: str) -> dict[str, dict[str, Any]] | None:
    uri = job_uri(store_root, job_id, "result.json")
    if not store.exists(uri):
        return None
    size = int(store.get_json(uri)["data_bytes"])
    return {"aggregated_bytes": counter(size, size, "bytes")}


def _from_parts(store_root: str, job_id: str) -> dict[str, dict[str, Any]]:
    uri = worklist_uri(store_root, job_id)
    if not store.exists(uri):
        return {}
    ranges = {int(s["shard"]): int(s["end"]) - int(s["start"]) for s in store.get_json(uri)}
    done = 0
    for part in store.list_uris(job_uri(store_root, job_id, STAGE, "parts") + "/"):
        found = _PART.search(part)
        if found is not None:
            done += ranges.get(int(found[1]), 0)
    return {"aggregated_bytes": counter(done, sum(ranges.values()), "bytes")}
