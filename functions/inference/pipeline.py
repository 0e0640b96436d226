"""Pure core of the ``inference`` job around its GPU worker: prepare, preprocess, cpu_done, reconcile, commit.

* **preprocess** tokenizes one shard and writes ``pre/<H>/<k>.npz`` put-if-absent; an existing shard file
  is kept (lineage: a shard's CPU task re-runs only when its file is missing).
* **cpu_done** marks the end of the CPU stage (the worker exits once it is there and nothing is left).
* **reconcile** lists the shards lacking a commit marker ``out/<H>/<k>.done`` into ``missing.json`` (the
  repair round's manifest). The workflow runs one repair round (no loops in the plan vocabulary).
* **commit** fails naming the shards still missing, else merges every shard's embeddings in input order
  into the output Parquet (``id`` and ``embedding`` fixed_size_list<float32>[dim], with the model, width
  and config in its metadata) plus a manifest (which holds the workers'
  reports), and writes the result (with the batches' padding fraction and the workers' compute seconds).
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

import numpy as np

from shardfold.functions import store
from shardfold.functions.errors import ShardfoldError
from shardfold.functions.inference import shards as layout
from shardfold.functions.inference.preprocess import decode_shard, encode_shard, read_shard
from shardfold.functions.inference.shards import STAGE, load_plan, output_uri, prepare
from shardfold.functions.inference.spec import InferenceJob
from shardfold.functions.jobs import scratch_key
from shardfold.functions.log import logger
from shardfold.functions.manifest import manifest_ref
from shardfold.functions.store.uri import join

__all__ = ["commit", "cpu_done", "missing_shards", "prepare", "preprocess", "progress", "reconcile"]


class MissingShards(ShardfoldError):
    """Commit found shards without a commit marker after the repair round."""


def preprocess(spec: InferenceJob, job_id: str, store_root: str, shard: int) -> dict[str, Any]:
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
    wrote = store.put_if_absent(uri, encode_shard(rows, spec.max_tokens))
    return {"shard": shard, "rows": len(rows.texts), "skipped": len(rows.skipped), "cached": not wrote}


def cpu_done(spec: InferenceJob, job_id: str, store_root: str) -> dict[str, Any]:
    """Mark the CPU stage finished (every shard's preprocess task returned)."""
    p = load_plan(store_root, job_id)
    store.put_json(layout.cpu_done_uri(store_root, job_id), {"shards": len(p["shards"])})
    return {"shards": len(p["shards"])}


def missing_shards(store_root: str, job_id: str, p: dict[str, Any]) -> list[int]:
    """Shards of the plan lacking a commit marker for its config hash, ascending."""
    prefix = layout.out_prefix(store_root, job_id, p["config_hash"])
    done = {layout.shard_of(u) for u in store.list_uris(prefix) if u.endswith(".done")}
    return [s["shard"] for s in p["shards"] if s["shard"] not in done]


def progress(store_root: str, job_id: str) -> dict[str, dict[str, int]]:
    """Shards embedded so far (commit markers) of the planned shards: the GPU workers' progress, which an
    executor sees only as one running step. Empty until the plan exists; from the result once the job has
    it (its scratch, the markers included, is gone then)."""
    result_uri = join(store_root, "jobs", job_id, "result.json")
    if store.exists(result_uri):
        shards = int(store.get_json(result_uri)["shards"])
        return {"embedded_shards": {"done": shards, "total": shards}}
    if not store.exists(layout.plan_uri(store_root, job_id)):
        return {}
    p = load_plan(store_root, job_id)
    done = len(p["shards"]) - len(missing_shards(store_root, job_id, p))
    return {"embedded_shards": {"done": done, "total": len(p["shards"])}}


def reconcile(spec: InferenceJob, job_id: str, store_root: str) -> dict[str, Any]:
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
        "missing": manifest_ref(uri, len(missing)),
        "repair_workers": manifest_ref(r_uri, len(repair)),
        "count": len(missing),
        "first": missing[:20],
    }


def _load_out(store_root: str, job_id: str, h: str, shard: int, rows: int) -> np.ndarray:
    emb = layout.load_arrays(store.get(layout.out_uri(store_root, job_id, h, shard)))
    if emb.ndim != 2 or emb.shape[0] != rows:
        raise ShardfoldError(f"shard {shard}: embeddings of shape {emb.shape}, expected {rows} rows")
    return emb.astype(np.float32, copy=False)


def _output_metadata(plan: dict[str, Any], dim: int | None) -> dict[str, str]:
    """What the output Parquet says of itself: the model, the vectors' width, the config hash and config."""
    config = plan.get("config") or {}
    model = config.get("model")
    return {
        "shardfold.model": model if isinstance(model, str) else json.dumps(model, sort_keys=True),
        "shardfold.dim": str(dim or 0),
        "shardfold.config_hash": str(plan.get("config_hash", "")),
        "shardfold.config": json.dumps(config, sort_keys=True),
    }


def worker_reports(store_root: str, job_id: str) -> list[dict[str, Any]]:
    """Every worker's summary (``workers/<attempt>/<name>.json``), by attempt and name."""
    prefix = layout.worker_reports_prefix(store_root, job_id) + "/"
    return [store.get_json(u) for u in sorted(store.list_uris(prefix)) if u.endswith(".json")]


def _batching_summary(workers: list[dict[str, Any]]) -> dict[str, Any]:
    """What the result says of the GPU stage: the workers that reported (a killed worker does not), the
    padding fraction over all their batches, and their embedding seconds."""
    real = sum(w.get("real_tokens", 0) for w in workers)
    padded = sum(w.get("padded_tokens", 0) for w in workers)
    return {
        "workers": len(workers),
        "padding_fraction": round(1 - real / padded, 4) if padded else 0.0,
        "compute_s": round(sum(w.get("compute_s", 0.0) for w in workers), 3),
    }


def commit(spec: InferenceJob, job_id: str, store_root: str) -> dict[str, Any]:
    """Merge every shard's embeddings in input order into the output Parquet and write the result."""
    import pyarrow as pa
    import pyarrow.parquet as pq

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
    shards = [decode_shard(store.get(layout.pre_uri(store_root, job_id, h, s["shard"]))) for s in p["shards"]]
    string_ids = any(sh["ids"].dtype.kind == "U" for sh in shards)
    id_type = pa.string() if string_ids else pa.int64()
    out = output_uri(spec, store_root, job_id)
    skipped: list[dict[str, Any]] = []
    rows, dim, writer = 0, None, None
    with tempfile.TemporaryFile() as f:
        for s, sh in zip(p["shards"], shards, strict=True):
            skipped.extend(sh["skipped"])
            n = len(sh["row_index"])
            if not np.all(np.diff(sh["row_index"]) > 0):
                raise ShardfoldError(f"shard {s['shard']}: rows out of input order in its preprocessed file")
            emb = _load_out(store_root, job_id, h, s["shard"], n)
            if dim is None and n:
                dim = emb.shape[1]
            elif n and emb.shape[1] != dim:
                raise ShardfoldError(f"shard {s['shard']}: embedding width {emb.shape[1]}, others {dim}")
            if not n:  # an empty shard adds no rows (and cannot say the width)
                continue
            ids = sh["ids"].astype(str) if string_ids else sh["ids"]
            values = pa.array(emb.reshape(-1), type=pa.float32())
            # a fixed-size list (Arrow): pyarrow and pandas read one vector per row; DuckDB casts FLOAT[dim]
            embedding = pa.FixedSizeListArray.from_arrays(values, dim)
            table = pa.table({"id": pa.array(ids, type=id_type), "embedding": embedding})
            if writer is None:
                writer = pq.ParquetWriter(f, table.schema.with_metadata(_output_metadata(p, dim)))
            writer.write_table(table)
            rows += n
        if writer is None:  # no rows at all: an empty table of the same columns
            empty = pa.table(
                {"id": pa.array([], type=id_type), "embedding": pa.array([], pa.list_(pa.float32()))}
            )
            writer = pq.ParquetWriter(f, empty.schema.with_metadata(_output_metadata(p, dim)))
            writer.write_table(empty)
        writer.close()
        f.seek(0)
        store.put_file(out, f)
    workers = worker_reports(store_root, job_id)
    manifest = {
        "workers": workers,
        "output": out,
        "rows": rows,
        "dim": dim,
        "config_hash": h,
        "config": p["config"],
        "inputs": list(spec.inputs),
        "shards": len(p["shards"]),
        "skipped": skipped,
    }
    manifest_out = (
        out.rsplit(".", 1)[0] + ".manifest.json" if out.endswith(".parquet") else out + ".manifest.json"
    )
    store.put(manifest_out, json.dumps(manifest, sort_keys=True, indent=1).encode())
    result = {
        "job_id": job_id,
        "kind": "inference",
        "output": out,
        "manifest": manifest_out,
        "rows": rows,
        "dim": dim,
        "skipped": len(skipped),
        "shards": len(p["shards"]),
        "config_hash": h,
        **_batching_summary(workers),
    }
    store.put_json(result_uri, result)
    # the preprocessed and embedded shards, claims and worker reports (the manifest holds the reports)
    store.delete_prefix(join(store_root, scratch_key(job_id, STAGE)))
    logger.info("committed inference", extra={k: v for k, v in result.items() if k != "job_id"})
    return result
