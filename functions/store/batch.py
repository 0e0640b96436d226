"""GetBatch: many objects, byte ranges or TAR members fetched as one ordered, streamed, fault-tolerant read.

The engine runs in the consumer's thread. Transports report completed reads into a queue; the engine
keeps a sliding window of items (at most ``window`` items between the oldest one not yet yielded and the
newest one requested, at most ``concurrency`` reads in flight), puts answers into a reorder buffer and
yields the contiguous ready prefix, so entry 0 comes out as soon as it arrives and the buffer never holds
more than ``window`` items (peak buffered bytes <= window x largest item).

Faults:
- throttling and 5xx (:class:`TransientError`) are retried with exponential backoff and full jitter;
- a read outstanding far longer than its peers (``hedge_after`` seconds, by default
  ``max(2 s, 3 x p95)`` of completed reads) is re-issued once and the first answer wins;
- a missing object or member, or a range outside the object, is a *soft* error: with
  ``continue_on_error`` the entry becomes a zero-byte ``__404__/<name>`` placeholder carrying the error
  (aborting with :class:`TooManySoftErrors` past ``max_soft_errors``); without it,
  :class:`BatchItemError` names the item and the stream ends. Anything else (retries exhausted, access
  denied) is a hard error: always :class:`BatchItemError`. So is an object that changed since it was
  pinned (``pins``: its :class:`InputChanged` is the item error's cause); the check rides on each read
  (S3 ``If-Match``, local ``fstat``), never an extra request.
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

from aws_lambda_powertools import Logger
from pydantic import ValidationError

from functions.errors import (
    BatchItemError,
    InvalidRange,
    ObjectNotFound,
    ShardfoldError,
    SpecError,
    StoreError,
    TooManySoftErrors,
)
from functions.specs import BatchItem
from functions.store.local import check_range
from functions.store.pinning import Pin
from functions.store.retry import RetryPolicy, TransientError
from functions.store.tar import INDEX_BLOCK, find_member, index_tar
from functions.store.transport import Transport, default_transport, fetch_blocking, thread_pool
from functions.store.uri import default_name, resolve, store_root

logger = Logger(service="shardfold")

# Reads in flight. S3 answers small GETs in tens of ms, so throughput is concurrency / latency until the
# client's CPU binds; the CRT transport costs ~0.15 ms CPU per object, which leaves room for 128.
DEFAULT_CONCURRENCY = 128
WINDOW_PER_READ = 2  # default window: items buffered or in flight per read in flight
HEDGE_FLOOR_S = 2.0  # AWS: retry a small GET still unanswered after 2 s
HEDGE_P95_FACTOR = 3.0
HEDGE_MIN_SAMPLES = 16  # below this many completed reads, p95 means little: use the floor
PLACEHOLDER = "__404__/"
SOFT_ERRORS = (ObjectNotFound, InvalidRange)

_HEDGE, _RETRY = 0, 1


@dataclass(slots=True)
class BatchEntry:
    """One output entry: ``name`` is its path in the archive; ``error`` is set on placeholders."""

    index: int
    name: str
    data: bytes
    error: str | None = None


@dataclass
class BatchStats:
    """What one GetBatch did; tests read ``peak_buffered_bytes`` to check the memory bound."""

    window: int
    concurrency: int
    items: int = 0  # entries yielded
    bytes: int = 0  # data bytes yielded
    requests: int = 0  # reads issued, including retries and hedges
    retries: int = 0
    hedges: int = 0
    hedge_wins: int = 0  # items whose hedged duplicate answered first
    soft_errors: int = 0
    tar_indexes: int = 0  # TAR shards whose member index was built
    buffered_bytes: int = 0  # answered but not yet yielded
    peak_buffered_bytes: int = 0
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
        "outstanding",
        "attempts",
        "hedged",
        "failures",
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
        self.outstanding: dict[int, tuple[float, Any]] = {}  # attempt -> (issued at, cancel)
        self.attempts = 0  # reads issued so far; numbers the next one
        self.hedged = -1  # the attempt number of the hedge, once issued
        self.failures = 0  # transient failures so far
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
    max_soft_errors: int | None = None,
    hedge_after: float | None = None,
    transport: Transport | None = None,
    retry: RetryPolicy | None = None,
    pins: Mapping[str, Pin] | None = None,
) -> BatchStream:
    """Fetch ``items`` and yield one :class:`BatchEntry` per item, in request order (duplicates allowed).

    ``items``: :class:`BatchItem`, dicts of its fields, or URI strings; any iterable (consumed lazily).
    ``concurrency``: reads in flight (default 128). ``window``: items buffered or in flight ahead of the
    consumer (default ``2 x concurrency``); memory is bounded by ``window x largest item``.
    ``hedge_after``: seconds before a slow read is duplicated (default adaptive; ``math.inf`` disables).
    ``transport``: how reads are made (default: ``file://`` on threads, ``s3://`` per
    ``SHARDFOLD_S3_TRANSPORT``). ``retry``: backoff for throttling and 5xx. ``pins``: resolved URI ->
    :class:`Pin` recorded at plan time; reads of those objects (TAR index scans included) fail the item
    with :class:`InputChanged` if the object changed since.
    """
    concurrency = concurrency or DEFAULT_CONCURRENCY
    window = window or WINDOW_PER_READ * concurrency
    if concurrency < 1 or window < 1:
        raise ValueError(f"window ({window}) and concurrency ({concurrency}) must be at least 1")
    if max_soft_errors is not None and max_soft_errors < 0:
        raise ValueError(f"max_soft_errors must be >= 0, got {max_soft_errors}")
    engine = _Engine(
        iter(items),
        continue_on_error=continue_on_error,
        window=window,
        concurrency=concurrency,
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
    ):
        self.items = items
        self.continue_on_error = continue_on_error
        self.window = window
        self.concurrency = concurrency
        self.max_soft_errors = max_soft_errors
        self.hedge_after = hedge_after
        self.transport = transport
        self.retry = retry
        self.pins = pins or None
        self.stats = BatchStats(window=window, concurrency=concurrency)
        self.root = store_root()
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.slots: dict[int, _Slot] = {}
        self.next_out = 0  # index of the next entry to yield
        self.next_in = 0  # index the next item pulled from ``items`` gets
        self.exhausted = False
        self.in_flight = 0
        self.answered = 0  # reads that succeeded
        self.timers: list[tuple[float, int, int, int, int]] = []  # (when, seq, kind, index, attempt)
        self.timer_seq = 0
        self.indexes: dict[str, dict | BaseException] = {}  # shard URI -> member index, or why not
        self.waiting: dict[str, list[_Slot]] = {}  # shard URI -> slots waiting for its index
        self.hedge_delay = HEDGE_FLOOR_S if hedge_after is None else hedge_after
        self.hedging = not math.isinf(self.hedge_delay)

    # --- the loop --------------------------------------------------------------------------------------

    def run(self) -> Iterator[BatchEntry]:
        try:
            while True:
                if self.timers:  # also when the consumer never waits, so the timer heap stays short
                    self._fire_timers()
                self._fill()
                head = self.slots.get(self.next_out)
                if head is None:
                    break  # nothing requested beyond the last yielded entry: done
                if head.ready:
                    if head.fatal is not None:
                        raise head.fatal
                    yield self._emit(head)
                else:
                    self._wait()
        finally:
            self._abandon()
            logger.debug("get_batch finished", extra={"stats": _summary(self.stats)})

    def _fill(self) -> None:
        while (
            not self.exhausted
            and self.in_flight < self.concurrency
            and self.next_in - self.next_out < self.window
        ):
            try:
                item = next(self.items)
            except StopIteration:
                self.exhausted = True
                return
            slot = self._slot(self.next_in, item)
            self.slots[slot.index] = slot
            self.next_in += 1
            self._start(slot)

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
        stats.items += 1
        stats.bytes += n
        name = PLACEHOLDER + slot.name if slot.error is not None else slot.name
        return BatchEntry(slot.index, name, slot.data, slot.error)

    def _abandon(self) -> None:
        for slot in self.slots.values():
            for _, cancel in slot.outstanding.values():
                _cancel(cancel)
            slot.outstanding.clear()
        self.slots.clear()
        self.in_flight = 0

    # --- items -----------------------------------------------------------------------------------------

    def _slot(self, index: int, item: BatchItem | dict | str) -> _Slot:
        try:
            return self._make_slot(index, item)
        except StoreError as exc:  # e.g. UnsafeKey: same error, saying which item
            raise type(exc)(f"item {index}: {exc}") from None

    def _make_slot(self, index: int, item: BatchItem | dict | str) -> _Slot:
        if isinstance(item, str):
            uri = resolve(item, self.root)
            return _Slot(index, uri, 0, None, None, default_name(uri, self.root))
        if isinstance(item, dict):
            try:
                item = BatchItem.model_validate(item)
            except ValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(map(str, e['loc'])) or 'item'}: {e['msg']}" for e in exc.errors()
                )
                raise SpecError(f"item {index} is not a valid batch item: {problems}") from None
        uri = resolve(item.uri, self.root)
        name = item.name or default_name(uri, self.root)
        if item.archpath and not item.name:
            name = f"{name}/{item.archpath.lstrip('/')}"
        return _Slot(index, uri, item.start, item.length, item.archpath, name)

    def _start(self, slot: _Slot) -> None:
        if slot.archpath is None:
            slot.read = (slot.start, slot.length)
            self._issue(slot)
            return
        index = self.indexes.get(slot.uri)
        if index is None:
            waiters = self.waiting.setdefault(slot.uri, [])
            waiters.append(slot)
            if len(waiters) == 1:
                thread_pool("tar-index").submit(self._build_index, slot.uri)
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
        self._issue(slot)

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
        for attempt in range(1, self.retry.max_attempts + 1):
            try:
                pin = self.pins.get(uri) if self.pins else None
                try:
                    return fetch_blocking(self.transport, uri, offset, INDEX_BLOCK, pin)
                except InvalidRange:
                    pass  # the block runs past the end: read what is left
                try:
                    return fetch_blocking(self.transport, uri, offset, None, pin)
                except InvalidRange:
                    return b""  # past the end
            except TransientError:
                if attempt == self.retry.max_attempts:
                    raise
                time.sleep(self.retry.delay(attempt))  # a pool thread backing off, not a test wait
        raise AssertionError("unreachable")

    # --- reads -----------------------------------------------------------------------------------------

    def _issue(self, slot: _Slot, hedge: bool = False) -> None:
        attempt = slot.attempts
        slot.attempts += 1
        if hedge:
            slot.hedged = attempt
        start, length = slot.read  # type: ignore[misc]
        now = time.monotonic()
        put = self.events.put
        index = slot.index

        def done(data: bytes | None, exc: BaseException | None) -> None:
            put((index, attempt, data, exc))

        pin = self.pins.get(slot.uri) if self.pins else None
        if pin is None:
            cancel = self.transport.fetch(slot.uri, start, length, done)
        else:
            cancel = self.transport.fetch(slot.uri, start, length, done, pin)
        slot.outstanding[attempt] = (now, cancel)
        self.in_flight += 1
        stats = self.stats
        stats.requests += 1
        if self.in_flight > stats.peak_in_flight:
            stats.peak_in_flight = self.in_flight
        if self.hedging and slot.hedged < 0:
            self._timer(now + self.hedge_delay, _HEDGE, index, attempt)

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
        if exc is None:
            self._succeed(slot, data, issued[0], attempt)
        elif isinstance(exc, TransientError):
            if slot.outstanding:
                return  # its hedge (or the original) is still out and may yet answer
            slot.failures += 1
            if slot.failures >= self.retry.max_attempts:
                self._fail(slot, exc)
            else:
                self.stats.retries += 1
                self._timer(time.monotonic() + self.retry.delay(slot.failures), _RETRY, index, attempt)
        else:
            self._fail(slot, exc)

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
        if stats.buffered_bytes > stats.peak_buffered_bytes:
            stats.peak_buffered_bytes = stats.buffered_bytes
        if n > stats.largest_item_bytes:
            stats.largest_item_bytes = n

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

    def _drop_outstanding(self, slot: _Slot) -> None:
        for _, cancel in slot.outstanding.values():
            _cancel(cancel)
            self.in_flight -= 1
        slot.outstanding.clear()

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
                self._issue(slot)
            elif attempt in slot.outstanding and slot.hedged < 0:
                issued_at = slot.outstanding[attempt][0]
                if now < issued_at + self.hedge_delay:  # the delay grew since this timer was set
                    self._timer(issued_at + self.hedge_delay, _HEDGE, index, attempt)
                    continue
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
        "peak_buffered_bytes",
    )
    return {k: getattr(stats, k) for k in keys}
