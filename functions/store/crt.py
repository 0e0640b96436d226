"""GetBatch's default S3 transport: awscrt's native S3 client.

Requests are signed, sent and received on the CRT's own event-loop threads; Python only builds the
request and collects the body in callbacks. Measured on many 10 KiB GETs (bench/transports.py) it costs
about a fifth of boto3's client CPU per object, which is what bounds a GetBatch gatherer's throughput.

The CRT does not read boto3's endpoint variables, so this module does: ``AWS_ENDPOINT_URL_S3`` (or
``AWS_ENDPOINT_URL``) switches to path-style requests against that host (TLS off for ``http://``);
otherwise requests go to ``<bucket>.s3.<region>.amazonaws.com``. Region: ``AWS_REGION``, then
``AWS_DEFAULT_REGION``, then us-east-1. Credentials: the CRT's default chain (environment, profile,
container and instance roles), which covers Lambda and Batch, unless the caller set others
(:mod:`functions.credentials`); one client per set of credentials.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Any
from urllib.parse import quote, urlsplit

from awscrt.auth import AwsCredentialsProvider
from awscrt.http import HttpHeaders, HttpRequest
from awscrt.io import ClientBootstrap, DefaultHostResolver, EventLoopGroup
from awscrt.s3 import S3Client, S3RequestTlsMode, S3RequestType, S3RetryConfig, S3RetryMode

from shardfold.functions import credentials, telemetry
from shardfold.functions.errors import InvalidRange, ObjectNotFound, StoreError
from shardfold.functions.store.pinning import Pin, TooLarge, changed
from shardfold.functions.store.retry import TRANSIENT_STATUS, TransientError
from shardfold.functions.store.s3 import check_body, denied, heard_from_endpoint, range_header
from shardfold.functions.store.s3 import endpoint as s3_endpoint
from shardfold.functions.store.transport import Boto3Transport as _Boto3
from shardfold.functions.store.transport import Cancel, Done, thread_pool

THROUGHPUT_TARGET_GBPS = 100.0
_clients: dict[tuple, _Client] = credentials.cache()
_lock = threading.Lock()


class _Client:
    """An S3Client with the addressing it was made for."""

    def __init__(self, endpoint: str | None, region: str, signer: credentials.Credentials | None):
        self.endpoint_url = s3_endpoint()[0]  # what heard_from_endpoint records answers under
        elg = EventLoopGroup()
        bootstrap = ClientBootstrap(elg, DefaultHostResolver(elg))
        self.region = region
        self.host: str | None = None
        tls = S3RequestTlsMode.ENABLED
        if endpoint:
            parts = urlsplit(endpoint)
            self.host = parts.netloc  # host[:port]: the Host header picks where the CRT connects
            self.prefix = parts.path.rstrip("/")
            if parts.scheme == "http":
                tls = S3RequestTlsMode.DISABLED
        self.client = S3Client(
            bootstrap=bootstrap,
            region=region,
            credential_provider=_provider(bootstrap, signer),
            tls_mode=tls,
            # The engine retries and hedges itself; CRT retries underneath would multiply attempts.
            retry_config=S3RetryConfig(retry_mode=S3RetryMode.NONE),
            # The CRT sizes its connection pool from this target; the default (10 Gb/s) caps small-object
            # GETs at ~1,000/s, far below what the engine keeps in flight.
            throughput_target_gbps=THROUGHPUT_TARGET_GBPS,
        )

    def address(self, bucket: str, key: str) -> tuple[str, str]:
        """(Host header, request path) for an object."""
        path = "/" + quote(key, safe="/~")
        if self.host is not None:
            return self.host, f"{self.prefix}/{bucket}{path}"
        if "." in bucket:  # a dotted name breaks the TLS certificate of the virtual host
            return f"s3.{self.region}.amazonaws.com", f"/{bucket}{path}"
        return f"{bucket}.s3.{self.region}.amazonaws.com", path


def _provider(bootstrap: ClientBootstrap, signer: credentials.Credentials | None) -> AwsCredentialsProvider:
    """The CRT's default chain, or the credentials a caller set (:func:`functions.credentials.using`)."""
    if signer is None:
        return AwsCredentialsProvider.new_default_chain(bootstrap)
    return AwsCredentialsProvider.new_static(
        signer.access_key_id, signer.secret_access_key, signer.session_token
    )


def crt_client() -> _Client:
    env = os.environ
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    signer = credentials.current()
    key = (os.getpid(), endpoint, region, signer, env.get("AWS_ACCESS_KEY_ID"))
    client = _clients.get(key)
    if client is None:
        with _lock:
            client = _clients.get(key) or _Client(endpoint, region, signer)
            _clients[key] = client
    return client


def _error(
    uri: str,
    exc: BaseException | None,
    status: int | None,
    body: bytes | None,
    op: str = "GET",
    pin: Pin | None = None,
) -> BaseException:
    text = (body or b"")[:512].decode("utf-8", "replace")
    code = text.partition("<Code>")[2].partition("</Code>")[0]
    if status == 412 and pin is not None:
        return changed(uri, pin, f"not ETag {pin.etag} (S3 refused If-Match)")
    if status == 404:
        what = "bucket" if code == "NoSuchBucket" else "object"
        return ObjectNotFound(f"no {what} at {uri} ({code or 404})")
    if status == 416:
        size = text.partition("<ActualObjectSize>")[2].partition("</ActualObjectSize>")[0] or "?"
        reason = f"requested range is outside the object ({size} bytes)"
        return InvalidRange.of(uri, reason)
    if status is None and "CREDENTIALS" in str(getattr(exc, "name", "")):
        return StoreError(f"{op} {uri}: no usable AWS credentials ({exc}); configure credentials or a role")
    if status is None or status in TRANSIENT_STATUS or code == "SlowDown":
        return TransientError(f"{op} {uri}: {code or status or exc}", status)
    if status == 403:
        return denied(op, uri, code or "403")
    return StoreError(f"{op} {uri} failed: HTTP {status} {code}")


class _Get:
    """Callbacks of one GET."""

    __slots__ = (
        "uri",
        "start",
        "length",
        "limit",
        "done",
        "chunks",
        "content_range",
        "etag",
        "pin",
        "url",
        "meter",
    )

    def __init__(
        self,
        uri: str,
        start: int,
        length: int | None,
        done: Done,
        pin: Pin | None = None,
        limit: int | None = None,
        url: str | None = None,
    ):
        self.uri, self.start, self.length, self.done, self.pin = uri, start, length, done, pin
        self.limit, self.url = limit, url
        self.chunks: list[bytes] = []
        self.content_range: str | None = None
        self.etag: str | None = None
        self.meter = telemetry.current()  # the callbacks run on the CRT's threads, outside the task's context
        telemetry.count("GET")

    def on_headers(self, status_code: int, headers: list[tuple[str, str]], **kwargs: Any) -> None:
        if self.length is not None or self.limit is not None:
            for name, value in headers:
                lower = name.lower()
                if lower == "content-range":
                    self.content_range = value
                elif lower == "etag":
                    self.etag = value

    def on_body(self, chunk: Any, offset: int, **kwargs: Any) -> None:
        # The buffer is only valid during the callback; the CRT delivers parts in offset order.
        self.chunks.append(bytes(chunk))

    def on_done(
        self,
        error: BaseException | None = None,
        status_code: int | None = None,
        error_body: Any = None,
        **kwargs: Any,
    ) -> None:
        if error is None or status_code is not None:
            heard_from_endpoint(self.url)
        if error is not None:
            if status_code == 416 and self.limit is not None and self.start == 0:
                self.done(b"", None)  # the first byte of an empty object is past its end
                return
            self.done(None, _error(self.uri, error, status_code, error_body, pin=self.pin))
            return
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if self.meter is not None:
            self.meter.add(None, read=len(data))
        if self.limit is not None:
            total = _total(self.content_range)
            if total is not None and total - self.start > self.limit:
                pin = Pin(total, etag=self.etag)
                self.done(None, TooLarge(self.uri, total - self.start, self.limit, pin))
                return
            self.done(data, None)
            return
        try:
            data = check_body(self.uri, data, self.start, self.length, self.content_range)
        except InvalidRange as exc:
            self.done(None, exc)
            return
        self.done(data, None)


def _total(content_range: str | None) -> int | None:
    """The object size in a ``Content-Range: bytes a-b/size`` header (None when absent or unknown)."""
    size = (content_range or "").rpartition("/")[2]
    return int(size) if size.isdigit() else None


class CrtTransport:
    name = "crt"
    limits = True

    def __init__(self) -> None:
        self._client = crt_client()
        self._fallback = _Boto3()

    def fetch(
        self,
        uri: str,
        start: int,
        length: int | None,
        done: Done,
        pin: Pin | None = None,
        limit: int | None = None,
    ) -> Cancel | None:
        if length == 0:  # a zero-byte read still needs the object to exist: a HEAD, rare enough for boto3
            return self._fallback.fetch(uri, start, length, done, pin)
        bucket, _, key = uri[5:].partition("/")
        host, path = self._client.address(bucket, key)
        headers = [("Host", host)]
        if length is None and limit is not None:
            # the first ``limit`` bytes, and from Content-Range the size: a longer object is TooLarge
            # having read no more than the limit (an empty one answers 416, which means b"")
            rng: str | None = f"bytes={start}-{start + max(limit, 1) - 1}"
        else:
            limit = None
            rng = range_header(start, length)
        if rng:
            headers.append(("Range", rng))
        if pin is not None and pin.etag:
            headers.append(("If-Match", pin.etag))
        get = _Get(uri, start, length, done, pin, limit, self._client.endpoint_url)
        try:
            request = self._client.client.make_request(
                type=S3RequestType.GET_OBJECT,
                request=HttpRequest("GET", path, HttpHeaders(headers)),
                on_headers=get.on_headers,
                on_body=get.on_body,
                on_done=get.on_done,
            )
        except Exception as exc:  # e.g. the client is shutting down: let the engine retry elsewhere
            thread_pool("crt-errors").submit(done, None, TransientError(f"GET {uri}: {exc}"))
            return None
        return request.cancel


class _Head:
    """Callbacks of one HEAD: the object's pin (size, ETag), or None when there is no object."""

    __slots__ = ("uri", "future", "size", "etag")

    def __init__(self, uri: str, future: Future):
        self.uri, self.future, self.size, self.etag = uri, future, 0, None

    def on_headers(self, status_code: int, headers: list[tuple[str, str]], **kwargs: Any) -> None:
        for name, value in headers:
            lower = name.lower()
            if lower == "content-length":
                self.size = int(value)
            elif lower == "etag":
                self.etag = value

    def on_done(self, error: BaseException | None = None, status_code: int | None = None, **kw: Any) -> None:
        if error is None or status_code is not None:
            heard_from_endpoint()
        if error is None:
            self.future.set_result(Pin(self.size, etag=self.etag))
        elif status_code == 404:
            self.future.set_result(None)
        else:
            self.future.set_exception(_error(self.uri, error, status_code, kw.get("error_body"), "HEAD"))


def head_pins(
    uris: list[str], errors: dict[str, Exception], timeout_s: float = 120.0
) -> dict[str, Pin | None]:
    """Pins (size, ETag) of S3 objects (None: no object), every HEAD in flight at once on the process's CRT
    client: no thread per request, a fraction of boto3's CPU per call. A lookup that failed is put in
    ``errors`` by URI, once every lookup has answered."""
    client = crt_client()
    futures: dict[str, Future] = {}
    for uri in uris:
        future: Future = Future()
        bucket, _, key = uri[5:].partition("/")
        host, path = client.address(bucket, key)
        head = _Head(uri, future)
        telemetry.count("HEAD")
        try:
            client.client.make_request(
                type=S3RequestType.DEFAULT,
                operation_name="HeadObject",
                request=HttpRequest("HEAD", path, HttpHeaders([("Host", host)])),
                on_headers=head.on_headers,
                on_done=head.on_done,
            )
        except Exception as exc:  # the client is shutting down: as transient as a dropped connection
            future.set_exception(TransientError(f"HEAD {uri}: {exc}"))
        futures[uri] = future
    found: dict[str, Pin | None] = {}
    for uri, future in futures.items():
        try:
            found[uri] = future.result(
                timeout_s
            )  # no answer this long after the one before: a stuck endpoint
        except TimeoutError:  # an endpoint that swallows requests: as transient as a dropped connection
            errors[uri] = TransientError(f"HEAD {uri}: no answer in {timeout_s:g} s")
        except Exception as exc:  # noqa: BLE001 - reported by URI, as the thread pool's lookups are
            errors[uri] = exc
    return found
