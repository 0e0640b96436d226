"""Transports: how the GetBatch engine reads one byte range of one object.

A transport starts a read and reports back through a callback, from any thread. The engine (which
orders, windows, retries and hedges) never blocks on a single read, so a callback-native client such as
awscrt's needs no thread per request. Errors reported: :class:`ObjectNotFound`, :class:`InvalidRange`,
:class:`TransientError` (retried) or anything else (the item fails).

A read of unknown length may carry a ``limit``: a transport that can (it says so with ``limits = True``,
see :func:`takes_limit`) then reads at most ``limit`` bytes and, when the object runs on past them,
answers :class:`~functions.store.pinning.TooLarge` with the bytes to its end (and the object's pin)
instead of the data, so the engine can bound its memory without knowing any size in advance. Locally
that is one ``fstat`` before the read; boto3 looks at the answer's ``Content-Length`` before reading its
body; the CRT asks for the first ``limit`` bytes as a range and reads the size from ``Content-Range``.

``SHARDFOLD_S3_TRANSPORT`` picks the S3 client: ``crt`` (awscrt's native S3 client, the default: about a
fifth of boto3's CPU per small GET) or ``boto3`` (a thread pool over one boto3 client). ``crt`` falls back to
``boto3`` when awscrt cannot be imported.
"""

from __future__ import annotations

import contextvars
import functools
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from shardfold.functions import telemetry
from shardfold.functions.log import logger
from shardfold.functions.store import local, s3
from shardfold.functions.store.pinning import Pin
from shardfold.functions.store.uri import FILE, S3

Done = Callable[[bytes | None, BaseException | None], None]
Cancel = Callable[[], object]

THREADS = 128  # per-process pool ceiling; threads start on demand, the engine bounds how many are busy


class Transport(Protocol):
    def fetch(
        self, uri: str, start: int, length: int | None, done: Done, pin: Pin | None = None
    ) -> Cancel | None:
        """Start reading ``length`` bytes (``None``: to the end) at ``start`` of the object at ``uri``.

        Call ``done(data, None)`` or ``done(None, error)`` exactly once, from any thread. Return a
        function that abandons the read (used when a hedged duplicate already answered), or ``None``.
        With a ``pin`` (the engine passes one only when it has one), read only the object it pinned and
        report :class:`InputChanged` otherwise, in the same request (``If-Match``, ``fstat``).
        A transport with ``limits = True`` also takes ``limit=`` (only with ``length=None``): see the
        module doc.
        """
        ...


def takes_limit(transport: object) -> bool:
    """Whether ``transport`` honours ``fetch(..., limit=n)``."""
    return bool(getattr(transport, "limits", False))


_pools: dict[tuple[int, str], ThreadPoolExecutor] = {}
_pool_lock = threading.Lock()


def thread_pool(name: str) -> ThreadPoolExecutor:
    """A per-process pool (re-created after fork, whose child inherits no threads)."""
    key = (os.getpid(), name)
    pool = _pools.get(key)
    if pool is None:
        with _pool_lock:
            pool = _pools.get(key) or ThreadPoolExecutor(THREADS, thread_name_prefix=f"sf-{name}")
            _pools[key] = pool
    return pool


def _deliver(read: Callable[[], bytes], done: Done) -> None:
    """Run a read and report its bytes or its error to ``done`` (reported, never raised: a transport's
    reads run on pool or reader threads, or inline for the engine, which hears of them only through
    ``done``)."""
    try:
        data = read()
    except BaseException as exc:
        done(None, exc)
        return
    done(data, None)


class _ThreadTransport:
    """Runs a blocking read function on a shared thread pool."""

    name = "threads"
    limits = True

    def _read(self, uri: str, start: int, length: int | None, pin: Pin | None, limit: int | None) -> bytes:
        raise NotImplementedError

    def fetch(
        self,
        uri: str,
        start: int,
        length: int | None,
        done: Done,
        pin: Pin | None = None,
        limit: int | None = None,
    ) -> Cancel | None:
        run = functools.partial(_deliver, functools.partial(self._read, uri, start, length, pin, limit), done)
        return thread_pool(self.name).submit(telemetry.carried(run)).cancel


# Threads that read local files: a few, as a local disk (or its page cache) serves a read in microseconds; a
# thread per read in flight (as S3's latency needs) spends more on switching between them than on reading.
LOCAL_READERS = min(8, 2 * (os.cpu_count() or 1))
# A local read of at most this many bytes (its length, or the limit of a read of unknown length) is done on
# the caller's thread: from the page cache it takes microseconds, less than a hand-over to a reader
INLINE_READ_BYTES = 256 * 1024


class _Readers:
    """A few daemon threads taking reads from one queue: no future, no pool bookkeeping per read (a 1 KiB
    file is read in less time than ``ThreadPoolExecutor.submit`` takes). Each read runs in the context of
    the task that handed it over, so it counts for that task's telemetry."""

    def __init__(self, threads: int):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        for k in range(threads):
            threading.Thread(target=self._loop, name=f"sf-local-{k}", daemon=True).start()

    def _loop(self) -> None:
        while True:
            context, read, done = self.queue.get()
            context.run(_deliver, read, done)


_readers: dict[int, _Readers] = {}


def local_readers() -> _Readers:
    """This process's readers (re-created after fork, whose child inherits no threads)."""
    readers = _readers.get(os.getpid())
    if readers is None:
        with _pool_lock:
            readers = _readers.get(os.getpid()) or _Readers(LOCAL_READERS)
            _readers[os.getpid()] = readers
    return readers


class LocalTransport:
    """``file://`` objects, read by a few threads (:class:`_Readers`; reads release the GIL); with
    ``buffers``, ranges that fit are read into its reused buffers (numpy views, see
    :class:`~functions.store.local.Buffers`). A local read is not abandoned once queued (``None``)."""

    name = "local"
    limits = True

    def __init__(self, buffers: local.Buffers | None = None):
        self.buffers = buffers

    def read(self, uri: str, start: int, length: int | None, pin: Pin | None, limit: int | None) -> bytes:
        """One read on the caller's thread, raising its error (the engine's direct path for small reads)."""
        # the path as a string: a Path per read cost as much as the read of a small file
        return local.get(uri[len(FILE) :], uri, start, length, pin, limit=limit, into=self.buffers)

    def fetch(
        self,
        uri: str,
        start: int,
        length: int | None,
        done: Done,
        pin: Pin | None = None,
        limit: int | None = None,
    ) -> Cancel | None:
        read = functools.partial(self.read, uri, start, length, pin, limit)
        size = length if length is not None else limit
        if size is not None and size <= INLINE_READ_BYTES:
            _deliver(read, done)  # small: read here; handing it to a reader costs more than the read
        else:
            local_readers().queue.put((contextvars.copy_context(), read, done))
        return None


class Boto3Transport(_ThreadTransport):
    """``s3://`` objects through boto3 on a thread pool; botocore's own retries are off (the engine's
    policy applies instead, so retries do not multiply)."""

    name = "boto3"

    def _read(self, uri: str, start: int, length: int | None, pin: Pin | None, limit: int | None) -> bytes:
        return s3.get(uri, start, length, client=s3.s3_client(retries=False), pin=pin, limit=limit)


class RoutingTransport:
    """Sends each read to the transport for its URI scheme."""

    limits = True  # the default transports all honour a limit

    def __init__(self, s3_transport: Transport | None = None, local_transport: Transport | None = None):
        self._s3 = s3_transport
        self._local = local_transport or LocalTransport()

    @property
    def local_read(self) -> Callable[..., bytes] | None:
        """The built-in local transport's blocking read (:meth:`LocalTransport.read`), else None."""
        return self._local.read if isinstance(self._local, LocalTransport) else None

    @property
    def s3(self) -> Transport:
        if self._s3 is None:
            self._s3 = s3_transport()
        return self._s3

    def fetch(
        self,
        uri: str,
        start: int,
        length: int | None,
        done: Done,
        pin: Pin | None = None,
        limit: int | None = None,
    ) -> Cancel | None:
        target = self.s3 if uri.startswith(S3) else self._local
        if limit is not None and takes_limit(target):
            return target.fetch(uri, start, length, done, pin, limit=limit)
        if pin is None:  # transports written before pins need not take one
            return target.fetch(uri, start, length, done)
        return target.fetch(uri, start, length, done, pin)


def s3_transport_name() -> str:
    """The S3 transport ``SHARDFOLD_S3_TRANSPORT`` selects (``crt`` by default)."""
    name = os.environ.get("SHARDFOLD_S3_TRANSPORT", "crt").strip().lower() or "crt"
    if name not in ("crt", "boto3"):
        raise ValueError(f"SHARDFOLD_S3_TRANSPORT={name!r}: expected 'crt' or 'boto3'")
    return name


def s3_transport() -> Transport:
    if s3_transport_name() == "crt":
        try:
            from shardfold.functions.store.crt import CrtTransport

            return CrtTransport()
        except ImportError as exc:
            logger.warning("awscrt unavailable, using boto3 for GetBatch", extra={"error": str(exc)})
    return Boto3Transport()


def default_transport() -> Transport:
    return RoutingTransport()


def fetch_blocking(
    transport: Transport, uri: str, start: int, length: int | None, pin: Pin | None = None
) -> bytes:
    """One read through a transport, waiting for the answer (for the rare sequential reads, e.g. TAR
    index scans)."""
    finished = threading.Event()
    box: list = [None, None]

    def done(data: bytes | None, exc: BaseException | None) -> None:
        box[0], box[1] = data, exc
        finished.set()

    if pin is None:
        transport.fetch(uri, start, length, done)
    else:
        transport.fetch(uri, start, length, done, pin)
    finished.wait()
    if box[1] is not None:
        raise box[1]
    return box[0]
