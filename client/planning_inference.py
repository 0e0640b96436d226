"""``shardfold plan`` for inference jobs: the job's own shard list, CPU tasks, the GPU job, per-task memory.

The estimate counts rows exactly as the job's plan step does (:func:`functions.inference.plan.make_shards`:
a JSONL file is read once to index its lines, a Parquet file's footer gives its row count), so the shard
count and the number of CPU tasks are the ones the job will have. An input that is missing or unreadable
does not stop the estimate: a note names it, and the job would fail at its plan step naming it too.

Per-task memory is a model, not a measurement: a preprocess task holds one shard's text and its token ids
(int32, at most ``max_tokens`` per row) on top of the tokenizer runtime; the worker holds the model, a
bounded prefetch of preprocessed shards and one batch's activations; commit holds the preprocessed shards'
ids and streams embeddings to Parquet one shard at a time.
"""

from __future__ import annotations

from typing import Any

from client import pricing
from client.planning import DetailTable, KindEstimate, MiB, TaskLoad, estimator, map_names_for

RUNTIME_BYTES = 200 * MiB  # Python + pyarrow + tokenizers in a preprocess/commit task
WORKER_RUNTIME_BYTES = 1536 * MiB  # torch + transformers + the model
TEXT_BYTES_PER_ROW = 1024  # assumed when the inputs cannot be read
EMBED_DIM = 384  # all-MiniLM-L6-v2; a user model's width is not known before it runs
HIDDEN_LAYERS_LIVE = 4  # activations of a few layers live at once in inference mode
PREFETCH_SHARDS = 2
CPU_TOKENS_PER_S = 2_000_000  # tokenizers (Rust) on one Lambda vCPU, order of magnitude
GPU_ROWS_PER_S = 2000  # MiniLM on one A10G, order of magnitude, for the duration estimate only


def _shards(spec: Any, store_root: str) -> tuple[list[dict[str, Any]], list[str]]:
    from functions.inference.plan import make_shards

    try:
        return make_shards(spec, store_root), []
    except Exception as exc:  # noqa: BLE001 - any unreadable input becomes a note, as in the other kinds
        return [], [f"{exc}: the job will fail at its plan step; rows and shards are not known"]


@estimator("inference")
def estimate_inference(spec: Any, store_root: str, probe_limit: int) -> KindEstimate:
    shards, notes = _shards(spec, store_root)
    n_shards = max(1, len(shards))
    rows = sum(s["rows"] for s in shards) if shards else spec.shard_rows
    shard_rows = max((s["rows"] for s in shards), default=spec.shard_rows)
    shard_text = (
        max(
            ((s.get("byte_end", 0) - s.get("byte_start", 0)) for s in shards),
            default=shard_rows * TEXT_BYTES_PER_ROW,
        )
        or shard_rows * TEXT_BYTES_PER_ROW
    )
    shard_tokens = shard_rows * spec.max_tokens
    pre_bytes = shard_tokens * 4 + shard_rows * 3 * 8  # input_ids int32 + offsets, row_index, ids
    preprocess_peak = RUNTIME_BYTES + 3 * shard_text + 3 * pre_bytes  # text, encodings, npz buffer
    batch_act = spec.batch_tokens * EMBED_DIM * 4 * HIDDEN_LAYERS_LIVE * 4  # hidden + FFN (4x) widths
    worker_peak = WORKER_RUNTIME_BYTES + (PREFETCH_SHARDS + 1) * pre_bytes + batch_act
    out_bytes = rows * EMBED_DIM * 4
    commit_peak = RUNTIME_BYTES + n_shards * shard_rows * 16 + 3 * shard_rows * EMBED_DIM * 4
    cpu_s = pricing.TASK_OVERHEAD_S + shard_tokens / CPU_TOKENS_PER_S
    workers = max(1, min(spec.gpu_workers, n_shards))
    gpu_s = rows / GPU_ROWS_PER_S / workers  # per worker: the shards are shared out by claims
    loads = {
        "plan": TaskLoad(
            peak_bytes=RUNTIME_BYTES + 24 * rows,
            gets=len(spec.inputs),
            puts=2,
            duration_s=pricing.TASK_OVERHEAD_S,
        ),
        "preprocess": TaskLoad(peak_bytes=preprocess_peak, gets=3, puts=1, duration_s=cpu_s),
        "cpu_done": TaskLoad(peak_bytes=RUNTIME_BYTES, gets=1, puts=1, duration_s=pricing.TASK_OVERHEAD_S),
        "reconcile": TaskLoad(peak_bytes=RUNTIME_BYTES, gets=2, puts=1, duration_s=pricing.TASK_OVERHEAD_S),
        "worker": TaskLoad(
            peak_bytes=worker_peak,
            gets=2 * -(-n_shards // workers) + 2,
            puts=3 * -(-n_shards // workers),
            duration_s=gpu_s,
        ),
        "commit": TaskLoad(
            peak_bytes=commit_peak,
            gets=2 * n_shards + 2,
            puts=3,
            duration_s=pricing.TASK_OVERHEAD_S + out_bytes / pricing.LAMBDA_NET_BYTES_PER_S,
        ),
    }
    map_items = map_names_for("inference", n_shards)
    map_items["repair_preprocess"] = 0  # a clean run repairs nothing
    map_items["infer_workers"] = workers
    notes.append(
        f"GPU stage: {workers} AWS Batch job(s) of 1 GPU, ~{gpu_s:,.0f} s each at ~{GPU_ROWS_PER_S} rows/s "
        "for MiniLM "
        f"(order of magnitude), priced as g5.xlarge on-demand (${pricing.BATCH_GPU_USD_PER_HOUR}/h) with "
        f"~{pricing.BATCH_STARTUP_S:.0f} s of instance start per Batch job (the repair round's job too); "
        "the default Spot compute environment usually costs far less"
    )
    notes.append("repair round: runs only for shards lacking a commit marker (none in a clean run)")
    details = [
        DetailTable(
            title="inference plan",
            columns=["rows", "shards", "CPU tasks", "GPU jobs", "preprocess MiB", "worker MiB", "commit MiB"],
            rows=[
                [
                    rows,
                    n_shards,
                    n_shards,
                    f"{workers} Batch job(s), 1 GPU each",
                    round(preprocess_peak / MiB),
                    round(worker_peak / MiB),
                    round(commit_peak / MiB),
                ]
            ],
        )
    ]
    return KindEstimate(
        items=rows,
        loads=loads,
        map_items=map_items,
        notes=notes,
        output_bytes=out_bytes,
        details=details,
    )
