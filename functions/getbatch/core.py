"""Pure core of the ``getbatch`` job: plan → gather parts → assemble.

* **plan** splits the request into parts of ``items_per_part`` items, writes each part's item list and a
  work list of the parts (Distributed Map reads it with ``ItemReader``), so no item list ever travels
  through the control plane. A part of an inline request with nothing pinned needs no list: its work list
  entry says ``inline`` and gather takes the items from the spec. Every object read more than once — named
  by several items (ranges of one object), or a TAR shard (its index, then its members) — is pinned (one
  HEAD or stat each, all in flight at once) and each part records the pins of its objects, so one job never
  mixes two versions of an object. An object read once needs no pin: its one GET is one version, whenever
  the plan was made (an item too large for the engine's byte budget, read in ranges, is held to the version
  its first read found).
* **gather** fetches one part with the GetBatch engine and streams it into the store as a TAR *fragment*
  (members only, no end-of-archive marker) plus its per-item status rows (as JSON Lines, as the status file
  will hold them) and its *tally* (items, failures, bytes); every read carries its object's
  pin, so an object changed since the plan fails the job (:class:`InputChanged`, never a placeholder);
  the only part of a request is written as the whole archive at the output URI, with its status file
  and the job result, leaving nothing to assemble.
* **assemble** concatenates the fragments and a TAR trailer into one archive, and the parts' status rows
  into the per-item status file, both server-side; it reads only the parts' tallies (its memory does not
  grow with the items), writes the job result, then removes the temporaries (after a one-part request,
  only the temporaries).

Each task logs one summary line (never a line per item, never an object's bytes): prepare ``planned
getbatch`` (items, parts, pinned objects, the part work list's URI), gather ``gathered part`` (the part,
its items, how many failed, their bytes, and the fragment or archive it wrote with its size and status
rows), assemble ``assembled getbatch`` (the archive and its size, the status file, items, failed
items and bytes; ``result already committed`` when an earlier attempt or the only part committed it).

Every object goes to a key derived from (job id, stage, part), so retries and resumes overwrite identical
bytes and never double-count.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

from pydantic import ValidationError

from shardfold.functions import access, jsontext, store
from shardfold.functions.errors import (
    BatchItemError,
    InputChanged,
    ObjectNotFound,
    ShardfoldError,
    SpecError,
    StoreError,
    TooManySoftErrors,
    UnsafeKey,
)
from shardfold.functions.getbatch.spec import GetBatchSpec
from shardfold.functions.jobs import scratch_key
from shardfold.functions.log import logger
from shardfold.functions.specs import BatchItem, describe_errors, json_type
from shardfold.functions.store.tar import TAR_TRAILER, write_tar
from shardfold.functions.store.uri import FILE, join
from shardfold.functions.worklist import worklist_ref

STAGE = "getbatch"
# Parts of local files run in worker processes locally (their reads keep an interpreter busy) when the
# request has this many items: starting the workers costs ~0.35 s in a process that has none yet, and
# processes save ~35 us an item against parts taking turns on one interpreter. Measured on 2 cores, a
# one-shot `shardfold run` of 4,000 items: 0.64 s on threads, 0.95 s in processes; of 20,000: 1.69, 1.57.
PROCESS_MIN_ITEMS = 10_000
_ROW_ENCODER = json.JSONEncoder(sort_keys=True)  # a status.jsonl row, as json.dumps(row, sort_keys=True)
_quote = json.encoder.encode_basestring_ascii  # how json.dumps writes a string (ensure_ascii)
_ROW_KEYS = {"error", "index", "name", "size"}  # a row write_tar makes


def job_uri(store_root: str, job_id: str, *parts: str) -> str:
    return join(store_root, "jobs", job_id, *parts)


def output_uri(spec: GetBatchSpec, store_root: str, job_id: str) -> str:
    if spec.output:
        return access.output_uri(spec.output, store_root, "output", job_id)
    return job_uri(store_root, job_id, "output", "batch.tar")


def load_items(spec: GetBatchSpec, store_root: str) -> list[BatchItem]:
    """The request's items, from the spec or from its manifest (a JSON array or JSON Lines of items).

    Every bad item is reported (up to ten in the message, all in ``SpecError.errors``) by its index in the
    request, ``items.<i>`` with the field at fault, and for a JSON Lines manifest by its line too."""
    lines: list[int] | None = None
    if spec.items is not None:  # validated with the spec: only the URIs are checked again
        raw: list[Any] = list(spec.items)
    else:
        assert spec.manifest is not None  # the spec validator guarantees one source
        raw, lines = _read_manifest(spec.manifest, store_root)
    items = []
    errors = []
    checked: set[str] = set()  # folders found not to be links, shared by every item's check
    for i, doc in enumerate(raw):
        where = f" (manifest line {lines[i]})" if lines is not None else ""
        try:
            items.append(parse_item(doc, store_root, checked=checked))
        except ValidationError as exc:
            errors += [
                {"field": e["field"], "error": e["error"] + where}
                for e in describe_errors(exc, prefix=f"items.{i}")
            ]
        except UnsafeKey as exc:
            errors.append({"field": f"items.{i}.uri", "error": str(exc) + where})
        except (ValueError, ShardfoldError) as exc:
            errors.append({"field": f"items.{i}", "error": str(exc) + where})
    if errors:
        summary = "; ".join(f"{e['field']}: {e['error']}" for e in errors[:10])
        source = f"manifest {spec.manifest}: " if spec.manifest is not None else ""
        raise SpecError(f"{source}{len(errors)} invalid item(s): {summary}", errors)
    return items


def _read_manifest(manifest: str, store_root: str) -> tuple[list[Any], list[int] | None]:
    """(items, their line numbers for JSON Lines, else None) of a manifest; :class:`SpecError` naming the
    manifest and the line when it is not UTF-8 or not JSON."""
    data = store.get(access.input_uri(manifest, store_root, "manifest"))

    def refuse(line: int | None, what: str) -> SpecError:
        where = f"manifest {manifest}" + (f", line {line}" if line is not None else "")
        return SpecError(f"{where}: {what}", [{"field": "manifest", "error": what}])

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise refuse(
            line,
            f"not UTF-8 text (byte {exc.start} of the file: {exc.reason}); "
            "a manifest is a JSON array or JSON Lines, saved as UTF-8",
        ) from None
    if text.lstrip().startswith("["):
        try:
            raw = jsontext.loads(text)
        except jsontext.JSONTextError as exc:
            raise refuse(None, f"not a JSON array of items ({exc})") from None
        if not raw:
            raise SpecError(f"manifest {manifest} lists no items", [{"field": "manifest", "error": "empty"}])
        return raw, None
    raw, lines = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw.append(jsontext.loads(line))
        except jsontext.JSONTextError as exc:
            raise refuse(n, f"not a JSON value ({exc}); JSON Lines holds one item per line") from None
        lines.append(n)
    if not raw:
        raise SpecError(f"manifest {manifest} lists no items", [{"field": "manifest", "error": "empty"}])
    return raw, lines


def parse_item(doc: Any, store_root: str, field: str = "", checked: set[str] | None = None) -> BatchItem:
    """One item of a request (a bare URI is shorthand for a whole object), its URI resolved and allowed
    (``checked``: see :func:`functions.access.input_uri`)."""
    if isinstance(doc, BatchItem):  # already valid (an inline item of a parsed spec)
        uri = access.input_uri(doc.uri, store_root, field, checked=checked)
        return doc if uri == doc.uri else doc.model_copy(update={"uri": uri})
    if not isinstance(doc, str | dict):
        raise ValueError(
            f'an item is a URI string or an object {{"uri": ..., "start", "length", "archpath", '
            f'"name"}}, got {json_type(doc)}'
        )
    item = BatchItem.model_validate({"uri": doc} if isinstance(doc, str) else doc)
    return item.model_copy(update={"uri": access.input_uri(item.uri, store_root, field, checked=checked)})


def prepare(spec: GetBatchSpec, job_id: str, store_root: str) -> dict:
    """Split the request into parts and write their item lists and the part work list."""
    items = load_items(spec, store_root)
    size = spec.items_per_part
    n_parts = math.ceil(len(items) / size)
    inputs = [(f"items.{i}.uri", item.uri) for i, item in enumerate(items)]
    if spec.manifest:
        inputs.append(("manifest", access.input_uri(spec.manifest, store_root, "manifest")))
    # the only part writes the archive (a retried gather would read it); else assemble does, after every read
    access.not_an_input(output_uri(spec, store_root, job_id), inputs, "output", after_reads=n_parts > 1)
    reads = Counter(item.uri for item in items)
    shards = {item.uri for item in items if item.archpath is not None}
    shared = [u for u, n in reads.items() if n > 1 or u in shards]
    pins = {u: pin.to_doc() for u, pin in store.pins(shared).items() if pin is not None}  # None: missing
    in_processes = n_parts > 1 and len(items) >= PROCESS_MIN_ITEMS
    worklist = []
    for p in range(n_parts):
        chunk = items[p * size : (p + 1) * size]
        ref = {"part": p, "first": p * size, "count": len(chunk), "of": n_parts}
        worklist.append(ref | _part_source(spec, job_id, store_root, p, chunk, pins, in_processes))
    worklist_uri = job_uri(store_root, job_id, STAGE, "worklist.json")
    store.put_json(worklist_uri, worklist, indent=None)
    logger.info(
        "planned getbatch",
        extra={
            "job_id": job_id,
            "items": len(items),
            "parts": n_parts,
            "items_per_part": size,
            "pinned": len(pins),  # objects read more than once, held to one version
            "part_lists": sum(1 for ref in worklist if not ref.get("inline")),
            "worklist": worklist_uri,
        },
    )
    return {"worklist": worklist_ref(worklist_uri, n_parts), "parts": n_parts, "items": len(items)}


def _part_source(
    spec: GetBatchSpec,
    job_id: str,
    store_root: str,
    part: int,
    chunk: list[BatchItem],
    pins: dict[str, dict],
    in_processes: bool,
) -> dict:
    """How part ``part`` is gathered: in a worker process or not, from the spec's items (``inline``) or from
    its item list, written here with its pins."""
    how: dict[str, Any] = {}
    if in_processes and all(i.uri.startswith(FILE) for i in chunk):
        how["mode"] = "process"  # local files only: CPU-bound (see workflow.GATHER_PART)
    part_pins = {i.uri: pins[i.uri] for i in chunk if i.uri in pins}
    if spec.items is not None and not part_pins:
        how["inline"] = True  # gather takes these items from the spec itself: no part list to write
    else:
        part_doc = {"items": [i.model_dump(exclude_none=True) for i in chunk], "pins": part_pins}
        store.put_json(_part_uri(store_root, job_id, part), part_doc, indent=None)
    return how


def gather(
    spec: GetBatchSpec, job_id: str, store_root: str, part: int, parts: int = 0, inline: bool = False
) -> dict:
    """Fetch one part in request order and write its TAR fragment and status rows.

    ``inline``: the part is the spec's own items, none pinned (prepare wrote no part list); they are
    resolved and checked again here. The only part of a request (``parts == 1``) is written as the whole
    archive, trailer included, at the output URI, with the status file and the result: there is nothing
    to assemble, so the data is written once instead of twice and assemble only clears the scratch."""
    first = part * spec.items_per_part  # the part's first item in the whole request
    if inline:
        if spec.items is None:
            raise SpecError(f"part {part} is marked inline, but the request lists its items in a manifest")
        chunk = spec.items[first : first + spec.items_per_part]
        checked: set[str] = set()  # folders found not to be links, shared by every item's check
        items = [parse_item(i, store_root, f"items.{first + k}.uri", checked) for k, i in enumerate(chunk)]
        pins: dict[str, store.Pin] = {}
    else:
        doc = store.get_json(_part_uri(store_root, job_id, part))
        if isinstance(doc, list):  # a part list written before inputs were pinned
            doc = {"items": doc, "pins": {}}
        items = [BatchItem.model_validate(d) for d in doc["items"]]
        pins = {uri: store.Pin(**pin) for uri, pin in doc["pins"].items()}
    whole = parts == 1
    entries = store.get_batch(
        items, continue_on_error=spec.continue_on_error, max_soft_errors=spec.max_soft_errors, pins=pins
    )
    # The fragment streams straight into the store (a multipart upload on S3), so the task holds the
    # engine's byte budget and a write buffer, never the fragment.
    target = output_uri(spec, store_root, job_id) if whole else _fragment_uri(store_root, job_id, part)
    try:
        with store.writer(target) as out:
            frag = _Counted(out)
            rows = write_tar(entries, frag, end_of_archive=whole)  # type: ignore[arg-type]
            for row in rows:
                row["index"] += first
            tally = _tally(rows)
            if whole:
                _check_soft_errors(spec, tally)  # before the archive is committed
    except BatchItemError as exc:  # name the item by its place in the user's request, not the part
        if isinstance(exc.__cause__, InputChanged):
            raise InputChanged(f"item {first + exc.index}: {exc.__cause__}", uri=exc.__cause__.uri) from None
        raise BatchItemError(first + exc.index, exc.item, exc.reason) from None
    said: dict[str, Any] = {"job_id": job_id, "part": part, "parts": parts or None, "items": len(rows)}
    said |= {"failed": tally["errors"], "item_bytes": tally["bytes"]}
    if whole:
        status = _status_file(store_root, job_id)
        store.put(status, _status_lines(rows))
        _commit_result(job_id, store_root, tally, 1, target)
        said |= {"archive": target, "archive_bytes": frag.bytes, "status": status}
    else:
        # the rows as they will stand in the status file (assemble joins the parts' bytes), then the part's
        # tally (assemble's counts, and the mark that the part's rows are all written)
        status = _part_status_uri(store_root, job_id, part)
        store.put(status, _status_lines(rows))
        store.put_json(_part_tally_uri(store_root, job_id, part), tally, indent=None)
        said |= {"fragment": target, "fragment_bytes": frag.bytes, "status": status}
    logger.info("gathered part", extra=said)  # one line per part, never one per item
    return {"part": part, "items": len(rows), "errors": tally["errors"], "bytes": tally["bytes"]}


class _Counted:
    """A file to write through that counts what is written (a fragment's size, known without a HEAD)."""

    def __init__(self, out: Any):
        self._write = out.write
        self.bytes = 0

    def write(self, data: bytes) -> int:
        self.bytes += len(data)
        return self._write(data)


def _tally(rows: list[dict]) -> dict:
    """A part's counts: its items, how many failed (and the first that did), their bytes."""
    failed = [r for r in rows if r["error"]]
    first = {"index": failed[0]["index"], "error": failed[0]["error"]} if failed else None
    return {
        "items": len(rows),
        "errors": len(failed),
        "bytes": sum(r["size"] for r in rows),
        "first_error": first,
    }


def read_tally(uri: str) -> dict:
    """A part's tally as gather wrote it; :class:`StoreError` naming the object when it is not one (anyone who
    may write the store may have written it)."""
    doc = store.get_json(uri)
    counts = isinstance(doc, dict) and all(
        type(doc.get(k)) is int and doc[k] >= 0 for k in ("items", "errors", "bytes")
    )
    first = doc.get("first_error") if isinstance(doc, dict) else None
    if not counts or not (
        first is None or (isinstance(first, dict) and type(first.get("index")) is int and "error" in first)
    ):
        raise StoreError(
            f"{uri} is not a part's tally (items, errors, bytes, first_error): the job's scratch was "
            "altered; run it again"
        )
    return doc


def _joined(tallies: list[dict]) -> dict:
    """The tally of consecutive parts, in request order."""
    first = next((t["first_error"] for t in tallies if t.get("first_error")), None)
    totals = {k: sum(t[k] for t in tallies) for k in ("items", "errors", "bytes")}
    return {**totals, "first_error": first}


def _check_soft_errors(spec: GetBatchSpec, tally: dict) -> None:
    failed, first = tally["errors"], tally["first_error"]
    if spec.max_soft_errors is not None and failed > spec.max_soft_errors:
        raise TooManySoftErrors(
            f"{failed} items failed, more than max_soft_errors={spec.max_soft_errors}; "
            f"first: item {first['index']} ({first['error']})"
        )


def assemble(spec: GetBatchSpec, job_id: str, store_root: str, parts: int) -> dict:
    """Join the fragments into the archive, write the status file and the result, clean up.

    After a one-part request's gather (which committed all three) and after a retried assemble, the
    result stands and only the scratch goes."""
    result_uri = job_uri(store_root, job_id, "result.json")
    if store.exists(result_uri):
        store.delete_prefix(join(store_root, scratch_key(job_id, STAGE)))
        result = store.get_json(result_uri)
        _log_assembled("result already committed", job_id, result, None)
        return result
    # the parts' tallies, not their rows: assemble holds a few numbers per part, however many items
    tally = _joined([read_tally(_part_tally_uri(store_root, job_id, p)) for p in range(parts)])
    _check_soft_errors(spec, tally)
    out = output_uri(spec, store_root, job_id)
    fragments = [_fragment_uri(store_root, job_id, p) for p in range(parts)]
    archive_bytes = None
    if parts == 1 and not store.exists(fragments[0]):  # the only part's gather wrote the archive itself
        if not store.exists(out):
            raise ObjectNotFound(
                f"the archive {out} that part 0 wrote is gone; resume the job to fetch it again"
            )
    else:
        trailer = job_uri(store_root, job_id, STAGE, "fragments", "trailer.tar")
        store.put(trailer, TAR_TRAILER)
        archive_bytes = store.assemble([*fragments, trailer], out)
    status = _status_file(store_root, job_id)
    store.assemble([_part_status_uri(store_root, job_id, p) for p in range(parts)], status)
    result = _commit_result(job_id, store_root, tally, parts, out)
    store.delete_prefix(join(store_root, scratch_key(job_id, STAGE)))  # part lists, fragments, status rows
    _log_assembled("assembled getbatch", job_id, result, archive_bytes)
    return result


def _log_assembled(message: str, job_id: str, result: Any, archive_bytes: int | None) -> None:
    """assemble's one line: the archive and status file the job's result names, items and bytes."""
    doc = result if isinstance(result, dict) else {}
    said = {k: doc.get(k) for k in ("archive", "status", "parts", "items")}
    said |= {"failed": doc.get("errors"), "item_bytes": doc.get("bytes"), "archive_bytes": archive_bytes}
    logger.info(message, extra={"job_id": job_id, **said})


def _status_lines(rows: list[dict]) -> bytes:
    """Rows as the per-item status file holds them: JSON Lines, keys sorted, each exactly
    ``json.dumps(row, sort_keys=True)`` (written from a template with json's own string encoder: a part
    has thousands of rows, and an encoder call per row was a tenth of a part's time)."""
    return "".join([_status_line(r) for r in rows]).encode()


def _status_line(row: dict) -> str:
    if row.keys() != _ROW_KEYS:
        return _ROW_ENCODER.encode(row) + "\n"  # not a row write_tar makes
    error, index, name, size = row["error"], row["index"], row["name"], row["size"]
    if (type(index), type(size), type(name)) != (int, int, str) or not (error is None or type(error) is str):
        return _ROW_ENCODER.encode(row) + "\n"
    said = "null" if error is None else _quote(error)
    return f'{{"error": {said}, "index": {index}, "name": {_quote(name)}, "size": {size}}}\n'


def _commit_result(job_id: str, store_root: str, tally: dict, parts: int, archive: str) -> dict:
    """Write the result (after the archive and the status file: it marks the job's output complete)."""
    result = {
        "job_id": job_id,
        "kind": "getbatch",
        "archive": archive,
        "status": _status_file(store_root, job_id),
        "items": tally["items"],
        "errors": tally["errors"],
        "bytes": tally["bytes"],
        "parts": parts,
    }
    store.put_json(job_uri(store_root, job_id, "result.json"), result)
    return result


def _status_file(root: str, job_id: str) -> str:
    return job_uri(root, job_id, "output", "status.jsonl")


def _part_uri(root: str, job_id: str, part: int) -> str:
    return job_uri(root, job_id, STAGE, "parts", f"{part:05d}.json")


def _fragment_uri(root: str, job_id: str, part: int) -> str:
    return job_uri(root, job_id, STAGE, "fragments", f"{part:05d}.tar")


def _part_status_uri(root: str, job_id: str, part: int) -> str:
    return job_uri(root, job_id, STAGE, "status", f"{part:05d}.jsonl")


def _part_tally_uri(root: str, job_id: str, part: int) -> str:
    # not <part>.json, where gathers before the tallies wrote a part's rows: a job resumed across the change
    # finds no tally (ObjectNotFound naming it) rather than misreading rows
    return job_uri(root, job_id, STAGE, "status", f"{part:05d}.tally.json")
