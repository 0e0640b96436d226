"""TAR in and out: the deterministic archive GetBatch writes, and the member index archpath reads use.

Writing is byte-reproducible: PAX format, mtime 0, uid/gid 0, empty owner names, mode
0o644, so the same request gives the same archive (and the same sha256) on every run and machine.
Reading a member does not fetch the whole shard: :func:`index_tar` walks the headers through ranged block
reads (tarfile seeks over member data) and returns each regular file's data offset and size.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable, Iterable
from typing import BinaryIO, Protocol

from shardfold.functions.errors import StoreError

# Characters an archive entry name may not hold: controls (a newline forges a line of a listing), the
# backslash (a directory separator where Windows tools extract) and the bidi controls (they make a name read
# as another: "exe.txt" shown for "txt.exe").
_UNSAFE_CHARS = frozenset(
    [chr(c) for c in range(0x20)]
    + [chr(0x7F)]
    + [chr(c) for c in range(0x80, 0xA0)]
    + ["\\"]
    + [chr(c) for c in (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))]
)


def unsafe_name(name: str) -> str | None:
    """Why ``name`` cannot be an archive entry's name (where an extracting tool writes it: it must stay
    inside the folder and read as what it is), or None when it can."""
    if not _UNSAFE_CHARS.isdisjoint(name):  # the set test first: every entry of a request is checked
        bad = sorted({f"U+{ord(c):04X}" for c in name if c in _UNSAFE_CHARS})
        return f"holds {', '.join(bad[:4])} (a control, bidi or backslash character)"
    if name.startswith("/") or (len(name) > 1 and name[1] == ":" and name[0].isalpha()):
        return "is absolute; give a relative path"
    parts = name.split("/")
    if ".." in parts:
        return "has a '..' component; give a path inside the archive"
    if parts[-1] in ("", "."):
        return "names a folder, not a file; end it with the file's name"
    return None


def entry_name(name: str) -> str:
    """``name`` made safe for the archive: what :func:`unsafe_name` refuses, percent-encoded (an object key
    may hold anything: ``../x``, ``a//b``, a newline), so a default name never escapes either."""
    if unsafe_name(name) is None:
        return name
    text = "".join(_escape(c) if c in _UNSAFE_CHARS else c for c in name).lstrip("/")
    if len(text) > 1 and text[1] == ":" and text[0].isalpha():
        text = text[0] + "%3A" + text[2:]
    parts = [{"..": "%2E%2E"}.get(p, p) for p in text.split("/")]
    parts[-1] = {"": "%2F", ".": "%2E"}.get(parts[-1], parts[-1])
    return "/".join(parts)


def _escape(c: str) -> str:
    return f"%{ord(c):02X}" if ord(c) < 0x100 else f"%u{ord(c):04X}"


TAR_FORMAT = tarfile.PAX_FORMAT
INDEX_BLOCK = 1 << 20  # bytes per ranged read while scanning headers
BLOCK = tarfile.BLOCKSIZE
# End of archive: two zero blocks. No padding to a 10 KiB record follows, so an archive is exactly its
# members' bytes plus this trailer, and fragments written with ``end_of_archive=False`` concatenate (with
# one trailer at the end) into the same bytes as one archive of all their entries.
TAR_TRAILER = bytes(2 * BLOCK)
_ZEROS = bytes(BLOCK)
JOIN_BYTES = 1 << 16  # a member up to this size is written with its header and padding in one call


class Entry(Protocol):
    """What :func:`write_tar` takes: a GetBatch :class:`~functions.store.batch.BatchEntry`, or anything
    with these fields (``data`` is read only when the entry has no ``chunks()``)."""

    index: int
    name: str
    data: bytes
    error: str | None


# The fixed fields of a regular member's ustar header: mode 0644, uid/gid 0, mtime 0, no link, empty owner
# names, no device numbers, no prefix. Offsets per POSIX.1-1988.
_MODE_IDS = b"0000644\x00" + b"0000000\x00" * 2
_AFTER_SIZE = b"00000000000\x00" + b" " * 8 + b"0" + bytes(100) + b"ustar\x0000" + bytes(64)
_TAIL = bytes(8 + 8 + 155 + 12)  # device numbers (empty for a regular file), prefix, padding
_MTIME = b"00000000000\x00"
_AFTER_CHECKSUM = _AFTER_SIZE[len(_MTIME) + 8 :]  # type flag, link name, magic, owner names
# The checksum is the sum of the header's bytes with its own field read as spaces: the fixed fields' part
# once here, so a header costs the sum of its name and size only.
_FIXED_SUM = sum(_MODE_IDS) + sum(_AFTER_SIZE) + sum(_TAIL)


def tar_header(name: str, size: int) -> bytes:
    """The (PAX) header block(s) of a regular file with fixed metadata.

    A name of at most 100 printable ASCII characters and a size below 8 GiB need no PAX record, so the
    header is the plain ustar block tarfile would write, built here directly (a TarInfo costs ~75 us, as much
    as fetching a small object). Anything else goes through tarfile."""
    if size < 8**11 and len(name) <= 100 and name.isascii() and name.isprintable():
        raw, size_field = name.encode("ascii"), b"%011o\x00" % size
        checksum = b"%06o\x00 " % (_FIXED_SUM + sum(raw) + sum(size_field))
        return b"".join(
            (raw.ljust(100, b"\x00"), _MODE_IDS, size_field, _MTIME, checksum, _AFTER_CHECKSUM, _TAIL)
        )
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info.tobuf(TAR_FORMAT, "utf-8", "surrogateescape")


def write_tar(entries: Iterable[Entry], fileobj: BinaryIO, end_of_archive: bool = True) -> list[dict]:
    """Write ``entries`` in order as TAR members into ``fileobj``; return a status row per entry:
    ``{"index", "name", "size", "error"}``.

    ``end_of_archive=False`` leaves the trailer off, for fragments that are concatenated later. An
    exception from ``entries`` propagates (the output is then incomplete and must be discarded).
    """
    rows: list[dict] = []
    write = fileobj.write
    for e in entries:
        name = entry_name(e.name)  # a default name is an object key, which may hold anything
        if getattr(e, "streamed", False):  # too large to hold: its bytes arrive in ranges
            n = e.size  # type: ignore[attr-defined]
            write(tar_header(name, n))
            written = 0
            for chunk in e.chunks():  # type: ignore[attr-defined]
                write(chunk)
                written += len(chunk)
            if written != n:
                raise StoreError(f"entry {e.index} ({e.name}): read {written} bytes of {n}")
        else:
            data = e.data
            n = len(data)
            if n <= JOIN_BYTES:  # one write, not three: a request has thousands of small members
                write(b"".join((tar_header(name, n), data, _ZEROS[: -n % BLOCK])))
                rows.append({"index": e.index, "name": name, "size": n, "error": e.error})
                continue
            write(tar_header(name, n))
            write(data)
        if n and (pad := -n % BLOCK):
            write(bytes(pad))
        rows.append({"index": e.index, "name": name, "size": n, "error": e.error})
    if end_of_archive:
        write(TAR_TRAILER)
    return rows


class _BlockReader(io.RawIOBase):
    """A read-only, seekable file over ``read_block(offset) -> bytes`` (short or empty at the end)."""

    def __init__(self, read_block: Callable[[int], bytes], block: int):
        self._read_block = read_block
        self._block = block
        self._pos = 0
        self._cached_at = -1
        self._cached = b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset += self._pos
        elif whence != io.SEEK_SET:
            raise io.UnsupportedOperation("seek from the end is not supported")
        self._pos = offset
        return offset

    def read(self, n: int = -1) -> bytes:
        out = bytearray()
        while n < 0 or len(out) < n:
            at = self._pos - self._pos % self._block
            if at != self._cached_at:
                self._cached, self._cached_at = self._read_block(at), at
            piece = self._cached[self._pos - at :]
            if n >= 0:
                piece = piece[: n - len(out)]
            if len(piece) == 0:
                break
            out += memoryview(piece)  # a block may be a numpy view (get_batch's buffer_bytes)
            self._pos += len(piece)
        return bytes(out)

    def readinto(self, b) -> int:  # type: ignore[override]
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def index_tar(read_block: Callable[[int], bytes], block: int = INDEX_BLOCK) -> dict[str, tuple[int, int]]:
    """Map each regular member's name to ``(data offset, size)``; a later duplicate wins, as on extraction.

    Raises :class:`tarfile.ReadError` when the object is not an uncompressed TAR.
    """
    index: dict[str, tuple[int, int]] = {}
    with tarfile.open(fileobj=_BlockReader(read_block, block), mode="r:") as tar:
        for member in tar:
            if member.isreg() and not member.issparse():
                index[member.name] = (member.offset_data, member.size)
    return index


def find_member(index: dict[str, tuple[int, int]], archpath: str) -> tuple[int, int] | None:
    """Look a member up by its path, tolerating a leading './' on either side."""
    found = index.get(archpath)
    if found is None:
        bare = archpath.removeprefix("./")
        found = index.get(bare) or index.get("./" + bare)
    return found
