"""Task loads of a getbatch job, from the engine's own constants (see :mod:`functions.estimate`).

* **probe**: the item list (inline, or the manifest when it fits the probe's byte budget; beyond, the
  count is extrapolated from its first bytes). Only when the budget asks for the figures (``shardfold
  plan``; submit does not) the sizes of up to ``budget.objects`` distinct objects too (evenly sampled), looked
  up on the store's shared pool: the memory check needs no size, because the engine's memory is bounded in
  bytes. Submit HEADs one object only to see that the S3 endpoint answers, and not even that when it
  answered this process within the last minute. A TAR member's size is unknown before the engine indexes
  its shard: it is bounded by the shard and assumed at most 1 MiB.
* **loads**: a gather task holds what the GetBatch engine holds — buffered answers and reads in flight,
  at most :data:`functions.store.batch.DEFAULT_MAX_BYTES` plus one read's step whatever the objects'
  sizes (a larger item is streamed through in ranges); where the sizes are known, no more than ``window``
  items (the engine's default window, :data:`~functions.store.batch.WINDOW_PER_READ` x its concurrency,
  never more than the part's items) times the largest — plus the write buffer of its TAR fragment,
  streamed to the store in parts (:data:`functions.store.s3.WRITE_PART`, two at a time), plus the parsed
  items (every task parses the spec, so with an inline request all of them). plan holds the parsed
  request; assemble only each part's tally (the parts' status rows are joined in the store). Without sizes,
  the time, cost and output figures assume 1 MiB objects (items with a ``length`` count as that length).
"""

from __future__ import annotations

import math
import os
from typing import Any

from shardfold.functions import access, jsontext, pricing, store
from shardfold.functions.errors import ShardfoldError, SpecError
from shardfold.functions.estimate import Loads, MiB, Probe, ProbeBudget, TaskLoad
from shardfold.functions.getbatch import core
from shardfold.functions.getbatch.spec import GetBatchSpec
from shardfold.functions.getbatch.workflow import ASSEMBLE, GATHER, GATHER_PART, PREPARE
from shardfold.functions.store import batch, s3
from shardfold.functions.store.uri import join, local_path
from shardfold.functions.tables import size_text

# Python memory of one parsed BatchItem plus its JSON (measured: 576 bytes held, 769 at the parse's peak).
ITEM_OBJECT_BYTES = 1024
TALLY_BYTES = 512  # one part's tally as assemble holds it (a dict of four numbers and the first error)
TAR_MEMBER_ASSUMED = 1 * MiB
UNKNOWN_OBJECT_ASSUMED = 1 * MiB  # an object whose size was not looked up, for the figures only
RUNTIME_BYTES = pricing.LAMBDA_BASELINE_MB * MiB
ENDPOINT_ANSWERED_S = 60.0  # how recent an answer from the S3 endpoint spares submit its one HEAD


def _items(spec: GetBatchSpec, store_root: str, budget: ProbeBudget) -> tuple[list[Any], int, list[str]]:
    """(items read, the request's item count, notes). A manifest over the byte budget is read in part.

    Inline items are the spec's own (submit's policy check has resolved and allowed every URI); they are
    resolved here only when their sizes are to be looked up."""
    if spec.items is not None:
        if not budget.figures:
            return list(spec.items), len(spec.items), []
        items = [
            core.parse_item(i.model_dump(), store_root, f"items.{k}.uri") for k, i in enumerate(spec.items)
        ]
        return items, len(items), []
    uri = access.input_uri(spec.manifest, store_root, "manifest")
    total = store.size(uri)
    if total <= budget.data_bytes:
        items = core.load_items(spec, store_root)
        return items, len(items), []
    head = store.get(uri, 0, budget.data_bytes).decode("utf-8", errors="ignore")
    seen = head.count('"uri"') or head.count("\n") or 1
    n = max(seen, round(seen * total / len(head.encode())))
    rows = [line for line in head.splitlines()[:-1] if line.strip().startswith("{")]
    items = []
    for line in rows:
        try:
            items.append(core.parse_item(jsontext.loads(line.rstrip(",")), store_root))
        except (ValueError, ShardfoldError):
            continue
    return items, n, [f"manifest of {total / MiB:,.1f} MiB: ~{n:,} items, extrapolated from its first bytes"]


def _sizes(
    spec: GetBatchSpec, items: list[Any], budget: ProbeBudget, notes: list[str]
) -> dict[str, int | None]:
    """Sizes of (a sample of) the objects read whole or to their end; {} when the budget says not to."""
    if not budget.figures:
        _check_endpoint(items, notes)
        return {}
    unknown = sorted({i.uri for i in items if i.length is None})
    if len(unknown) > budget.objects:
        step = len(unknown) / budget.objects
        sample = [unknown[int(k * step)] for k in range(budget.objects)]
        notes.append(
            f"sizes probed for {len(sample):,} of {len(unknown):,} distinct objects (evenly sampled)"
        )
    else:
        sample = unknown
    try:
        return store.sizes(sample)
    except ShardfoldError as exc:  # e.g. no permission on a bucket: size from the fallback, say so
        notes.append(f"object sizes unknown ({exc}); time and cost assume 1 MiB objects")
        return {}


def _check_endpoint(items: list[Any], notes: list[str]) -> None:
    """One HEAD of the first ``s3://`` item, unless the S3 endpoint answered this process in the last
    :data:`ENDPOINT_ANSWERED_S`: an endpoint that does not answer is then refused at submit, naming it,
    rather than failing the job's gather after its retries. (An object that is not there, or not allowed, is
    the job's to report.)"""
    first = next((i.uri for i in items if i.uri.startswith("s3://")), None)
    if first is None or s3.answered_within(ENDPOINT_ANSWERED_S):
        return
    try:
        store.sizes([first])
    except ShardfoldError as exc:
        notes.append(f"{first}: {exc}")


# Local files among a spec's inline items that submit stats (a stat costs microseconds; S3 objects are left
# to the job, which reports each one)
MAX_LOCAL_CHECKS = 10_000


def _refuse_missing_local_files(spec: GetBatchSpec, store_root: str) -> None:
    """At submit: an inline item that is a local file (``file://``, an absolute path, a key of the local
    store) that does not exist fails the job unless ``continue_on_error``: refused here, naming it."""
    if spec.items is None or spec.continue_on_error:
        return
    for k, item in enumerate(spec.items[:MAX_LOCAL_CHECKS]):
        # submit's policy check allowed every URI already: here only where it points
        uri = item.uri if "://" in item.uri else join(store_root, item.uri)
        if uri.startswith("file://") and not os.path.isfile(uri[len("file://") :]):
            raise SpecError(
                f"items.{k}.uri: no file at {local_path(uri)} (set continue_on_error to fetch the others and "
                "mark it missing)",
                [{"field": f"items.{k}.uri", "error": f"no file at {local_path(uri)}"}],
            )


def probe(spec: GetBatchSpec, store_root: str, budget: ProbeBudget) -> Probe:
    if budget.refuse:
        _refuse_missing_local_files(spec, store_root)
    items, n, notes = _items(spec, store_root, budget)
    found = _sizes(spec, items, budget, notes)
    missing = {u for u, s in found.items() if s is None}
    if missing:
        how = "become __404__ placeholders" if spec.continue_on_error else "will fail the job"
        notes.append(f"{len(missing)} object(s) not found, e.g. {min(missing)}: they {how}")
    members = sum(1 for i in items if i.archpath)
    if members:
        notes.append(f"{members} TAR member(s): sizes assumed <= 1 MiB each")
    if not budget.figures:
        notes.append("object sizes not looked up (the memory check needs none); `shardfold plan` does")
    return Probe(facts=_size_facts(spec, items, n, found), notes=notes)


def _size_facts(spec: GetBatchSpec, items: list[Any], n: int, found: dict[str, int | None]) -> dict[str, Any]:
    """The probe's facts: item count, largest item and part, total bytes and whether sizes were read."""
    fallback = _fallback(items, found)
    seen = [_item_bytes(i, found, fallback) for i in items]
    mean = sum(seen) / len(seen) if seen else fallback
    per_part = spec.items_per_part
    parts = math.ceil(n / per_part)
    part_bytes = max((sum(seen[p * per_part : (p + 1) * per_part]) for p in range(parts)), default=0)
    if len(seen) < n:  # the request was read in part: the rest is like what was seen
        part_bytes = max(part_bytes, int(mean * min(per_part, n)))
    # The largest item is known when every item read has a length or a looked-up size (not sampled, not a
    # TAR member's guess); otherwise the memory model uses the engine's byte bound.
    sized = len(items) == n and all(
        i.length is not None or (i.archpath is None and i.uri in found) for i in items
    )
    return {
        "items": n,
        # None: not known, and not needed for memory (the engine holds a bounded number of bytes)
        "largest_item_bytes": max(seen, default=fallback) if sized else None,
        "largest_part_bytes": part_bytes,
        "total_bytes": int(sum(seen) + mean * (n - len(seen))),
        # whether total_bytes rests on sizes read (lengths given or objects looked up), not an assumption
        "total_known": bool(found) or (bool(items) and all(i.length is not None for i in items)),
        "sizes_probed": len(found),
        "missing": sorted(u for u, v in found.items() if v is None),
    }


def _fallback(items: list[Any], found: dict[str, int | None]) -> int:
    """The size of an object not looked up: the mean of the plain objects that were, else 1 MiB."""
    shards = {i.uri for i in items if i.archpath is not None}
    plain = [v for u, v in found.items() if v is not None and u not in shards]
    return int(sum(plain) / len(plain)) if plain else UNKNOWN_OBJECT_ASSUMED


def _item_bytes(item: Any, found: dict[str, int | None], fallback: int) -> int:
    """The bytes an item reads: its length, else its object's size less its start (a TAR member <= 1 MiB)."""
    if item.length is not None:
        return item.length
    if item.uri in found and found[item.uri] is None:
        return 0
    whole = found.get(item.uri) or fallback
    return min(whole, TAR_MEMBER_ASSUMED) if item.archpath is not None else max(whole - item.start, 0)


def gather_buffer(per_part: int, largest: int | None) -> dict[str, int]:
    """What the engine holds in one gather task, named: its byte budget (plus one read's step), or, when the
    largest item is known, the window's worth of it if that is less."""
    concurrency = batch.DEFAULT_CONCURRENCY
    window = min(batch.WINDOW_PER_READ * concurrency, per_part)
    bound = batch.DEFAULT_MAX_BYTES + batch.step_bytes(batch.DEFAULT_MAX_BYTES, concurrency)
    if largest is not None and window * largest < bound:
        return {f"the engine's window ({window} item(s) of up to {size_text(largest)})": window * largest}
    return {"the engine's byte budget (whatever the objects' sizes)": bound}


def loads(spec: GetBatchSpec, probed: Probe) -> Loads:
    facts = probed.facts
    n = int(facts["items"])
    largest = facts.get("largest_item_bytes")
    part_bytes = int(facts["largest_part_bytes"])
    per_part = min(spec.items_per_part, n)
    parts = math.ceil(n / spec.items_per_part)
    concurrency = batch.DEFAULT_CONCURRENCY
    # the streamed fragment's part filling + uploading, no more than the part where its size is known
    write_buffer = 2 * s3.WRITE_PART if largest is None else min(part_bytes, 2 * s3.WRITE_PART)
    # every task parses the spec, an inline request's items with it; a part list holds one part's items
    spec_items = {f"the spec's {n:,} parsed items": n * ITEM_OBJECT_BYTES} if spec.items is not None else {}
    part_items = (
        {} if spec.items is not None else {f"{per_part:,} parsed items": per_part * ITEM_OBJECT_BYTES}
    )
    gather = TaskLoad(
        RUNTIME_BYTES,
        {
            **gather_buffer(per_part, None if largest is None else int(largest)),
            "the TAR fragment's write buffer": write_buffer,
            **(spec_items or part_items),
        },
        gets=2 + per_part,  # spec + part list + one GET per item
        puts=1 + math.ceil(max(part_bytes, 1) / s3.WRITE_PART) + (2 if part_bytes > s3.WRITE_PART else 0),
        duration_s=pricing.TASK_OVERHEAD_S
        + math.ceil(per_part / concurrency) * pricing.S3_GET_LATENCY_S
        + part_bytes / pricing.LAMBDA_NET_BYTES_PER_S,
    )
    plan = TaskLoad(
        RUNTIME_BYTES,
        {f"{n:,} parsed items and their part lists": n * ITEM_OBJECT_BYTES * 2},
        gets=1 + (1 if spec.manifest else 0),
        puts=parts + 1,
        duration_s=pricing.TASK_OVERHEAD_S + (parts + 1) * pricing.S3_GET_LATENCY_S,
    )
    assemble = TaskLoad(
        RUNTIME_BYTES,
        {
            **spec_items,
            f"{parts:,} parts' tallies": parts * TALLY_BYTES,
            # S3 joins parts under 5 MiB (the status rows', small fragments) in memory, one part at a time
            "small parts joined in memory": 2 * s3.MIN_PART if parts > 1 else 0,
        },
        gets=1 + 2 * parts,  # the spec, each part's tally and (when small) its status rows
        # trailer, multipart create + one copy per fragment + complete, status, result, and a LIST to clean up
        puts=1 + (parts + 3) + 1 + 1 + 1,
        duration_s=pricing.TASK_OVERHEAD_S + (parts + 5) * pricing.S3_GET_LATENCY_S,
    )
    too_long = "to fit: a request this long needs a bigger plan function; split it into several jobs"
    return Loads(
        items=n,
        tasks={PREPARE: plan, GATHER_PART: gather, ASSEMBLE: assemble},
        map_items={GATHER: parts},
        notes=[too_long] if n * ITEM_OBJECT_BYTES * 2 > 512 * MiB else [],
        # a 512-byte header per member (plus padding) and the trailer; unknown when no size was read (the
        # submit-time probe looks none up: an assumed size per object is no estimate of the output)
        output_bytes=int(facts["total_bytes"]) + n * 1024 + 1024 if facts.get("total_known", True) else None,
    )
