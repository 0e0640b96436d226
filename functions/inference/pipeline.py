"""Pure core of the ``inference`` job around its GPU worker: prepare, preprocess, cpu_done, reconcile, commit.

* **preprocess** tokenizes one shard and writes ``pre/<H>/<k>.npz`` put-if-absent; an existing shard file
  is kept (lineage: a shard's CPU task re-runs only when its file is missing).
* **cpu_done** marks the end of the CPU stage (the worker exits once it is there and nothing is left).
* **reconcile** lists the shards lacking a commit marker ``out/<H>/<k>.done`` into ``missing.json`` (the
  repair round's work list). The workflow runs one repair round (the plan vocabulary loops only a
  polling Task).
* **commit** fails naming the shards still missing, else merges every shard's output in input order into
  the output Parquet, streamed to the store a row group per shard (memory holds two shards, whatever the
  rows; no local disk) (``id`` and the task's columns: ``embedding`` fixed_size_list<float32>[dim];
  ``label`` and ``scores``; ``text``, ``finish_reason``, ``prompt_tokens``, ``completion_tokens``; and
  ``error`` where rows may fail; the task, model and config in its metadata) plus a manifest (which holds
  the workers' reports), and writes the result (rows, rows with an error, the batches' padding fraction,
  the workers' compute seconds). More failed rows than ``max_error_fraction`` fail the job instead.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import numpy as np

from shardfold.functions import store
from shardfold.functions.errors import ShardfoldError
from shardfold.functions.inference import openai_batch
from shardfold.functions.inference import shards as layout
from shardfold.functions.inference.preprocess import decode_shard, encode_shard, read_shard
from shardfold.functions.inference.shards import STAGE, load_plan, output_uri, prepare
from shardfold.functions.inference.spec import HFModel, InferenceSpec
from shardfold.functions.jobs import scratch_key
from shardfold.functions.kinds import counter
from shardfold.functions.log import logger
from shardfold.functions.store.uri import join
from shardfold.functions.worklist import worklist_ref

__all__ = ["commit", "cpu_done", "missing_shards", "prepare", "preprocess", "progress", "reconcile"]


class MissingShards(ShardfoldError):
    """Commit found shards without a commit marker after the repair round."""


def preprocess(spec: InferenceSpec, job_id: str, store_root: str, shard: int) -> dict[str, Any]:
    """Tokenize shard ``shard`` into ``pre/<H>/<k>.npz`` unless it is already there."""
    p = load_plan(store_root, job_id)
    h = p["config_hash"]
    uri = layout.pre_uri(store_root, job_id, h, shard)
    if store.exists(uri):
        return {"shard": shard, "cached": True}
    entry = p["shards"][shard]
    try:
        rows = read_shard(spec, entry, layout.plan_pin(p, entry["uri"]))
    except ShardfoldError as exc:
        # The GPU worker polls for shards; tell it the CPU stage failed so it stops instead of waiting.
        store.put_if_absent(
            layout.cpu_failed_uri(store_root, job_id),
            json.dumps({"shard": shard, "error": str(exc)}).encode(),
        )
        raise
    wrote = store.put_if_absent(uri, encode_shard(rows, spec, p))
    return {"shard": shard, "rows": len(rows.texts), "skipped": len(rows.skipped), "cached": not wrote}


def cpu_done(spec: InferenceSpec, job_id: str, store_root: str) -> dict[str, Any]:
    """Mark the CPU stage finished (every shard's preprocess task returned)."""
    p = load_plan(store_root, job_id)
    store.put_json(layout.cpu_done_uri(store_root, job_id), {"shards": len(p["shards"])})
    return {"shards": len(p["shards"])}


def missing_shards(store_root: str, job_id: str, p: dict[str, Any]) -> list[int]:
    """Shards of the plan lacking a commit marker for its config hash, ascending."""
    prefix = layout.out_prefix(store_root, job_id, p["config_hash"])
    done = {layout.shard_of(u) for u in store.list_uris(prefix) if u.endswith(".done")}
    return [s["shard"] for s in p["shards"] if s["shard"] not in done]


def progress(store_root: str, job_id: str) -> dict[str, dict[str, Any]]:
    """Shards embedded so far (commit markers) of the planned shards, and the input rows they hold: the GPU
    workers' progress, which an executor sees only as one running step. Empty until the plan exists; from
    the result once the job has it (its scratch, the markers included, is gone then)."""
    result_uri = join(store_root, "jobs", job_id, "result.json")
    if store.exists(result_uri):
        result = store.get_json(result_uri)
        shards = int(result["shards"])
        rows = int(result["rows"]) + int(result.get("skipped") or 0)  # the input's rows, as the plan counts
        return {"embedded_shards": counter(shards, shards), "embedded_rows": counter(rows, rows, "rows")}
    if not store.exists(layout.plan_uri(store_root, job_id)):
        return {}
    p = load_plan(store_root, job_id)
    missing = set(missing_shards(store_root, job_id, p))
    done = [s for s in p["shards"] if s["shard"] not in missing]
    return {
        "embedded_shards": counter(len(done), len(p["shards"])),
        "embedded_rows": counter(sum(s["rows"] for s in done), sum(s["rows"] for s in p["shards"]), "rows"),
    }


def reconcile(spec: InferenceSpec, job_id: str, store_root: str) -> dict[str, Any]:
    """Write ``missing.json`` (``[{"shard": k}]`` for every shard lacking a marker) and the repair round's
    worker list (one worker if any shard is missing); return their references."""
    p = load_plan(store_root, job_id)
    missing = missing_shards(store_root, job_id, p)
    uri = layout.missing_uri(store_root, job_id)
    store.put_json(uri, [{"shard": k} for k in missing])
    # the repair round's GPU job: one (attempt 1) when shards are missing, none otherwise
    repair = [{"worker": 0, "attempt": 1}] if missing else []
    r_uri = layout.repair_workers_uri(store_root, job_id)
    store.put_json(r_uri, repair)
    if missing:
        logger.warning(
            "shards to repair", extra={"job_id": job_id, "count": len(missing), "first": missing[:10]}
        )
    return {
        "missing": worklist_ref(uri, len(missing)),
        "repair_workers": worklist_ref(r_uri, len(repair)),
        "count": len(missing),
        "first": missing[:20],
    }


class TooManyRowErrors(ShardfoldError):
    """More rows ended with an error than the spec's max_error_fraction allows."""


def _load_out(store_root: str, job_id: str, h: str, shard: int, rows: int) -> dict[str, np.ndarray]:
    out = layout.load_arrays(store.get(layout.out_uri(store_root, job_id, h, shard)))
    if not isinstance(out, dict) or any(len(a) != rows for a in out.values()):
        shapes = {k: list(a.shape) for k, a in out.items()} if isinstance(out, dict) else "not an npz"
        raise ShardfoldError(f"shard {shard}: output arrays {shapes}, expected {rows} rows each")
    return out


def _nullable(values: Any, errors: np.ndarray) -> Any:
    """``values`` (a pyarrow array) with a null where the row has an error."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not errors.any():
        return values
    return pc.if_else(pa.array(errors), pa.nulls(len(values), values.type), values)


def _columns(spec: InferenceSpec, plan: dict[str, Any], out: dict[str, np.ndarray], errors: np.ndarray):
    """The task's output columns of one shard (besides ``id`` and ``error``), null where a row failed."""
    import pyarrow as pa

    bad = errors != ""
    if spec.task == "embed":
        emb = out["embedding"].astype(np.float32, copy=False)
        values = pa.array(emb.reshape(-1), type=pa.float32())
        # a fixed-size list (Arrow): pyarrow and pandas read one vector per row; DuckDB casts FLOAT[dim]
        return {"embedding": pa.FixedSizeListArray.from_arrays(values, emb.shape[1], mask=pa.array(bad))}
    if spec.task == "classify":
        scores = out["scores"].astype(np.float32, copy=False)
        labels = plan["model"]["labels"]
        label = pa.array([labels[i] for i in scores.argmax(axis=1)], type=pa.string())
        values = pa.array(scores.reshape(-1), type=pa.float32())
        return {
            "label": _nullable(label, bad),
            "scores": pa.FixedSizeListArray.from_arrays(values, scores.shape[1], mask=pa.array(bad)),
        }
    n = out["text"].shape[1]

    def per_choice(a: np.ndarray, typ: Any) -> Any:
        if n == 1:
            return _nullable(pa.array(a[:, 0].tolist(), type=typ), bad)
        return pa.array([None if b else row for row, b in zip(a.tolist(), bad, strict=True)], pa.list_(typ))

    return {
        "text": per_choice(out["text"], pa.string()),
        "finish_reason": per_choice(out["finish_reason"], pa.string()),
        "prompt_tokens": _nullable(pa.array(out["prompt_tokens"], type=pa.int32()), bad),
        "completion_tokens": per_choice(out["completion_tokens"], pa.int32()),
    }


class _ParquetOut:
    """The output Parquet, a row group per shard: its schema and metadata from the first shard's table,
    every shard's vectors of one width (``dim``); with no rows, an empty table of the task's columns."""

    def __init__(self, spec: InferenceSpec, plan: dict[str, Any], f: Any, string_ids: bool) -> None:
        import pyarrow as pa

        self.spec, self.plan, self.f = spec, plan, f
        self.id_type = pa.string() if string_ids else pa.int64()
        self.dim: int | None = None
        self.writer: Any = None

    def write(self, shard: int, ids: np.ndarray, columns: dict[str, Any], row_errors: np.ndarray) -> None:
        """One shard's rows: ``id``, the task's columns and ``error`` (where the output has it)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        width = columns["embedding"].type.list_size if "embedding" in columns else None
        if self.dim is not None and width != self.dim:
            raise ShardfoldError(f"shard {shard}: embedding width {width}, others {self.dim}")
        self.dim = width
        table = {"id": pa.array(ids, type=self.id_type), **columns}
        if self.spec.errors_column:
            table["error"] = _nullable(pa.array(row_errors.tolist(), pa.string()), row_errors == "")
        t = pa.table(table)
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.f, t.schema.with_metadata(self.metadata()))
        self.writer.write_table(t)

    def close(self) -> int | None:
        """Write the footer (the schema first, when no shard had rows); the vectors' width."""
        import pyarrow.parquet as pq

        if self.writer is None:
            self.writer = pq.ParquetWriter(self.f, self.empty_schema().with_metadata(self.metadata()))
        self.writer.close()
        return self.dim

    def abort(self) -> None:
        """Close after an error, so the writer writes no footer later into a sink that is gone."""
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.close()

    def metadata(self) -> dict[str, str]:
        """What the output Parquet says of itself: the task, the model, the vectors' width, the config hash
        and config."""
        config = self.plan.get("config") or {}
        model = config.get("model")
        if model == "hf":
            model = f"hf:{self.spec.model.hf}"
        return {
            "shardfold.task": self.spec.task,
            "shardfold.model": model if isinstance(model, str) else json.dumps(model, sort_keys=True),
            "shardfold.dim": str(self.dim or 0),
            "shardfold.config_hash": str(self.plan.get("config_hash", "")),
            "shardfold.config": json.dumps(config, sort_keys=True),
        }

    def empty_schema(self) -> Any:
        """The schema of an output of no rows (its vectors of no fixed width)."""
        import pyarrow as pa

        columns = {
            "embed": [("embedding", pa.list_(pa.float32()))],
            "classify": [("label", pa.string()), ("scores", pa.list_(pa.float32()))],
            "generate": [
                ("text", pa.string()),
                ("finish_reason", pa.string()),
                ("prompt_tokens", pa.int32()),
                ("completion_tokens", pa.int32()),
            ],
        }[self.spec.task]
        error = [("error", pa.string())] if self.spec.errors_column else []
        return pa.schema([("id", self.id_type), *columns, *error])


def _openai_lines(
    spec: InferenceSpec,
    job_id: str,
    sh: dict[str, Any],
    out: dict[str, np.ndarray],
    ids: np.ndarray,
    row_errors: np.ndarray,
    created: int,
):
    """One shard's OpenAI Batch output lines (:mod:`functions.inference.openai_batch`), as bytes."""
    model = str(spec.model.hf) if isinstance(spec.model, HFModel) else str(spec.model)
    params = sh.get("params")
    for i in range(len(ids)):
        row = {
            "texts": out["text"][i].tolist(),
            "finish_reasons": out["finish_reason"][i].tolist(),
            "completion_tokens": out["completion_tokens"][i].tolist(),
            "prompt_tokens": int(out["prompt_tokens"][i]),
            "params": json.loads(str(params[i])) if params is not None else {},
        }
        line = openai_batch.response_line(
            job_id, int(sh["row_index"][i]), str(ids[i]), model, created, row, str(row_errors[i]) or None
        )
        yield (line + "\n").encode()


def worker_reports(store_root: str, job_id: str) -> list[dict[str, Any]]:
    """Every worker's summary (``workers/<attempt>/<name>.json``), by attempt and name."""
    prefix = layout.worker_reports_prefix(store_root, job_id) + "/"
    return [store.get_json(u) for u in sorted(store.list_uris(prefix)) if u.endswith(".json")]


def _batching_summary(workers: list[dict[str, Any]]) -> dict[str, Any]:
    """What the result says of the GPU stage: the workers that reported (a killed worker does not), the
    padding fraction over all their batches, and their embedding seconds."""
    real = sum(w.get("real_tokens", 0) for w in workers)
    padded = sum(w.get("padded_tokens", 0) for w in workers)
    summary = {
        "workers": len(workers),
        "padding_fraction": round(1 - real / padded, 4) if padded else 0.0,
        "compute_s": round(sum(w.get("compute_s", 0.0) for w in workers), 3),
    }
    generated = sum(w.get("generated_tokens", 0) for w in workers)
    if generated:
        summary["generated_tokens"] = generated
        summary["prefix_saved_tokens"] = sum(w.get("prefix_saved_tokens", 0) for w in workers)
    return summary


class _StringIds(Exception):
    """A shard has string ids after others wrote integer ones: the merge starts again with strings."""


SKIPPED_LISTED = 1000  # skipped rows the manifest lists (the result counts them all)


def _shards_in_order(store_root: str, job_id: str, p: dict[str, Any]):
    """``(plan entry, preprocessed arrays, output arrays)`` of every shard in input order, one at a time,
    the next one's two GETs under way while the caller writes this one's rows (two shards in memory)."""
    from concurrent.futures import ThreadPoolExecutor

    from shardfold.functions import telemetry

    h = p["config_hash"]

    def load(s: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, np.ndarray]]:
        sh = decode_shard(store.get(layout.pre_uri(store_root, job_id, h, s["shard"])))
        n = len(sh["row_index"])
        if not np.all(np.diff(sh["row_index"]) > 0):
            raise ShardfoldError(f"shard {s['shard']}: rows out of input order in its preprocessed file")
        # an empty shard adds no rows (and cannot say the width)
        return s, sh, _load_out(store_root, job_id, h, s["shard"], n) if n else {}

    with ThreadPoolExecutor(1, thread_name_prefix="sf-commit-read") as pool:
        ahead = None
        for s in p["shards"]:
            current, ahead = ahead, pool.submit(telemetry.carried(load), s)
            if current is not None:
                yield current.result()
        if ahead is not None:
            yield ahead.result()


def _merge(
    spec: InferenceSpec, job_id: str, store_root: str, p: dict[str, Any], f: Any, string_ids: bool
) -> dict[str, Any]:
    """Write every shard's rows in input order to ``f`` (Parquet row groups, or OpenAI lines), one shard at
    a time; count rows, errors and skipped rows. :class:`_StringIds` when a shard's ids are strings and
    ``string_ids`` is False."""
    skipped: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []  # the first few, for the result
    rows = failed = skipped_rows = 0
    parquet = _ParquetOut(spec, p, f, string_ids) if spec.output_format == "parquet" else None
    created = int(time.time())  # an OpenAI response's "created"
    try:
        for s, sh, arrays in _shards_in_order(store_root, job_id, p):
            skipped_rows += len(sh["skipped"])
            skipped.extend(sh["skipped"][: SKIPPED_LISTED - len(skipped)])
            n = len(sh["row_index"])
            if not n:
                continue
            if sh["ids"].dtype.kind == "U" and not string_ids:
                raise _StringIds
            row_errors = arrays["error"] if "error" in arrays else sh["errors"]
            ids = sh["ids"].astype(str) if string_ids else sh["ids"]
            bad = np.flatnonzero(row_errors != "")
            failed += len(bad)
            errors += [{"id": ids[i].item(), "error": str(row_errors[i])} for i in bad[: 10 - len(errors)]]
            rows += n
            if parquet is None:
                f.writelines(_openai_lines(spec, job_id, sh, arrays, ids, row_errors, created))
            else:
                parquet.write(s["shard"], ids, _columns(spec, p, arrays, row_errors), row_errors)
    except BaseException:
        if parquet is not None:
            parquet.abort()
        raise
    dim = parquet.close() if parquet is not None else None
    if rows and failed / rows > spec.max_error_fraction:
        shown = "; ".join(f"id {e['id']}: {e['error']}" for e in errors[:3])
        raise TooManyRowErrors(
            f"{failed} of {rows} rows ended with an error ({failed / rows:.1%}), more than "
            f"max_error_fraction {spec.max_error_fraction}; first: {shown}"
        )
    return {
        "rows": rows,
        "dim": dim,
        "errors": failed,
        "first_errors": errors,
        "skipped": skipped,
        "skipped_rows": skipped_rows,
    }


def commit(spec: InferenceSpec, job_id: str, store_root: str) -> dict[str, Any]:
    """Merge every shard's output in input order into the output (streamed to the store, one shard in
    memory at a time) and write the result; fail, writing nothing, when more rows ended with an error than
    ``max_error_fraction`` allows."""
    result_uri = join(store_root, "jobs", job_id, "result.json")
    if store.exists(result_uri):  # a retried commit after success: the result stands, scratch goes
        store.delete_prefix(join(store_root, scratch_key(job_id, STAGE)))
        return store.get_json(result_uri)
    p = load_plan(store_root, job_id)
    h = p["config_hash"]
    missing = missing_shards(store_root, job_id, p)
    if missing:
        shown = ", ".join(str(k) for k in missing[:20]) + (" …" if len(missing) > 20 else "")
        raise MissingShards(
            f"{len(missing)} shard(s) still lack a commit marker after the repair round: {shown}; "
            "resume the job to recompute only those"
        )
    out = output_uri(spec, store_root, job_id)
    # integer ids unless a shard has strings: then once more, every id a string (the retry runs after the
    # except block, so the first pass's shards are freed)
    for string_ids in (False, True):
        try:
            with store.writer(out) as f:
                merged = _merge(spec, job_id, store_root, p, f, string_ids)
            break
        except _StringIds:
            continue
    workers = worker_reports(store_root, job_id)
    manifest = {  # written with sorted keys
        **merged,
        "workers": workers,
        "output": out,
        "config_hash": h,
        "config": p["config"],
        "inputs": list(spec.inputs),
        "shards": len(p["shards"]),
    }
    stem = out.rsplit(".", 1)[0] if out.endswith((".parquet", ".jsonl")) else out
    manifest_out = stem + ".manifest.json"
    store.put(manifest_out, json.dumps(manifest, sort_keys=True, indent=1).encode())
    result = {
        "job_id": job_id,
        "kind": "inference",
        "task": spec.task,
        "output": out,
        "manifest": manifest_out,
        "rows": merged["rows"],
        "dim": merged["dim"],
        "errors": merged["errors"],
        "skipped": merged["skipped_rows"],
        "shards": len(p["shards"]),
        "config_hash": h,
        **_batching_summary(workers),
    }
    store.put_json(result_uri, result)
    # the preprocessed and embedded shards, claims and worker reports (the manifest holds the reports)
    store.delete_prefix(join(store_root, scratch_key(job_id, STAGE)))
    logger.info("committed inference", extra={k: v for k, v in result.items() if k != "job_id"})
    return result
