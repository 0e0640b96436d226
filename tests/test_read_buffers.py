"""Reads into reused, page-aligned buffers (``local.Buffers``; ``get_batch(buffer_bytes=...)``), what a
fedavg shard reads its ranges into: the same bytes as a plain read, the same checks (pin, range), and no
buffer reused while anything can still see it."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from shardfold.functions import store
from shardfold.functions.errors import BatchItemError, InputChanged, InvalidRange, ObjectNotFound
from shardfold.functions.store import local
from shardfold.functions.store.uri import join, local_path


@pytest.fixture
def blob(local_root):
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    uri = join(local_root, "in", "blob.bin")
    store.put(uri, data)
    return uri, data


def read(uri: str, start: int, length: int, buffers: local.Buffers, pin=None):
    return local.get(local_path(uri), uri, start, length, pin, into=buffers)


def test_a_read_into_buffers_gives_the_bytes_in_a_page_aligned_view(blob):
    uri, data = blob
    bufs = local.Buffers(64 << 10)
    got = read(uri, 12345, 50_000, bufs)
    assert isinstance(got, np.ndarray) and got.dtype == np.uint8
    assert got.tobytes() == data[12345 : 12345 + 50_000]
    assert got.ctypes.data % 4096 == 0


def test_a_buffer_is_reused_only_once_nothing_sees_it(blob):
    uri, data = blob
    bufs = local.Buffers(64 << 10)
    first = read(uri, 0, 4096, bufs)
    kept = np.frombuffer(first, np.uint32)  # a view made from the read keeps its buffer too
    del first
    second = read(uri, 8192, 4096, bufs)
    assert bufs.made == 2  # the first buffer is still seen through ``kept``: a new one
    assert kept.tobytes() == data[:4096]  # and the later read did not write over it
    del second
    third = read(uri, 65536, 4096, bufs)
    assert bufs.made == 2  # the second buffer came back
    assert third.tobytes() == data[65536 : 65536 + 4096]
    del kept, third
    gc.collect()
    for k in range(20):
        assert read(uri, k * 4096, 4096, bufs).tobytes() == data[k * 4096 : (k + 1) * 4096]
    assert bufs.made == 2


def test_a_range_larger_than_a_buffer_is_read_as_bytes(blob):
    uri, data = blob
    got = read(uri, 0, 100_000, local.Buffers(64 << 10))
    assert isinstance(got, bytes) and got == data[:100_000]


def test_buffered_reads_keep_the_range_and_pin_checks(blob):
    uri, data = blob
    bufs = local.Buffers(64 << 10)
    with pytest.raises(InvalidRange, match="outside the object"):
        read(uri, len(data) - 10, 20, bufs)
    pin = store.pin(uri)
    assert read(uri, 0, 10, bufs, pin).tobytes() == data[:10]
    with open(local_path(uri), "r+b") as f:  # rewritten in place: same inode, new mtime
        f.write(b"x")
    os.utime(local_path(uri), ns=(pin.mtime_ns + 10**9, pin.mtime_ns + 10**9))
    with pytest.raises(InputChanged):
        read(uri, 0, 10, bufs, pin)


def test_get_batch_with_buffer_bytes_yields_the_same_bytes_from_a_bounded_pool(blob, monkeypatch):
    uri, data = blob
    pools: list[local.Buffers] = []
    real = local.Buffers.__init__

    def record(self, size):
        real(self, size)
        pools.append(self)

    monkeypatch.setattr(local.Buffers, "__init__", record)
    items = [{"uri": uri, "start": s, "length": 32768} for s in range(0, len(data), 32768)]
    plain = [e.data for e in store.get_batch(items, window=4, concurrency=4)]
    got = []
    with store.get_batch(items, window=4, concurrency=4, buffer_bytes=32768) as stream:
        for entry in stream:
            view = entry.data
            del entry
            got.append(view.tobytes())
            del view
    assert got == plain == [data[s : s + 32768] for s in range(0, len(data), 32768)]
    assert 1 <= pools[0].made <= 5  # the window, plus the one the consumer holds


def test_get_batch_buffered_read_of_a_changed_input_names_it(blob):
    uri, data = blob
    pin = store.pin(uri)
    store.put(uri, data[::-1])  # replaced: a new file
    items = [{"uri": uri, "start": 0, "length": 4096}]
    with pytest.raises(BatchItemError) as err:
        list(store.get_batch(items, pins={uri: pin}, buffer_bytes=4096))
    assert isinstance(err.value.__cause__, InputChanged)


def test_buffer_bytes_is_for_the_default_transport_only():
    from shardfold.functions.store.transport import LocalTransport

    with pytest.raises(ValueError, match="buffer_bytes"):
        store.get_batch([], transport=LocalTransport(), buffer_bytes=1024)


def test_a_file_cut_short_during_a_buffered_read_is_a_changed_input_when_pinned(blob, monkeypatch):
    uri, data = blob
    pin = store.pin(uri)
    monkeypatch.setattr(os, "preadv", lambda *a: 0)  # as if truncated between the fstat and the read
    with pytest.raises(InputChanged):
        read(uri, 0, 4096, local.Buffers(8192), pin)
    with pytest.raises(InvalidRange, match="ended at byte 0"):
        read(uri, 0, 4096, local.Buffers(8192))


def test_entries_holding_views_compare_and_stream_like_bytes(blob):
    uri, data = blob
    items = [{"uri": uri, "start": 0, "length": 1}, {"uri": uri, "start": 5, "length": 100}]
    plain = list(store.get_batch(items))
    viewed = list(store.get_batch(items, buffer_bytes=4096))
    assert isinstance(viewed[1].data, np.ndarray)
    assert viewed == plain
    assert [b"".join(bytes(c) for c in e.chunks()) for e in viewed] == [data[:1], data[5:105]]


def test_tar_members_read_through_buffers(local_root):
    import io
    import tarfile

    members = {f"m{i}.bin": os.urandom(300_000 + i) for i in range(8)}  # a 2.4 MiB shard: 3 index blocks
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    uri = join(local_root, "shards", "s.tar")
    store.put(uri, out.getvalue())
    items = [{"uri": uri, "archpath": name} for name in members]
    got = [bytes(e.data) for e in store.get_batch(items, buffer_bytes=1 << 20)]
    assert got == list(members.values())


@pytest.mark.parametrize(
    "derive",
    [
        lambda v: np.frombuffer(v, np.float32, count=10, offset=64),  # as a shard reads a piece
        lambda v: v[100:200],
        lambda v: v.view(np.uint16)[3:],
        lambda v: memoryview(v),
    ],
    ids=["frombuffer", "slice", "view", "memoryview"],
)
def test_anything_made_from_a_read_keeps_its_buffer_out_of_the_pool(blob, derive):
    uri, data = blob
    bufs = local.Buffers(8192)
    first = read(uri, 0, 4096, bufs)
    kept = derive(first)
    want = bytes(kept)
    del first
    gc.collect()
    for k in range(1, 5):
        read(uri, k * 4096, 4096, bufs)  # each dropped at once: their buffer is reused
    assert bufs.made == 2 and bytes(kept) == want


@pytest.mark.parametrize("buffered", [True, False])
def test_a_file_shorter_than_its_fstat_said_is_refused_on_both_read_paths(blob, monkeypatch, buffered):
    from types import SimpleNamespace

    from shardfold.functions.store.pinning import local_pin

    uri, data = blob
    real = os.fstat

    def fstat(fd):  # as if the file lost its last 100 bytes between the fstat and the read
        st = real(fd)
        return SimpleNamespace(
            st_mode=st.st_mode, st_size=st.st_size + 100, st_mtime_ns=st.st_mtime_ns, st_ino=st.st_ino
        )

    monkeypatch.setattr(os, "fstat", fstat)
    with open(local_path(uri), "rb") as f:
        pin = local_pin(fstat(f.fileno()))
    bufs = local.Buffers(1 << 16) if buffered else None
    start = len(data) - 50
    with pytest.raises(InvalidRange, match=f"ended at byte {len(data)}"):
        local.get(local_path(uri), uri, start, 100, into=bufs)
    with pytest.raises(InputChanged):
        local.get(local_path(uri), uri, start, 100, pin, into=bufs)


def test_a_folder_is_no_object_and_a_file_whose_size_says_zero_is_read_whole(tmp_path):
    # reads are made on a bare descriptor, which opens a folder too: it must still be "no object"
    for args in ((), (0, 10), (0, None, None, 1024)):
        with pytest.raises(ObjectNotFound, match="no object"):
            local.get(str(tmp_path), tmp_path.as_uri(), *args)
    # a whole read does not trust the size: /proc files say 0 and hold text
    status = local.get("/proc/self/status", "file:///proc/self/status")
    assert b"Name:" in status


def test_a_pipe_is_read_whole_and_a_short_read_is_continued(tmp_path, monkeypatch):
    r, w = os.pipe()
    os.write(w, b"from a pipe")
    os.close(w)
    assert local.get(f"/dev/fd/{r}", "file:///dev/fd/r") == b"from a pipe"  # a whole read needs no seek
    os.close(r)
    # a filesystem that answers a read in pieces (FUSE, NFS): the range is still read whole, not "cut short"
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(200)))
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: real(fd, min(n, 7), offset))
    assert local.get(str(path), path.as_uri(), 10, 100) == bytes(range(10, 110))
    monkeypatch.setattr(local, "ONE_CALL_BYTES", 50)  # a large range goes through one buffer
    assert local.get(str(path), path.as_uri(), 10, 100) == bytes(range(10, 110))


def test_a_whole_read_goes_to_the_end_whatever_the_size_said(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(200)))
    real_pread, real_fstat = os.pread, os.fstat
    monkeypatch.setattr(os, "pread", lambda fd, n, at: real_pread(fd, min(n, 7), at))  # answered in pieces
    assert local.get(str(path), path.as_uri()) == bytes(range(200))
    monkeypatch.setattr(os, "pread", real_pread)
    # grown since the fstat (a log being written): read on to the end
    monkeypatch.setattr(os, "fstat", lambda fd: os.stat_result((*real_fstat(fd)[:6], 50, 0, 0, 0)))
    assert local.get(str(path), path.as_uri()) == bytes(range(200))
