"""CPU stage of an ``inference`` job: read one shard's rows, tokenize them, write ``pre/<H>/<k>.npz``.

No torch: the tokenizer is the ``tokenizers`` library reading the model's ``tokenizer.json`` (the bundled
all-MiniLM-L6-v2's for ``minilm`` and TorchScript models, a Hugging Face folder's own otherwise),
configured as transformers uses it: its special tokens (``[CLS] … [SEP]``; ``[CLS] a [SEP] b [SEP]`` and
token type ids for a pair), truncated to the input tokens (special tokens included; pairs longest first),
no padding (the GPU batcher pads).

``generate`` rows are kept as read (``prompts``: each row's prompt or chat messages as JSON): the worker
renders the chat template and tokenizes with transformers, exactly as the model's tokenizer does, and a
row it cannot (no template, too long) gets an error of its own.

The shard file is a numpy ``savez`` archive (:func:`encode_shard` / :func:`decode_shard`):

* ``input_ids`` int32, every row's token ids back to back; ``offsets`` int64 (rows + 1): row ``r`` is
  ``input_ids[offsets[r]:offsets[r + 1]]``;
* ``row_index`` int64: each kept row's global row number (across all inputs, bad rows counted);
* ``ids``: the id column (int64, or unicode strings), the row number when the spec names no ``id_field``;
* ``skipped``: a 0-d unicode array holding the JSON list of skipped rows (``on_bad_row="skip"``), each
  ``{"input", "line" | "row", "row_index", "error"}``;
* ``errors`` (unicode, one per kept row, ``""`` for none): a bad row kept with ``on_bad_row="error"``
  (no tokens); ``type_ids`` (int8, beside ``input_ids``) for pairs; ``prompts`` for generate, and
  ``params`` (each OpenAI Batch request's own options as JSON) with ``input_format: "openai"``.
"""

from __future__ import annotations

import functools
import io
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardfold.functions import store
from shardfold.functions.errors import BadInputError
from shardfold.functions.inference import hf, openai_batch
from shardfold.functions.inference.shards import load_arrays, tokenizer_path
from shardfold.functions.inference.spec import InferenceSpec
from shardfold.functions.store.pinning import Pin


@dataclass
class ShardRows:
    """The rows of one shard as read from its input: texts, ids, global row numbers, skipped rows."""

    texts: list[Any] = field(default_factory=list)  # a generate row's messages are a list
    pairs: list[str] = field(default_factory=list)
    params: list[dict[str, Any]] = field(default_factory=list)  # an OpenAI Batch request's own options
    errors: list[str] = field(default_factory=list)
    ids: list[Any] = field(default_factory=list)
    row_index: list[int] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)


@functools.lru_cache(maxsize=4)
def load_tokenizer(max_tokens: int):
    """The built-in tokenizer truncating to ``max_tokens`` (special tokens included), without padding."""
    return hf.tokenizer_from_text(tokenizer_path().read_text(encoding="utf-8"), max_tokens)


def tokenize(
    texts: list[str], max_tokens: int, pairs: list[str] | None = None, tokenizer: Any = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(input_ids int32 flat, offsets int64, type_ids int8 flat or None)`` of ``texts`` (with ``pairs``:
    of each text and its pair), by ``tokenizer`` (default: the built-in one)."""
    tok = tokenizer or load_tokenizer(max_tokens)
    batch = list(zip(texts, pairs, strict=True)) if pairs is not None else texts
    encodings = tok.encode_batch(batch) if texts else []
    lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
    offsets = np.zeros(len(encodings) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    input_ids = np.empty(int(offsets[-1]), dtype=np.int32)
    type_ids = np.empty(int(offsets[-1]), dtype=np.int8) if pairs is not None else None
    for r, e in enumerate(encodings):
        input_ids[offsets[r] : offsets[r + 1]] = e.ids
        if type_ids is not None:
            type_ids[offsets[r] : offsets[r + 1]] = e.type_ids
    return input_ids, offsets, type_ids


# ---------------------------------------------------------------------------------------------- reading


class _Rows:
    """Collects rows, applying the bad-row policy: fail with the location, or record it and go on."""

    def __init__(self, spec: InferenceSpec, shard: dict[str, Any]):
        self.spec, self.shard, self.out = spec, shard, ShardRows()

    def bad(self, where: dict[str, Any], row_index: int, error: str, row_id: Any = None) -> None:
        loc = f"line {where['line']}" if "line" in where else f"row {where['row']}"
        if self.spec.on_bad_row == "fail":
            raise BadInputError(f"{self.shard['input']} {loc}: {error}")
        if self.spec.on_bad_row == "error":  # kept, with its error and no tokens
            self._keep(row_index, "" if self.spec.task != "generate" else None, None, row_id, error)
            return
        self.out.skipped.append(
            {"input": self.shard["input"], **where, "row_index": row_index, "error": error}
        )

    def add(
        self,
        where: dict[str, Any],
        row_index: int,
        text: Any,
        row_id: Any,
        has_id: bool,
        pair: Any = None,
        params: dict[str, Any] | None = None,
    ) -> None:
        spec = self.spec
        if spec.input_format == "openai":
            pass  # row_id is the request's custom_id
        elif spec.id_field is None:
            row_id = row_index
        elif not has_id or row_id is None:
            return self.bad(where, row_index, f"missing id field {spec.id_field!r}")
        elif isinstance(row_id, bool) or not isinstance(row_id, int | str):
            return self.bad(where, row_index, f"id field {spec.id_field!r} is a {type(row_id).__name__}")
        problem = _bad_value(spec.field or "body", text, spec.task == "generate")
        if problem is None and spec.pair_field is not None:
            problem = _bad_value(spec.pair_field, pair, False)
        if problem is not None:
            return self.bad(where, row_index, problem, row_id)
        self._keep(row_index, text, pair, row_id, "", params)

    def _keep(
        self, row_index: int, text: Any, pair: Any, row_id: Any, error: str, params: dict | None = None
    ) -> None:
        self.out.texts.append(text)
        if self.spec.input_format == "openai":
            self.out.params.append(params or {})
        if self.spec.pair_field is not None:
            self.out.pairs.append(pair if isinstance(pair, str) else "")
        self.out.errors.append(error)
        self.out.ids.append(row_index if row_id is None else row_id)
        self.out.row_index.append(row_index)


def _bad_value(name: str, value: Any, chat: bool) -> str | None:
    """Why a row's ``name`` value cannot be used (None when it can): a string, or for generate a list of
    chat messages (``{"role": str, "content": str}``)."""
    if value is None:
        return f"missing field {name!r}"
    if isinstance(value, str):
        return None
    if not chat:
        return f"field {name!r} is a {type(value).__name__}, not a string"
    if not isinstance(value, list) or not value:
        return f"field {name!r} is a {type(value).__name__}, not a prompt or a list of chat messages"
    for i, m in enumerate(value):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            return f'field {name!r} message {i} is not {{"role": str, "content": str}}'
    return None


def _add_request(rows: _Rows, where: dict[str, Any], row_index: int, doc: dict[str, Any]) -> None:
    """An OpenAI Batch request line: its prompt, custom_id and own options, or a bad row saying why."""
    custom_id = doc.get("custom_id") if isinstance(doc.get("custom_id"), str) else None
    try:
        custom_id, prompt, params = openai_batch.read_request(doc)
    except ValueError as exc:
        return rows.bad(where, row_index, f"not an OpenAI Batch request: {exc}", custom_id)
    rows.add(where, row_index, prompt, custom_id, True, params=params)


def read_jsonl_shard(spec: InferenceSpec, shard: dict[str, Any], pin: Pin | None = None) -> ShardRows:
    """The shard's rows from its byte range (one ranged read: memory is bounded by the shard), of the
    pinned object only when given its ``pin``."""
    data = store.get(shard["uri"], shard["byte_start"], shard["byte_end"] - shard["byte_start"], pin)
    rows = _Rows(spec, shard)
    line_no, row_index = shard["first_line"], shard["row_offset"]
    for raw in data.split(b"\n"):
        if raw.strip(b" \t\r"):
            where = {"line": line_no}
            try:
                doc = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                rows.bad(where, row_index, f"not UTF-8 ({exc.reason} at byte {exc.start})")
            except json.JSONDecodeError as exc:
                rows.bad(where, row_index, f"not JSON ({exc.msg}, column {exc.colno})")
            else:
                if not isinstance(doc, dict):
                    rows.bad(where, row_index, f"a JSON {type(doc).__name__}, not an object")
                elif spec.input_format == "openai":
                    _add_request(rows, where, row_index, doc)
                else:
                    has_id = spec.id_field is not None and spec.id_field in doc
                    pair = doc.get(spec.pair_field) if spec.pair_field else None
                    rows.add(
                        where, row_index, doc.get(spec.field), doc.get(spec.id_field or ""), has_id, pair
                    )
            row_index += 1
        line_no += 1
    if row_index - shard["row_offset"] != shard["rows"]:
        raise BadInputError(
            f"{shard['input']}: shard {shard['shard']} has {row_index - shard['row_offset']} rows where the "
            f"plan counted {shard['rows']}; the file changed after the plan"
        )
    return rows.out


def read_parquet_shard(spec: InferenceSpec, shard: dict[str, Any], pin: Pin | None = None) -> ShardRows:
    """The shard's rows: only the row groups overlapping its row range, only the needed columns."""
    from shardfold.functions.inference.shards import open_parquet, parquet_errors

    pf = open_parquet(shard["uri"], shard["input"], pin)
    names = set(pf.schema_arrow.names)
    columns = [spec.field] + [c for c in (spec.id_field, spec.pair_field) if c]
    for c in columns:
        if c not in names:
            raise BadInputError(f"{shard['input']}: no column {c!r} (columns: {sorted(names)})")
    start, stop = shard["start_row"], shard["start_row"] + shard["rows"]
    groups, first, pos = [], None, 0
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if pos < stop and pos + n > start:
            groups.append(g)
            first = pos if first is None else first
        pos += n
    with parquet_errors(shard["input"]):
        table = pf.read_row_groups(groups, columns=columns).slice(start - (first or 0), shard["rows"])
    texts = table.column(spec.field).to_pylist()
    ids = table.column(spec.id_field).to_pylist() if spec.id_field else [None] * len(texts)
    pairs = table.column(spec.pair_field).to_pylist() if spec.pair_field else [None] * len(texts)
    rows = _Rows(spec, shard)
    for r, (text, row_id, pair) in enumerate(zip(texts, ids, pairs, strict=True)):
        rows.add({"row": start + r}, shard["row_offset"] + r, text, row_id, spec.id_field is not None, pair)
    return rows.out


def read_shard(spec: InferenceSpec, shard: dict[str, Any], pin: Pin | None = None) -> ShardRows:
    """The shard's rows; given the input's ``pin``, :class:`InputChanged` if it changed since the plan."""
    if shard["format"] == "jsonl":
        return read_jsonl_shard(spec, shard, pin)
    return read_parquet_shard(spec, shard, pin)


# ---------------------------------------------------------------------------------------------- files


def shard_tokenizer(spec: InferenceSpec, plan: dict[str, Any]) -> tuple[Any, int]:
    """The tokenizer of the job's model and its input tokens per row (the plan's, for a folder)."""
    model = plan.get("model")
    if model is None:
        return load_tokenizer(spec.max_input_tokens), spec.max_input_tokens
    uri = model["files"]["tokenizer.json"]
    pin = Pin.from_doc(model["pins"]["tokenizer.json"])
    return hf.load_tokenizer(uri, pin, model["input_tokens"]), model["input_tokens"]


def encode_shard(rows: ShardRows, spec: InferenceSpec, plan: dict[str, Any]) -> bytes:
    """The ``.npz`` bytes of a tokenized shard."""
    arrays: dict[str, np.ndarray] = {}
    if spec.task == "generate":
        input_ids, offsets = np.zeros(0, dtype=np.int32), np.zeros(len(rows.texts) + 1, dtype=np.int64)
        arrays["prompts"] = np.asarray([json.dumps(t) for t in rows.texts], dtype=np.str_)
        if spec.input_format == "openai":
            arrays["params"] = np.asarray([json.dumps(p) for p in rows.params], dtype=np.str_)
    else:
        tok, max_tokens = shard_tokenizer(spec, plan)
        input_ids, offsets, type_ids = tokenize(
            rows.texts, max_tokens, rows.pairs if spec.pair_field else None, tok
        )
        if type_ids is not None and (plan.get("model") or {}).get("type_ids"):
            arrays["type_ids"] = type_ids  # only a model with segment embeddings takes them
    if rows.ids and all(isinstance(i, int) for i in rows.ids):
        ids = np.asarray(rows.ids, dtype=np.int64)
    elif rows.ids:
        ids = np.asarray([str(i) for i in rows.ids], dtype=np.str_)
    else:
        ids = np.zeros(0, dtype=np.int64)
    buf = io.BytesIO()
    np.savez(
        buf,
        input_ids=input_ids,
        offsets=offsets,
        row_index=np.asarray(rows.row_index, dtype=np.int64),
        ids=ids,
        skipped=np.array(json.dumps(rows.skipped, sort_keys=True)),
        errors=np.asarray(rows.errors, dtype=np.str_),
        **arrays,
    )
    return buf.getvalue()


def decode_shard(data: bytes) -> dict[str, Any]:
    """A shard file's arrays; ``skipped`` decoded to its list; ``errors`` empty strings when absent."""
    out: dict[str, Any] = load_arrays(data)
    out["skipped"] = json.loads(str(out["skipped"]))
    if "errors" not in out:
        out["errors"] = np.full(len(out["row_index"]), "", dtype=np.str_)
    return out
