"""Deterministic TAR writing and the TAR member index used by archpath reads."""

import hashlib
import io
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from shardfold.functions.store.batch import BatchEntry
from shardfold.functions.store.tar import (
    TAR_FORMAT,
    TAR_TRAILER,
    entry_name,
    find_member,
    index_tar,
    tar_header,
    write_tar,
)

NAMES = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/\\\x00"),
    min_size=1,
    max_size=40,
).filter(lambda s: s not in (".", ".."))


def entries_strategy():
    return st.lists(
        st.tuples(st.lists(NAMES, min_size=1, max_size=6).map("/".join), st.binary(max_size=3000)),
        max_size=12,
    )


def _tar(entries) -> bytes:
    buf = io.BytesIO()
    write_tar([BatchEntry(i, n, d) for i, (n, d) in enumerate(entries)], buf)
    return buf.getvalue()


@settings(max_examples=examples(60), deadline=None)
@given(entries_strategy())
def test_write_tar_is_byte_identical_and_readable(entries):
    a, b = _tar(entries), _tar(list(entries))
    assert hashlib.sha256(a).digest() == hashlib.sha256(b).digest()
    with tarfile.open(fileobj=io.BytesIO(a)) as tf:
        members = tf.getmembers()
        # a name that would escape or mislead is written percent-encoded (tar.entry_name); others as given
        assert [(m.name, tf.extractfile(m).read()) for m in members] == [
            (entry_name(n), d) for n, d in entries
        ]
        for m in members:
            assert (m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) == (0, 0, 0, "", "", 0o644)
            assert m.isreg()


@settings(max_examples=examples(30), deadline=None)
@given(entries_strategy(), st.integers(0, 12))
def test_fragments_concatenate_into_the_whole_archive(entries, cut):
    """Fragments without the trailer, joined with one trailer, equal one archive of all entries."""
    cut = min(cut, len(entries))
    whole = _tar(entries)
    parts = []
    for chunk in (entries[:cut], entries[cut:]):
        buf = io.BytesIO()
        write_tar([BatchEntry(i, n, d) for i, (n, d) in enumerate(chunk)], buf, end_of_archive=False)
        parts.append(buf.getvalue())
    assert b"".join(parts) + TAR_TRAILER == whole


def test_status_rows_record_errors_and_sizes():
    entries = [BatchEntry(0, "a", b"xyz"), BatchEntry(1, "__404__/b", b"", "no object at s3://x/b")]
    rows = write_tar(entries, io.BytesIO())
    assert rows == [
        {"index": 0, "name": "a", "size": 3, "error": None},
        {"index": 1, "name": "__404__/b", "size": 0, "error": "no object at s3://x/b"},
    ]


def test_an_error_from_the_entries_propagates():
    def entries():
        yield BatchEntry(0, "a", b"1")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_tar(entries(), io.BytesIO())


def _shard(members: list[tuple[str, bytes]], with_dirs: bool = True) -> bytes:
    """A TAR as other tools write it: tarfile defaults, GNU format, a directory, a symlink."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        if with_dirs:
            d = tarfile.TarInfo("dir")
            d.type = tarfile.DIRTYPE
            tf.addfile(d)
            link = tarfile.TarInfo("link")
            link.type = tarfile.SYMTYPE
            link.linkname = "dir"
            tf.addfile(link)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _reader(blob: bytes, block: int, calls: list | None = None):
    def read_block(offset: int) -> bytes:
        if calls is not None:
            calls.append(offset)
        assert offset % block == 0
        return blob[offset : offset + block]

    return read_block


@settings(max_examples=examples(40), deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(NAMES, min_size=1, max_size=8).map("/".join), st.binary(max_size=5000)), max_size=8
    ),
    st.sampled_from([512, 700, 4096, 1 << 20]),
)
def test_index_tar_finds_every_member_at_any_block_size(members, block):
    blob = _shard(members)
    index = index_tar(_reader(blob, block), block)
    expected = dict(members)  # a later duplicate wins, as on extraction
    assert set(index) == set(expected)
    for name, data in expected.items():
        offset, size = index[name]
        assert blob[offset : offset + size] == data


def test_index_tar_skips_member_data_instead_of_reading_it():
    members = [(f"m{i}", bytes([i]) * 300_000) for i in range(8)]
    blob = _shard(members, with_dirs=False)
    calls: list[int] = []
    index_tar(_reader(blob, 4096, calls), 4096)
    assert len(set(calls)) < 2 * len(members) + 4  # about one block per header, not the whole shard
    assert len(set(calls)) * 4096 < len(blob) // 10


def test_index_tar_rejects_a_non_tar():
    with pytest.raises(tarfile.ReadError):
        index_tar(_reader(b"this is not a tar archive" * 100, 512), 512)


def test_find_member_tolerates_leading_dot_slash():
    index = {"./a/b.wav": (512, 3), "c.txt": (2048, 1)}
    assert find_member(index, "a/b.wav") == (512, 3)
    assert find_member(index, "./c.txt") == (2048, 1)
    assert find_member(index, "nope") is None


@settings(max_examples=examples(400), deadline=None)
@given(
    st.one_of(
        st.text(min_size=1, max_size=120),
        st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=110),
    ),
    st.one_of(st.integers(0, 2 * 8**11), st.sampled_from([0, 511, 512, 8**11 - 1, 8**11])),
)
def test_the_direct_header_is_the_one_tarfile_writes(name, size):
    # the fast path (plain ustar for short printable ASCII names) must not change a byte of the archive
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid = size, 0, 0o644, 0, 0
    info.uname = info.gname = ""
    assert tar_header(name, size) == info.tobuf(TAR_FORMAT, "utf-8", "surrogateescape")
