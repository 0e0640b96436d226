"""The object store: ``s3://`` and ``file://`` behind one interface, plus GetBatch.

Every function takes a URI (``s3://bucket/key``, ``file:///abs/path``) or a key relative to the store
root (``$SHARDFOLD_HOME``, default ``./.shardfold``). Missing objects raise :class:`ObjectNotFound`, bad
ranges :class:`InvalidRange`, keys that would leave the root :class:`UnsafeKey`.

Environment: ``SHARDFOLD_HOME`` (store root), ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (an S3
endpoint such as a moto server, honoured by boto3 and by GetBatch's CRT transport), ``AWS_REGION``,
``SHARDFOLD_S3_TRANSPORT`` (``crt`` default, or ``boto3``: the client GetBatch reads S3 with),
``AWS_MAX_ATTEMPTS`` (attempts per boto3 request, default 6: the first and 5 retries).
"""

from __future__ import annotations

import bisect
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

from shardfold.functions import jsontext, telemetry
from shardfold.functions.errors import ObjectExists, ObjectNotFound, StoreError
from shardfold.functions.store import local, s3, transport
from shardfold.functions.store.batch import BatchEntry, BatchStats, BatchStream, get_batch
from shardfold.functions.store.pinning import Pin, changed
from shardfold.functions.store.retry import RetryPolicy, TransientError
from shardfold.functions.store.tar import write_tar
from shardfold.functions.store.uri import (
    is_s3,
    join,
    local_path,
    reach,
    resolve,
    scoped,
    split_s3,
    store_root,
)

__all__ = [
    "BatchEntry",
    "BatchStats",
    "BatchStream",
    "Pin",
    "RetryPolicy",
    "TransientError",
    "assemble",
    "delete",
    "delete_prefix",
    "endpoint_errors",
    "exists",
    "get",
    "get_batch",
    "get_json",
    "is_s3",
    "join",
    "list_uris",
    "pin",
    "pins",
    "put",
    "put_file",
    "put_file_if_absent",
    "put_if_absent",
    "put_json",
    "reach",
    "resolve",
    "scoped",
    "size",
    "sizes",
    "split_s3",
    "spooled_writer",
    "store_root",
    "verify",
    "write_tar",
    "writer",
]


def get(uri: str, start: int = 0, length: int | None = None, pin: Pin | None = None) -> bytes:
    """The object's bytes, or ``length`` bytes from ``start`` (``None``: to the end). With a ``pin`` (from
    :func:`pin`), only the pinned object's: :class:`InputChanged` if it changed since, checked in the same
    request (S3 ``If-Match``; locally ``fstat`` of the opened file)."""
    uri = reach(uri)
    if is_s3(uri):
        return s3.get(uri, start, length, pin=pin)
    return local.get(local_path(uri), uri, start, length, pin)


def put(uri: str, data: bytes) -> None:
    """Write an object atomically: readers see the old object or the new one, never a mix."""
    uri = reach(uri, write=True)
    if is_s3(uri):
        s3.put(uri, bytes(data))
    else:
        local.put(local_path(uri), data)


def put_file(uri: str, fileobj: BinaryIO) -> None:
    """Like :func:`put`, streaming from a binary file object (memory does not grow with its size)."""
    uri = reach(uri, write=True)
    if is_s3(uri):
        s3.put_file(uri, fileobj)
    else:
        local.put_file(local_path(uri), fileobj)


@contextmanager
def writer(uri: str) -> Iterator[BinaryIO]:
    """A file to stream an object into, without holding it: it appears whole when the block exits cleanly
    and not at all when it raises (locally a temporary file renamed into place; on S3 a multipart upload
    holding at most two 8 MiB parts)."""
    uri = reach(uri, write=True)
    with s3.writer(uri) if is_s3(uri) else local.writer(local_path(uri)) as f:
        yield f


@contextmanager
def spooled_writer(uri: str, spool_bytes: int, if_absent: bool = False) -> Iterator[BinaryIO]:
    """A file to write one object that is sent whole when the block exits cleanly (nothing appears when it
    raises). On S3 the bytes are spooled (in memory up to ``spool_bytes``, then in a temporary file) and
    sent in one PUT (:func:`put_file`: one request where a multipart upload is ten); locally the file is
    written in place by :func:`writer`, with no second copy. ``if_absent``: only if no object is there
    (:class:`ObjectExists` when one is: nothing written), as :func:`put_if_absent`."""
    uri = reach(uri, write=True)
    if not is_s3(uri):
        with local.writer(local_path(uri), if_absent=if_absent) as f:
            yield f
        return
    with tempfile.SpooledTemporaryFile(max_size=spool_bytes) as spool:
        yield spool  # type: ignore[misc]
        spool.seek(0)
        if not if_absent:
            s3.put_file(uri, spool)  # type: ignore[arg-type]
        elif not s3.put_file_if_absent(uri, spool):  # type: ignore[arg-type]
            raise ObjectExists(f"{uri} exists: not written")


def put_if_absent(uri: str, data: bytes) -> bool:
    """Write only if nothing is at ``uri``; True if this call wrote it. Safe against concurrent writers."""
    uri = reach(uri, write=True)
    if is_s3(uri):
        return s3.put_if_absent(uri, bytes(data))
    return local.put_if_absent(local_path(uri), data)


def put_file_if_absent(uri: str, fileobj: BinaryIO) -> bool:
    """:func:`put_if_absent` streaming from a seekable binary file object (at most
    :data:`functions.store.s3.MAX_SINGLE_PUT` bytes on S3: one conditional PUT)."""
    uri = reach(uri, write=True)
    if is_s3(uri):
        return s3.put_file_if_absent(uri, fileobj)
    return local.put_file_if_absent(local_path(uri), fileobj)


def exists(uri: str) -> bool:
    uri = reach(uri)
    if is_s3(uri):
        return s3.head_size(uri) is not None
    return local.exists(local_path(uri))


def size(uri: str) -> int:
    uri = reach(uri)
    if is_s3(uri):
        n = s3.head_size(uri)
        if n is None:
            raise ObjectNotFound(f"no object at {uri}")
        return n
    return local.size(local_path(uri), uri)


def sizes(uris: list[str]) -> dict[str, int | None]:
    """The size of each object (None where there is no object), looked up concurrently (see :func:`pins`)."""
    return {u: None if p is None else p.size for u, p in pins(uris).items()}


def pin(uri: str) -> Pin:
    """What the object is now (size and ETag on S3; size, mtime_ns and inode locally), for later reads to
    check against (:func:`get`'s and :func:`get_batch`'s ``pin``/``pins``)."""
    found = pins([uri])[uri]
    if found is None:
        raise ObjectNotFound(f"no object at {resolve(uri)}")
    return found


def pins(uris: list[str], failed: dict[str, StoreError] | None = None) -> dict[str, Pin | None]:
    """The pin of each object (None where there is no object), looked up concurrently: S3 objects by HEADs
    all in flight on the CRT client when it is the transport, else on the process's shared thread pool.
    A failure is raised once every lookup has answered (the first in ``uris`` order); with ``failed``, a
    :class:`StoreError` (refused, malformed) is put there by URI instead and the others' pins returned."""
    resolved = {u: reach(u) for u in uris}
    wanted = list(dict.fromkeys(resolved.values()))
    errors: dict[str, Exception] = {}
    found = _crt_pins([r for r in wanted if is_s3(r)], errors)
    rest = [r for r in wanted if r not in found and r not in errors]
    pool = transport.thread_pool("size")
    futures = [pool.submit(telemetry.carried(_pin), r) for r in rest]  # counted for the calling task
    for r, future in zip(rest, futures, strict=True):
        try:
            found[r] = future.result()
        except Exception as exc:  # noqa: BLE001 - every lookup answers first; raised or reported below
            errors[r] = exc
    for u, r in resolved.items():
        if (exc := errors.get(r)) is not None:
            if failed is None or not isinstance(exc, StoreError):
                raise exc
            failed[u] = exc
    return {u: found[r] for u, r in resolved.items() if r not in errors}


def _pin(uri: str) -> Pin | None:
    """One object's pin (one HEAD or stat)."""
    return s3.head_pin(uri) if is_s3(uri) else local.pin(local_path(uri), uri)


def _crt_pins(on_s3: list[str], errors: dict[str, Exception]) -> dict[str, Pin | None]:
    """Pins by HEADs all in flight on the CRT client, when it is the transport (else {}: the pool asks);
    a lookup that failed goes into ``errors`` by URI."""
    if not on_s3 or transport.s3_transport_name() != "crt":
        return {}
    try:
        from shardfold.functions.store.crt import head_pins
    except ImportError:  # no awscrt here: boto3, as GetBatch itself falls back
        return {}
    return head_pins(on_s3, errors)


def verify(uri: str, pinned: Pin) -> None:
    """Raise :class:`InputChanged` if the object is no longer the one ``pinned`` describes (one HEAD or
    stat): for inputs read by code that cannot take a pin (e.g. a library opening the file itself)."""
    now = pins([uri])[uri]
    if now != pinned:
        raise changed(resolve(uri), pinned, now)


@contextmanager
def endpoint_errors() -> Iterator[None]:
    """Where a person waits for the answer (submit, plan): an S3 endpoint that does not answer at all, after
    the client's own retries, raises :class:`StoreUnreachable`, one line naming the endpoint and what to
    check, instead of a transient error or a botocore traceback. Tasks do not use it: they retry."""
    try:
        yield
    except Exception as exc:
        named = s3.unreachable(exc)
        if named is None or named is exc:
            raise
        raise named from None


def list_uris(prefix_uri: str, start_after: str | None = None) -> list[str]:
    """URIs of all objects under a prefix (string prefix, as on S3; recursive), sorted; with ``start_after``
    (a URI under the prefix), only those that sort after it, as S3's StartAfter (so a poller that knows
    where its work begins does not list everything before it again)."""
    prefix_uri = reach(prefix_uri, prefix=True)
    if is_s3(prefix_uri):
        return s3.list_uris(prefix_uri, start_after and split_s3(resolve(start_after))[1])
    found = ["file://" + str(p) for p in local.list_paths(str(local_path(prefix_uri)) + _slash(prefix_uri))]
    if start_after is not None:
        after = "file://" + str(local_path(resolve(start_after)))
        found = found[bisect.bisect_right(found, after) :]
    return found


def delete(uri: str) -> None:
    """Remove an object; removing a missing one is not an error."""
    uri = reach(uri, write=True)
    if is_s3(uri):
        s3.delete(uri)
    else:
        local.delete(local_path(uri))


def delete_prefix(prefix_uri: str) -> int:
    """Remove every object under a prefix; returns how many were removed."""
    prefix_uri = reach(prefix_uri, write=True, prefix=True)
    if is_s3(prefix_uri):
        return s3.delete_prefix(prefix_uri)
    return local.delete_prefix(str(local_path(prefix_uri)) + _slash(prefix_uri))


def assemble(part_uris: list[str], dest_uri: str) -> int:
    """Concatenate objects, in order, into one new object (atomically); its size in bytes. Parts and
    destination share a scheme: S3 copies server-side where it can (multipart UploadPartCopy)."""
    dest_uri = reach(dest_uri, write=True)
    parts = [reach(u) for u in part_uris]
    if any(is_s3(u) != is_s3(dest_uri) for u in parts):
        raise StoreError(f"assemble: parts and destination {dest_uri} must all be s3:// or all local")
    if is_s3(dest_uri):
        found = sizes(parts)  # the parts' HEADs all at once
        lengths = []
        for uri in parts:
            if (n := found[uri]) is None:
                raise ObjectNotFound(f"assemble: part {uri} does not exist")
            lengths.append(n)
        s3.assemble(parts, dest_uri, lengths)
        return sum(lengths)
    return local.assemble([local_path(u) for u in parts], parts, local_path(dest_uri))


def get_json(uri: str) -> Any:
    """The JSON document at ``uri`` (:mod:`functions.jsontext`: anyone who may write to the store may have
    written it); :class:`StoreError` when it is not one."""
    data = get(uri)
    try:
        return jsontext.loads(data)
    except jsontext.JSONTextError as exc:
        raise StoreError(f"{resolve(uri)} is not valid JSON: {exc}") from None


def put_json(uri: str, obj: Any, indent: int | None = 2) -> None:
    """Write ``obj`` as JSON, indented for people to read; ``indent=None`` for long machine-read lists
    (Python's C encoder does not indent: the pure-Python one is several times slower)."""
    put(uri, json.dumps(obj, indent=indent).encode())


def _slash(uri: str) -> str:
    # Path() drops a trailing slash, which S3-style prefix matching needs ('a/' is not 'a').
    return "/" if uri.endswith("/") else ""
