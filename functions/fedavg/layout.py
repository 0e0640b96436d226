"""safetensors layouts: parse and check one file's header, match N clients, write the output header.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of UTF-8 JSON, then the
data buffer. The JSON maps tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the data buffer) plus an optional ``"__metadata__"`` of string to string. Writers sort tensors
by dtype then name, so the dict order says nothing about where data lies: every offset here comes from
``data_offsets``. As the safetensors library does, a file is refused unless its tensors tile the data
buffer exactly (no overlap, no gap, each ``end - begin`` equal to ``prod(shape) * itemsize``) and the
object ends where the buffer does.

Every error is an :class:`InvalidModelFile` whose message starts with ``client <i> (<uri>)`` and names the
tensor when there is one.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Literal

import ml_dtypes
import numpy as np

from shardfold.functions import jsontext
from shardfold.functions.errors import InvalidModelFile

PREFIX_BYTES = 8  # the u64 little-endian header length
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the header
HEADER_ALIGN = 8  # the output header is space-padded so the data buffer starts 8-byte aligned
METADATA = "__metadata__"

Kind = Literal["float", "int", "bool"]


@dataclass(frozen=True)
class DType:
    """A safetensors dtype: its name, the numpy dtype its bytes are read as, and how it is aggregated."""

    name: str
    np: np.dtype
    kind: Kind

    @property
    def itemsize(self) -> int:
        return self.np.itemsize


def _dt(name: str, np_type: Any, kind: Kind) -> tuple[str, DType]:
    return name, DType(name, np.dtype(np_type), kind)


# Every dtype fedavg aggregates. BOOL is read as bytes (0 false, anything else true).
DTYPES: dict[str, DType] = dict(
    [
        _dt("F64", "<f8", "float"),
        _dt("F32", "<f4", "float"),
        _dt("F16", "<f2", "float"),
        _dt("BF16", ml_dtypes.bfloat16, "float"),
        _dt("F8_E4M3", ml_dtypes.float8_e4m3fn, "float"),
        _dt("F8_E5M2", ml_dtypes.float8_e5m2, "float"),
        _dt("I64", "<i8", "int"),
        _dt("I32", "<i4", "int"),
        _dt("I16", "<i2", "int"),
        _dt("I8", "i1", "int"),
        _dt("U64", "<u8", "int"),
        _dt("U32", "<u4", "int"),
        _dt("U16", "<u2", "int"),
        _dt("U8", "u1", "int"),
        _dt("BOOL", "u1", "bool"),
    ]
)


@dataclass(frozen=True)
class Tensor:
    """One tensor: its offsets in a data buffer (a client file's, or the output's)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def dt(self) -> DType:
        return DTYPES[self.dtype]

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FileHeader:
    """One file's parsed header. ``data_start`` is where its data buffer begins in the object."""

    header_len: int
    tensors: dict[str, Tensor]
    metadata: dict[str, str]
    data_bytes: int

    @property
    def data_start(self) -> int:
        return PREFIX_BYTES + self.header_len

    @property
    def object_bytes(self) -> int:
        return self.data_start + self.data_bytes


def where(client: int, uri: str) -> str:
    return f"client {client} ({uri})"


def bad_file(client: int, uri: str, what: str, tensor: str | None = None) -> InvalidModelFile:
    """The error for client ``client``'s update at ``uri``: ``what`` is wrong (its ``reason``)."""
    return InvalidModelFile(
        f"{where(client, uri)}: {what}", client=client, uri=uri, tensor=tensor, reason=what
    )


def parse_length_prefix(prefix: bytes, client: int, uri: str) -> int:
    """The header length from a file's first 8 bytes; refuses what cannot be a safetensors header."""
    if len(prefix) < PREFIX_BYTES:
        raise bad_file(
            client, uri, f"only {len(prefix)} bytes: not a safetensors file (no 8-byte length prefix)"
        )
    (n,) = struct.unpack("<Q", prefix[:PREFIX_BYTES])
    if n > MAX_HEADER_BYTES:
        raise bad_file(
            client,
            uri,
            f"not a safetensors file: its length prefix announces a {n}-byte header, more than the "
            f"{MAX_HEADER_BYTES}-byte limit (is it a .pt, .npy or other format?)",
        )
    if n < 2:
        raise bad_file(client, uri, f"not a safetensors file: its length prefix announces a {n}-byte header")
    return n


def parse_header(raw: bytes, client: int, uri: str) -> FileHeader:
    """Parse and check one header (the ``n`` bytes after the prefix)."""
    try:
        doc = jsontext.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise bad_file(client, uri, "not a safetensors file: its header is not UTF-8 text") from None
    except ValueError as exc:  # JSONDecodeError is a ValueError, and so is a duplicate key
        raise bad_file(client, uri, f"not a safetensors file: its header is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise bad_file(client, uri, "not a safetensors file: its header is not a JSON object")
    meta = doc.pop(METADATA, None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad_file(client, uri, f"{METADATA} must map strings to strings, got {json.dumps(meta)[:200]}")
    tensors: dict[str, Tensor] = {}
    for name, info in doc.items():
        tensors[name] = _tensor(name, info, client, uri)
    data_bytes = _check_tiling(tensors, client, uri)
    return FileHeader(header_len=len(raw), tensors=tensors, metadata=meta, data_bytes=data_bytes)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tensor(name: str, info: Any, client: int, uri: str) -> Tensor:
    def bad(what: str) -> InvalidModelFile:
        return bad_file(client, uri, f"tensor {name!r}: {what}", tensor=name)

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise bad("entry must be an object with dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"dtype {dtype!r} is not supported by fedavg (supported: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"shape {shape!r} must be a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise bad(f"data_offsets {offsets!r} must be [begin, end] with 0 <= begin <= end")
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != expected:
        raise bad(
            f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes but dtype {dtype} with shape "
            f"{shape} needs {expected}"
        )
    return Tensor(name, dtype, tuple(shape), offsets[0], offsets[1])


def _check_tiling(tensors: dict[str, Tensor], client: int, uri: str) -> int:
    """The tensors must cover the data buffer exactly once; returns the buffer's length."""
    pos = 0
    prev: Tensor | None = None
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end, t.name)):
        if t.begin < pos:
            assert prev is not None
            raise bad_file(
                client,
                uri,
                f"tensor {t.name!r} (bytes {t.begin}-{t.end}) overlaps tensor {prev.name!r} "
                f"(bytes {prev.begin}-{prev.end})",
                tensor=t.name,
            )
        if t.begin > pos:
            after = f"after tensor {prev.name!r}" if prev else "at the start of the data"
            raise bad_file(
                client,
                uri,
                f"data_offsets leave a gap of {t.begin - pos} bytes {after}, before tensor {t.name!r}",
                tensor=t.name,
            )
        pos = t.end
        if t.end > t.begin:
            prev = t
    return pos


def check_object_size(header: FileHeader, size: int, client: int, uri: str) -> None:
    """The object must end exactly where the header says its data buffer does."""
    want = header.object_bytes
    if size < want:
        raise bad_file(
            client,
            uri,
            f"truncated: the header describes {header.data_bytes} data bytes (object of {want} bytes) but "
            f"the object has only {size} bytes",
        )
    if size > want:
        raise bad_file(
            client,
            uri,
            f"{size - want} unexpected bytes after the data the header describes ({want} bytes); "
            "not a valid safetensors file",
        )


# --- N clients --------------------------------------------------------------------------------------------


def check_like_first(first: FileHeader, h: FileHeader, client: int, uri: str, ref: int = 0) -> None:
    """Client ``client`` must have exactly client ``ref``'s tensors (``first``: the round's), with the same
    dtypes and shapes (its offsets may differ). The first difference, in tensor-name order, is the error."""
    for name in sorted(first.tensors.keys() - h.tensors.keys()):
        raise bad_file(client, uri, f"has no tensor {name!r}, which client {ref} has", tensor=name)
    for name in sorted(h.tensors.keys() - first.tensors.keys()):
        raise bad_file(client, uri, f"has a tensor {name!r} that client {ref} does not have", tensor=name)
    for name in sorted(first.tensors):
        a, b = first.tensors[name], h.tensors[name]
        if a.dtype != b.dtype:
            raise bad_file(
                client, uri, f"tensor {name!r} is {b.dtype}, but client {ref}'s is {a.dtype}", tensor=name
            )
        if a.shape != b.shape:
            raise bad_file(
                client,
                uri,
                f"tensor {name!r} has shape {list(b.shape)}, but client {ref}'s has {list(a.shape)}",
                tensor=name,
            )


def output_tensors(first: FileHeader) -> list[Tensor]:
    """The output's tensors in client 0's data order (so a client written like client 0 is read in one
    range per chunk); their offsets are client 0's."""
    return sorted(first.tensors.values(), key=lambda t: (t.begin, t.end, t.name))


def encode_header(tensors: list[Tensor], metadata: dict[str, str]) -> bytes:
    """The output's length prefix and header JSON, space-padded so the data starts 8-byte aligned."""
    doc: dict[str, Any] = {METADATA: dict(metadata)} if metadata else {}
    for t in tensors:
        doc[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.begin, t.end]}
    text = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text


def weight_from_metadata(metadata: dict[str, str], client: int, uri: str) -> float:
    """A client's weight from ``__metadata__["num_examples"]``: a finite number > 0."""
    hint = f"set clients.{client}.weight in the spec, or uniform=true"
    raw = metadata.get("num_examples")
    if raw is None:
        raise bad_file(
            client, uri, f"no weight: the spec gives none and {METADATA} has no 'num_examples'; {hint}"
        )
    try:
        value = float(raw.strip())
    except ValueError:
        raise bad_file(client, uri, f"{METADATA}.num_examples is {raw!r}, not a number; {hint}") from None
    if not (math.isfinite(value) and value > 0):
        raise bad_file(
            client, uri, f"{METADATA}.num_examples is {raw!r}; a weight must be a finite number > 0; {hint}"
        )
    return value


def format_number(value: float) -> str:
    """A weight total as metadata text: an integer without ``.0`` when it is one."""
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)
