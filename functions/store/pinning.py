"""Pins: what an input object was when a job was planned, so a later read refuses a changed one.

A job plans over its inputs (fedavg's header offsets, getbatch's items, inference's byte ranges) and its
tasks read them later, maybe much later (a resume). A :class:`Pin` records the object at plan time: its
size and, on S3, its ETag, or for a local file its ``mtime_ns`` and inode. Reads given a pin check it
without an extra request: an S3 GET sends ``If-Match: <ETag>`` (S3 answers 412 when the object changed),
a local read compares ``fstat`` of the opened file. Either way a change raises :class:`InputChanged`
naming the object, the pin and, where known, what is there now.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from shardfold.functions.errors import InputChanged


@dataclass(frozen=True, slots=True)
class Pin:
    size: int
    etag: str | None = None  # S3
    mtime_ns: int | None = None  # local
    inode: int | None = None  # local

    def to_doc(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_doc(cls, doc: dict[str, Any] | None) -> Pin | None:
        return None if doc is None else cls(**doc)

    def fingerprint(self) -> str:
        """``sha256:<hex>`` of the pin's fields: equal exactly when the pins are, without recording the
        object's size where a document is read by more people than may read the object (a dataset's size
        is a proxy for its row count). Whoever knows the other fields (ETag; mtime and inode) got them
        from a HEAD or a stat, which states the size anyway."""
        text = json.dumps(self.to_doc(), sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()

    def describe(self) -> str:
        if self.etag is not None:
            return f"{self.size} bytes, ETag {self.etag}"
        return f"{self.size} bytes, mtime_ns {self.mtime_ns}, inode {self.inode}"


class TooLarge(Exception):
    """A read with a ``limit`` found more: ``size`` bytes from its start to the object's end. Nothing (or
    at most ``limit`` bytes, dropped) was read. ``pin``: the object as the answer described it, when it
    did, so reading it again in ranges can insist on the same object."""

    def __init__(self, uri: str, size: int, limit: int, pin: Pin | None = None):
        super().__init__(f"{uri}: {size} bytes to read, more than the read's limit of {limit}")
        self.size = size
        self.pin = pin


def local_pin(st: os.stat_result) -> Pin:
    return Pin(st.st_size, mtime_ns=st.st_mtime_ns, inode=st.st_ino)


def changed(uri: str, planned: Pin, now: Pin | str | None) -> InputChanged:
    """The error for ``uri`` found different from its pin (``now``: what is there, or words for it)."""
    if now is None:
        now = "no object"
    elif isinstance(now, Pin):
        now = now.describe()
    return InputChanged(
        f"input {uri} changed since the job was planned (planned: {planned.describe()}; now: {now}); "
        "submit a new job to use the new content",
        uri=uri,
    )


def check_local(uri: str, pin: Pin, st: os.stat_result) -> None:
    """Raise :class:`InputChanged` unless the opened file's ``fstat`` matches the pin."""
    if (st.st_size, st.st_mtime_ns, st.st_ino) != (pin.size, pin.mtime_ns, pin.inode):
        raise changed(uri, pin, local_pin(st))
