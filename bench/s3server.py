"""A small, fast, in-memory S3-compatible HTTP server for benchmarks (loopback only).

Why not moto: moto's server tops out near 150 GET/s on a 2-core machine, so with ~16 ms of injected
latency any client running more than a couple of concurrent GETs would measure moto, not the client.
This server is a single asyncio ``Protocol`` that answers from memory and costs tens of microseconds of
CPU per request, so it stays far from saturation (the benchmark measures and reports its capacity and its
CPU use during every mode).

Supported (path-style addressing; the Authorization header is ignored, any credentials work):

* GetObject (``Range: bytes=a-b`` / ``a-`` / ``-n`` -> 206 with Content-Range; start beyond the end -> 416
  InvalidRange; missing key -> 404 NoSuchKey XML), HeadObject, PutObject (incl. ``If-None-Match: *`` ->
  412, ``aws-chunked`` bodies, ``Expect: 100-continue``), CopyObject, DeleteObject, DeleteObjects,
  CreateBucket / HeadBucket / DeleteBucket, ListObjectsV2 (prefix, delimiter, max-keys, continuation),
  multipart upload (Create / UploadPart / UploadPartCopy with ranges / Complete / Abort).
* Injected time-to-first-byte: every response waits ``median * exp(sigma * N(0,1))`` seconds (lognormal,
  capped) before its status line is written. Other requests on other connections proceed meanwhile. The
  draw is a function of the seed, the request and how often it was asked since ``reset_stats``, so two
  runs of the same requests meet the same delays.

Control: the benchmark runs the server in a child process (so its CPU is not counted as client CPU) and
drives it through a ``multiprocessing`` pipe: populate synthetic objects, clear, set latency, read
request counters. Run standalone for manual poking::

    python bench/s3server.py --port 9000 --ttfb-ms 16 --populate bkt/obj/:100:10240
"""

from __future__ import annotations

import argparse
import asyncio
import email.utils
import hashlib
import math
import os
import random
import re
import socket
import sys
import time
import uuid
from statistics import NormalDist
from urllib.parse import parse_qsl, quote, unquote
from xml.sax.saxutils import escape

_RANGE_RE = re.compile(r"bytes=(\d*)-(\d*)$")
_COPY_RANGE_RE = re.compile(r"bytes=(\d+)-(\d+)$")
_XML_HEAD = b'<?xml version="1.0" encoding="UTF-8"?>\n'
_S3_NS = "http://s3.amazonaws.com/doc/2006-03-01/"
_REASONS = {
    100: "Continue",
    200: "OK",
    204: "No Content",
    206: "Partial Content",
    304: "Not Modified",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    409: "Conflict",
    412: "Precondition Failed",
    416: "Requested Range Not Satisfiable",
    500: "Internal Server Error",
    501: "Not Implemented",
}


# ---------------------------------------------------------------------------------------------------------
# Synthetic objects: deterministic content shared by the server (which stores it) and the benchmark
# (which verifies what it fetched without keeping a second copy).


def synthetic_base(seed: int, size: int) -> bytes:
    """Random filler shared by all synthetic objects of one population."""
    return random.Random(seed).randbytes(size)


def synthetic_object(key: str, size: int, base: bytes) -> bytes:
    """Object content: a 32-byte key digest (so objects differ) followed by shared filler."""
    head = hashlib.sha256(key.encode()).digest()
    if size <= len(head):
        return head[:size]
    return head + base[: size - len(head)]


def synthetic_keys(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{i:07d}" for i in range(count)]


# ---------------------------------------------------------------------------------------------------------


class _Obj:
    __slots__ = ("data", "etag", "mtime")

    def __init__(self, data: bytes, etag: str | None = None):
        self.data = data
        self.etag = etag or '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"'
        self.mtime = time.time()


_NORMAL = NormalDist()


class Store:
    """Buckets of objects in memory, plus server-wide latency settings and counters."""

    def __init__(self) -> None:
        self.buckets: dict[str, dict[str, _Obj]] = {}
        self.uploads: dict[str, tuple[str, str, dict[int, _Obj]]] = {}
        self.ttfb_median = 0.0
        self.ttfb_sigma = 0.0
        self.ttfb_cap = 2.0
        self.seed = 0
        self.asked: dict[str, int] = {}  # per request (method, path, range): times asked since reset_stats
        self.counts: dict[str, int] = {}
        self.bytes_out = 0

    def set_latency(self, median_s: float, sigma: float, cap_s: float = 2.0, seed: int | None = None) -> None:
        self.ttfb_median = max(0.0, float(median_s))
        self.ttfb_sigma = max(0.0, float(sigma))
        self.ttfb_cap = float(cap_s)
        if seed is not None:
            self.seed = int(seed)

    def delay(self, request: str) -> float:
        """The injected delay of ``request`` (method, path and range), drawn from the seed, the request and
        how many times it was asked since the counters were reset: every mode (the benchmark resets them
        before each) meets the same delays on the same batch, so modes are compared on common draws, not on
        whichever part of one random stream each happened to get."""
        if self.ttfb_median <= 0:
            return 0.0
        if not self.ttfb_sigma:
            return min(self.ttfb_median, self.ttfb_cap)
        n = self.asked[request] = self.asked.get(request, 0) + 1
        digest = hashlib.blake2b(f"{self.seed}\n{n}\n{request}".encode(), digest_size=8).digest()
        u = (int.from_bytes(digest, "big") + 0.5) / 2**64  # uniform on (0, 1)
        return min(self.ttfb_median * math.exp(self.ttfb_sigma * _NORMAL.inv_cdf(u)), self.ttfb_cap)

    def populate(self, bucket: str, prefix: str, count: int, size: int, seed: int = 0) -> int:
        base = synthetic_base(seed, size)
        objs = self.buckets.setdefault(bucket, {})
        for key in synthetic_keys(prefix, count):
            data = synthetic_object(key, size, base)
            # A cheap ETag: hashing megabytes per object would only slow populate down.
            objs[key] = _Obj(
                data, etag='"' + hashlib.md5(key.encode(), usedforsecurity=False).hexdigest() + '"'
            )
        return count

    def clear(self, bucket: str | None = None, prefix: str = "") -> int:
        n = 0
        for b in [bucket] if bucket else list(self.buckets):
            objs = self.buckets.get(b, {})
            for k in [k for k in objs if k.startswith(prefix)]:
                del objs[k]
                n += 1
        return n

    def stats(self) -> dict:
        return {"counts": dict(self.counts), "bytes_out": self.bytes_out, "pid": os.getpid()}

    def reset_stats(self) -> None:
        self.counts.clear()
        self.asked.clear()
        self.bytes_out = 0

    def control(self, msg: dict):
        op = msg.get("op")
        if op == "populate":
            return self.populate(msg["bucket"], msg["prefix"], msg["count"], msg["size"], msg.get("seed", 0))
        if op == "clear":
            return self.clear(msg.get("bucket"), msg.get("prefix", ""))
        if op == "latency":
            self.set_latency(msg["median_s"], msg.get("sigma", 0.0), msg.get("cap_s", 2.0), msg.get("seed"))
            return True
        if op == "stats":
            return self.stats()
        if op == "reset_stats":
            self.reset_stats()
            return True
        if op == "bucket":
            self.buckets.setdefault(msg["bucket"], {})
            return True
        if op == "ping":
            return "pong"
        raise ValueError(f"unknown control op {op!r}")


def _xml(tag: str, body: str) -> bytes:
    return _XML_HEAD + f'<{tag} xmlns="{_S3_NS}">{body}</{tag}>'.encode()


def _error(status: int, code: str, message: str, resource: str = "") -> tuple[int, dict, bytes]:
    body = (
        _XML_HEAD
        + f"<Error><Code>{code}</Code><Message>{escape(message)}</Message>"
        f"<Resource>{escape(resource)}</Resource><RequestId>0</RequestId></Error>".encode()
    )
    return status, {"Content-Type": "application/xml"}, body


def _httpdate(t: float) -> str:
    return email.utils.formatdate(t, usegmt=True)


def _isodate(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(t))


def _decode_aws_chunked(body: bytes) -> bytes:
    """Decode an ``aws-chunked`` (or HTTP chunked) body: ``hex[;ext] CRLF data CRLF ... 0 CRLF trailers``."""
    out = bytearray()
    pos = 0
    while True:
        eol = body.index(b"\r\n", pos)
        n = int(body[pos:eol].split(b";", 1)[0], 16)
        pos = eol + 2
        if n == 0:
            break
        out += body[pos : pos + n]
        pos += n + 2
    return bytes(out)


class S3Protocol(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection. Responses are written in request order."""

    def __init__(self, store: Store):
        self.store = store
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.pending: list[list] = []  # [ready, bytes|None] in request order (handles pipelining)
        self.closed = False
        self.loop = asyncio.get_running_loop()
        self.close_after = False

    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def connection_lost(self, exc):
        self.closed = True

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).decode("latin-1")
            lines = head.split("\r\n")
            try:
                method, target, _version = lines[0].split(" ", 2)
            except ValueError:
                self._fail_connection()
                return
            headers = {}
            for line in lines[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            body_start = end + 4
            if headers.get("transfer-encoding", "").lower() == "chunked":
                term = buf.find(b"0\r\n\r\n", body_start)
                # A full parser would walk the chunk sizes; bodies here are small control-plane uploads.
                if term < 0:
                    return
                body = _decode_aws_chunked(bytes(buf[body_start : term + 5]))
                consumed = term + 5
            else:
                n = int(headers.get("content-length", "0") or 0)
                if n and headers.get("expect", "").lower() == "100-continue" and len(buf) - body_start < n:
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    # Mark the header block so the 100 is sent once (the request is re-parsed when
                    # more of its body arrives).
                    low = bytes(buf[:end]).lower()
                    i = low.find(b"100-continue")
                    buf[i : i + 12] = b"100-sent-xxx"
                    return
                if len(buf) - body_start < n:
                    return
                body = bytes(buf[body_start : body_start + n])
                consumed = body_start + n
            del buf[:consumed]
            if headers.get("connection", "").lower() == "close":
                self.close_after = True
            self._dispatch(method, target, headers, body)
            if self.close_after:
                return

    def _fail_connection(self):
        if self.transport:
            self.transport.close()

    def _dispatch(self, method: str, target: str, headers: dict, body: bytes) -> None:
        slot = [False, None]
        self.pending.append(slot)
        try:
            status, hdrs, payload = self._handle(method, target, headers, body)
        except Exception as exc:  # a bug here must not hang the client
            status, hdrs, payload = _error(500, "InternalError", repr(exc))
        st = self.store
        st.counts[method] = st.counts.get(method, 0) + 1
        head_only = method == "HEAD"
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
        if "Content-Length" not in hdrs:
            hdrs["Content-Length"] = str(len(payload))
        hdrs.setdefault("x-amz-request-id", "0")
        for k, v in hdrs.items():
            lines.append(f"{k}: {v}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if head_only:
            out = (head,)
        elif len(payload) < 65536:
            out = (head + payload,)
        else:
            out = (head, payload)
        if not head_only:
            st.bytes_out += len(payload)
        delay = st.delay(f"{method} {target} {headers.get('range', '')}")
        slot[1] = out
        if delay > 0:
            self.loop.call_later(delay, self._ready, slot)
        else:
            self._ready(slot)

    def _ready(self, slot: list) -> None:
        slot[0] = True
        if self.closed:
            return
        pending = self.pending
        while pending and pending[0][0]:
            s = pending.pop(0)
            for chunk in s[1]:
                self.transport.write(chunk)
        if self.close_after and not pending:
            self.transport.close()

    # --- request routing -------------------------------------------------------------------------------

    def _handle(self, method: str, target: str, headers: dict, body: bytes) -> tuple[int, dict, bytes]:
        path, _, qs = target.partition("?")
        query = dict(parse_qsl(qs, keep_blank_values=True)) if qs else {}
        path = unquote(path)
        bucket, _, key = path.lstrip("/").partition("/")
        if not bucket:
            if method == "GET":  # ListBuckets
                names = "".join(
                    f"<Bucket><Name>{escape(b)}</Name><CreationDate>{_isodate(0)}</CreationDate></Bucket>"
                    for b in sorted(self.store.buckets)
                )
                return (
                    200,
                    {"Content-Type": "application/xml"},
                    _xml(
                        "ListAllMyBucketsResult", f"<Buckets>{names}</Buckets><Owner><ID>bench</ID></Owner>"
                    ),
                )
            return _error(405, "MethodNotAllowed", "unsupported", "/")
        if not key:
            return self._bucket_op(method, bucket, query, headers, body)
        return self._object_op(method, bucket, key, query, headers, body)

    def _bucket_op(self, method, bucket, query, headers, body):
        buckets = self.store.buckets
        if method == "PUT":
            buckets.setdefault(bucket, {})
            return 200, {"Location": f"/{bucket}"}, b""
        if bucket not in buckets:
            return _error(404, "NoSuchBucket", "The specified bucket does not exist", f"/{bucket}")
        if method == "HEAD":
            return 200, {"x-amz-bucket-region": "us-east-1"}, b""
        if method == "DELETE":
            if buckets[bucket]:
                return _error(409, "BucketNotEmpty", "The bucket you tried to delete is not empty")
            del buckets[bucket]
            return 204, {}, b""
        if method == "POST" and "delete" in query:
            return self._delete_objects(bucket, body)
        if method == "GET":
            if "location" in query:
                return 200, {"Content-Type": "application/xml"}, _xml("LocationConstraint", "")
            return self._list_v2(bucket, query)
        return _error(501, "NotImplemented", f"{method} on a bucket is not implemented here")

    def _list_v2(self, bucket, query):
        objs = self.store.buckets[bucket]
        prefix = query.get("prefix", "")
        delim = query.get("delimiter", "")
        max_keys = int(query.get("max-keys", "1000") or 1000)
        after = query.get("continuation-token") or query.get("start-after") or query.get("marker") or ""
        keys = sorted(k for k in objs if k.startswith(prefix) and k > after)
        contents, prefixes, seen = [], [], set()
        truncated, last = False, ""
        for k in keys:
            if len(contents) + len(prefixes) >= max_keys:
                truncated = True
                break
            if delim:
                cut = k.find(delim, len(prefix))
                if cut >= 0:
                    cp = k[: cut + len(delim)]
                    if cp not in seen:
                        seen.add(cp)
                        prefixes.append(cp)
                    last = k
                    continue
            contents.append(k)
            last = k
        enc = query.get("encoding-type") == "url"

        def name(s: str) -> str:
            return escape(quote(s, safe="/") if enc else s)

        parts = [
            f"<Name>{escape(bucket)}</Name><Prefix>{name(prefix)}</Prefix><KeyCount>"
            f"{len(contents) + len(prefixes)}</KeyCount><MaxKeys>{max_keys}</MaxKeys>"
            f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"
        ]
        if delim:
            parts.append(f"<Delimiter>{escape(delim)}</Delimiter>")
        if enc:
            parts.append("<EncodingType>url</EncodingType>")
        if truncated:
            parts.append(f"<NextContinuationToken>{escape(last)}</NextContinuationToken>")
        for k in contents:
            o = objs[k]
            parts.append(
                f"<Contents><Key>{name(k)}</Key><LastModified>{_isodate(o.mtime)}</LastModified>"
                f"<ETag>{escape(o.etag)}</ETag><Size>{len(o.data)}</Size>"
                "<StorageClass>STANDARD</StorageClass></Contents>"
            )
        for p in prefixes:
            parts.append(f"<CommonPrefixes><Prefix>{name(p)}</Prefix></CommonPrefixes>")
        return 200, {"Content-Type": "application/xml"}, _xml("ListBucketResult", "".join(parts))

    def _delete_objects(self, bucket, body):
        objs = self.store.buckets[bucket]
        keys = re.findall(rb"<Key>(.*?)</Key>", body, re.S)
        out = []
        for raw in keys:
            k = raw.decode()
            k = k.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"').replace("&amp;", "&")
            objs.pop(k, None)
            out.append(f"<Deleted><Key>{escape(k)}</Key></Deleted>")
        return 200, {"Content-Type": "application/xml"}, _xml("DeleteResult", "".join(out))

    def _object_op(self, method, bucket, key, query, headers, body):
        store = self.store
        objs = store.buckets.get(bucket)
        if objs is None:
            return _error(404, "NoSuchBucket", "The specified bucket does not exist", f"/{bucket}")
        if method in ("GET", "HEAD") and not query.get("uploadId"):
            return self._get(method, bucket, key, objs, headers, query)
        if method == "PUT":
            if "partNumber" in query and "uploadId" in query:
                return self._upload_part(bucket, key, query, headers, body)
            if "x-amz-copy-source" in headers:
                src = self._copy_source(headers)
                if isinstance(src, tuple):
                    return src
                if headers.get("if-none-match") == "*" and key in objs:
                    return _error(412, "PreconditionFailed", "At least one of the preconditions failed")
                o = _Obj(src.data)
                objs[key] = o
                return (
                    200,
                    {"Content-Type": "application/xml"},
                    _xml(
                        "CopyObjectResult",
                        f"<LastModified>{_isodate(o.mtime)}</LastModified><ETag>{escape(o.etag)}</ETag>",
                    ),
                )
            if headers.get("if-none-match") == "*" and key in objs:
                return _error(412, "PreconditionFailed", "At least one of the preconditions failed", key)
            data = self._body(headers, body)
            o = _Obj(data)
            objs[key] = o
            return 200, {"ETag": o.etag}, b""
        if method == "DELETE":
            if "uploadId" in query:
                store.uploads.pop(query["uploadId"], None)
                return 204, {}, b""
            objs.pop(key, None)
            return 204, {}, b""
        if method == "POST":
            if "uploads" in query:
                uid = uuid.uuid4().hex
                store.uploads[uid] = (bucket, key, {})
                return (
                    200,
                    {"Content-Type": "application/xml"},
                    _xml(
                        "InitiateMultipartUploadResult",
                        f"<Bucket>{escape(bucket)}</Bucket><Key>{escape(key)}</Key><UploadId>{uid}</UploadId>",
                    ),
                )
            if "uploadId" in query:
                return self._complete(bucket, key, query, headers, body)
        if method == "GET" and "uploadId" in query:  # ListParts
            up = store.uploads.get(query["uploadId"])
            if up is None:
                return _error(404, "NoSuchUpload", "The specified upload does not exist")
            parts = "".join(
                f"<Part><PartNumber>{n}</PartNumber><ETag>{escape(p.etag)}</ETag><Size>{len(p.data)}</Size></Part>"
                for n, p in sorted(up[2].items())
            )
            return 200, {"Content-Type": "application/xml"}, _xml("ListPartsResult", parts)
        return _error(501, "NotImplemented", f"{method} on an object is not implemented here")

    @staticmethod
    def _body(headers, body):
        enc = headers.get("content-encoding", "")
        sha = headers.get("x-amz-content-sha256", "")
        if "aws-chunked" in enc or sha.startswith("STREAMING-"):
            return _decode_aws_chunked(body)
        return body

    def _copy_source(self, headers):
        src = unquote(headers["x-amz-copy-source"].split("?", 1)[0]).lstrip("/")
        sb, _, sk = src.partition("/")
        o = self.store.buckets.get(sb, {}).get(sk)
        if o is None:
            return _error(404, "NoSuchKey", "The specified key does not exist.", src)
        return o

    def _upload_part(self, bucket, key, query, headers, body):
        up = self.store.uploads.get(query["uploadId"])
        if up is None:
            return _error(404, "NoSuchUpload", "The specified upload does not exist")
        n = int(query["partNumber"])
        if "x-amz-copy-source" in headers:
            src = self._copy_source(headers)
            if isinstance(src, tuple):
                return src
            data = src.data
            rng = headers.get("x-amz-copy-source-range")
            if rng:
                m = _COPY_RANGE_RE.match(rng)
                if not m or int(m.group(2)) >= len(data) or int(m.group(1)) > int(m.group(2)):
                    return _error(416, "InvalidRange", "The requested range is not satisfiable")
                data = data[int(m.group(1)) : int(m.group(2)) + 1]
            # A cheap ETag (the source's and the range's): hashing the copied bytes on this one thread
            # would serialise concurrent copies behind the server's CPU, which AWS spreads over many.
            tag = hashlib.md5(f"{src.etag}{rng}".encode(), usedforsecurity=False).hexdigest()
            p = _Obj(data, etag=f'"{tag}"')
            up[2][n] = p
            return (
                200,
                {"Content-Type": "application/xml"},
                _xml(
                    "CopyPartResult",
                    f"<LastModified>{_isodate(p.mtime)}</LastModified><ETag>{escape(p.etag)}</ETag>",
                ),
            )
        p = _Obj(self._body(headers, body))
        up[2][n] = p
        return 200, {"ETag": p.etag}, b""

    def _complete(self, bucket, key, query, headers, body):
        up = self.store.uploads.get(query["uploadId"])
        if up is None:
            return _error(404, "NoSuchUpload", "The specified upload does not exist")
        nums = [int(x) for x in re.findall(rb"<PartNumber>\s*(\d+)\s*</PartNumber>", body)]
        if not nums:
            nums = sorted(up[2])
        try:
            parts = [up[2][n] for n in nums]
        except KeyError:
            return _error(400, "InvalidPart", "One or more of the specified parts could not be found")
        for p in parts[:-1]:
            if len(p.data) < 5 * 1024 * 1024:
                return _error(400, "EntityTooSmall", "Your proposed upload is smaller than the minimum size")
        objs = self.store.buckets[bucket]
        if headers.get("if-none-match") == "*" and key in objs:
            return _error(412, "PreconditionFailed", "At least one of the preconditions failed", key)
        md5s = b"".join(bytes.fromhex(p.etag.strip('"')) for p in parts)
        etag = f'"{hashlib.md5(md5s, usedforsecurity=False).hexdigest()}-{len(parts)}"'
        o = _Obj(b"".join(p.data for p in parts), etag=etag)
        objs[key] = o
        del self.store.uploads[query["uploadId"]]
        return (
            200,
            {"Content-Type": "application/xml"},
            _xml(
                "CompleteMultipartUploadResult",
                f"<Bucket>{escape(bucket)}</Bucket><Key>{escape(key)}</Key><ETag>{escape(etag)}</ETag>",
            ),
        )

    def _get(self, method, bucket, key, objs, headers, query):
        o = objs.get(key)
        if o is None:
            if method == "HEAD":
                return 404, {}, b""
            return _error(404, "NoSuchKey", "The specified key does not exist.", f"/{bucket}/{key}")
        inm = headers.get("if-none-match")
        if inm and inm.strip() in (o.etag, "*"):
            return 304, {"ETag": o.etag}, b""
        im = headers.get("if-match")
        if im and im.strip() not in (o.etag, "*"):
            return _error(412, "PreconditionFailed", "At least one of the preconditions failed")
        data = o.data
        size = len(data)
        hdrs = {
            "Content-Type": "application/octet-stream",
            "ETag": o.etag,
            "Last-Modified": _httpdate(o.mtime),
            "Accept-Ranges": "bytes",
        }
        rng = headers.get("range")
        pn = query.get("partNumber")
        if rng or (pn and pn != "1"):
            m = _RANGE_RE.match(rng or "")
            if not m or (not m.group(1) and not m.group(2)):
                if pn:
                    return _error(416, "InvalidPartNumber", "The requested partnumber is not satisfiable")
                # S3 ignores a malformed Range and returns the whole object.
                hdrs["Content-Length"] = str(size)
                return 200, hdrs, (b"" if method == "HEAD" else data)
            if m.group(1):
                start = int(m.group(1))
                end = int(m.group(2)) if m.group(2) else size - 1
            else:  # suffix range: the last n bytes
                n = int(m.group(2))
                start, end = max(0, size - n), size - 1
            if start >= size or end < start:
                hdrs = {"Content-Type": "application/xml"}
                st, h, b = _error(
                    416, "InvalidRange", "The requested range is not satisfiable", f"/{bucket}/{key}"
                )
                h["Content-Range"] = f"bytes */{size}"
                return st, h, b
            end = min(end, size - 1)
            hdrs["Content-Range"] = f"bytes {start}-{end}/{size}"
            hdrs["Content-Length"] = str(end - start + 1)
            if method == "HEAD":
                return 206, hdrs, b""
            # The whole object (e.g. awscrt's first-part request on a small object) needs no copy.
            return 206, hdrs, (data if start == 0 and end == size - 1 else data[start : end + 1])
        if pn:
            hdrs["x-amz-mp-parts-count"] = "1"
        hdrs["Content-Length"] = str(size)
        return 200, hdrs, (b"" if method == "HEAD" else data)


# ---------------------------------------------------------------------------------------------------------
# Process entry points


def _bind(host: str, port: int) -> socket.socket:
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"refusing to bind {host!r}: this benchmark server serves loopback only")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def _serve(sock: socket.socket, store: Store, conn=None, ready=None) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: S3Protocol(store), sock=sock)
    stop = loop.create_future()
    if conn is not None:

        def on_control():
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                if not stop.done():
                    stop.set_result(None)
                return
            if msg.get("op") == "stop":
                conn.send({"ok": True, "result": None})
                if not stop.done():
                    stop.set_result(None)
                return
            try:
                conn.send({"ok": True, "result": store.control(msg)})
            except Exception as exc:
                conn.send({"ok": False, "error": repr(exc)})

        loop.add_reader(conn.fileno(), on_control)
    if ready is not None:
        ready()
    async with server:
        if conn is None:
            await server.serve_forever()
        else:
            await stop


def server_main(port: int, conn, ttfb_median_s: float = 0.0, ttfb_sigma: float = 0.0, seed: int = 0) -> None:
    """Child-process entry point: serve on 127.0.0.1:port until the control pipe says stop or closes."""
    store = Store()
    store.set_latency(ttfb_median_s, ttfb_sigma, seed=seed)
    sock = _bind("127.0.0.1", port)

    def ready():
        conn.send({"ok": True, "result": {"port": sock.getsockname()[1], "pid": os.getpid()}})

    asyncio.run(_serve(sock, store, conn, ready))


class ServerHandle:
    """Parent-side handle on a server child process (spawned, so the client's threads are not forked)."""

    def __init__(self, port: int = 0, ttfb_median_s: float = 0.0, ttfb_sigma: float = 0.0, seed: int = 0):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=server_main,
            args=(port, child, ttfb_median_s, ttfb_sigma, seed),
            daemon=True,
            name="bench-s3server",
        )
        self.proc.start()
        child.close()
        try:
            if not self._conn.poll(60):
                raise RuntimeError("benchmark S3 server did not start within 60 s")
            info = self._recv()
        except (EOFError, OSError, RuntimeError) as exc:
            self.proc.kill()
            raise RuntimeError(
                f"benchmark S3 server failed to start ({exc!r}); a script that starts it must guard its "
                "entry point with `if __name__ == '__main__':` (the server is a spawned process)"
            ) from exc
        self.port = info["port"]
        self.pid = info["pid"]
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _recv(self):
        msg = self._conn.recv()
        if not msg.get("ok"):
            raise RuntimeError(f"benchmark S3 server: {msg.get('error')}")
        return msg["result"]

    def call(self, op: str, timeout: float = 600, **kw):
        self._conn.send({"op": op, **kw})
        if not self._conn.poll(timeout):
            raise RuntimeError(f"benchmark S3 server did not answer {op!r} within {timeout} s")
        return self._recv()

    def populate(self, bucket: str, prefix: str, count: int, size: int, seed: int = 0) -> int:
        self.call("bucket", bucket=bucket)
        return self.call("populate", bucket=bucket, prefix=prefix, count=count, size=size, seed=seed)

    def set_latency(self, median_s: float, sigma: float = 0.0, cap_s: float = 2.0, seed: int | None = None):
        return self.call("latency", median_s=median_s, sigma=sigma, cap_s=cap_s, seed=seed)

    def cpu_seconds(self) -> float:
        import psutil

        t = psutil.Process(self.pid).cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("stop", timeout=10)
        except Exception:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--ttfb-ms", type=float, default=0.0, help="median injected time to first byte")
    ap.add_argument("--ttfb-sigma", type=float, default=0.0, help="lognormal sigma of the injected delay")
    ap.add_argument(
        "--populate",
        action="append",
        default=[],
        metavar="BUCKET/PREFIX:COUNT:SIZE",
        help="create COUNT synthetic objects of SIZE bytes named PREFIX0000000.. (repeatable)",
    )
    args = ap.parse_args(argv)
    store = Store()
    store.set_latency(args.ttfb_ms / 1000, args.ttfb_sigma)
    for spec in args.populate:
        path, count, size = spec.rsplit(":", 2)
        bucket, _, prefix = path.partition("/")
        store.buckets.setdefault(bucket, {})
        store.populate(bucket, prefix, int(count), int(size))
    sock = _bind("127.0.0.1", args.port)
    print(f"serving S3 on http://127.0.0.1:{sock.getsockname()[1]} (Ctrl-C to stop)", file=sys.stderr)
    try:
        asyncio.run(_serve(sock, store))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
