"""``shardfold plan`` for getbatch jobs: item sizes (probed), parts, and each task's window and spool."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from client import pricing
from client.planning import KindEstimate, MiB, TaskLoad, estimator, map_names_for
from functions.errors import ObjectNotFound, StoreError

PROBE_THREADS = 32
# Python memory of one parsed BatchItem plus its JSON (plan and assemble hold all of them / their rows).
ITEM_OBJECT_BYTES = 1024
STATUS_ROW_BYTES = 400
# Objects above this are written with multipart upload; each part is one PUT (functions.store).
MULTIPART_CHUNK = 8 * MiB


def _probe_sizes(uris: list[str]) -> tuple[dict[str, int], list[str]]:
    """Sizes of the given objects (HEAD/stat), and those that do not exist."""
    from functions import store

    sizes: dict[str, int] = {}
    missing: list[str] = []

    def one(uri: str) -> None:
        try:
            sizes[uri] = store.size(uri)
        except ObjectNotFound:
            missing.append(uri)

    with ThreadPoolExecutor(PROBE_THREADS) as pool:
        list(pool.map(one, uris))
    return sizes, missing


def _store_defaults() -> tuple[int, int]:
    """(window, concurrency) the GetBatch engine uses when the job does not say."""
    from functions.store import batch

    concurrency = int(batch.DEFAULT_CONCURRENCY)
    return int(getattr(batch, "DEFAULT_WINDOW", 0) or 2 * concurrency), concurrency


@estimator("getbatch")
def estimate_getbatch(spec: Any, store_root: str, probe_limit: int) -> KindEstimate:
    from functions.getbatch import core

    items = core.load_items(spec, store_root)
    n = len(items)
    per_part = spec.items_per_part
    parts = math.ceil(n / per_part)
    window, concurrency = _store_defaults()
    notes: list[str] = []

    # Item sizes: exact for ranges with a length, probed (HEAD/stat) for whole objects. A TAR member's size
    # is unknown before the engine indexes its shard: it is bounded by the shard, assumed 1 MiB at most.
    unknown = sorted({i.uri for i in items if i.length is None})
    if len(unknown) > probe_limit:
        step = len(unknown) / probe_limit
        probe = [unknown[int(k * step)] for k in range(probe_limit)]
        notes.append(f"sizes probed for {len(probe):,} of {len(unknown):,} distinct objects (evenly sampled)")
    else:
        probe = unknown
    try:
        sizes, missing = _probe_sizes(probe)
    except StoreError as exc:  # e.g. no credentials for a bucket: plan without sizes rather than fail
        sizes, missing = {}, []
        notes.append(f"object sizes unknown ({exc}); memory and time assume 1 MiB objects")
    shards = {i.uri for i in items if i.archpath is not None}
    plain = [v for u, v in sizes.items() if u not in shards]
    fallback = int(sum(plain) / len(plain)) if plain else MiB
    missing_set = set(missing)

    def item_bytes(i: Any) -> int:
        if i.length is not None:
            return i.length
        if i.uri in missing_set:
            return 0
        whole = sizes.get(i.uri, fallback)
        if i.archpath is not None:
            return min(whole, MiB)
        return max(whole - i.start, 0)

    item_sizes = [item_bytes(i) for i in items]
    if shards:
        notes.append(f"{sum(1 for i in items if i.archpath)} TAR member(s): sizes assumed <= 1 MiB each")
    largest_buffered = max(item_sizes, default=0)
    total = sum(item_sizes)
    part_bytes = max(
        (sum(item_sizes[p * per_part : (p + 1) * per_part]) for p in range(parts)),
        default=0,
    )
    if missing:
        how = "become __404__ placeholders" if spec.continue_on_error else "will fail the job"
        notes.append(f"{len(missing)} object(s) not found, e.g. {missing[0]}: they {how}")

    base = pricing.LAMBDA_BASELINE_MB * MiB
    spool = min(part_bytes, core.SPOOL_BYTES)  # the TAR fragment is spooled in memory up to SPOOL_BYTES
    gather_peak = base + min(window, per_part) * largest_buffered + spool + per_part * ITEM_OBJECT_BYTES
    gather = TaskLoad(
        peak_bytes=gather_peak,
        gets=2 + min(per_part, n),  # spec + part list + one GET per item
        puts=1 + math.ceil(max(part_bytes, 1) / MULTIPART_CHUNK) + (2 if part_bytes > MULTIPART_CHUNK else 0),
        duration_s=pricing.TASK_OVERHEAD_S
        + math.ceil(min(per_part, n) / concurrency) * pricing.S3_GET_LATENCY_S
        + part_bytes / pricing.LAMBDA_NET_BYTES_PER_S,
    )
    plan = TaskLoad(
        peak_bytes=base + n * ITEM_OBJECT_BYTES * 2,  # parsed items + their JSON for the part lists
        gets=1 + (1 if spec.manifest else 0),
        puts=parts + 1,
        duration_s=pricing.TASK_OVERHEAD_S + (parts + 1) * pricing.S3_GET_LATENCY_S,
    )
    assemble = TaskLoad(
        peak_bytes=base + n * STATUS_ROW_BYTES * 2,  # the rows plus the status.jsonl text
        gets=1 + parts,
        # trailer, multipart create + one copy per fragment + complete, status, result, and a LIST to clean up
        puts=1 + (parts + 3) + 1 + 1 + 1,
        duration_s=pricing.TASK_OVERHEAD_S + (parts + 5) * pricing.S3_GET_LATENCY_S,
    )
    if gather_peak > 0:
        notes.append(
            f"gather holds up to {min(window, per_part)} items in flight "
            f"(largest {largest_buffered / MiB:.2f} MiB) plus a TAR fragment spooled in memory "
            f"up to {core.SPOOL_BYTES // MiB} MiB"
        )
    if largest_buffered * min(window, per_part) > 512 * MiB:
        notes.append(
            "to fit: give large objects byte ranges (start/length) so each item stays small, or raise the "
            "gather function's memory_mb"
        )
    if n * ITEM_OBJECT_BYTES * 2 > 512 * MiB:
        notes.append("to fit: a request this long needs a bigger plan function; split it into several jobs")
    tar_overhead = n * 1024 + 1024  # a 512-byte header per member (plus padding) and the trailer
    return KindEstimate(
        items=n,
        loads={"plan": plan, "gather": gather, "assemble": assemble},
        map_items=map_names_for(spec.kind, parts),
        notes=notes,
        output_bytes=total + tar_overhead,
    )
