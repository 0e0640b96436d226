"""The data path of ``dpquery``: read a CSV or Parquet dataset from the store, map every attribute to its
domain indices, count marginals.

**Privacy: nothing here may depend on row contents except the histograms.** Neither an error, nor whether
a read fails, nor anything returned besides the histograms of :func:`marginals` depends on the values or
the number of the rows. What may fail is decided by public facts only: the file exists and is a CSV with a
header row / a Parquet file, it has the schema's columns, and (Parquet) their declared types can hold the
attribute's domain. Row by row:

* A value outside its attribute's domain, or missing (null, an empty CSV field), follows the attribute's
  ``out_of_domain`` policy (:class:`functions.dpquery.spec.DPAttribute`): ``drop`` leaves the record out of
  every marginal, ``clip`` moves an out-of-range integer to the first/last bin, ``other`` counts it in an
  extra category. A record is dropped when any attribute that drops does so, so every marginal counts the
  same records (the histogram of the records that fit the schema) and adding or removing one record
  changes each marginal by at most one count. How many were dropped is never computed aloud.
* A malformed CSV row (too few or too many fields) is skipped, exactly like a dropped record (pyarrow's
  ``invalid_row_handler``), and never counted. Bytes that are not UTF-8 are decoded leniently (each bad
  byte becomes U+FFFD), so they make a value out of domain instead of failing the read.
* pyarrow's own error messages quote the offending row (``Expected 3 columns, got 2: <row text>``), so
  they are never passed on: a failure to read the file becomes a :class:`DatasetError` without them.

Reading and mapping:

* The dataset is streamed in record batches (pyarrow), so memory is O(batch + the marginals being counted),
  never O(file). Local files are memory-mapped; S3 objects are read through ranged GETs.
* Each attribute's values map to indices ``0..n_i−1`` by the schema:

  - ``categories``: a value matches a category by its text: a string category by equality, an integer
    category by its decimal text (``7``, ``-3``), a boolean category by ``true``/``false`` in any case.
    CSV columns are always read as text, so type inference never changes the match; Parquet columns are
    compared by the same text form (an integer column with integer categories is matched by value).
  - ``range`` ``[lo, hi]`` with bin width ``w``: integers (an integral float, or an integer of at most 18
    digits written as text, surrounding spaces allowed) in ``[lo, hi]`` go to bin ``(v − lo) // w``.

  The vectorised mapping never raises on a value; should pyarrow still refuse a batch, the batch is mapped
  value by value in Python with the same rules (:meth:`Domain.indices`).
* :func:`scan` checks the public facts and reads the whole file once (so a file that cannot be read fails
  before any budget is reserved); :func:`marginals` counts the histograms of a set of attribute tuples in
  one pass: one ``np.bincount`` per *maximal* tuple, and every other tuple by summing axes of a tuple that
  covers it.

What is not protected: a CSV whose quoting is broken (a field that opens a quote and never closes it) is
not a sequence of rows; the parser reads the following lines into that field, so they are skipped with
it. Neighbouring datasets are datasets of records; a CSV writer quotes every record on its own.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import hashlib
import io
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from shardfold.functions import store
from shardfold.functions.dpquery.spec import DPAttribute
from shardfold.functions.dpquery.unit import ContributionBound
from shardfold.functions.errors import DatasetError, ObjectNotFound, PlanError
from shardfold.functions.store.uri import is_s3, local_path

# Rows per Parquet record batch, and bytes per CSV block: bound the memory of one step of a scan. A block
# holds whole lines, so a file whose longest line (or header) is longer is read again with blocks 4x as
# large, up to MAX_CSV_BLOCK_BYTES (a valid CSV with a 50 MB line or 10^6 columns is still read).
BATCH_ROWS = 1 << 17
CSV_BLOCK_BYTES = 8 << 20
HEADER_BLOCK_BYTES = 1 << 16
MAX_CSV_BLOCK_BYTES = 64 << 20
# S3 reads are buffered in chunks of this size (one ranged GET each).
READ_CHUNK_BYTES = 8 << 20
# A dense histogram larger than this is refused (the planner bounds marginal sizes far below it).
MAX_HISTOGRAM_CELLS = 1 << 31
# 18 digits always fit int64; longer integers are outside every domain. ``\s`` is ASCII whitespace in RE2.
_INT_TEXT = r"^\s*[+-]?[0-9]{1,18}\s*$"
_INT_RE = re.compile(_INT_TEXT, re.ASCII)
_INT_STRIP = r"^\s*\+?|\s*$"
# The CSV reader decodes through this codec: UTF-8 where bytes are valid, U+FFFD for each invalid byte.
LENIENT_UTF8 = "shardfold-utf8-lenient"


class _LenientDecoder(codecs.BufferedIncrementalDecoder):
    def __init__(self, errors: str = "replace"):
        super().__init__("replace")

    _buffer_decode = staticmethod(codecs.utf_8_decode)


def _lenient_codec(name: str) -> codecs.CodecInfo | None:
    if name.replace("_", "-") != LENIENT_UTF8:
        return None
    u = codecs.lookup("utf-8")
    return codecs.CodecInfo(
        name=LENIENT_UTF8,
        encode=u.encode,
        decode=lambda b, errors="replace": u.decode(b, "replace"),
        incrementalencoder=u.incrementalencoder,
        incrementaldecoder=_LenientDecoder,
    )


codecs.register(_lenient_codec)


def _skip_row(row: object) -> str:
    """pyarrow's handler of a malformed CSV row: skip it. The row is neither kept, counted nor logged."""
    return "skip"


# --- reading ------------------------------------------------------------------------------------------------


class StoreFile(io.RawIOBase):
    """A read-only, seekable file over an object in the store: every read is a ranged GET."""

    def __init__(self, uri: str):
        super().__init__()
        self.uri = uri
        self._size = store.size(uri)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:  # type: ignore[override]
        n = min(len(buffer), self._size - self._pos)
        if n <= 0:
            return 0
        data = store.get(self.uri, self._pos, n)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def size(self) -> int:
        return self._size


def _open(uri: str):
    """A binary file object over the dataset: a memory map for a local file, ranged GETs on S3."""
    try:
        if is_s3(uri):
            return io.BufferedReader(StoreFile(uri), buffer_size=READ_CHUNK_BYTES)
        path = local_path(store.resolve(uri))
        if not path.is_file():
            raise ObjectNotFound(f"dataset {uri} does not exist")
        return pa.memory_map(str(path), "r")
    except ObjectNotFound:
        raise ObjectNotFound(f"dataset {uri} does not exist; check the spec's 'dataset' URI") from None


def _block_too_small(exc: BaseException) -> bool:
    """pyarrow's CSV reader failed because a line (or the header) is longer than its block."""
    text = str(exc)
    return "straddl" in text or "cannot infer number of columns" in text


def _csv_reader(f, block: int, **convert: object) -> pcsv.CSVStreamingReader:
    """A CSV stream on ``f`` (at its start) with blocks of ``block`` bytes, decoded leniently (invalid
    UTF-8 becomes U+FFFD) and skipping malformed rows."""
    return pcsv.open_csv(
        f,
        read_options=pcsv.ReadOptions(block_size=block, use_threads=False, encoding=LENIENT_UTF8),
        parse_options=pcsv.ParseOptions(invalid_row_handler=_skip_row),
        convert_options=pcsv.ConvertOptions(**convert),
    )


def _csv_header(f) -> list[str]:
    """The CSV's header row, read with the csv module from a prefix of the file that grows until it holds
    the whole row: pyarrow would infer a type for every column (52 s and 8.5 GB for 10^6 columns)."""
    size = HEADER_BLOCK_BYTES
    while True:
        f.seek(0)
        head = f.read(size)
        at_end = len(head) < size
        # lenient, like the rows: bytes that are not UTF-8 further down the prefix must not fail the read
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text = decoder.decode(head, final=at_end).removeprefix("\ufeff")
        lines = io.StringIO(text, newline="")
        row = next(csv.reader(lines), None)
        if row is None:
            raise DatasetError("the CSV file is empty; it needs a header row naming its columns")
        if lines.read() or at_end:
            return row
        if size >= MAX_CSV_BLOCK_BYTES:
            raise DatasetError(f"the CSV header row is longer than {MAX_CSV_BLOCK_BYTES >> 20} MiB")
        size *= 4


def column_names(uri: str, fmt: str) -> list[str]:
    """The dataset's column names (the CSV header row, or the Parquet schema)."""
    with _open(uri) as f:
        try:
            if fmt == "parquet":
                return list(pq.ParquetFile(f).schema_arrow.names)
            return _csv_header(f)
        except (pa.ArrowException, OSError, UnicodeDecodeError, csv.Error) as exc:
            raise _opaque(uri, fmt, exc) from None
        except DatasetError as exc:
            raise DatasetError(f"dataset {uri}: {exc}") from None


def _opaque(uri: str, fmt: str, exc: BaseException) -> DatasetError:
    """A parse failure without pyarrow's message (it may quote a row of the dataset)."""
    kind = type(exc).__name__
    return DatasetError(
        f"dataset {uri} could not be read as {fmt.upper()} ({kind}; details withheld because they may "
        f"contain data). Check that the file is a valid {fmt.upper()} file"
        + (
            " with a header row, the same number of fields on every line and no line over "
            f"{MAX_CSV_BLOCK_BYTES >> 20} MiB"
            if fmt == "csv"
            else ""
        )
    )


MAX_NAMED_COLUMNS = 50  # a refusal lists at most this many of the dataset's columns


def _missing(uri: str, missing: list[str], wanted: int, names: Sequence[str]) -> DatasetError:
    """A schema attribute the file lacks, naming the columns it has (the header or the Parquet schema:
    public facts, like the schema itself)."""
    shown = ", ".join(repr(c) for c in list(names)[:MAX_NAMED_COLUMNS])
    more = f", and {len(names) - MAX_NAMED_COLUMNS} more" if len(names) > MAX_NAMED_COLUMNS else ""
    return DatasetError(
        f"dataset {uri} has no column {', '.join(repr(c) for c in missing)}; its {len(names)} column(s): "
        f"{shown}{more} (each attribute is named as its column)",
        column=missing[0],
        missing=missing,
    )


def record_batches(uri: str, fmt: str, columns: Sequence[str]) -> Iterator[pa.RecordBatch]:
    """Stream ``columns`` of the dataset in record batches (CSV columns as text). A missing column raises
    :class:`DatasetError` naming it (and every other missing one) before any batch is produced."""
    names = column_names(uri, fmt)
    missing = [c for c in columns if c not in names]
    if missing:
        raise _missing(uri, missing, len(columns), names)
    if fmt != "parquet":
        yield from _csv_batches(uri, columns)
        return
    f = _open(uri)
    try:
        pf = pq.ParquetFile(f)
        batches = pf.iter_batches(batch_size=BATCH_ROWS, columns=list(columns), use_threads=False)
        try:
            yield from batches
        except (pa.ArrowException, OSError) as exc:
            raise _opaque(uri, fmt, exc) from None
    finally:
        f.close()


def _csv_batches(uri: str, columns: Sequence[str]) -> Iterator[pa.RecordBatch]:
    """The CSV's record batches. A line longer than the block restarts the read with larger blocks and
    skips the rows already produced (a CSV reads to the same rows in the same order every time). Each
    attempt opens the file afresh and closes its reader: the lenient decoder reads ahead of the parser,
    so two attempts must never share a file position."""
    convert = {
        "include_columns": list(columns),
        "column_types": {c: pa.string() for c in columns},
        "strings_can_be_null": True,
        "null_values": [""],  # only an empty field is missing: "NA" or "null" may be categories
        "quoted_strings_can_be_null": False,
    }
    block, produced = CSV_BLOCK_BYTES, 0
    while True:
        seen = 0
        f = _open(uri)
        reader = None
        try:
            reader = _csv_reader(f, block, **convert)
            for batch in reader:
                skip = min(max(produced - seen, 0), batch.num_rows)
                seen += batch.num_rows
                if skip < batch.num_rows:
                    produced += batch.num_rows - skip
                    yield batch.slice(skip) if skip else batch
            return
        except (pa.ArrowException, OSError) as exc:
            if isinstance(exc, pa.ArrowInvalid) and _block_too_small(exc) and block < MAX_CSV_BLOCK_BYTES:
                block = min(block * 4, MAX_CSV_BLOCK_BYTES)
                continue
            raise _opaque(uri, "csv", exc) from None
        finally:
            if reader is not None:
                with contextlib.suppress(pa.ArrowException, OSError):
                    reader.close()
            f.close()


# --- domains ------------------------------------------------------------------------------------------------


def _category_text(value: str | int | bool) -> list[str]:
    """The texts a category matches (booleans in three spellings)."""
    if isinstance(value, bool):
        t = "true" if value else "false"
        return [t, t.capitalize(), t.upper()]
    return [str(value)]


def _is_text(t: pa.DataType) -> bool:
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or (pa.types.is_large_binary(t))
    )


def type_problem(attribute: DPAttribute, t: pa.DataType) -> str | None:
    """Why a column of Arrow type ``t`` cannot hold the attribute's domain, or None. The type is the
    file's declared schema (CSV: always text), a public fact: the only per-column reason a job may fail."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_null(t) or _is_text(t) or pa.types.is_integer(t) or pa.types.is_floating(t):
        return None
    if attribute.categories is not None and pa.types.is_boolean(t):
        return None
    if attribute.categories is not None:
        return f"has type {t}, which cannot be matched to categories; store it as text, integers or booleans"
    return f"has type {t}, which cannot hold an integer range; store it as integers (or integer text)"


def _as_binary(arr: pa.Array) -> pa.Array:
    """Text as bytes (no UTF-8 check: a Parquet writer may have stored invalid UTF-8)."""
    if pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type):
        arr = pc.cast(arr, pa.large_binary())
    return pc.cast(arr, pa.binary())


@dataclass
class Domain:
    """How one attribute's values map to indices ``0..size−1`` (built from a :class:`DPAttribute`), and
    what happens to a value outside the declared domain (``attribute.policy``): index −1 (``drop``; also a
    non-integer under ``clip``), the nearest bin (``clip``), or the last index (``other``)."""

    attribute: DPAttribute
    size: int = field(init=False)
    declared: int = field(init=False)
    policy: str = field(init=False)
    _texts: pa.Array | None = field(init=False, default=None)
    _text_index: np.ndarray | None = field(init=False, default=None)
    _ints: pa.Array | None = field(init=False, default=None)
    _int_index: np.ndarray | None = field(init=False, default=None)
    _by_text: dict[str, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        a = self.attribute
        self.size = a.size
        self.declared = a.declared_size
        self.policy = a.policy
        if a.categories is None:
            return
        texts: list[bytes] = []
        owner: list[int] = []
        where: dict[str, int] = {}
        for i, c in enumerate(a.categories):
            for t in _category_text(c):
                if t in where:
                    raise DatasetError(
                        f"attribute {a.name!r}: categories.{i} ({c!r}) and categories.{where[t]} both match "
                        f"the text {t!r}; make the categories distinct as text",
                        column=a.name,
                    )
                where[t] = i
                texts.append(t.encode())
                owner.append(i)
        self._by_text = where
        self._texts = pa.array(texts, pa.binary())
        self._text_index = np.asarray(owner, dtype=np.int64)
        ints = [(c, i) for i, c in enumerate(a.categories) if isinstance(c, int) and not isinstance(c, bool)]
        if len(ints) == len(a.categories):  # all-integer categories: match integer columns by value
            self._ints = pa.array([c for c, _ in ints], pa.int64())
            self._int_index = np.asarray([i for _, i in ints], dtype=np.int64)

    @property
    def name(self) -> str:
        return self.attribute.name

    @property
    def drops(self) -> bool:
        """Whether some value makes this attribute drop its record (``drop``, or a non-integer under
        ``clip``); an ``other`` attribute never does."""
        return self.policy != "other"

    def indices(self, arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """Domain index of every value; a value outside the declared domain or missing gets what the
        policy says (−1: the record is dropped). Raises only for a column type that cannot hold the
        domain (:func:`type_problem`, a fact of the file's schema), never because of a value."""
        if isinstance(arr, pa.ChunkedArray):
            arr = arr.combine_chunks()
        problem = type_problem(self.attribute, arr.type)
        if problem:
            raise DatasetError(f"column {self.name!r} {problem}", column=self.name)
        try:
            if pa.types.is_dictionary(arr.type):
                arr = arr.dictionary_decode()
            if pa.types.is_null(arr.type):
                return self._finish(np.full(len(arr), -1, dtype=np.int64))
            if self.attribute.categories is not None:
                return self._finish(self._categorical(arr))
            return self._finish(self._range(arr))
        except (pa.ArrowException, ValueError, TypeError, OverflowError):
            # never passed on (its message may quote a value) and never fatal: map value by value
            return self._slow(arr)

    def _finish(self, idx: np.ndarray) -> np.ndarray:
        """Apply the policy to ``idx`` (−1: outside the declared domain, or missing; ``clip`` has already
        moved out-of-range integers): ``other`` gives such values the extra category's index."""
        if self.policy == "other":
            return np.where(idx < 0, self.declared, idx)
        return idx

    def _categorical(self, arr: pa.Array) -> np.ndarray:
        if self._ints is not None and pa.types.is_integer(arr.type):
            pos = pc.index_in(pc.cast(arr, pa.int64(), safe=False), value_set=self._ints)
            lookup = self._int_index
        else:
            if _is_text(arr.type):
                text = _as_binary(arr)
            else:
                text = pc.cast(pc.cast(arr, pa.string()), pa.binary())
            pos = pc.index_in(text, value_set=self._texts)
            lookup = self._text_index
        idx = pos.to_numpy(zero_copy_only=False)
        if pos.null_count:
            idx = np.where(np.isnan(idx), -1, idx)
        idx = idx.astype(np.int64)
        ok = idx >= 0
        out = np.full(len(idx), -1, dtype=np.int64)
        out[ok] = lookup[idx[ok]]
        return out

    def _range(self, arr: pa.Array) -> np.ndarray:
        """Bin index, or −1 for a value that is not an integer in the range (``clip``: not an integer)."""
        t = arr.type
        if pa.types.is_integer(t):
            if pa.types.is_uint64(t):  # above 2^62: outside every domain (and clipped to hi)
                big = pc.fill_null(pc.greater(arr, pa.scalar(2**62, pa.uint64())), False)
                arr = pc.if_else(big, pa.scalar(2**62, pa.uint64()), arr)
            valid = pc.is_valid(arr)
            values = pc.fill_null(pc.cast(arr, pa.int64()), 0)
        elif pa.types.is_floating(t):
            finite = pc.and_(pc.is_finite(arr), pc.less_equal(pc.abs(arr), 2.0**62))
            integral = pc.and_(finite, pc.equal(arr, pc.floor(arr)))
            valid = pc.fill_null(integral, False)
            values = pc.cast(pc.if_else(valid, arr, 0.0), pa.int64(), safe=False)
        else:  # text (the type was checked)
            text = _as_binary(arr)
            valid = pc.fill_null(pc.match_substring_regex(text, _INT_TEXT), False)
            text = pc.if_else(valid, text, pa.scalar(b"0", pa.binary()))
            text = pc.replace_substring_regex(text, pattern=_INT_STRIP, replacement="")
            values = pc.cast(pc.cast(text, pa.string()), pa.int64())
        v = np.clip(np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.int64), -(2**62), 2**62)
        ok = np.asarray(pc.fill_null(valid, False).to_numpy(zero_copy_only=False), dtype=bool)
        return self._bins(v, ok)

    def _bins(self, v: np.ndarray, ok: np.ndarray) -> np.ndarray:
        lo, hi = self.attribute.range  # type: ignore[misc]
        w = self.attribute.bin_width or 1
        if self.policy == "clip":
            v = np.clip(v, lo, hi)
        else:
            ok = ok & (v >= lo) & (v <= hi)
        return np.where(ok, (v - lo) // w, -1).astype(np.int64)

    # --- the value-by-value fallback (the same rules, in Python) --------------------------------------

    def _slow(self, arr: pa.Array) -> np.ndarray:
        if _is_text(arr.type):
            values: list = [
                None if b is None else b.decode("utf-8", "replace") for b in _as_binary(arr).to_pylist()
            ]
        else:
            values = arr.to_pylist()
        if self.attribute.categories is not None:
            idx = np.asarray([self._slow_category(x) for x in values], dtype=np.int64)
            return self._finish(idx)
        ints = [self._slow_int(x) for x in values]
        ok = np.asarray([i is not None for i in ints], dtype=bool)
        v = np.asarray([0 if i is None else i for i in ints], dtype=np.int64)
        return self._finish(self._bins(v, ok))

    def _slow_category(self, x: object) -> int:
        if x is None:
            return -1
        if self._ints is not None and isinstance(x, int) and not isinstance(x, bool):
            hit = [i for c, i in zip(self._ints.to_pylist(), self._int_index, strict=True) if c == x]
            return int(hit[0]) if hit else -1
        if isinstance(x, bool):
            text = "true" if x else "false"
        elif isinstance(x, float) and x.is_integer():
            text = str(int(x))
        else:
            text = str(x)
        return self._by_text.get(text, -1)

    @staticmethod
    def _slow_int(x: object) -> int | None:
        if x is None or isinstance(x, bool):
            return None
        if isinstance(x, int):
            return max(min(x, 2**62), -(2**62))
        if isinstance(x, float):
            return int(x) if math.isfinite(x) and abs(x) <= 2.0**62 and x.is_integer() else None
        if isinstance(x, str) and _INT_RE.match(x):
            return int(x.strip().removeprefix("+"))
        return None


def domains(attributes: Sequence[DPAttribute]) -> list[Domain]:
    return [Domain(a) for a in attributes]


# --- scanning -----------------------------------------------------------------------------------------------


def check_schema(uri: str, fmt: str, attributes: Sequence[DPAttribute]) -> None:
    """The public facts: the file is a CSV with a header row or a Parquet file, it has every column the
    schema names, and (Parquet) each column's declared type can hold its attribute's domain."""
    names = column_names(uri, fmt)
    missing = [a.name for a in attributes if a.name not in names]
    if missing:
        raise _missing(uri, missing, len(attributes), names)
    if fmt != "parquet":
        return
    with _open(uri) as f:
        try:
            schema = pq.ParquetFile(f).schema_arrow
        except (pa.ArrowException, OSError) as exc:
            raise _opaque(uri, fmt, exc) from None
    for a in attributes:
        problem = type_problem(a, schema.field(a.name).type)
        if problem:
            raise DatasetError(f"dataset {uri}: column {a.name!r} {problem}", column=a.name)


def scan(uri: str, fmt: str, attributes: Sequence[DPAttribute]) -> None:
    """Check the public facts (:func:`check_schema`), then read the schema's columns once through the
    domain mapping, so that a file that cannot be read fails here, before any budget is reserved. Nothing
    about the rows is kept or returned: their values and their number follow the policies, never errors."""
    check_schema(uri, fmt, attributes)
    doms = domains(attributes)
    for batch in record_batches(uri, fmt, [d.name for d in doms]):
        for j, d in enumerate(doms):
            d.indices(batch.column(j))


def maximal(tuples: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The tuples not contained in another one of the list (sorted, deduplicated)."""
    sets = sorted({tuple(sorted(t)) for t in tuples}, key=lambda t: (-len(t), t))
    out: list[tuple[int, ...]] = []
    for t in sets:
        st = set(t)
        if not any(st <= set(m) for m in out):
            out.append(t)
    return sorted(out)


def marginal_from(cover: np.ndarray, cover_attrs: tuple[int, ...], attrs: tuple[int, ...]) -> np.ndarray:
    """The marginal on ``attrs`` (sorted) by summing the other axes of the marginal on ``cover_attrs``."""
    drop = tuple(k for k, a in enumerate(cover_attrs) if a not in attrs)
    return cover.sum(axis=drop) if drop else cover


def marginals(
    uri: str,
    fmt: str,
    attributes: Sequence[DPAttribute],
    tuples: Sequence[tuple[int, ...]],
    *,
    unit: ContributionBound | None = None,
) -> dict[tuple[int, ...], np.ndarray]:
    """Histograms (int64, shape ``(n_i for i in t)``) of every attribute tuple ``t`` (sorted schema
    indices), in one pass over the data: a bincount per maximal tuple, the rest by axis sums.

    Every histogram counts the same records: those that no attribute drops (its policy, see
    :class:`Domain`). So the columns read are the ones the tuples use plus those of every attribute that
    can drop a record (``drop`` or ``clip``); an attribute with ``other`` is read only when used.

    ``unit`` (a privacy unit, :class:`functions.dpquery.unit.ContributionBound`): a first pass over its id
    column chooses at most k rows per person (data-independently), and the counting pass counts only
    those rows."""
    wanted = sorted({tuple(sorted(t)) for t in tuples})
    covers = maximal(wanted)
    used = sorted({a for t in covers for a in t})
    all_doms = domains(attributes)
    read = sorted(set(used) | {a for a, d in enumerate(all_doms) if d.drops})
    doms = {a: all_doms[a] for a in read}
    sizes = {a: doms[a].size for a in used}
    hist = _zero_histograms(covers, sizes, attributes)
    for batch in _counted_batches(uri, fmt, attributes, [doms[a].name for a in read], unit):
        idx, rows = _kept_indices(batch, doms, read, used, unit)
        _count(hist, idx, sizes, rows)
    shaped = {t: h.reshape([sizes[a] for a in t]) for t, h in hist.items()}
    out: dict[tuple[int, ...], np.ndarray] = {}
    for t in wanted:
        cover = next(c for c in covers if set(t) <= set(c))
        out[t] = marginal_from(shaped[cover], cover, t)
    return out


def _zero_histograms(covers, sizes: dict[int, int], attributes) -> dict[tuple[int, ...], np.ndarray]:
    """A flat int64 histogram of zeros per maximal tuple; a PlanError names one of too many cells."""
    hist: dict[tuple[int, ...], np.ndarray] = {}
    for t in covers:
        cells = int(np.prod([sizes[a] for a in t], dtype=object)) if t else 1
        if cells > MAX_HISTOGRAM_CELLS:
            raise PlanError(
                f"marginal {[attributes[a].name for a in t]} has {cells:,} cells; too many to count"
            )
        hist[t] = np.zeros(cells, dtype=np.int64)
    return hist


def _counted_batches(uri, fmt, attributes, names: list[str], unit) -> Iterator[pa.RecordBatch]:
    """The batches :func:`marginals` counts: the columns ``names`` (and the privacy unit's id column, after a
    first pass over it chooses the rows kept), or the row counts alone when no column is read."""
    if unit is not None:
        for batch in record_batches(uri, fmt, [unit.id_column]):
            unit.count(batch.column(0))
        unit.finish()
        return record_batches(uri, fmt, names + ([unit.id_column] if unit.id_column not in names else []))
    return record_batches(uri, fmt, names) if names else _rows_only(uri, fmt, attributes)


def _kept_indices(batch, doms, read, used, unit) -> tuple[dict[int, np.ndarray], int]:
    """Each used attribute's value indices of a batch's rows that are counted, and their number: rows
    that an attribute drops, or the privacy unit leaves out, are left out of every histogram (a
    data-independent filter)."""
    idx = {a: doms[a].indices(batch.column(j)) for j, a in enumerate(read)}
    keep = unit.keep(batch.column(unit.id_column)) if unit is not None else None
    droppers = [a for a in read if doms[a].drops]
    if droppers:
        kept = np.logical_and.reduce([idx[a] >= 0 for a in droppers])
        keep = kept if keep is None else keep & kept
    if keep is not None and not keep.all():
        return {a: idx[a][keep] for a in used}, int(np.count_nonzero(keep))
    return {a: idx[a] for a in used}, batch.num_rows


def _flat_dtype(cells: int) -> type:
    """The narrowest integer type that holds every flat cell index of a marginal (faster arithmetic)."""
    if cells <= np.iinfo(np.int16).max:
        return np.int16
    if cells <= np.iinfo(np.int32).max:
        return np.int32
    return np.int64


def _count(
    hist: dict[tuple[int, ...], np.ndarray],
    idx: dict[int, np.ndarray],
    sizes: dict[int, int],
    rows: int,
) -> None:
    """Add one batch to every histogram: flat cell index by Horner's rule in the narrowest integer type,
    then one bincount. Covers arrive sorted, so consecutive ones share a prefix, computed once."""
    typed: dict[tuple[int, type], np.ndarray] = {}
    prefix: dict[tuple, np.ndarray] = {}  # only the latest prefix of each (length, dtype) is kept
    for t, h in hist.items():
        if not t:
            h[0] += rows
            continue
        dt = _flat_dtype(h.size)

        def col(a: int, dt: type = dt) -> np.ndarray:
            key = (a, dt)
            if key not in typed:
                typed[key] = idx[a].astype(dt)
            return typed[key]

        flat = col(t[0])
        for m in range(1, len(t)):
            key = (t[: m + 1], dt)
            hit = prefix.get((m, dt))
            if hit is not None and hit[0] == key:
                flat = hit[1]
                continue
            flat = flat * dt(sizes[t[m]]) + col(t[m])
            if m < len(t) - 1:
                prefix[(m, dt)] = (key, flat)
        h += np.bincount(flat, minlength=h.size)


def _rows_only(uri: str, fmt: str, attributes: Sequence[DPAttribute]) -> Iterator[pa.RecordBatch]:
    """Batches of the first schema column only (to count rows when only the total is wanted)."""
    yield from record_batches(uri, fmt, [attributes[0].name])


HASH_CHUNK_BYTES = 8 << 20  # the fingerprint streams the dataset in reads of this size


def identify(uri: str, fmt: str, pin: Any = None) -> dict[str, Any]:
    """The dataset's identity, which binds a budget ledger to its data (:mod:`functions.ledger`): URI, size,
    pin (ETag / mtime+inode) and the sha256 of its bytes (streamed), plus ``rows_at_most``, an upper bound on
    its rows that the prepare step checks against the spec's public row bound: for CSV the number of line
    breaks (every line but maybe the last ends with one, the header is a line, and a quoted field may hold
    more), for Parquet the row count in its footer. Private: never returned to the submitter."""
    h = hashlib.sha256()
    breaks = 0
    prev_cr = False
    size = 0

    last = b""

    def feed(chunk: bytes) -> None:
        nonlocal breaks, prev_cr, size, last
        h.update(chunk)
        size += len(chunk)
        last = chunk[-1:] or last
        if fmt == "csv" and chunk:
            # line breaks: \n, \r\n, or a lone \r (a \r\n split across chunks is counted once)
            breaks += chunk.count(b"\n") + chunk.count(b"\r") - chunk.count(b"\r\n")
            if prev_cr and chunk[:1] == b"\n":
                breaks -= 1
            prev_cr = chunk[-1:] == b"\r"

    resolved = store.resolve(uri)
    if is_s3(resolved):
        total = store.size(resolved)
        for start in range(0, total, HASH_CHUNK_BYTES):
            feed(store.get(resolved, start, min(HASH_CHUNK_BYTES, total - start)))
    else:
        with open(local_path(resolved), "rb") as f:
            while chunk := f.read(HASH_CHUNK_BYTES):
                feed(chunk)
    if fmt == "parquet":
        with _open(uri) as f:
            rows = int(pq.ParquetFile(f).metadata.num_rows)
    else:  # lines: the breaks, plus one if the last line has none; one line is the header
        rows = max(0, breaks - (1 if last in (b"\n", b"\r") else 0))
    ident: dict[str, Any] = {"uri": uri, "bytes": size, "fingerprint": "sha256:" + h.hexdigest()}
    if pin is not None:
        ident["pin"] = pin.to_doc()
    ident["rows_at_most"] = rows
    return ident
