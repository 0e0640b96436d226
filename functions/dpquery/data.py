"""The data path of ``dpquery``: read a CSV or Parquet dataset from the store, map every attribute to its
domain indices, count marginals.

* The dataset is streamed in record batches (pyarrow), so memory is O(batch + the marginals being counted),
  never O(file). Local files are memory-mapped; S3 objects are read through ranged GETs.
* Each attribute's values map to indices ``0..n_i−1`` by the schema
  (:class:`functions.dpquery.spec.DPAttribute`):

  - ``categories``: a value matches a category by its text: a string category by equality, an integer
    category by its decimal text (``7``, ``-3``), a boolean category by ``true``/``false`` in any case.
    CSV columns are always read as text, so type inference never changes the match; Parquet columns are
    compared by the same text form (an integer column with integer categories is matched by value).
  - ``range`` ``[lo, hi]`` with bin width ``w``: integers (an integral float, or an integer written as text,
    counts) in ``[lo, hi]`` go to bin ``(v − lo) // w``.

  A missing value (null, empty CSV field) or a value outside the domain is an error that names the column
  and HOW MANY rows are at fault, never the values or the rows: the data are private.
* :func:`scan` validates every schema attribute in one pass; :func:`marginals` counts the histograms of a
  set of attribute tuples in one pass: one ``np.bincount`` per *maximal* tuple, and every other tuple by
  summing axes of a tuple that covers it.

pyarrow's own error messages quote the offending row (``Expected 3 columns, got 2: <row text>``), so they
are never passed on: a parse failure becomes a :class:`DatasetError` without the message.
"""

from __future__ import annotations

import codecs
import csv
import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from functions import store
from functions.dpquery.spec import DPAttribute
from functions.dpquery.unit import ContributionBound
from functions.errors import DatasetError, ObjectNotFound, PlanError
from functions.store.uri import is_s3, local_path

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
_INT_TEXT = r"^[+-]?[0-9]{1,18}$"  # 18 digits always fit int64; longer integers are outside every domain
_BOOL_TEXT = {"true": True, "false": False}


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


def _csv_reader(f, block: int, **convert: object) -> tuple[pcsv.CSVStreamingReader, int]:
    """Open a CSV stream on ``f`` (at its start) with blocks of at least ``block`` bytes, growing them until
    the header fits; ``(reader, block size used)``."""
    while True:
        try:
            reader = pcsv.open_csv(
                f,
                read_options=pcsv.ReadOptions(block_size=block, use_threads=False),
                convert_options=pcsv.ConvertOptions(**convert),
            )
            return reader, block
        except pa.ArrowInvalid as exc:
            if not _block_too_small(exc) or block >= MAX_CSV_BLOCK_BYTES:
                raise
            block = min(block * 4, MAX_CSV_BLOCK_BYTES)
            f.seek(0)


def _csv_header(f) -> list[str]:
    """The CSV's header row, read with the csv module from a prefix of the file that grows until it holds
    the whole row: pyarrow would infer a type for every column (52 s and 8.5 GB for 10^6 columns)."""
    size = HEADER_BLOCK_BYTES
    while True:
        f.seek(0)
        head = f.read(size)
        at_end = len(head) < size
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=at_end).removeprefix("\ufeff")
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


def record_batches(uri: str, fmt: str, columns: Sequence[str]) -> Iterator[pa.RecordBatch]:
    """Stream ``columns`` of the dataset in record batches (CSV columns as text). A missing column raises
    :class:`DatasetError` naming it (and every other missing one) before any batch is produced."""
    names = column_names(uri, fmt)
    missing = [c for c in columns if c not in names]
    if missing:
        raise DatasetError(
            f"dataset {uri} has no column {', '.join(repr(c) for c in missing)} "
            f"(the schema names {len(columns)} attribute(s); the dataset has {len(names)} column(s))",
            column=missing[0],
            missing=missing,
        )
    f = _open(uri)
    try:
        if fmt == "parquet":
            pf = pq.ParquetFile(f)
            batches = pf.iter_batches(batch_size=BATCH_ROWS, columns=list(columns), use_threads=False)
            try:
                yield from batches
            except (pa.ArrowException, OSError) as exc:
                raise _opaque(uri, fmt, exc) from None
        else:
            yield from _csv_batches(uri, f, columns)
    finally:
        f.close()


def _csv_batches(uri: str, f, columns: Sequence[str]) -> Iterator[pa.RecordBatch]:
    """The CSV's record batches. A line longer than the block restarts the read with larger blocks and
    skips the rows already produced (a CSV reads to the same rows in the same order every time)."""
    convert = {
        "include_columns": list(columns),
        "column_types": {c: pa.string() for c in columns},
        "strings_can_be_null": True,
        "quoted_strings_can_be_null": False,
    }
    block, produced = CSV_BLOCK_BYTES, 0
    while True:
        seen = 0
        try:
            reader, block = _csv_reader(f, block, **convert)
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
                f.seek(0)
                continue
            raise _opaque(uri, "csv", exc) from None


# --- domains ------------------------------------------------------------------------------------------------


def _category_text(value: str | int | bool) -> list[str]:
    """The texts a category matches (booleans in three spellings)."""
    if isinstance(value, bool):
        t = "true" if value else "false"
        return [t, t.capitalize(), t.upper()]
    return [str(value)]


@dataclass
class Domain:
    """How one attribute's values map to indices ``0..size−1`` (built from a :class:`DPAttribute`)."""

    attribute: DPAttribute
    size: int = field(init=False)
    _texts: pa.Array | None = field(init=False, default=None)
    _text_index: np.ndarray | None = field(init=False, default=None)
    _ints: pa.Array | None = field(init=False, default=None)
    _int_index: np.ndarray | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        a = self.attribute
        self.size = a.size
        if a.categories is None:
            return
        texts: list[str] = []
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
                texts.append(t)
                owner.append(i)
        self._texts = pa.array(texts, pa.string())
        self._text_index = np.asarray(owner, dtype=np.int64)
        ints = [(c, i) for i, c in enumerate(a.categories) if isinstance(c, int) and not isinstance(c, bool)]
        if len(ints) == len(a.categories):  # all-integer categories: match integer columns by value
            self._ints = pa.array([c for c, _ in ints], pa.int64())
            self._int_index = np.asarray([i for _, i in ints], dtype=np.int64)

    @property
    def name(self) -> str:
        return self.attribute.name

    def indices(self, arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """Domain index of every value, −1 where the value is missing or outside the domain."""
        if isinstance(arr, pa.ChunkedArray):
            arr = arr.combine_chunks()
        try:
            if pa.types.is_dictionary(arr.type):
                arr = arr.dictionary_decode()
            if self.attribute.categories is not None:
                return self._categorical(arr)
            return self._range(arr)
        except pa.ArrowException as exc:  # its message may quote a value: never pass it on
            raise DatasetError(
                f"column {self.name!r} ({arr.type}): values could not be mapped to the domain "
                f"({type(exc).__name__}; details withheld because they may contain data)",
                column=self.name,
            ) from None

    def _categorical(self, arr: pa.Array) -> np.ndarray:
        if self._ints is not None and pa.types.is_integer(arr.type):
            pos = pc.index_in(pc.cast(arr, pa.int64(), safe=False), value_set=self._ints)
            lookup = self._int_index
        else:
            text = arr if pa.types.is_string(arr.type) else _as_text(arr, self.name)
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
        lo, hi = self.attribute.range  # type: ignore[misc]
        w = self.attribute.bin_width or 1
        t = arr.type
        if pa.types.is_integer(t):
            values = pc.cast(arr, pa.int64(), safe=False)
            valid = pc.is_valid(values)
        elif pa.types.is_floating(t):
            finite = pc.and_(pc.is_finite(arr), pc.less_equal(pc.abs(arr), 2.0**62))
            integral = pc.and_(finite, pc.equal(arr, pc.floor(arr)))
            valid = pc.fill_null(integral, False)
            values = pc.cast(pc.if_else(valid, arr, 0.0), pa.int64(), safe=False)
        elif pa.types.is_string(t) or pa.types.is_large_string(t):
            text = pc.utf8_trim_whitespace(pc.cast(arr, pa.string()))
            valid = pc.fill_null(pc.match_substring_regex(text, _INT_TEXT), False)
            text = pc.replace_substring_regex(text, pattern=r"^\+", replacement="")
            values = pc.cast(pc.if_else(valid, text, "0"), pa.int64())
        else:
            raise DatasetError(
                f"column {self.name!r} has type {t}, which cannot hold an integer range; "
                "store it as integers (or integer text)",
                column=self.name,
            )
        v = values.to_numpy(zero_copy_only=False)
        ok = np.asarray(pc.fill_null(valid, False).to_numpy(zero_copy_only=False), dtype=bool)
        if v.dtype != np.int64:  # nulls made it float
            v = np.where(ok, v, 0).astype(np.int64)
        ok &= (v >= lo) & (v <= hi)
        return np.where(ok, (v - lo) // w, -1).astype(np.int64)


def _as_text(arr: pa.Array, name: str) -> pa.Array:
    t = arr.type
    if pa.types.is_large_string(t):
        return pc.cast(arr, pa.string())
    if pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_floating(t):
        return pc.cast(arr, pa.string())
    raise DatasetError(
        f"column {name!r} has type {t}, which cannot be matched to categories; "
        "store it as text, integers or booleans",
        column=name,
    )


def domains(attributes: Sequence[DPAttribute]) -> list[Domain]:
    return [Domain(a) for a in attributes]


# --- scanning -----------------------------------------------------------------------------------------------


def _domain_error(uri: str, bad: dict[str, int]) -> DatasetError:
    parts = [f"column {c!r}: {n:,} row(s)" for c, n in bad.items()]
    first = next(iter(bad))
    return DatasetError(
        f"dataset {uri}: values missing or outside the schema's domain in "
        + "; ".join(parts)
        + ". Fix the data, or widen the attribute's categories or range",
        column=first,
        count=bad[first],
        counts=dict(bad),
    )


def scan(uri: str, fmt: str, attributes: Sequence[DPAttribute]) -> dict:
    """Validate the dataset against the schema in one pass: every column present, every value in its
    domain. Returns ``{"bytes": <object size>}`` (a fingerprint that later stages check); raises
    :class:`DatasetError` naming each bad column with its count of bad rows. The row count is not
    returned: in the add/remove-one-record model it is private."""
    doms = domains(attributes)
    bad = {d.name: 0 for d in doms}
    for batch in record_batches(uri, fmt, [d.name for d in doms]):
        for j, d in enumerate(doms):
            bad[d.name] += int(np.count_nonzero(d.indices(batch.column(j)) < 0))
    bad = {c: n for c, n in bad.items() if n}
    if bad:
        raise _domain_error(uri, bad)
    return {"bytes": store.size(uri)}


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

    Only the columns the tuples use are read. A value outside its domain raises :class:`DatasetError`
    (the plan validated the data; this catches a dataset changed since).

    ``unit`` (a privacy unit, :class:`functions.dpquery.unit.ContributionBound`): a first pass over its id
    column chooses at most k rows per person (data-independently), and the counting pass counts only
    those rows."""
    wanted = sorted({tuple(sorted(t)) for t in tuples})
    covers = maximal(wanted)
    used = sorted({a for t in covers for a in t})
    doms = {a: Domain(attributes[a]) for a in used}
    sizes = {a: doms[a].size for a in used}
    hist: dict[tuple[int, ...], np.ndarray] = {}
    for t in covers:
        cells = int(np.prod([sizes[a] for a in t], dtype=object)) if t else 1
        if cells > MAX_HISTOGRAM_CELLS:
            raise PlanError(
                f"marginal {[attributes[a].name for a in t]} has {cells:,} cells; too many to count"
            )
        hist[t] = np.zeros(cells, dtype=np.int64)
    bad = {doms[a].name: 0 for a in used}
    names = [doms[a].name for a in used]
    if unit is not None:
        for batch in record_batches(uri, fmt, [unit.id_column]):
            unit.count(batch.column(0))
        unit.finish()
        read = names + ([unit.id_column] if unit.id_column not in names else [])
        batches = record_batches(uri, fmt, read)
    else:
        batches = record_batches(uri, fmt, names) if used else _rows_only(uri, fmt, attributes)
    for batch in batches:
        idx = {}
        for j, a in enumerate(used):
            idx[a] = doms[a].indices(batch.column(j))
            bad[doms[a].name] += int(np.count_nonzero(idx[a] < 0))
        keep = unit.keep(batch.column(unit.id_column)) if unit is not None else None
        if any(bad.values()):
            continue  # keep counting bad rows for the error; the histograms are discarded
        if keep is not None:
            idx = {a: v[keep] for a, v in idx.items()}
        _count(hist, idx, sizes, batch.num_rows if keep is None else int(np.count_nonzero(keep)))
    bad = {c: n for c, n in bad.items() if n}
    if bad:
        raise _domain_error(uri, bad)
    shaped = {t: h.reshape([sizes[a] for a in t]) for t, h in hist.items()}
    out: dict[tuple[int, ...], np.ndarray] = {}
    for t in wanted:
        cover = next(c for c in covers if set(t) <= set(c))
        out[t] = marginal_from(shaped[cover], cover, t)
    return out


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
