"""The GetBatch engine: order, streaming, bounded memory, retries, hedging, ranges, archpath, errors.

Fake transports decide when each read answers (gates are Events, order comes from virtual delays), so no
test waits on wall-clock time. The same semantics are then checked on real transports: local files,
S3 through boto3 under ``mock_aws``, and S3 through awscrt against a moto server.
"""

import hashlib
import heapq
import io
import queue
import random
import tarfile
import tempfile
import threading
import time
from collections import Counter

import boto3
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from moto import mock_aws
from tiers import examples

from shardfold.functions import store
from shardfold.functions.errors import (
    BatchItemError,
    InputChanged,
    InvalidRange,
    ObjectNotFound,
    SpecError,
    TooManySoftErrors,
)
from shardfold.functions.specs import BatchItem
from shardfold.functions.store import transport as transport_mod
from shardfold.functions.store.batch import HEDGE_FLOOR_S, BatchEntry, _Engine, step_bytes
from shardfold.functions.store.local import check_range
from shardfold.functions.store.pinning import Pin, TooLarge
from shardfold.functions.store.retry import RetryPolicy, TransientError
from shardfold.functions.store.tar import write_tar

FAST_RETRY = RetryPolicy(max_attempts=4, base_s=0.001, cap_s=0.002)


def obj(i: int, size: int | None = None) -> bytes:
    size = 50 + 37 * i if size is None else size
    return bytes((i + k) % 251 for k in range(size))


def answer(objects: dict[str, bytes], uri: str, start: int, length: int | None) -> bytes:
    """What a store answers for a read: the same range rules as every real transport."""
    if uri not in objects:
        raise ObjectNotFound(f"no object at {uri}")
    data = objects[uri]
    check_range(uri, len(data), start, length)
    return data[start:] if length is None else data[start : start + length]


class GatedTransport:
    """Answers each read on its own thread. A read may first wait on an Event (``gates``), or until a
    number of other reads have answered (``after``); ``faults`` make given attempts fail."""

    def __init__(self, objects, gates=None, after=None, faults=None):
        self.objects = objects
        self.gates = gates or {}  # (uri, attempt) -> Event
        self.after = after or {}  # (uri, attempt) -> answered count to wait for
        self.faults = faults or {}  # (uri, attempt) -> exception
        self.requests: list[tuple[str, int, int | None]] = []
        self.attempts: Counter = Counter()
        self.cancelled: list[tuple[str, int]] = []
        self.answered = 0
        self.cond = threading.Condition()
        self.outstanding = 0
        self.peak_outstanding = 0

    def fetch(self, uri, start, length, done):
        with self.cond:
            n = self.attempts[uri]
            self.attempts[uri] += 1
            self.requests.append((uri, start, length))
            self.outstanding += 1
            self.peak_outstanding = max(self.peak_outstanding, self.outstanding)

        def run():
            if gate := self.gates.get((uri, n)):
                gate.wait()
            with self.cond:
                self.cond.wait_for(lambda: self.answered >= self.after.get((uri, n), 0))
            try:
                if fault := self.faults.get((uri, n)):
                    raise fault
                data, exc = answer(self.objects, uri, start, length), None
            except Exception as e:
                data, exc = None, e
            with self.cond:
                self.answered += 1
                self.outstanding -= 1
                self.cond.notify_all()
            done(data, exc)

        threading.Thread(target=run, daemon=True).start()
        return lambda: self.cancelled.append((uri, n))


class DelayedTransport:
    """Answers reads on one thread in order of virtual time: read number ``s`` answers at ``s + delay``.
    It holds answers until the engine's whole first wave has arrived, so early reads really do overtake."""

    def __init__(self, objects, delays: list[int], first_wave: int):
        self.objects, self.delays, self.first_wave = objects, delays or [0], first_wave
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.seq = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def fetch(self, uri, start, length, done):
        s = self.seq
        self.seq += 1
        self.inbox.put((s + self.delays[s % len(self.delays)], s, uri, start, length, done))

    def close(self):
        self.inbox.put(None)
        self.thread.join()

    def _run(self):
        heap: list = []
        arrived = 0
        while True:
            block = not heap or arrived < self.first_wave
            try:
                msg = self.inbox.get(block=block)
            except queue.Empty:
                msg = False
            if msg is None:
                return
            if msg:
                heapq.heappush(heap, msg)
                arrived += 1
                continue  # take in everything that has arrived before answering
            _, _, uri, start, length, done = heapq.heappop(heap)
            try:
                data, exc = answer(self.objects, uri, start, length), None
            except Exception as e:
                data, exc = None, e
            done(data, exc)


# --- order, duplicates, memory (fake transports) ----------------------------------------------------------


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=12),
    picks=st.lists(st.integers(0, 100), min_size=1, max_size=60),
    delays=st.lists(st.integers(0, 40), min_size=1, max_size=20),
    concurrency=st.integers(1, 8),
    extra_window=st.integers(0, 8),
)
def test_order_under_random_delays(sizes, picks, delays, concurrency, extra_window):
    objects = {f"s3://bkt/o{i}": obj(i, n) for i, n in enumerate(sizes)}
    request = [f"s3://bkt/o{p % len(sizes)}" for p in picks]  # duplicates likely
    window = concurrency + extra_window
    fake = DelayedTransport(objects, delays, first_wave=min(len(request), concurrency))
    try:
        stream = store.get_batch(
            request, concurrency=concurrency, window=window, transport=fake, hedge_after=1e9
        )
        got = [(e.index, e.name, e.data) for e in stream]
    finally:
        fake.close()
    assert got == [(i, u.removeprefix("s3://bkt/"), objects[u]) for i, u in enumerate(request)]
    assert stream.stats.peak_buffered_bytes <= window * max(len(objects[u]) for u in request)
    assert stream.stats.peak_in_flight <= concurrency


@settings(max_examples=examples(40), deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=40), window=st.integers(1, 6))
def test_peak_buffered_bytes_within_window_times_largest(sizes, window):
    objects = {f"s3://bkt/o{i}": obj(i, n) for i, n in enumerate(sizes)}
    request = list(objects)
    # The head item answers last within its window, so the buffer fills up as far as it ever can.
    after = {(request[0], 0): min(window, len(request)) - 1}
    fake = GatedTransport(objects, after=after)
    stream = store.get_batch(request, window=window, concurrency=window, transport=fake, hedge_after=1e9)
    assert [e.data for e in stream] == [objects[u] for u in request]
    stats = stream.stats
    assert stats.peak_buffered_bytes <= window * max(sizes)
    assert stats.peak_buffered_bytes >= sum(sizes[1:window])  # the window really was used
    assert fake.peak_outstanding <= window


def test_first_entry_streams_before_the_last_item_is_requested():
    objects = {f"s3://bkt/o{i}": obj(i) for i in range(10)}
    request = list(objects)
    hold = threading.Event()
    gates = {(u, 0): hold for u in request[1:]}
    fake = GatedTransport(objects, gates=gates)
    pulled: list[str] = []

    def lazily():
        for u in request:
            pulled.append(u)
            yield u

    stream = store.get_batch(lazily(), window=3, transport=fake, hedge_after=1e9)
    first = next(stream)
    assert (first.index, first.data) == (0, objects[request[0]])
    assert [u for u, _, _ in fake.requests] == request[:3]  # the last item is not even requested yet
    assert pulled == request[:3]  # and the item iterator was read only as far as the window
    hold.set()
    assert [e.data for e in stream] == [objects[u] for u in request[1:]]


def test_closing_the_stream_abandons_reads_in_flight():
    objects = {f"s3://bkt/o{i}": obj(i) for i in range(6)}
    hold = threading.Event()
    fake = GatedTransport(objects, gates={(u, 0): hold for u in list(objects)[1:]})
    with store.get_batch(list(objects), window=4, transport=fake, hedge_after=1e9) as stream:
        next(stream)
    assert sorted(fake.cancelled) == [(u, 0) for u in list(objects)[1:4]]
    hold.set()


# --- memory bounded in bytes -------------------------------------------------------------------------------


class LimitTransport:
    """Answers on threads after a seeded random delay and honours ``limit`` as the real transports do.
    It keeps the bytes that really exist: answers being read (what each read in flight will return) plus
    answers delivered and not yet released by the consumer (``consumed``), and their peak."""

    limits = True

    def __init__(self, objects, seed=0):
        self.objects = objects
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.live = 0  # bytes in flight or delivered, less what the consumer released
        self.peak = 0
        self.reads: list[tuple[str, int, int | None, int | None]] = []

    def _add(self, n):
        with self.lock:
            self.live += n
            self.peak = max(self.peak, self.live)

    def consumed(self, n):
        self._add(-n)

    def fetch(self, uri, start, length, done, pin=None, limit=None):
        with self.lock:
            self.reads.append((uri, start, length, limit))
            delay = self.rng.random() * 0.002
        data = self.objects.get(uri)
        if data is None:
            answer, exc = None, ObjectNotFound(f"no object at {uri}")
        else:
            size = len(data)
            try:
                check_range(uri, size, start, length)
                if limit is not None and length is None and size - start > limit:
                    answer, exc = None, TooLarge(uri, size - start, limit, Pin(size, etag="e"))
                else:
                    answer, exc = (data[start:] if length is None else data[start : start + length]), None
            except InvalidRange as e:
                answer, exc = None, e
        n = len(answer) if answer is not None else 0
        self._add(n)  # what this read will hold once the body is in

        def run():
            time.sleep(delay)
            done(answer, exc)

        threading.Thread(target=run, daemon=True).start()


def _drain(stream, fake):
    """Consume ``stream`` the way the TAR writer does, releasing each piece once taken."""
    out = []
    for e in stream:
        parts = []
        for chunk in e.chunks():
            parts.append(chunk)
            fake.consumed(len(chunk))
        out.append((e.index, e.name, b"".join(parts), e.error))
    return out


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 9000), min_size=1, max_size=30),
    # from 256 B: a smaller budget streams 9 KB objects in thousands of reads and only costs time; the
    # smallest budget is the explicit example below
    max_bytes=st.integers(256, 12_000),
    concurrency=st.integers(1, 8),
    seed=st.integers(0, 1000),
)
@example(sizes=[0, 1, 2, 37, 5], max_bytes=1, concurrency=3, seed=7)
def test_held_bytes_stay_within_the_budget_whatever_the_sizes(sizes, max_bytes, concurrency, seed):
    objects = {f"s3://bkt/o{i}": obj(i, n) for i, n in enumerate(sizes)}
    request = list(objects) + [{"uri": "s3://bkt/o0", "start": 0, "length": sizes[0]}]
    fake = LimitTransport(objects, seed)
    stream = store.get_batch(
        request, concurrency=concurrency, max_bytes=max_bytes, transport=fake, hedge_after=1e9
    )
    got = _drain(stream, fake)
    assert got == [(i, u.removeprefix("s3://bkt/"), objects[u], None) for i, u in enumerate(objects)] + [
        (len(objects), "o0", objects["s3://bkt/o0"], None)
    ]
    bound = max_bytes + step_bytes(max_bytes, concurrency)
    assert fake.peak <= bound and stream.stats.peak_held_bytes <= bound
    assert stream.stats.held_bytes == 0
    # an item larger than the whole budget was streamed, never held whole
    assert stream.stats.streamed >= sum(
        1 for n in sizes if n > max_bytes + step_bytes(max_bytes, concurrency)
    )


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 9000), min_size=1, max_size=20),
    max_bytes=st.integers(256, 12_000),
    concurrency=st.integers(1, 8),
    cut=st.integers(0, 9000),
)
def test_local_files_read_on_the_spot_give_what_the_evented_engine_gives(sizes, max_bytes, concurrency, cut):
    # small local reads are made and settled on the engine's own thread (no hand-over, no event); the same
    # request over the same bytes through a transport that answers on threads must give the same entries
    # (bytes, placeholders and their errors), within the same budget
    with tempfile.TemporaryDirectory() as folder:
        local_objects = {}
        for i, n in enumerate(sizes):
            path = f"{folder}/o{i}"
            with open(path, "wb") as f:
                f.write(obj(i, n))
            local_objects[f"file://{path}"] = obj(i, n)
        extra = [
            {"uri": f"file://{folder}/gone"},  # missing: a placeholder
            {"uri": f"file://{folder}/o0", "start": 0, "length": sizes[0] + 1},  # past the end
            {"uri": f"file://{folder}/o0", "start": min(cut, max(sizes[0] - 1, 0))},  # to the end
        ]
        request = [*local_objects, *extra]
        stream = store.get_batch(
            request, continue_on_error=True, concurrency=concurrency, max_bytes=max_bytes
        )
        here = [(e.index, b"".join(e.chunks()), e.error is not None) for e in stream]
        bound = max_bytes + step_bytes(max_bytes, concurrency)
        assert stream.stats.peak_held_bytes <= bound and stream.stats.held_bytes == 0
    remote = {u.replace(f"file://{folder}", "s3://bkt"): data for u, data in local_objects.items()}
    same = [{**i, "uri": i["uri"].replace(f"file://{folder}", "s3://bkt")} for i in extra]
    fake = LimitTransport(remote)
    evented = store.get_batch(
        [*remote, *same], continue_on_error=True, concurrency=concurrency, max_bytes=max_bytes, transport=fake
    )
    assert here == [(i, data, error is not None) for i, _, data, error in _drain(evented, fake)]
    assert [error for _, _, error in here[-3:]] == [True, True, False]


def test_a_local_read_made_at_once_is_made_once_and_only_its_own_failures_settle_the_item(
    tmp_path, monkeypatch
):
    """Small local files are read on the engine's thread: a missing one is read once (one GET, settled as
    its placeholder), a filesystem error is the item's error; an exception that is not a read's (a task's
    timeout raised into the thread) is not taken for the item's failure and leaves the batch as itself."""
    from shardfold.functions.store import local

    for name in ("a", "c"):
        (tmp_path / name).write_bytes(name.encode() * 10)
    uris = [(tmp_path / n).as_uri() for n in ("a", "gone1", "c", "gone2")]
    reads = []
    real_get = local.get
    monkeypatch.setattr(local, "get", lambda *a, **kw: reads.append(a[1]) or real_get(*a, **kw))
    stream = store.get_batch(uris, continue_on_error=True)
    assert [(e.data, e.error is not None) for e in stream] == [
        (b"a" * 10, False),
        (b"", True),
        (b"c" * 10, False),
        (b"", True),
    ]
    assert reads == uris and stream.stats.requests == 4

    class Expired(Exception):  # what orchestrator.invoke raises into a handler at its timeout
        pass

    def refuse(path, uri, *args, **kwargs):
        if uri.endswith("/c"):
            raise error
        return real_get(path, uri, *args, **kwargs)

    monkeypatch.setattr(local, "get", refuse)
    for error, ranged in (
        (PermissionError(13, "Permission denied"), False),
        (Expired(), False),
        (Expired(), True),
    ):
        items = [uris[0], {"uri": uris[2], "start": 1} if ranged else uris[2]]  # a range: read as a slot
        with pytest.raises(BatchItemError if isinstance(error, OSError) else Expired) as err:
            list(store.get_batch(items, continue_on_error=True))
        if isinstance(error, OSError):
            assert err.value.index == 1 and "Permission denied" in str(err.value)


def test_small_objects_keep_full_concurrency_under_the_budget():
    objects = {f"s3://bkt/o{i}": obj(i, 1000) for i in range(64)}
    fake = LimitTransport(objects)
    stream = store.get_batch(list(objects), concurrency=16, transport=fake, hedge_after=1e9)
    assert [d for _, _, d, _ in _drain(stream, fake)] == list(objects.values())
    assert stream.stats.oversize == 0 and stream.stats.streamed == 0
    # the first reads may return a step; once sizes are seen, 64 KiB (the least a read may be capped at)
    limits = [limit for _, _, _, limit in fake.reads]
    assert limits[0] == step_bytes(stream.stats.max_bytes, 16) and limits[-1] == 64 * 1024
    assert set(limits) == {limits[0], 64 * 1024}


def test_an_object_past_the_step_is_read_again_by_its_size():
    objects = {"s3://bkt/small": b"s" * 100, "s3://bkt/big": b"B" * 5000, "s3://bkt/after": b"a" * 10}
    fake = LimitTransport(objects)
    stream = store.get_batch(
        list(objects), concurrency=4, max_bytes=4 * 1024, transport=fake, hedge_after=1e9
    )
    step = step_bytes(4 * 1024, 4)  # the 64 KiB floor, capped at the budget: 4 KiB
    # 5000 bytes fit neither the step nor the budget: streamed as the head, in ranges
    assert [d for _, _, d, _ in _drain(stream, fake)] == list(objects.values())
    assert ("s3://bkt/big", 0, None, step) in fake.reads
    assert stream.stats.oversize == 1 and stream.stats.streamed == 1

    fake = LimitTransport(objects)
    stream = store.get_batch(
        list(objects), concurrency=64, max_bytes=1 << 20, transport=fake, hedge_after=1e9
    )
    step = step_bytes(1 << 20, 64)  # 64 KiB: everything fits at once
    assert [d for _, _, d, _ in _drain(stream, fake)] == list(objects.values())
    assert stream.stats.oversize == 0 and all(limit == step for _, _, _, limit in fake.reads)


def test_a_streamed_entry_gives_the_same_archive():
    objects = {f"s3://bkt/o{i}": obj(i, n) for i, n in enumerate([10, 70_000, 0, 200_000, 33])}
    request = [*objects, {"uri": "s3://bkt/o3", "start": 5, "length": 150_000}]
    archives = set()
    for max_bytes in (1 << 30, 100_000, 1000):
        fake = LimitTransport(objects)
        buf = io.BytesIO()
        stream = store.get_batch(request, concurrency=2, max_bytes=max_bytes, transport=fake, hedge_after=1e9)
        write_tar(stream, buf)
        archives.add(buf.getvalue())
        assert (stream.stats.streamed > 0) == (max_bytes < 1 << 30)
    assert len(archives) == 1
    with tarfile.open(fileobj=io.BytesIO(archives.pop())) as tf:
        assert [tf.extractfile(m).read() for m in tf] == [
            *objects.values(),
            objects["s3://bkt/o3"][5:150_005],
        ]


def test_a_streamed_entry_reads_into_data_and_leaves_no_debt():
    objects = {"s3://bkt/big": obj(1, 9000), "s3://bkt/b": b"bb"}
    fake = LimitTransport(objects)
    stream = store.get_batch(list(objects), concurrency=1, max_bytes=2000, transport=fake, hedge_after=1e9)
    first = next(stream)
    assert first.streamed and first.size == 9000 and first.data == objects["s3://bkt/big"]
    assert first == BatchEntry(0, "big", objects["s3://bkt/big"])
    assert next(stream).data == b"bb"
    # a streamed entry skipped by its consumer is abandoned, and the rest still comes out
    stream = store.get_batch(list(objects), concurrency=1, max_bytes=2000, transport=fake, hedge_after=1e9)
    assert [e.name for e in stream] == ["big", "b"] and stream.stats.held_bytes == 0


def test_a_range_too_large_to_hold_fails_softly_like_any_item():
    # ranges given by length are not read before their turn: the engine first reads 0 bytes of the object
    # (its size and pin), so a missing object or a range past the end is a placeholder, never a torn entry
    objects = {"s3://bkt/big": obj(1, 9000), "s3://bkt/b": b"bb"}
    request = [
        {"uri": "s3://bkt/big", "start": 100, "length": 8000},
        {"uri": "s3://bkt/gone", "start": 0, "length": 8000},
        {"uri": "s3://bkt/big", "start": 2000, "length": 8000},  # ends 1,000 bytes past the object
        "s3://bkt/b",
    ]
    fake = LimitTransport(objects)
    stream = store.get_batch(
        request, continue_on_error=True, concurrency=1, max_bytes=2000, transport=fake, hedge_after=1e9
    )
    got = _drain(stream, fake)
    assert [(name, data) for _, name, data, _ in got] == [
        ("big", objects["s3://bkt/big"][100:8100]),
        ("__404__/gone", b""),
        ("__404__/big", b""),
        ("b", b"bb"),
    ]
    assert "no object" in got[1][3] and "outside the object" in got[2][3]
    assert stream.stats.streamed == 1 and ("s3://bkt/big", 100, None, 0) in fake.reads  # the probe


def test_local_stream_is_pinned_to_the_object_it_started_on(local_data):
    root = local_data
    big = store.join(root, "data", "big")
    store.put(big, obj(7, 300_000))
    stream = store.get_batch(["data/o1", "data/big", "data/o2"], concurrency=2, max_bytes=100_000)
    entries = iter(stream)
    assert next(entries).data == obj(1)
    second = next(entries)
    chunks = second.chunks()
    first = next(chunks)
    assert second.streamed and 0 < len(first) < 300_000 and obj(7, 300_000).startswith(first)
    store.put(big, obj(8, 300_000))  # replaced while it streams
    with pytest.raises(BatchItemError, match="item 1") as info:
        list(chunks)
    assert isinstance(info.value.__cause__, InputChanged)


# --- retries and hedging ------------------------------------------------------------------------------------


def test_throttling_and_5xx_are_retried():
    objects = {f"s3://bkt/o{i}": obj(i) for i in range(5)}
    faults = {
        ("s3://bkt/o1", 0): TransientError("SlowDown", 503),
        ("s3://bkt/o1", 1): TransientError("Too Many Requests", 429),
        ("s3://bkt/o3", 0): TransientError("InternalError", 500),
    }
    fake = GatedTransport(objects, faults=faults)
    stream = store.get_batch(list(objects), transport=fake, retry=FAST_RETRY, hedge_after=1e9)
    assert [e.data for e in stream] == list(objects.values())
    assert stream.stats.retries == 3
    assert fake.attempts["s3://bkt/o1"] == 3


def test_retries_run_out_into_a_hard_error_even_with_continue_on_error():
    objects = {"s3://bkt/a": b"a", "s3://bkt/b": b"b"}
    faults = {("s3://bkt/b", n): TransientError("SlowDown", 503) for n in range(FAST_RETRY.max_attempts)}
    fake = GatedTransport(objects, faults=faults)
    stream = store.get_batch(
        list(objects), continue_on_error=True, transport=fake, retry=FAST_RETRY, hedge_after=1e9
    )
    with pytest.raises(BatchItemError, match=r"item 1 \(s3://bkt/b\).*gave up after 4 tries") as info:
        list(stream)
    assert info.value.index == 1


def test_a_straggler_is_hedged_and_the_first_answer_wins():
    objects = {f"s3://bkt/o{i}": obj(i) for i in range(8)}
    straggler = "s3://bkt/o3"
    never = threading.Event()  # the straggler's first read hangs until the test ends
    fake = GatedTransport(objects, gates={(straggler, 0): never})
    stream = store.get_batch(list(objects), transport=fake, hedge_after=0.01)
    try:
        assert [e.data for e in stream] == list(objects.values())
    finally:
        never.set()  # its late answer goes to a finished stream and is ignored
    assert fake.attempts[straggler] == 2
    assert (straggler, 0) in fake.cancelled
    assert stream.stats.hedge_wins >= 1 and stream.stats.hedges >= 1


def test_a_late_answer_from_the_original_read_is_ignored():
    objects = {"s3://bkt/a": b"A" * 10, "s3://bkt/b": b"B" * 10}
    first = threading.Event()
    fake = GatedTransport(objects, gates={("s3://bkt/a", 0): first})
    stream = store.get_batch(list(objects), transport=fake, hedge_after=0.01, window=1)
    assert next(stream).data == b"A" * 10  # answered by the hedge
    first.set()  # now the original answers too, while the stream is still running
    assert [e.data for e in stream] == [b"B" * 10]
    assert stream.stats.items == 2


def test_adaptive_hedge_delay_follows_p95_with_a_floor():
    engine = _Engine(iter(()), **_engine_defaults())
    assert engine.hedge_delay == HEDGE_FLOOR_S
    engine.stats.latencies.extend([0.01] * 100)
    engine._adapt_hedge_delay()
    assert engine.hedge_delay == HEDGE_FLOOR_S  # fast peers: the floor holds
    engine.stats.latencies.extend([1.0] * 100)
    engine._adapt_hedge_delay()
    assert engine.hedge_delay == pytest.approx(3.0)  # 3 x p95


def _engine_defaults():
    return dict(
        continue_on_error=False,
        window=4,
        concurrency=2,
        max_soft_errors=None,
        hedge_after=None,
        transport=GatedTransport({}),
        retry=RetryPolicy(),
    )


# --- local files: semantics ---------------------------------------------------------------------------


@pytest.fixture
def local_data(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    root = store.store_root()
    for i in range(6):
        store.put(store.join(root, "data", f"o{i}"), obj(i))
    members = [("a/x.wav", b"x" * 1000), ("b.txt", b"0123456789"), ("empty", b"")]
    store.put(store.join(root, "shards", "s.tar"), _tar_bytes(members))
    return root


def _tar_bytes(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_local_order_duplicates_and_names(local_data):
    request = [
        "data/o3",
        "data/o0",
        "data/o3",
        {"uri": "data/o1", "name": "renamed"},
        BatchItem(uri="data/o5"),
    ]
    entries = list(store.get_batch(request))
    assert [e.index for e in entries] == [0, 1, 2, 3, 4]
    assert [e.name for e in entries] == ["data/o3", "data/o0", "data/o3", "renamed", "data/o5"]
    assert [e.data for e in entries] == [obj(3), obj(0), obj(3), obj(1), obj(5)]
    assert all(e.error is None for e in entries)


def test_local_ranges(local_data):
    request = [
        {"uri": "data/o2", "start": 5, "length": 7},
        {"uri": "data/o2", "start": 5},
        {"uri": "data/o2", "start": 0, "length": 0},
        {"uri": "data/o2", "start": len(obj(2)) - 1, "length": 1},
    ]
    got = [e.data for e in store.get_batch(request)]
    assert got == [obj(2)[5:12], obj(2)[5:], b"", obj(2)[-1:]]


def test_missing_and_bad_ranges_become_placeholders_with_continue_on_error(local_data):
    request = [
        "data/o0",
        "data/missing",
        {"uri": "data/o1", "start": 10_000},
        {"uri": "data/o1", "start": 10, "length": 10_000},
        "data/o2",
    ]
    entries = list(store.get_batch(request, continue_on_error=True))
    assert [e.name for e in entries] == [
        "data/o0",
        "__404__/data/missing",
        "__404__/data/o1",
        "__404__/data/o1",
        "data/o2",
    ]
    assert [e.data for e in entries] == [obj(0), b"", b"", b"", obj(2)]
    assert "no object" in entries[1].error and "data/missing" in entries[1].error
    assert "outside the object" in entries[2].error and "outside the object" in entries[3].error
    assert entries[0].error is None and entries[4].error is None


def test_without_continue_on_error_a_missing_item_stops_the_stream(local_data):
    stream = store.get_batch(["data/o0", "data/o1", "data/missing", "data/o2"], window=1)
    assert [e.data for e in (next(stream), next(stream))] == [obj(0), obj(1)]
    with pytest.raises(BatchItemError, match=r"item 2 \(.*data/missing\)") as info:
        next(stream)
    assert info.value.index == 2 and info.value.item.endswith("data/missing")
    assert list(stream) == []  # and nothing more comes out


def test_too_many_soft_errors_abort(local_data):
    request = ["data/o0", "data/x1", "data/x2", "data/x3", "data/o1"]
    assert len(list(store.get_batch(request, continue_on_error=True, max_soft_errors=3))) == 5
    with pytest.raises(TooManySoftErrors, match="max_soft_errors=2"):
        list(store.get_batch(request, continue_on_error=True, max_soft_errors=2))


def test_items_may_not_leave_the_store_root(local_data):
    from shardfold.functions.errors import UnsafeKey

    with pytest.raises(UnsafeKey, match="item 1"):
        list(store.get_batch(["data/o0", "data/../../secret"]))


def test_bad_items_are_spec_errors(local_data):
    with pytest.raises(SpecError, match="item 1"):
        list(store.get_batch(["data/o0", {"uri": "data/o1", "start": 3, "length": 0}]))
    with pytest.raises(ValueError):
        store.get_batch(["data/o0"], window=0, concurrency=-1)


def test_archpath_reads_members_and_ranges_within_them(local_data):
    shard = "shards/s.tar"
    request = [
        {"uri": shard, "archpath": "a/x.wav"},
        {"uri": shard, "archpath": "b.txt", "start": 3, "length": 4},
        {"uri": shard, "archpath": "b.txt", "start": 8},
        {"uri": shard, "archpath": "empty"},
        {"uri": shard, "archpath": "b.txt", "name": "custom"},
        "data/o4",
    ]
    stream = store.get_batch(request)
    entries = list(stream)
    assert [e.name for e in entries] == [
        "shards/s.tar/a/x.wav",
        "shards/s.tar/b.txt",
        "shards/s.tar/b.txt",
        "shards/s.tar/empty",
        "custom",
        "data/o4",
    ]
    assert [e.data for e in entries] == [b"x" * 1000, b"3456", b"89", b"", b"0123456789", obj(4)]
    assert stream.stats.tar_indexes == 1  # one header scan serves every member of the shard


def test_archpath_errors_are_soft(local_data):
    request = [
        {"uri": "shards/s.tar", "archpath": "nope.wav"},
        {"uri": "shards/s.tar", "archpath": "b.txt", "start": 5, "length": 6},
        {"uri": "data/o1", "archpath": "x"},  # not a TAR
        {"uri": "shards/missing.tar", "archpath": "x"},
        {"uri": "shards/s.tar", "archpath": "b.txt"},
    ]
    entries = list(store.get_batch(request, continue_on_error=True))
    assert [e.name.startswith("__404__/") for e in entries] == [True, True, True, True, False]
    assert "no member 'nope.wav'" in entries[0].error
    assert "outside the object" in entries[1].error
    assert "not an uncompressed TAR" in entries[2].error
    assert "no object" in entries[3].error
    assert entries[4].data == b"0123456789"
    with pytest.raises(BatchItemError, match="item 0.*member nope.wav"):
        list(store.get_batch(request[:1]))


def test_same_request_gives_a_byte_identical_tar(local_data):
    objects = {f"s3://bkt/o{i}": obj(i) for i in range(8)}
    request = [
        "s3://bkt/o5",
        "s3://bkt/o1",
        "s3://bkt/missing",
        {"uri": "s3://bkt/o1", "start": 3, "length": 9},
        "s3://bkt/o5",
        "s3://bkt/o7",
    ]
    digests = set()
    for delays in ([0], [9, 0, 5, 1], [1, 30, 2, 0, 7]):
        fake = DelayedTransport(objects, delays, first_wave=4)
        buf = io.BytesIO()
        try:
            write_tar(store.get_batch(request, continue_on_error=True, concurrency=4, transport=fake), buf)
        finally:
            fake.close()
        digests.add(hashlib.sha256(buf.getvalue()).hexdigest())
    assert len(digests) == 1


# --- transport selection ------------------------------------------------------------------------------------


def test_transport_selection(monkeypatch):
    from shardfold.functions.store.crt import CrtTransport

    monkeypatch.delenv("SHARDFOLD_S3_TRANSPORT", raising=False)
    assert isinstance(transport_mod.s3_transport(), CrtTransport)
    monkeypatch.setenv("SHARDFOLD_S3_TRANSPORT", "boto3")
    assert isinstance(transport_mod.s3_transport(), transport_mod.Boto3Transport)
    monkeypatch.setenv("SHARDFOLD_S3_TRANSPORT", "curl")
    with pytest.raises(ValueError, match="SHARDFOLD_S3_TRANSPORT"):
        transport_mod.s3_transport()


def test_crt_error_mapping():
    from shardfold.functions.store.crt import _error

    body = b"<Error><Code>SlowDown</Code></Error>"
    assert isinstance(_error("s3://b/k", None, 503, body), TransientError)
    assert isinstance(_error("s3://b/k", None, 500, b""), TransientError)
    assert isinstance(_error("s3://b/k", RuntimeError("reset"), None, None), TransientError)
    assert isinstance(_error("s3://b/k", None, 404, b"<Code>NoSuchKey</Code>"), ObjectNotFound)
    assert isinstance(_error("s3://b/k", None, 416, b""), InvalidRange)
    assert "access denied" in str(_error("s3://b/k", None, 403, b"<Code>AccessDenied</Code>"))
    from awscrt.exceptions import AwsCrtError

    no_creds = AwsCrtError(1, "AWS_AUTH_CREDENTIALS_PROVIDER_CHAIN_SOURCES_EXHAUSTED", "none")
    assert "credentials" in str(_error("s3://b/k", no_creds, None, None))


# --- S3: boto3 under mock_aws, awscrt against a moto server -------------------------------------------------

S3_OBJECTS = {f"dir/o{i}": obj(i) for i in range(12)} | {
    "sp ace+plus é.bin": b"weird key",
    "empty": b"",
    "mid": obj(20, 80_000),  # past a read's step under SMALL_BUDGET: read again by its size
    "big": obj(21, 300_000),  # past the whole SMALL_BUDGET: streamed in ranges
}
SMALL_BUDGET = {"max_bytes": 100_000, "concurrency": 8}  # a step of 64 KiB
SHARD = _tar_bytes([("m/one.txt", b"member one"), ("two.bin", obj(2))])


def _fill_bucket(client, bucket: str) -> None:
    client.create_bucket(Bucket=bucket)
    for key, data in S3_OBJECTS.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)
    client.put_object(Bucket=bucket, Key="shard.tar", Body=SHARD)


def _s3_request(bucket: str) -> tuple[list, list]:
    """A request mixing everything, and the entries it must produce (name, data, is_error)."""
    b = f"s3://{bucket}"
    request = [
        f"{b}/dir/o3",
        f"{b}/dir/o0",
        f"{b}/dir/o3",
        {"uri": f"{b}/dir/o5", "start": 4, "length": 10},
        {"uri": f"{b}/dir/o5", "start": 100},
        f"{b}/sp ace+plus é.bin",
        f"{b}/empty",
        f"{b}/nope",
        {"uri": f"{b}/dir/o1", "start": 10_000},
        {"uri": f"{b}/shard.tar", "archpath": "m/one.txt", "start": 7},
        {"uri": f"{b}/shard.tar", "archpath": "two.bin"},
        f"{b}/mid",
        f"{b}/big",
        {"uri": f"{b}/big", "start": 1000},
        {"uri": f"{b}/big", "start": 10, "length": 250_000},
    ] + [f"{b}/dir/o{i}" for i in range(12)]
    expected = [
        ("dir/o3", obj(3), False),
        ("dir/o0", obj(0), False),
        ("dir/o3", obj(3), False),
        ("dir/o5", obj(5)[4:14], False),
        ("dir/o5", obj(5)[100:], False),
        ("sp ace+plus é.bin", b"weird key", False),
        ("empty", b"", False),
        ("__404__/nope", b"", True),
        ("__404__/dir/o1", b"", True),
        ("shard.tar/m/one.txt", b"one", False),
        ("shard.tar/two.bin", obj(2), False),
        ("mid", S3_OBJECTS["mid"], False),
        ("big", S3_OBJECTS["big"], False),
        ("big", S3_OBJECTS["big"][1000:], False),
        ("big", S3_OBJECTS["big"][10:250_010], False),
    ] + [(f"dir/o{i}", obj(i), False) for i in range(12)]
    return request, expected


def _check(stream, expected) -> None:
    got = [(e.name, e.data, e.error is not None) for e in stream]
    assert got == expected


def _check_small_budget(request, expected) -> None:
    """The same request under a budget smaller than its large objects: the transport stops a read at its
    limit, the engine reads it again by its size or streams it, and the entries are the same."""
    stream = store.get_batch(request, continue_on_error=True, **SMALL_BUDGET)
    _check(stream, expected)
    stats = stream.stats
    # stopped: mid, big, big from 1000; streamed: those bigs, and the 250,000-byte range (after its probe)
    assert stats.oversize == 3 and stats.streamed == 3
    assert stats.peak_held_bytes <= SMALL_BUDGET["max_bytes"] + 64 * 1024 and stats.held_bytes == 0


@pytest.mark.slow
def test_s3_with_boto3_transport(aws_env, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_S3_TRANSPORT", "boto3")
    with mock_aws():
        _fill_bucket(boto3.client("s3"), "gb-boto3")
        request, expected = _s3_request("gb-boto3")
        _check(store.get_batch(request, continue_on_error=True, concurrency=4), expected)
        _check_small_budget(request, expected)
        with pytest.raises(BatchItemError, match=r"item 7 \(s3://gb-boto3/nope\)"):
            list(store.get_batch(request))


@pytest.fixture
def crt_bucket(moto_server, aws_env, monkeypatch, request):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_server)
    monkeypatch.delenv("SHARDFOLD_S3_TRANSPORT", raising=False)  # the default: awscrt
    bucket = f"gb-crt-{request.node.name.split('[')[0][-20:].replace('_', '-')}"
    _fill_bucket(boto3.client("s3", endpoint_url=moto_server), bucket)
    return bucket


@pytest.mark.slow
def test_s3_with_crt_transport(crt_bucket):
    from shardfold.functions.store.crt import CrtTransport

    assert isinstance(transport_mod.s3_transport(), CrtTransport)
    request, expected = _s3_request(crt_bucket)
    _check(store.get_batch(request, continue_on_error=True, concurrency=8), expected)
    _check_small_budget(request, expected)
    stream = store.get_batch(request)
    assert [e.data for e in (next(stream) for _ in range(7))] == [d for _, d, _ in expected[:7]]
    with pytest.raises(BatchItemError, match=rf"item 7 \(s3://{crt_bucket}/nope\)"):
        list(stream)


class Flaky:
    """Wraps a transport: the first read of each listed URI fails with a throttling error."""

    def __init__(self, inner, uris, status=503):
        self.inner, self.left, self.status = inner, set(uris), status
        self.failed = 0
        self.lock = threading.Lock()

    def fetch(self, uri, start, length, done):
        with self.lock:
            fail = uri in self.left
            self.left.discard(uri)
        if fail:
            self.failed += 1
            threading.Thread(target=done, args=(None, TransientError("SlowDown", self.status))).start()
            return None
        return self.inner.fetch(uri, start, length, done)


@pytest.mark.slow
def test_s3_crt_injected_throttling_is_retried(crt_bucket):
    request, expected = _s3_request(crt_bucket)
    flaky = Flaky(transport_mod.default_transport(), [f"s3://{crt_bucket}/dir/o{i}" for i in (0, 3, 5, 7)])
    stream = store.get_batch(request, continue_on_error=True, transport=flaky, retry=FAST_RETRY)
    _check(stream, expected)
    assert flaky.failed == 4 and stream.stats.retries == 4


@pytest.mark.slow
def test_store_get_on_moto_server(crt_bucket):
    """The plain store calls honour the same endpoint variable (boto3 reads it)."""
    assert store.get(f"s3://{crt_bucket}/dir/o2", 3, 5) == obj(2)[3:8]
    assert store.exists(f"s3://{crt_bucket}/shard.tar")


def test_crt_addressing(monkeypatch, aws_env):
    from shardfold.functions.store.crt import _Client, crt_client

    aws = _Client(None, "eu-west-1", None)
    assert aws.address("bkt", "a b/c+d") == ("bkt.s3.eu-west-1.amazonaws.com", "/a%20b/c%2Bd")
    assert aws.address("my.dotted.bkt", "k") == ("s3.eu-west-1.amazonaws.com", "/my.dotted.bkt/k")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:4566/base/")
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    local = crt_client()
    assert (local.host, local.region) == ("127.0.0.1:4566", "ap-south-1")
    assert local.address("bkt", "k/x") == ("127.0.0.1:4566", "/base/bkt/k/x")


def test_sizes_through_crt_heads_match_boto3(crt_bucket, tmp_path, monkeypatch):
    local = tmp_path / "here.bin"
    local.write_bytes(b"x" * 7)
    present = [f"s3://{crt_bucket}/{key}" for key in [*S3_OBJECTS, "shard.tar"]]
    uris = [*present, f"s3://{crt_bucket}/nope", local.as_uri()]
    crt = store.sizes(uris)
    assert [crt[u] for u in present] == [len(d) for d in S3_OBJECTS.values()] + [len(SHARD)]
    assert crt[f"s3://{crt_bucket}/nope"] is None and crt[local.as_uri()] == 7
    monkeypatch.setenv("SHARDFOLD_S3_TRANSPORT", "boto3")
    assert store.sizes(uris) == crt
