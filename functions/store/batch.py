"""GetBatch: many objects, byte ranges or TAR members fetched as one ordered, streamed, fault-tolerant read.

The engine runs in the consumer's thread. Transports report completed reads into a queue; the engine
keeps a sliding window of items (at most ``window`` items between the oldest one not yet yielded and the
newest one requested, at most ``concurrency`` reads in flight), puts answers into a reorder buffer and
yields the contiguous ready prefix, so entry 0 comes out as soon as it arrives. A small local read (at most
``INLINE_READ_BYTES``) takes microseconds from the page cache, less than a hand-over: it is made on the
engine's thread and settled at once, and with nothing pending a small local file is read and yielded at
once, with no slot at all (most of a request of local files).

Memory is bounded in bytes, not by the window times the largest item. The engine holds at most ``max_bytes``
(default :data:`DEFAULT_MAX_BYTES`) buffered or reserved for reads in flight: a read of known length
reserves that length; a read of unknown length (a whole object, or to its end) reserves a *cap* and asks the
transport to stop at that many bytes. The cap starts at one *step* (``max_bytes / concurrency``, at least 64
KiB) and then follows the largest item seen (never below 64 KiB nor above the step), so objects alike in
size reserve what they are. A transport that finds the object longer answers
:class:`~functions.store.pinning.TooLarge` with its size (and, where the answer carries one, the object's
pin) without reading the rest, and the item waits until its whole length fits: no later item is started
meanwhile. An item that does not fit even when it is the next to be yielded is *streamed*: its entry carries
the size and reads the bytes in ranges as the consumer takes them (:meth:`BatchEntry.chunks`), each range
checked against the object's pin (the plan's, or the one the read that stopped reported; an item with
neither is first read for 0 bytes, which finds its size and pin, so a missing object or a range past the end
is still an ordinary item error). So the buffered and reserved bytes never pass ``max_bytes`` plus one step,
whatever the objects' sizes, and no size has to be known before the request starts. (A transport that cannot
stop a read early, such as a test's fake, reads whole objects; the bound then holds only for known lengths.)

Faults:
- throttling and 5xx (:class:`TransientError`) are retried with exponential backoff and full jitter;
- a read outstanding far longer than its peers (``hedge_after`` seconds, by default
  ``max(2 s, 3 x p95)`` of completed reads) is re-issued once, if its reservation fits, and the first
  answer wins;
- a missing object or member, or a range outside the object, is a *soft* error: with
  ``continue_on_error`` the entry becomes a zero-byte ``__404__/<name>`` placeholder carrying the error
  (aborting with :class:`TooManySoftErrors` past ``max_soft_errors``); without it,
  :class:`BatchItemError` names the item and the stream ends. Anything else (retries exhausted, access
  denied) is a hard error: always :class:`BatchItemError`. So is an object that changed since it was
  pinned (``pins``: its :class:`InputChanged` is the item error's cause); the check rides on each read
  (S3 ``If-Match``, local ``fstat``), never an extra request. A streamed entry's error (raised from its
  chunks) is always hard: its header is already out.
Errors come out in request order: once item k fails, reads after it are abandoned, the entries before it
are yielded, then the error is raised, so it always names the first failing item and nothing after it is
ever yielded. :class:`TooManySoftErrors` aborts at once.
"""

from __future__ import annotations

import heapq
import math
import queue
import tarfile
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from pydantic import ValidationError

from shardfold.functions import collector, telemetry
from shardfold.functions.errors import (
    BatchItemError,
    InvalidRange,
    ObjectNotFound,
    ShardfoldError,
    SpecError,
    StoreError,
    TooManySoftErrors,
)
from shardfold.functions.log import logger
from shardfold.functions.specs import BatchItem
from shardfold.functions.store.local import Buffers, check_range
from shardfold.functions.store.pinning import Pin, TooLarge
from shardfold.functions.store.retry import RetryPolicy, TransientError
from shardfold.functions.store.tar import INDEX_BLOCK, find_member, index_tar
from shardfold.functions.store.transport import (
    INLINE_READ_BYTES,
    LocalTransport,
    RoutingTransport,
    Transport,
    default_transport,
    fetch_blocking,
    takes_limit,
    thread_pool,
)
from shardfold.functions.store.uri import FILE, default_name, reach, store_root

MiB = 1024 * 1024
# Reads in flight. S3 answers small GETs in tens of ms, so throughput is concurrency / latency until the
# client's CPU binds; the CRT transport costs ~0.15 ms CPU per object, which leaves room for 128.
DEFAULT_CONCURRENCY = 128
WINDOW_PER_READ = 2  # default window: items buffered or in flight per read in flight
# Bytes buffered or reserved for reads in flight: what a gather task holds of the objects it fetches.
DEFAULT_MAX_BYTES = 256 * MiB
MIN_STEP = 64 * 1024  # the least a read of unknown length may return before it stops at the step
HEDGE_FLOOR_S = 2.0  # AWS: retry a small GET still unanswered after 2 s
HEDGE_P95_FACTOR = 3.0
HEDGE_MIN_SAMPLES = 16  # below this many completed reads, p95 means little: use the floor
PLACEHOLDER = "__404__/"
SOFT_ERRORS = (ObjectNotFound, InvalidRange)

_HEDGE, _RETRY = 0, 1


# What a read made on the engine's own thread reports as its item's outcome (a missing or changed object, a
# bad range, one too large for its reservation, a filesystem error, a path the OS cannot take). Anything else
# raised there is not the item's: a task's timeout raised into the thread, an interrupt; it propagates.
READ_FAILURES = (ShardfoldError, TransientError, TooLarge, OSError, ValueError)


def step_bytes(max_bytes: int, concurrency: int) -> int:
    """What a read of unknown length reserves (and may return before it stops): ``max_bytes /
    concurrency``, at least :data:`MIN_STEP`, at most ``max_bytes``."""
    return min(max_bytes, max(MIN_STEP, max_bytes // concurrency))


class BatchEntry:
    """One output entry: ``name`` is its path in the archive, ``size`` its length; ``error`` is set on
    placeholders.

    An item too large for the engine's byte budget is a *streamed* entry: :meth:`chunks` reads its bytes in
    ranges as they are taken, and must be drained before the next entry is asked for (the stream then
    abandons what is left of it). ``data`` gives any entry's bytes in one piece, reading a streamed one
    into memory whole."""

    __slots__ = ("index", "name", "error", "size", "streamed", "_data", "_stream")

    def __init__(
        self,
        index: int,
        name: str,
        data: bytes = b"",
        error: str | None = None,
        *,
        size: int | None = None,
        stream: Iterator[bytes] | None = None,
    ):
        self.index = index
        self.name = name
        self.error = error
        self.size = len(data) if size is None else size
        self.streamed = stream is not None
        self._data = data
        self._stream = stream

    @property
    def data(self) -> bytes:  # or a numpy uint8 view, from get_batch(buffer_bytes=...)
        if self._stream is not None:
            self._data = b"".join(self.chunks())
        return self._data

    def chunks(self) -> Iterator[bytes]:
        """The entry's bytes, in order: one piece, or for a streamed entry its ranges as they are read."""
        stream, self._stream = self._stream, None
        if stream is not None:
            yield from stream
        elif len(self._data):  # bytes, or a numpy view (get_batch's buffer_bytes)
            yield self._data

    def close(self) -> None:
        """Abandon what is left of a streamed entry."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()  # type: ignore[attr-defined]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BatchEntry):
            return NotImplemented
        mine = (self.index, self.name, bytes(self.data), self.error)
        return mine == (other.index, other.name, bytes(other.data), other.error)

    def __repr__(self) -> str:
        how = "streamed" if self.streamed else "bytes"
        return f"BatchEntry({self.index}, {self.name!r}, {self.size} {how}, error={self.error!r})"


@dataclass
class BatchStats:
    """What one GetBatch did; tests read ``peak_held_bytes`` and ``peak_buffered_bytes`` to check the
    memory bound."""

    window: int
    concurrency: int
    max_bytes: int = DEFAULT_MAX_BYTES
    items: int = 0  # entries yielded
    bytes: int = 0  # data bytes yielded
    requests: int = 0  # reads issued, including retries and hedges
    retries: int = 0
    hedges: int = 0
    hedge_wins: int = 0  # items whose hedged duplicate answered first
    soft_errors: int = 0
    tar_indexes: int = 0  # TAR shards whose member index was built
    oversize: int = 0  # reads the transport stopped at their limit (the item was then read by its size)
    streamed: int = 0  # entries read in ranges as the consumer took them
    buffered_bytes: int = 0  # answered but not yet yielded
    peak_buffered_bytes: int = 0
    held_bytes: int = 0  # buffered, plus reserved for reads in flight or about to be retried
    peak_held_bytes: int = 0
    largest_item_bytes: int = 0
    peak_in_flight: int = 0
    latencies: deque = field(default_factory=lambda: deque(maxlen=512), repr=False)


class _Slot:
    """One requested item while it is in the window."""

    __slots__ = (
        "index",
        "uri",
        "start",
        "length",
        "archpath",
        "name",
        "read",
        "size",
        "seen",
        "outstanding",
        "attempts",
        "hedged",
        "failures",
        "parked",
        "queued",
        "probing",
        "stream",
        "ready",
        "data",
        "error",
        "fatal",
    )

    def __init__(self, index: int, uri: str, start: int, length: int | None, archpath: str | None, name: str):
        self.index = index
        self.uri = uri
        self.start = start
        self.length = length
        self.archpath = archpath
        self.name = name
        self.read: tuple[int, int | None] | None = None  # (start, length) within the object
        self.size: int | None = None  # bytes the read returns, once known
        self.seen: Pin | None = None  # the object as a stopped read found it (for a streamed entry)
        self.outstanding: dict[int, tuple[float, Any, int]] = {}  # attempt -> (issued at, cancel, reserved)
        self.attempts = 0  # reads issued so far; numbers the next one
        self.hedged = -1  # the attempt number of the hedge, once issued
        self.failures = 0  # transient failures so far
        self.parked = 0  # bytes kept reserved while a retry waits
        self.queued = False  # waiting for room in the byte budget
        self.probing = False  # a read stopped at 0 bytes is out, to learn the object's size and pin
        self.stream = False  # to be yielded as a streamed entry
        self.ready = False
        self.data = b""
        self.error: str | None = None
        self.fatal: BatchItemError | None = None  # raised when this entry's turn comes

    def describe(self) -> str:
        return f"{self.uri} member {self.archpath}" if self.archpath else self.uri


class BatchStream(Iterator[BatchEntry]):
    """The entries of a GetBatch, in request order. ``stats`` fills in as it is consumed; ``close()``
    (or leaving a ``with`` block) abandons reads still in flight."""

    def __init__(self, engine: _Engine):
        self.stats = engine.stats
        self._gen = engine.run()

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> BatchEntry:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def get_batch(
    items: Iterable[BatchItem | dict | str],
    *,
    continue_on_error: bool = False,
    window: int | None = None,
    concurrency: int | None = None,
    max_bytes: int | None = None,
    max_soft_errors: int | None = None,
    hedge_after: float | None = None,
    transport: Transport | None = None,
    retry: RetryPolicy | None = None,
    pins: Mapping[str, Pin] | None = None,
    buffer_bytes: int | None = None,
) -> BatchStream:
    """Fetch ``items`` and yield one :class:`BatchEntry` per item, in request order (duplicates allowed).

    ``items``: :class:`BatchItem`, dicts of its fields, or URI strings; any iterable (consumed lazily).
    ``concurrency``: reads in flight (default 128). ``window``: items buffered or in flight ahead of the
    consumer (default ``2 x concurrency``). ``max_bytes``: bytes buffered or reserved for reads in flight
    (default :data:`DEFAULT_MAX_BYTES`); an item larger than what is free waits, and one larger than the
    whole budget is streamed (see the module doc).
    ``hedge_after``: seconds before a slow read is duplicated (default adaptive; ``math.inf`` disables).
    ``transport``: how reads are made (default: ``file://`` on threads, ``s3://`` per
    ``SHARDFOLD_S3_TRANSPORT``). ``retry``: backoff for throttling and 5xx. ``pins``: resolved URI ->
    :class:`Pin` recorded at plan time; reads of those objects (TAR index scans included) fail the item
    with :class:`InputChanged` if the object changed since. ``buffer_bytes`` (with the default transport):
    ranges of local files of at most that many bytes come back as numpy ``uint8`` views of reused,
    page-aligned buffers (:class:`~functions.store.local.Buffers`: several times faster to fill than new
    ``bytes``), for a consumer that only needs the bytes' buffer.
    """
    if buffer_bytes is not None:
        if transport is not None:
            raise ValueError("buffer_bytes applies to the default transport; give one or the other")
        transport = RoutingTransport(local_transport=LocalTransport(Buffers(buffer_bytes)))
    concurrency = concurrency or DEFAULT_CONCURRENCY
    window = window or WINDOW_PER_READ * concurrency
    max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    if concurrency < 1 or window < 1:
        raise ValueError(f"window ({window}) and concurrency ({concurrency}) must be at least 1")
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be at least 1, got {max_bytes}")
    if max_soft_errors is not None and max_soft_errors < 0:
        raise ValueError(f"max_soft_errors must be >= 0, got {max_soft_errors}")
    engine = _Engine(
        iter(items),
        continue_on_error=continue_on_error,
        window=window,
        concurrency=concurrency,
        max_bytes=max_bytes,
        max_soft_errors=max_soft_errors,
        hedge_after=hedge_after,
        transport=transport or default_transport(),
        retry=retry or RetryPolicy(),
        pins=pins,
    )
    return BatchStream(engine)


class _Engine:
    def __init__(
        self,
        items: Iterator[BatchItem | dict | str],
        *,
        continue_on_error: bool,
        window: int,
        concurrency: int,
        max_soft_errors: int | None,
        hedge_after: float | None,
        transport: Transport,
        retry: RetryPolicy,
        pins: Mapping[str, Pin] | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ):
        self.items = items
        self.continue_on_error = continue_on_error
        self.window = window
        self.concurrency = concurrency
        self.max_bytes = max_bytes
        self.step = step_bytes(max_bytes, concurrency)
        self.cap = self.step  # what a read of unknown length reserves now: see _learn
        self.limits = takes_limit(transport)
        # small local reads are made here and settled at once: no hand-over, no event, no hedge timer
        self.read_here = transport.local_read if isinstance(transport, RoutingTransport) else None
        self.max_soft_errors = max_soft_errors
        self.hedge_after = hedge_after
        self.transport = transport
        self.retry = retry
        self.pins = pins or None
        self.stats = BatchStats(window=window, concurrency=concurrency, max_bytes=max_bytes)
        self.root = store_root()
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.slots: dict[int, _Slot] = {}
        self.next_out = 0  # index of the next entry to yield
        self.next_in = 0  # index the next item pulled from ``items`` gets
        self.exhausted = False
        self.in_flight = 0
        self.held = 0  # bytes buffered, reserved for reads in flight, or kept for a retry
        self.queue: list[tuple[int, _Slot]] = []  # slots waiting for room, lowest index first
        self.answered = 0  # reads that succeeded
        self.timers: list[tuple[float, int, int, int, int]] = []  # (when, seq, kind, index, attempt)
        self.timer_seq = 0
        self.indexes: dict[str, dict | BaseException] = {}  # shard URI -> member index, or why not
        self.waiting: dict[str, list[_Slot]] = {}  # shard URI -> slots waiting for its index
        self.hedge_delay = HEDGE_FLOOR_S if hedge_after is None else hedge_after
        self.hedging = not math.isinf(self.hedge_delay)

    # --- the loop --------------------------------------------------------------------------------------

    def run(self) -> Iterator[BatchEntry]:
        pause = collector.relaxed()
        pause.__enter__()
        try:
            while True:
                if self.timers:  # also when the consumer never waits, so the timer heap stays short
                    self._fire_timers()
                if not self.slots and self.read_here is not None:
                    entry = self._at_once()
                    if entry is not None:
                        yield entry
                        continue
                self._fill()
                head = self.slots.get(self.next_out)
                if head is None:
                    break  # nothing requested beyond the last yielded entry: done
                if head.ready:
                    if head.fatal is not None:
                        raise head.fatal
                    if head.stream:
                        entry, chunk = self._emit_stream(head)
                        try:
                            yield entry
                        finally:
                            entry.close()  # whatever the consumer left of it
                            self._hold(-chunk)
                    else:
                        yield self._emit(head)
                else:
                    self._wait()
        finally:
            pause.__exit__(None, None, None)
            self._abandon()
            logger.debug("get_batch finished", extra={"stats": _summary(self.stats)})

    def _fill(self) -> None:
        """Start what the limits allow: first the slots waiting for room (lowest index first; while one
        waits, no new item is started), then new items."""
        while True:
            self._start_queued()
            if (
                self.queue
                or self.exhausted
                or self.in_flight >= self.concurrency
                or self.next_in - self.next_out >= self.window
                or (self.held + self.cap > self.max_bytes and self.slots)
            ):
                return
            try:
                item = next(self.items)
            except StopIteration:
                self.exhausted = True
                return
            slot = self._slot(self.next_in, item)
            self.slots[slot.index] = slot
            self.next_in += 1
            self._start(slot)

    def _at_once(self) -> BatchEntry | None:
        """With nothing pending, the next item when it is a small local file read whole: read here and made
        the next entry at once, with no slot, reservation or hand-over (most of a request of local files).
        A read that fails becomes a slot settled as usual (its placeholder is returned); anything else, a
        slot started as usual (None)."""
        limit = min(self.cap, INLINE_READ_BYTES)
        if self.queue or self.exhausted or not self.limits or self.held + limit > self.max_bytes:
            return None
        try:
            item = next(self.items)
        except StopIteration:
            self.exhausted = True
            return None
        index = self.next_in
        self.next_in += 1
        slot = self._slot(index, item)
        if slot.archpath is None and slot.start == 0 and slot.length is None and slot.uri.startswith(FILE):
            pin = self.pins.get(slot.uri) if self.pins else None
            try:
                data = self.read_here(slot.uri, 0, None, pin, limit)  # type: ignore[misc]
            except TooLarge:
                pass  # started as a slot: it waits for room for its size, or is streamed
            except READ_FAILURES as exc:
                slot.read = (0, None)  # a whole read, as _start makes it
                self.slots[index] = slot
                self.stats.requests += 1
                self._settle(slot, None, exc, None, -1, 0)
                return self._settled_now(slot)
            else:
                return self._read_at_once(index, slot.name, data)
        self.slots[index] = slot
        self._start(slot)
        return self._settled_now(slot)

    def _settled_now(self, slot: _Slot) -> BatchEntry | None:
        """The head slot's entry when it settled as it started (a placeholder, a local range): the next item
        is then read at once too."""
        return self._emit(slot) if slot.ready and slot.fatal is None and not slot.stream else None

    def _read_at_once(self, index: int, name: str, data: bytes) -> BatchEntry:
        """Item ``index``, read by :meth:`_at_once`, as the next entry: counted as a slot's read would be, its
        bytes held while the consumer has them."""
        stats = self.stats
        n = len(data)
        stats.requests += 1
        stats.items += 1
        stats.bytes += n
        stats.peak_held_bytes = max(stats.peak_held_bytes, self.held + n)
        stats.peak_buffered_bytes = max(stats.peak_buffered_bytes, stats.buffered_bytes + n)
        if n > stats.largest_item_bytes or self.cap == self.step:
            self._learn(n)
        self.next_out += 1
        return BatchEntry(index, name, data, None)

    def _start_queued(self) -> None:
        """Issue the queued slots that now fit, lowest index first, stopping at one that does not. The
        head always goes: by one more step, or streamed when it needs more than a step."""
        while self.queue and self.in_flight < self.concurrency:
            slot = self.queue[0][1]
            if self.slots.get(slot.index) is not slot or slot.ready:
                heapq.heappop(self.queue)  # dropped since (a failure stopped the batch)
                continue
            need = self._reservation(slot)
            over = self.held + need > self.max_bytes
            if over and slot.index != self.next_out:
                return
            heapq.heappop(self.queue)
            slot.queued = False
            if not (over and need > self.step):
                self._issue(slot)
            elif self._pin(slot) is None and self.limits:
                # the head, too large to fit, of an object not yet seen: learn its size and pin first (a
                # read stopped at 0 bytes), so a missing object or a range past its end is an item error
                # like any other, and the ranges it is then read in are of one version
                slot.probing = True
                self._issue(slot)
            else:
                slot.stream = slot.ready = True  # the head, too large to fit: read as it is taken

    def _wait(self) -> None:
        """Block until a read answers or a timer is due, then handle everything that is ready."""
        timeout = max(0.0, self.timers[0][0] - time.monotonic()) if self.timers else None
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            event = None
        self._fire_timers()
        while event is not None:
            self._handle(*event)
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                event = None

    def _emit(self, slot: _Slot) -> BatchEntry:
        del self.slots[slot.index]
        self.next_out += 1
        stats = self.stats
        n = len(slot.data)
        stats.buffered_bytes -= n
        self._hold(-n)
        stats.items += 1
        stats.bytes += n
        name = PLACEHOLDER + slot.name if slot.error is not None else slot.name
        return BatchEntry(slot.index, name, slot.data, slot.error)

    def _emit_stream(self, slot: _Slot) -> tuple[BatchEntry, int]:
        """The head slot as a streamed entry, and the bytes its ranges take (held until it is done)."""
        del self.slots[slot.index]
        self.next_out += 1
        size = slot.size or 0
        chunk = min(size, max(self.step, self.max_bytes - self.held))
        self._hold(chunk)
        stats = self.stats
        stats.items += 1
        stats.bytes += size
        stats.streamed += 1
        stream = self._stream(slot, chunk)
        return BatchEntry(slot.index, slot.name, size=size, stream=stream), chunk

    def _stream(self, slot: _Slot, chunk: int) -> Iterator[bytes]:
        start = slot.read[0]  # type: ignore[index]
        size = slot.size or 0
        pin = self._pin(slot)
        done = 0
        while done < size:
            n = min(chunk, size - done)
            try:
                data = self._read_range(slot.uri, start + done, n, pin)
            except BaseException as exc:
                known = isinstance(exc, ShardfoldError | TransientError)
                reason = str(exc) if known else f"{type(exc).__name__}: {exc}"
                raise BatchItemError(slot.index, slot.describe(), reason) from exc
            done += n
            yield data

    def _abandon(self) -> None:
        for slot in self.slots.values():
            for _, cancel, _ in slot.outstanding.values():
                _cancel(cancel)
            slot.outstanding.clear()
        self.slots.clear()
        self.queue.clear()
        self.in_flight = 0

    def _hold(self, n: int) -> None:
        self.held += n
        stats = self.stats
        stats.held_bytes = self.held
        if self.held > stats.peak_held_bytes:
            stats.peak_held_bytes = self.held

    # --- items -----------------------------------------------------------------------------------------

    def _slot(self, index: int, item: BatchItem | dict | str) -> _Slot:
        try:
            return self._make_slot(index, item)
        except StoreError as exc:  # e.g. UnsafeKey: same error, saying which item
            raise type(exc)(f"item {index}: {exc}") from None

    def _make_slot(self, index: int, item: BatchItem | dict | str) -> _Slot:
        if isinstance(item, str):
            uri = reach(item, root=self.root)
            return _Slot(index, uri, 0, None, None, default_name(uri, self.root))
        if isinstance(item, dict):
            try:
                item = BatchItem.model_validate(item)
            except ValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(map(str, e['loc'])) or 'item'}: {e['msg']}" for e in exc.errors()
                )
                raise SpecError(f"item {index} is not a valid batch item: {problems}") from None
        uri = reach(item.uri, root=self.root)
        name = item.name or default_name(uri, self.root)
        if item.archpath and not item.name:
            name = f"{name}/{item.archpath.lstrip('/')}"
        return _Slot(index, uri, item.start, item.length, item.archpath, name)

    def _start(self, slot: _Slot) -> None:
        if slot.archpath is None:
            slot.read = (slot.start, slot.length)
            slot.size = slot.length
            self._admit(slot)
            return
        index = self.indexes.get(slot.uri)
        if index is None:
            waiters = self.waiting.setdefault(slot.uri, [])
            waiters.append(slot)
            if len(waiters) == 1:
                # carried: the index's reads count for the calling task, under its reach and credentials
                thread_pool("tar-index").submit(telemetry.carried(self._build_index), slot.uri)
        else:
            self._start_member(slot, index)

    def _start_member(self, slot: _Slot, index: dict | BaseException) -> None:
        if isinstance(index, BaseException):
            self._fail(slot, index)
            return
        found = find_member(index, slot.archpath or "")
        if found is None:
            self._fail(slot, ObjectNotFound(f"{slot.uri} has no member {slot.archpath!r}"))
            return
        offset, size = found
        try:
            check_range(f"{slot.uri} member {slot.archpath}", size, slot.start, slot.length)
        except InvalidRange as exc:
            self._fail(slot, exc)
            return
        length = size - slot.start if slot.length is None else slot.length
        if length == 0:  # nothing to read: an empty member or a zero-length range
            self._succeed(slot, b"", None)
            return
        slot.read = (offset + slot.start, length)
        slot.size = length
        self._admit(slot)

    def _admit(self, slot: _Slot) -> None:
        """Issue the slot's read now if it fits (and no earlier slot waits for room), else queue it."""
        if (
            self.in_flight < self.concurrency
            and self.held + self._reservation(slot) <= self.max_bytes
            and (not self.queue or self.queue[0][0] > slot.index)
        ):
            self._issue(slot)
        else:
            slot.queued = True
            heapq.heappush(self.queue, (slot.index, slot))

    def _reservation(self, slot: _Slot) -> int:
        """Bytes the slot's next read may hold: its length when known, else the current cap."""
        return self.cap if slot.size is None else slot.size

    def _learn(self, size: int) -> None:
        """An item's size is known: reads of unknown length now reserve (and stop at) the largest size seen,
        at least :data:`MIN_STEP` and at most one step. Objects alike in size then each reserve what they
        are, not a step; a larger one costs one stopped read."""
        stats = self.stats
        if size > stats.largest_item_bytes:
            stats.largest_item_bytes = size
        self.cap = min(self.step, max(MIN_STEP, stats.largest_item_bytes))

    def _build_index(self, uri: str) -> None:
        """On a pool thread: scan a shard's headers, then hand the index to the engine thread."""
        try:
            result: dict | BaseException = index_tar(partial(self._read_block, uri), INDEX_BLOCK)
        except tarfile.ReadError as exc:
            result = ObjectNotFound(f"{uri} is not an uncompressed TAR, so archpath cannot be read ({exc})")
        except BaseException as exc:
            result = exc
        self.events.put((uri, -1, result, None))

    def _read_block(self, uri: str, offset: int) -> bytes:
        pin = self.pins.get(uri) if self.pins else None
        try:
            return self._read_range(uri, offset, INDEX_BLOCK, pin)
        except InvalidRange:
            pass  # the block runs past the end: read what is left
        try:
            return self._read_range(uri, offset, None, pin)
        except InvalidRange:
            return b""  # past the end

    def _read_range(self, uri: str, start: int, length: int | None, pin: Pin | None) -> bytes:
        """One blocking read (TAR index scans, streamed entries), transient errors retried."""
        for attempt in range(1, self.retry.max_attempts + 1):
            try:
                return fetch_blocking(self.transport, uri, start, length, pin)
            except TransientError:
                if attempt == self.retry.max_attempts:
                    raise
                time.sleep(self.retry.delay(attempt))  # a blocked reader backing off, not a test wait
        raise AssertionError("unreachable")

    # --- reads -----------------------------------------------------------------------------------------

    def _issue(self, slot: _Slot, hedge: bool = False) -> None:
        attempt = slot.attempts
        slot.attempts += 1
        if hedge:
            slot.hedged = attempt
        start, length = slot.read  # type: ignore[misc]
        reserved = self._reservation(slot)
        # a read of unknown length stops at what it reserved (the known size, when re-read by it: an
        # object that grew since stops again)
        limit = reserved if length is None and self.limits else None
        if slot.probing:
            length, limit, reserved = None, 0, 0
        elif self.read_here is not None and not hedge and slot.uri.startswith(FILE):
            size = length if length is not None else limit
            if size is not None and size <= INLINE_READ_BYTES:
                self._read_now(slot, start, length, limit, reserved)
                return
        now = time.monotonic()
        put = self.events.put
        index = slot.index

        def done(data: bytes | None, exc: BaseException | None) -> None:
            put((index, attempt, data, exc))

        pin = self.pins.get(slot.uri) if self.pins else None
        fetch = self.transport.fetch
        if limit is not None:
            cancel = fetch(slot.uri, start, length, done, pin, limit=limit)
        elif pin is None:
            cancel = fetch(slot.uri, start, length, done)
        else:
            cancel = fetch(slot.uri, start, length, done, pin)
        slot.outstanding[attempt] = (now, cancel, reserved)
        self._hold(reserved)
        self.in_flight += 1
        stats = self.stats
        stats.requests += 1
        if self.in_flight > stats.peak_in_flight:
            stats.peak_in_flight = self.in_flight
        if self.hedging and slot.hedged < 0:
            self._timer(now + self.hedge_delay, _HEDGE, index, attempt)

    def _read_now(
        self, slot: _Slot, start: int, length: int | None, limit: int | None, reserved: int
    ) -> None:
        """A small local read, made on this thread (as the local transport would) and settled at once."""
        self.stats.requests += 1
        pin = self.pins.get(slot.uri) if self.pins else None
        try:
            data = self.read_here(slot.uri, start, length, pin, limit)  # type: ignore[misc]
        except READ_FAILURES as exc:  # the item's outcome, as a transport reports it
            self._settle(slot, None, exc, None, -1, reserved)
        else:
            self._succeed(slot, data, None)

    def _handle(self, index: int | str, attempt: int, data: Any, exc: BaseException | None) -> None:
        if isinstance(index, str):  # a TAR index finished
            self.indexes[index] = data
            self.stats.tar_indexes += 1
            for slot in self.waiting.pop(index, ()):
                if self.slots.get(slot.index) is slot:
                    self._start_member(slot, data)
            return
        slot = self.slots.get(index)
        if slot is None or slot.ready:
            return  # a late duplicate of an answered item
        issued = slot.outstanding.pop(attempt, None)
        if issued is None:
            return  # an abandoned attempt
        self.in_flight -= 1
        self._hold(-issued[2])
        self._settle(slot, data, exc, issued[0], attempt, issued[2])

    def _settle(
        self,
        slot: _Slot,
        data: Any,
        exc: BaseException | None,
        issued_at: float | None,
        attempt: int,
        reserved: int,
    ) -> None:
        """What a read's answer (its bytes, or ``exc``) means for its slot."""
        index = slot.index
        if slot.probing and (exc is None or isinstance(exc, TooLarge)):
            self._probed(slot, len(data) if exc is None else exc.size, None if exc is None else exc.pin)
        elif exc is None:
            self._succeed(slot, data, issued_at, attempt)
        elif isinstance(exc, TooLarge):
            self._drop_outstanding(slot)
            self.stats.oversize += 1
            slot.size, slot.seen = exc.size, exc.pin
            self._learn(exc.size)
            slot.queued = True
            heapq.heappush(self.queue, (slot.index, slot))
        elif isinstance(exc, TransientError):
            if slot.outstanding:
                return  # its hedge (or the original) is still out and may yet answer
            slot.failures += 1
            if slot.failures >= self.retry.max_attempts:
                self._fail(slot, exc)
            else:
                self.stats.retries += 1
                telemetry.count(None, retries=1)
                slot.parked = reserved  # kept reserved for the retry
                self._hold(slot.parked)
                self._timer(time.monotonic() + self.retry.delay(slot.failures), _RETRY, index, attempt)
        else:
            self._fail(slot, exc)

    def _probed(self, slot: _Slot, to_end: int, pin: Pin | None) -> None:
        """A head slot's probe answered: the object has ``to_end`` bytes from the read's start."""
        self._drop_outstanding(slot)
        slot.probing = False
        slot.seen = pin
        if (slot.size or 0) > to_end:
            start = slot.read[0]  # type: ignore[index]
            self._fail(
                slot,
                InvalidRange(
                    f"{slot.describe()}: range of {slot.size} bytes from {start} is outside the object "
                    f"({to_end} bytes from there); fix the item's start/length"
                ),
            )
            return
        slot.stream = slot.ready = True

    def _pin(self, slot: _Slot) -> Pin | None:
        """What a streamed slot's ranges are checked against: the plan's pin, else what a read found."""
        return (self.pins.get(slot.uri) if self.pins else None) or slot.seen

    def _succeed(self, slot: _Slot, data: bytes, issued_at: float | None, attempt: int = -1) -> None:
        stats = self.stats
        if issued_at is not None:
            stats.latencies.append(time.monotonic() - issued_at)
            self.answered += 1
            if self.hedge_after is None and self.answered % 32 == 0:  # re-sorting per read would cost more
                self._adapt_hedge_delay()
        if attempt >= 0 and attempt == slot.hedged:
            stats.hedge_wins += 1
        self._drop_outstanding(slot)
        slot.ready, slot.data = True, data
        n = len(data)
        stats.buffered_bytes += n
        self._hold(n)
        if stats.buffered_bytes > stats.peak_buffered_bytes:
            stats.peak_buffered_bytes = stats.buffered_bytes
        if n > stats.largest_item_bytes or self.cap == self.step:
            self._learn(n)

    def _fail(self, slot: _Slot, exc: BaseException) -> None:
        self._drop_outstanding(slot)
        hard = not isinstance(exc, SOFT_ERRORS)
        known = isinstance(exc, ShardfoldError | TransientError)
        reason = str(exc) if known else f"{type(exc).__name__}: {exc}"
        if hard or not self.continue_on_error:
            if hard and isinstance(exc, TransientError) and slot.failures:
                reason = f"gave up after {slot.failures} tries: {reason}"
            slot.fatal = BatchItemError(slot.index, slot.describe(), reason)
            slot.fatal.__cause__ = exc
            slot.ready = True
            self._stop_after(slot.index)
            return
        stats = self.stats
        stats.soft_errors += 1
        slot.ready, slot.data, slot.error = True, b"", reason
        if self.max_soft_errors is not None and stats.soft_errors > self.max_soft_errors:
            raise TooManySoftErrors(
                f"{stats.soft_errors} items failed, more than max_soft_errors={self.max_soft_errors}; "
                f"latest: item {slot.index} ({slot.describe()}): {reason}"
            ) from exc

    def _stop_after(self, index: int) -> None:
        """Item ``index`` failed the batch: nothing after it will be yielded, so stop reading past it."""
        self.exhausted = True
        for later in [i for i in self.slots if i > index]:
            slot = self.slots.pop(later)
            self._drop_outstanding(slot)
            if slot.ready:
                self.stats.buffered_bytes -= len(slot.data)
                self._hold(-len(slot.data))

    def _drop_outstanding(self, slot: _Slot) -> None:
        for _, cancel, reserved in slot.outstanding.values():
            _cancel(cancel)
            self.in_flight -= 1
            self._hold(-reserved)
        slot.outstanding.clear()
        if slot.parked:
            self._hold(-slot.parked)
            slot.parked = 0

    # --- timers: hedges and retries --------------------------------------------------------------------

    def _timer(self, when: float, kind: int, index: int, attempt: int) -> None:
        self.timer_seq += 1
        heapq.heappush(self.timers, (when, self.timer_seq, kind, index, attempt))

    def _fire_timers(self) -> None:
        now = time.monotonic()
        timers = self.timers
        while timers and timers[0][0] <= now:
            _, _, kind, index, attempt = heapq.heappop(timers)
            slot = self.slots.get(index)
            if slot is None or slot.ready:
                continue
            if kind == _RETRY:
                if slot.parked:  # the retry takes over what was kept for it
                    self._hold(-slot.parked)
                    slot.parked = 0
                self._issue(slot)
            elif attempt in slot.outstanding and slot.hedged < 0:
                issued_at = slot.outstanding[attempt][0]
                if now < issued_at + self.hedge_delay:  # the delay grew since this timer was set
                    self._timer(issued_at + self.hedge_delay, _HEDGE, index, attempt)
                    continue
                if self.held + self._reservation(slot) > self.max_bytes:
                    continue  # no room for a second copy: the original read stands alone
                self.stats.hedges += 1
                self._issue(slot, hedge=True)

    def _adapt_hedge_delay(self) -> None:
        lat = self.stats.latencies
        if len(lat) < HEDGE_MIN_SAMPLES:
            return
        ordered = sorted(lat)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        self.hedge_delay = max(HEDGE_FLOOR_S, HEDGE_P95_FACTOR * p95)


def _cancel(cancel: Any) -> None:
    if cancel is not None:
        try:
            cancel()
        except Exception:  # the read finished meanwhile; nothing to abandon
            pass


def _summary(stats: BatchStats) -> dict:
    keys = (
        "items",
        "bytes",
        "requests",
        "retries",
        "hedges",
        "hedge_wins",
        "soft_errors",
        "oversize",
        "streamed",
        "peak_buffered_bytes",
        "peak_held_bytes",
    )
    return {k: getattr(stats, k) for k in keys}
