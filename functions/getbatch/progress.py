"""A getbatch job's progress in the user's units: items gathered and their bytes, part by part.

The executors count the gather step's tasks (parts of ``items_per_part`` items each); this counts what the
user asked for. Read from what the job already writes: the part work list (each part's item count) and the
tally each finished part leaves (its items' bytes), then the result once the job has it (the
scratch is gone then). A part's tally never changes once written (a retry writes the same bytes), so each is
read once per process however often progress is asked for.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

from shardfold.functions import store
from shardfold.functions.getbatch.core import STAGE, job_uri, read_tally
from shardfold.functions.kinds import counted, counter

# jobs/<id>/getbatch/status/<part:05d>.tally.json: a part's tally, as core.gather writes it
_PART = re.compile(r"/(\d{5})\.tally\.json$")
_CACHED_PARTS = 4096  # parts whose byte sums are kept (a few dozen bytes each)
_part_bytes: OrderedDict[str, int] = OrderedDict()
_lock = threading.Lock()


def progress(store_root: str, job_id: str) -> dict[str, dict[str, Any]]:
    """``gathered_items`` (of the request's) and ``gathered_bytes`` (their size; the total is known only at
    the end) of the parts finished so far. Empty until the parts are planned. A one-part request writes its
    archive and result at once, so it shows nothing done until then."""
    return counted(_from_result, _from_parts, store_root, job_id)


def _from_result(store_root: str, job_id: str) -> dict[str, dict[str, Any]] | None:
    uri = job_uri(store_root, job_id, "result.json")
    if not store.exists(uri):
        return None
    result = store.get_json(uri)
    items, size = int(result["items"]), int(result["bytes"])
    return {"gathered_items": counter(items, items, "items"), "gathered_bytes": counter(size, size, "bytes")}


def _from_parts(store_root: str, job_id: str) -> dict[str, dict[str, Any]]:
    worklist_uri = job_uri(store_root, job_id, STAGE, "worklist.json")
    if not store.exists(worklist_uri):
        return {}
    counts = {int(ref["part"]): int(ref["count"]) for ref in store.get_json(worklist_uri)}
    items = size = 0
    for uri in store.list_uris(job_uri(store_root, job_id, STAGE, "status") + "/"):
        found = _PART.search(uri)
        if found is None or int(found[1]) not in counts:
            continue
        items += counts[int(found[1])]
        size += _bytes_of(uri)
    return {
        "gathered_items": counter(items, sum(counts.values()), "items"),
        "gathered_bytes": counter(size, None, "bytes"),
    }


def _bytes_of(status_uri: str) -> int:
    """The bytes of one finished part's items (from its tally), read once per process."""
    with _lock:
        if status_uri in _part_bytes:
            _part_bytes.move_to_end(status_uri)
            return _part_bytes[status_uri]
    size = read_tally(status_uri)["bytes"]
    with _lock:
        _part_bytes[status_uri] = size
        while len(_part_bytes) > _CACHED_PARTS:
            _part_bytes.popitem(last=False)
    return size
