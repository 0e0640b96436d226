"""The local transport: a small read is done on the caller's thread, a large one by the few reader threads;
either way the bytes, the errors and the task's telemetry are those of functions.store.local.get."""

from __future__ import annotations

import threading

from shardfold.functions import telemetry
from shardfold.functions.errors import ObjectNotFound
from shardfold.functions.store import transport


def _fetch(t: transport.LocalTransport, uri: str, length: int | None, limit: int | None = None):
    box: dict = {}
    got = threading.Event()

    def done(data, exc):
        box.update(data=data, exc=exc, thread=threading.current_thread().name)
        got.set()

    t.fetch(uri, 0, length, done, limit=limit)
    assert got.wait(10)
    return box


def test_small_reads_inline_large_reads_on_readers_same_bytes_and_errors(tmp_path):
    small, large = tmp_path / "s.bin", tmp_path / "l.bin"
    small.write_bytes(b"x" * 1000)
    large.write_bytes(b"y" * (transport.INLINE_READ_BYTES + 1))
    t = transport.LocalTransport()
    here = threading.current_thread().name
    inline = _fetch(t, small.as_uri(), 1000)
    assert inline["data"] == b"x" * 1000 and inline["thread"] == here
    handed = _fetch(t, large.as_uri(), large.stat().st_size)
    assert bytes(handed["data"]) == large.read_bytes() and handed["thread"].startswith("sf-local-")
    # a read of unknown length: inline when its limit is small; the same errors either way
    assert _fetch(t, small.as_uri(), None, limit=4096)["thread"] == here
    for uri, length in ((tmp_path / "nope").as_uri(), 10), ((tmp_path / "nope").as_uri(), 10**9):
        assert isinstance(_fetch(t, uri, length)["exc"], ObjectNotFound)
    assert len({th.name for th in threading.enumerate() if th.name.startswith("sf-local-")}) <= (
        transport.LOCAL_READERS
    )


def test_reads_count_for_the_task_that_asked_on_either_path(tmp_path):
    small, large = tmp_path / "s.bin", tmp_path / "l.bin"
    small.write_bytes(b"x" * 10)
    large.write_bytes(b"y" * (transport.INLINE_READ_BYTES + 10))
    meter = telemetry.Meter()
    token = telemetry._meter.set(meter)
    try:
        t = transport.LocalTransport()
        _fetch(t, small.as_uri(), 10)
        _fetch(t, large.as_uri(), transport.INLINE_READ_BYTES + 10)
    finally:
        telemetry._meter.reset(token)
    assert meter.bytes_read == 10 + transport.INLINE_READ_BYTES + 10
    assert meter.requests.get("GET") == 2
