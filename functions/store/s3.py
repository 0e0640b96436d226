"""The S3 store behind ``s3://`` URIs (boto3).

One client per process (and per endpoint/region setting, so tests that switch endpoints get a fresh one),
re-created after fork because a client's connection pool must not be shared across processes. The
endpoint comes from boto3's own ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` variables.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any, BinaryIO

import boto3
import boto3.exceptions
import botocore.exceptions
from botocore.config import Config

from shardfold.functions import credentials, telemetry
from shardfold.functions.errors import (
    AccessDenied,
    InvalidRange,
    ObjectNotFound,
    StoreError,
    StoreUnreachable,
)
from shardfold.functions.log import logger
from shardfold.functions.store.local import check_range
from shardfold.functions.store.pinning import Pin, TooLarge, changed
from shardfold.functions.store.retry import TRANSIENT_CODES, TRANSIENT_STATUS, TransientError
from shardfold.functions.store.uri import split_s3

POOL = 128  # >= any GetBatch concurrency we run, so threads never wait on (or discard) a connection
MIN_PART = 5 * 1024 * 1024  # S3's smallest multipart part (all but the last)
MAX_COPY_PART = 5 * 1024**3  # S3's largest UploadPartCopy source range
MAX_PARTS = 10_000
WRITE_PART = 8 * 1024 * 1024  # a streamed write's multipart part (and what it buffers)
COPY_CONCURRENCY = 16  # UploadPartCopy requests of one assemble in flight at once
# put_file sends one PUT up to this size (S3 allows 5 GiB; a failed PUT is retried whole, so stay well below)
MAX_SINGLE_PUT = 512 * 1024 * 1024

_clients: dict[tuple, Any] = credentials.cache()
_lock = threading.Lock()
# When each S3 endpoint last answered this process (any HTTP answer, an error status included), as
# time.monotonic(): what tells submit it need not check that the endpoint is there (answered_within).
_answered: dict[str, float] = {}

_NETWORK_ERRORS = (
    botocore.exceptions.ConnectionError,
    botocore.exceptions.HTTPClientError,
    botocore.exceptions.ResponseStreamingError,
)
# What every call translates: S3's answers, no answer at all, and no credentials to sign with.
_BOTO_ERRORS = (
    botocore.exceptions.ClientError,
    *_NETWORK_ERRORS,
    botocore.exceptions.NoCredentialsError,
)


def _env_key() -> tuple:
    env = os.environ
    return (
        os.getpid(),
        env.get("AWS_ENDPOINT_URL_S3"),
        env.get("AWS_ENDPOINT_URL"),
        env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
        env.get("AWS_MAX_ATTEMPTS"),
        env.get("AWS_ACCESS_KEY_ID"),  # the process's own credentials changed: a new client signs with them
    )


def _retry_config() -> dict[str, Any]:
    """Standard retries: boto3's own ``AWS_MAX_ATTEMPTS`` (attempts in all, the first included) when set,
    which an explicit client config would otherwise override; else 5 retries after the first attempt."""
    raw = os.environ.get("AWS_MAX_ATTEMPTS", "").strip()
    if raw.isdigit() and int(raw) >= 1:
        return {"mode": "standard", "total_max_attempts": int(raw)}
    return {"mode": "standard", "max_attempts": 5}


def endpoint() -> tuple[str, str]:
    """(the S3 endpoint requests go to, where that came from): ``AWS_ENDPOINT_URL_S3``,
    ``AWS_ENDPOINT_URL``, or AWS's regional endpoint for ``AWS_REGION`` / ``AWS_DEFAULT_REGION``."""
    env = os.environ
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if env.get(var):
            return env[var], var
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        return f"https://s3.{region}.amazonaws.com", "AWS's endpoint for AWS_REGION"
    return "https://s3.us-east-1.amazonaws.com", "AWS's default endpoint; no AWS_REGION set"


def s3_client(retries: bool = True) -> Any:
    """The process's boto3 S3 client. ``retries=False`` gives one that tries once, for callers (the
    GetBatch engine) that run their own retry and hedging policy."""
    key = (*_env_key(), retries, credentials.current())
    client = _clients.get(key)
    if client is None:
        with _lock:
            client = _clients.get(key)
            if client is None:
                retry = _retry_config() if retries else {"total_max_attempts": 1}
                config = Config(max_pool_connections=POOL, retries=retry, tcp_keepalive=True)
                client = credentials.session().client("s3", config=config)
                client.meta.events.register("before-call.s3", _before_call)
                client.meta.events.register("after-call.s3", _after_call)  # a response came back
                _clients[key] = client
    return client


# Store requests by the type S3 bills them as (functions.telemetry counts them per task).
_REQUEST_TYPE = {
    "GetObject": "GET",
    "HeadObject": "HEAD",
    "PutObject": "PUT",
    "ListObjectsV2": "LIST",
    "DeleteObject": "DELETE",
    "DeleteObjects": "DELETE",
    "CopyObject": "COPY",
    "UploadPartCopy": "COPY",
}


def _before_call(model: Any = None, params: Any = None, **kwargs: Any) -> None:
    name = getattr(model, "name", "")
    body = (params or {}).get("body") if isinstance(params, dict) else None
    telemetry.count(_REQUEST_TYPE.get(name, name), written=_size(body))


def _size(body: Any) -> int:
    """Bytes left to send in a request body (bytes, or a seekable file as botocore passes them)."""
    if body is None:
        return 0
    if isinstance(body, bytes | bytearray | memoryview):
        return len(body)
    try:
        at = body.tell()
        end = body.seek(0, io.SEEK_END)
        body.seek(at)
        return int(end - at)
    except (AttributeError, OSError, ValueError):
        return 0


def _after_call(http_response: Any = None, parsed: Any = None, model: Any = None, **kwargs: Any) -> None:
    heard_from_endpoint()
    if isinstance(parsed, dict):
        read = parsed.get("ContentLength", 0) if getattr(model, "name", "") == "GetObject" else 0
        retries = parsed.get("ResponseMetadata", {}).get("RetryAttempts", 0)
        if read or retries:
            telemetry.count(None, read=int(read or 0), retries=int(retries or 0))


def heard_from_endpoint(url: str | None = None) -> None:
    """Record that the S3 endpoint (``url``, default the configured one) answered this process just now;
    transports call it on any answer."""
    _answered[url or endpoint()[0]] = time.monotonic()


def answered_within(seconds: float) -> bool:
    """Whether the S3 endpoint answered this process in the last ``seconds``."""
    at = _answered.get(endpoint()[0])
    return at is not None and time.monotonic() - at <= seconds


def _code_status(exc: botocore.exceptions.ClientError) -> tuple[str, int]:
    err = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(err.get("Code", "")), int(status or 0)


def translate(exc: Exception, uri: str, op: str) -> Exception:
    """A botocore exception as the store's error for ``uri``."""
    if isinstance(exc, _NETWORK_ERRORS):
        return TransientError(f"{op} {uri}: {exc}")
    if isinstance(exc, botocore.exceptions.NoCredentialsError):
        return StoreError(
            f"{op} {uri}: no AWS credentials found; set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE or a role"
        )
    if not isinstance(exc, botocore.exceptions.ClientError):
        return exc
    code, status = _code_status(exc)
    if code in ("NoSuchKey", "NotFound", "404") or status == 404:
        what = "bucket" if code == "NoSuchBucket" else "object"
        return ObjectNotFound(f"no {what} at {uri} ({code or status})")
    if code == "InvalidRange" or status == 416:
        size = exc.response.get("Error", {}).get("ActualObjectSize", "?")
        reason = f"requested range is outside the object ({size} bytes)"
        return InvalidRange.of(uri, reason)
    if code in TRANSIENT_CODES or status in TRANSIENT_STATUS:
        return TransientError(f"{op} {uri}: {code or status}", status)
    if status == 403 or code == "AccessDenied":
        return denied(op, uri, code or str(status))
    return StoreError(f"{op} {uri} failed: {code or status}: {exc}")


def denied(op: str, uri: str, code: str) -> AccessDenied:
    """S3's 403 for ``op`` on ``uri``: the credentials in use (a task's: its function's role) hold no grant
    for it, or the bucket's policy refuses them."""
    return AccessDenied(
        f"{op} {uri}: access denied ({code}); the credentials in use (a task's: its function's role) hold no "
        "grant for it, or the bucket policy refuses them"
    )


def unreachable(exc: BaseException) -> StoreUnreachable | None:
    """``exc`` as one line naming the S3 endpoint and what to check, when it says the endpoint did not
    answer at all (a connection-level :class:`TransientError`, status unknown, or a botocore network
    error); else None. For callers where a person waits (submit, plan), not for tasks, which retry."""
    if isinstance(exc, StoreUnreachable):
        return exc
    if isinstance(exc, _NETWORK_ERRORS):
        exc = TransientError(str(exc))
    if not isinstance(exc, TransientError) or exc.status is not None:
        return None
    url, source = endpoint()
    if source.startswith("AWS_ENDPOINT_URL"):
        check = f"check that {source} is the right address and that an S3 service is running there"
    else:
        check = "check the network (DNS, proxy, VPC endpoint) and AWS_REGION"
    reason = " ".join(str(exc).split()).rstrip(".")
    return StoreUnreachable(f"cannot reach the S3 endpoint {url} ({source}): {reason}; {check}")


def range_header(start: int, length: int | None) -> str | None:
    if start == 0 and length is None:
        return None
    if length is None:
        return f"bytes={start}-"
    return f"bytes={start}-{start + length - 1}"


def check_body(uri: str, data: bytes, start: int, length: int | None, content_range: str | None) -> bytes:
    """S3 clips a range that runs past the end; the store refuses it instead, as it does locally."""
    if length is not None and len(data) != length:
        total = (content_range or "").rpartition("/")[2] or "?"
        reason = (
            f"range bytes {start}-{start + length - 1} is outside the object ({total} bytes); "
            "fix the item's start/length"
        )
        raise InvalidRange.of(uri, reason)
    return data


def get(
    uri: str,
    start: int = 0,
    length: int | None = None,
    client: Any = None,
    pin: Pin | None = None,
    limit: int | None = None,
) -> bytes:
    """``length`` bytes at ``start``; with a ``pin``, only from the object it pinned: the request carries
    ``If-Match: <ETag>`` and S3's 412 becomes :class:`InputChanged`. ``limit`` (with ``length=None``):
    :class:`TooLarge` when the answer's ``Content-Length`` says more, its body left unread."""
    bucket, key = split_s3(uri)
    client = client or s3_client()
    kw: dict[str, str] = {"IfMatch": pin.etag} if pin is not None and pin.etag else {}
    try:
        if length == 0:
            check_range(uri, client.head_object(Bucket=bucket, Key=key, **kw)["ContentLength"], start, 0)
            return b""
        if rng := range_header(start, length):
            kw["Range"] = rng
        resp = client.get_object(Bucket=bucket, Key=key, **kw)
        if limit is not None and length is None and resp["ContentLength"] > limit:
            resp["Body"].close()  # the connection is dropped rather than drained
            total = start + resp["ContentLength"]
            raise TooLarge(uri, resp["ContentLength"], limit, Pin(total, etag=resp.get("ETag")))
        data = resp["Body"].read()
    except _BOTO_ERRORS as exc:
        if pin is not None and _precondition_failed(exc):
            raise changed(uri, pin, head_pin(uri)) from None
        raise translate(exc, uri, "GET") from None
    return check_body(uri, data, start, length, resp.get("ContentRange"))


def put(uri: str, data: bytes) -> None:
    bucket, key = split_s3(uri)
    client = s3_client()
    try:
        if len(data) <= MAX_COPY_PART:
            client.put_object(Bucket=bucket, Key=key, Body=data)
        else:  # beyond one PUT's limit: s3transfer's multipart upload (still all-or-nothing on S3)
            client.upload_fileobj(io.BytesIO(data), bucket, key)
    except _BOTO_ERRORS as exc:
        raise translate(exc, uri, "PUT") from None


def put_file(uri: str, fileobj: BinaryIO) -> None:
    """Upload a seekable file object from its current position: one PUT streaming the file up to
    :data:`MAX_SINGLE_PUT` (a PUT costs the same whatever its size: a 64 MiB fedavg part in 8 MiB multipart
    pieces was ten requests), s3transfer's multipart upload beyond."""
    bucket, key = split_s3(uri)
    start = fileobj.tell()
    size = fileobj.seek(0, io.SEEK_END) - start
    fileobj.seek(start)
    try:
        if size <= MAX_SINGLE_PUT:
            s3_client().put_object(Bucket=bucket, Key=key, Body=fileobj, ContentLength=size)
            return
        s3_client().upload_fileobj(fileobj, bucket, key)
    except _BOTO_ERRORS as exc:
        raise translate(exc, uri, "PUT") from None
    except boto3.exceptions.S3UploadFailedError as exc:
        raise StoreError(f"PUT {uri} failed: {exc}") from None


class _StreamedUpload(io.RawIOBase):
    """A write-only file over a multipart upload: parts of :data:`WRITE_PART` bytes, each uploaded by one
    background thread while the next fills, so memory holds at most two parts. Nothing is visible until
    :meth:`commit` completes the upload (a single PUT when everything fit in one part)."""

    def __init__(self, uri: str):
        self.uri = uri
        self.bucket, self.key = split_s3(uri)
        self.client = s3_client()
        self.buf = bytearray()
        self.parts: list[dict] = []
        self.upload_id: str | None = None
        self.pending: Future | None = None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="sf-s3-writer")

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.buf += data
        if len(self.buf) >= WRITE_PART:
            self._send(bytes(self.buf))
            self.buf = bytearray()
        return len(data)

    def _send(self, body: bytes) -> None:
        if self.upload_id is None:
            self.upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=self.key)["UploadId"]
        if self.pending is not None:
            self.pending.result()  # at most one part in flight beside the one filling
        number = len(self.parts) + 1
        if number > MAX_PARTS:
            raise StoreError(f"PUT {self.uri}: more than {MAX_PARTS} parts of {WRITE_PART} bytes")
        self.parts.append({"PartNumber": number})

        def upload() -> None:
            resp = self.client.upload_part(
                Bucket=self.bucket, Key=self.key, UploadId=self.upload_id, PartNumber=number, Body=body
            )
            self.parts[number - 1]["ETag"] = resp["ETag"]

        self.pending = self.pool.submit(telemetry.carried(upload))

    def commit(self) -> None:
        if self.upload_id is None:
            self.client.put_object(Bucket=self.bucket, Key=self.key, Body=bytes(self.buf))
            return
        if self.buf:
            self._send(bytes(self.buf))
            self.buf = bytearray()
        assert self.pending is not None
        self.pending.result()
        self.client.complete_multipart_upload(
            Bucket=self.bucket, Key=self.key, UploadId=self.upload_id, MultipartUpload={"Parts": self.parts}
        )

    def abort(self) -> None:
        if self.pending is not None:
            self.pending.exception()  # wait for it; its own error is not the one to report
        if self.upload_id is not None:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        super().close()


@contextmanager
def writer(uri: str) -> Iterator[BinaryIO]:
    """A file to stream an object into: the object appears whole when the block exits cleanly, never in
    part; an error aborts the upload."""
    upload = _StreamedUpload(uri)
    try:
        yield upload  # type: ignore[misc]
        upload.commit()
    except _BOTO_ERRORS as exc:
        _abort_quietly(upload)
        raise translate(exc, uri, "PUT") from None
    except BaseException:
        _abort_quietly(upload)
        raise
    finally:
        upload.close()


def _abort_quietly(upload: _StreamedUpload) -> None:
    try:
        upload.abort()
    except (botocore.exceptions.ClientError, *_NETWORK_ERRORS):  # the bucket's lifecycle rule aborts it later
        logger.warning("multipart upload not aborted", extra={"uri": upload.uri})


def put_if_absent(uri: str, data: bytes) -> bool:
    return put_file_if_absent(uri, io.BytesIO(data))


def put_file_if_absent(uri: str, fileobj: BinaryIO) -> bool:
    """:func:`put_if_absent` from a seekable file object (its current position on): one conditional PUT."""
    start = fileobj.tell()
    size = fileobj.seek(0, io.SEEK_END) - start
    if size > MAX_SINGLE_PUT:
        raise StoreError(f"put_if_absent {uri}: {size} bytes, over the {MAX_SINGLE_PUT} of one PUT")
    bucket, key = split_s3(uri)
    client = s3_client()
    for attempt in range(5):
        fileobj.seek(start)
        try:
            client.put_object(Bucket=bucket, Key=key, Body=fileobj, ContentLength=size, IfNoneMatch="*")
            return True
        except botocore.exceptions.ClientError as exc:
            code, status = _code_status(exc)
            if code == "PreconditionFailed" or status == 412:
                return False
            if code == "ConditionalRequestConflict" or status == 409:  # S3 says to retry
                time.sleep(0.05 * 2**attempt)
                continue
            raise translate(exc, uri, "PUT") from None
        except _BOTO_ERRORS as exc:
            raise translate(exc, uri, "PUT") from None
    raise StoreError(f"put_if_absent {uri}: kept conflicting with concurrent writers; retry later")


def _precondition_failed(exc: Exception) -> bool:
    if not isinstance(exc, botocore.exceptions.ClientError):
        return False
    code, status = _code_status(exc)
    return code == "PreconditionFailed" or status == 412


def head_size(uri: str) -> int | None:
    found = head_pin(uri)
    return None if found is None else found.size


def head_pin(uri: str) -> Pin | None:
    """The object's size and ETag (one HEAD), or None when there is no object."""
    bucket, key = split_s3(uri)
    try:
        resp = s3_client().head_object(Bucket=bucket, Key=key)
        return Pin(int(resp["ContentLength"]), etag=resp["ETag"])
    except botocore.exceptions.ClientError as exc:
        code, status = _code_status(exc)
        if status == 404 or code in ("404", "NoSuchKey", "NotFound"):
            return None
        raise translate(exc, uri, "HEAD") from None
    except _BOTO_ERRORS as exc:
        raise translate(exc, uri, "HEAD") from None


def list_uris(prefix_uri: str, start_after: str | None = None) -> list[str]:
    bucket, prefix = split_s3(prefix_uri)
    out: list[str] = []
    after = {"StartAfter": start_after} if start_after else {}
    try:
        for page in (
            s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, **after)
        ):
            out.extend(f"s3://{bucket}/{o['Key']}" for o in page.get("Contents", ()))
    except _BOTO_ERRORS as exc:
        raise translate(exc, prefix_uri, "LIST") from None
    return sorted(out)


def delete(uri: str) -> None:
    bucket, key = split_s3(uri)
    try:
        s3_client().delete_object(Bucket=bucket, Key=key)
    except _BOTO_ERRORS as exc:
        raise translate(exc, uri, "DELETE") from None


def delete_prefix(prefix_uri: str) -> int:
    bucket, _ = split_s3(prefix_uri)
    keys = [u.partition(f"s3://{bucket}/")[2] for u in list_uris(prefix_uri)]
    client = s3_client()
    for i in range(0, len(keys), 1000):
        batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
        resp = client.delete_objects(Bucket=bucket, Delete=batch)
        if errors := resp.get("Errors"):
            raise StoreError(f"delete_prefix {prefix_uri}: {len(errors)} keys not deleted, e.g. {errors[0]}")
    return len(keys)


def assemble(part_uris: list[str], dest_uri: str, sizes: list[int]) -> None:
    """Concatenate objects of the given ``sizes`` into ``dest_uri``.

    Parts of at least 5 MiB are copied server-side (UploadPartCopy); smaller ones are read and coalesced
    in memory into parts of at least 5 MiB, so any mix of sizes works and memory stays ~10 MiB.
    """
    if sum(sizes) < MIN_PART:  # too small for a multipart upload to be worth it: one PUT
        put(dest_uri, b"".join(get(u) for u, n in zip(part_uris, sizes, strict=True) if n))
        return
    _Multipart(dest_uri).run(part_uris, sizes)


class _Multipart:
    """One multipart upload that mixes server-side copies and in-memory parts."""

    def __init__(self, dest_uri: str):
        self.dest = dest_uri
        self.bucket, self.key = split_s3(dest_uri)
        self.client = s3_client()
        self.parts: list[dict] = []
        self.buf = bytearray()
        self.copies: list[Future] = []
        self.pool = ThreadPoolExecutor(COPY_CONCURRENCY, thread_name_prefix="sf-s3-copy")

    def run(self, part_uris: list[str], sizes: list[int]) -> None:
        upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=self.key)
        self.upload_id = upload["UploadId"]
        try:
            for i, (uri, n) in enumerate(zip(part_uris, sizes, strict=True)):
                self._add(uri, n, last=i == len(sizes) - 1)
            if self.buf or not self.parts:
                self._flush()
            # the first failure as soon as it happens: the copies still queued are then never sent
            done, _ = wait(self.copies, return_when=FIRST_EXCEPTION)
            for copy in (*done, *self.copies):
                copy.result()
            self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": self.parts},
            )
        except BaseException:
            self.pool.shutdown(wait=True, cancel_futures=True)  # no copy lands after the abort
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)
            raise
        finally:
            self.pool.shutdown(wait=True)

    def _add(self, uri: str, n: int, last: bool) -> None:
        pos = 0
        if self.buf:
            # Top the pending buffer up to a legal part size from the head of this object.
            take = min(n, MIN_PART - len(self.buf))
            self.buf += get(uri, 0, take) if take else b""
            pos = take
            if len(self.buf) >= MIN_PART:
                self._flush()
        rest = n - pos
        # A part below 5 MiB is legal only as the last one, so a short tail is copied only then.
        if rest >= MIN_PART or (rest and last and not self.buf):
            self._copy(uri, pos, rest)
        elif rest:
            self.buf += get(uri, pos, rest)

    def _number(self) -> int:
        if len(self.parts) >= MAX_PARTS:
            raise StoreError(f"assemble {self.dest}: more than {MAX_PARTS} parts; assemble in two levels")
        return len(self.parts) + 1

    def _flush(self) -> None:
        num = self._number()
        resp = self.client.upload_part(
            Bucket=self.bucket, Key=self.key, UploadId=self.upload_id, PartNumber=num, Body=bytes(self.buf)
        )
        self.parts.append({"PartNumber": num, "ETag": resp["ETag"]})
        self.buf = bytearray()

    def _copy(self, uri: str, start: int, length: int) -> None:
        """Copy a range server-side as one or more parts, in the background: S3 copies each part on its
        side, so a commit's copies overlap instead of queueing one after another."""
        src_bucket, src_key = split_s3(uri)
        pieces = -(-length // MAX_COPY_PART)  # equal pieces: each is >= 5 MiB when length is
        step = -(-length // pieces)
        for off in range(start, start + length, step):
            end = min(off + step, start + length) - 1
            part = {"PartNumber": self._number()}
            self.parts.append(part)

            def copy(part: dict = part, off: int = off, end: int = end) -> None:
                resp = self.client.upload_part_copy(
                    Bucket=self.bucket,
                    Key=self.key,
                    UploadId=self.upload_id,
                    PartNumber=part["PartNumber"],
                    CopySource={"Bucket": src_bucket, "Key": src_key},
                    CopySourceRange=f"bytes={off}-{end}",
                )
                part["ETag"] = resp["CopyPartResult"]["ETag"]

            self.copies.append(self.pool.submit(telemetry.carried(copy)))
