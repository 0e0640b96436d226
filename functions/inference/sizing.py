"""Task loads of an inference job: shards, CPU tasks, the GPU workers, per-task memory.

* **probe**: the inputs' row counts and bytes per row. Within the byte budget they are exact, as the job's
  prepare step counts them (:func:`functions.inference.shards.make_shards`: a JSONL file's lines, a Parquet
  footer's row count); beyond it (a submit reads at most 1 MiB) a JSONL file's rows are extrapolated from
  its first bytes and its size, and a Parquet file's footer is read. An input that is missing or unreadable
  becomes a note: the job fails at its prepare step naming it.
* **loads**: a preprocess task holds one shard's text and its token ids (int32, at most
  ``max_input_tokens`` per row) on top of the tokenizer runtime; the worker holds the model (a Hugging Face
  folder's weights as loaded, twice over while they load), for generate every running sequence's keys and
  values, a bounded prefetch of preprocessed
  shards and, on a CPU, one batch's activations; commit streams the output to the store two shards at a
  time (one written, the next read), and prepare scans a JSONL input a chunk at a time, keeping each
  shard's byte range: neither grows with the rows.

The worker's host memory depends on where it runs (the probe's ``worker_device``): on AWS (an ``s3://``
store) it is a Batch job with a GPU, locally it is this machine's GPU if it has one, else its CPU. On a GPU
the CUDA context takes host memory and the activations live on the device; on a CPU the activations are
host memory, under the worker's CPU token budget (:data:`functions.inference.worker.CPU_BATCH_TOKENS`).
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from shardfold.functions import access, pricing, store
from shardfold.functions.errors import ObjectNotFound, SpecError
from shardfold.functions.estimate import Loads, MiB, Probe, ProbeBudget, TaskLoad
from shardfold.functions.inference import workflow as wf
from shardfold.functions.inference.shards import READ_CHUNK
from shardfold.functions.inference.spec import HFModel, InferenceSpec, inference_input_format
from shardfold.functions.inference.worker import CPU_BATCH_TOKENS, PREFETCH
from shardfold.functions.store.uri import is_s3
from shardfold.functions.tables import Table

RUNTIME_BYTES = 200 * MiB  # Python + pyarrow + tokenizers in a preprocess/commit task
# prepare (JSONL inputs), cpu_done and reconcile import neither pyarrow nor tokenizers: the bare runtime
# (65 MiB measured without boto3; tests/test_memory.py)
BASE_RUNTIME_BYTES = pricing.LAMBDA_BASELINE_MB * MiB
# torch + transformers + MiniLM loaded on the host: 470 MiB measured on a CPU (tests/test_memory.py)
WORKER_RUNTIME_BYTES = 512 * MiB
# What a GPU worker's process adds on the host: the CUDA context and the kernels of cuBLAS/cuDNN (assumed,
# not measured here; the activations themselves live on the device).
CUDA_HOST_BYTES = 1024 * MiB
# A CPU worker's activations and what the allocator keeps of them, per token of its batch budget: ~210 MiB
# measured above the loaded model for MiniLM's 2,048-token CPU batches of mixed lengths (tests/test_memory.py)
CPU_BYTES_PER_BATCH_TOKEN = 112 * 1024
TEXT_BYTES_PER_ROW = 1024  # assumed when the inputs cannot be read
EMBED_DIM = 384  # all-MiniLM-L6-v2; a user model's width is not known before it runs
MODEL_LOAD_FACTOR = 2  # a user model's peak while loading, per byte of its file (see loads)
PREFETCH_SHARDS = PREFETCH  # claimed shards read ahead of the one being embedded
CPU_TOKENS_PER_S = 2_000_000  # tokenizers (Rust) on one Lambda vCPU, order of magnitude
GPU_ROWS_PER_S = 2000  # MiniLM on one A10G, order of magnitude, for the duration estimate only


# prepare scans a JSONL input in READ_CHUNK reads (the chunk, the line being checked, the next read's
# buffer) and keeps an entry per shard (its dict and its share of plan.json's text)
PLAN_READ_CHUNKS = 3
PLAN_BYTES_PER_SHARD = 2048


def _input_rows(uri: str, fmt: str, head_bytes: int) -> tuple[int, int, bool]:
    """(rows, bytes, exact) of one input, reading at most ``head_bytes`` of a JSONL file."""
    from shardfold.functions.inference.shards import jsonl_lines, parquet_num_rows

    size = store.size(uri)
    if fmt == "parquet":
        return parquet_num_rows(uri), size, True
    if size <= head_bytes:
        return sum(1 for _ in jsonl_lines(uri)), size, True
    head = store.get(uri, 0, head_bytes)
    lines = max(1, head.count(b"\n"))
    return max(lines, round(lines * size / len(head))), size, False


FIRST_ROW_BYTES = 16 * 1024  # what submit reads of a JSONL input to find its first row's keys


def _refuse_absent_fields(spec: InferenceSpec, uri: str, fmt: str | None, i: int) -> None:
    """At submit: a column the spec reads (``field``, ``pair_field``, ``id_field``) that no row of input
    ``i`` can have (a Parquet schema without it), or that its first JSONL row lacks when a bad row fails
    the job (``on_bad_row: fail``), is refused naming the field and the columns there are."""
    wanted = {
        k: v
        for k, v in (("field", spec.field), ("pair_field", spec.pair_field), ("id_field", spec.id_field))
        if v
    }
    if not wanted:
        return
    if fmt == "parquet":
        from shardfold.functions.inference.shards import open_parquet

        have = list(open_parquet(uri, f"inputs.{i}").schema_arrow.names)
        where = "its columns"
    elif fmt == "jsonl" and spec.on_bad_row == "fail":
        from shardfold.functions import jsontext

        size = store.size(uri)
        text = store.get(uri, 0, min(size, FIRST_ROW_BYTES))
        if b"\n" not in text and size > FIRST_ROW_BYTES:
            return  # a first row longer than that: the job reads it
        first = text.split(b"\n", 1)[0]
        try:
            row = jsontext.loads(first)
        except ValueError:
            return  # a bad first line is the job's to report, with its line number
        if not isinstance(row, dict):
            return
        have = list(row)
        where = "the keys of its first row"
    else:
        return
    for name, column in wanted.items():
        if column not in have:
            shown = ", ".join(repr(c) for c in have[:30]) + (", ..." if len(have) > 30 else "")
            msg = f"inputs.{i} has no {column!r} ({where}: {shown})"
            raise SpecError(f"{name}: {msg}", [{"field": name, "error": msg}])


def probe(spec: InferenceSpec, store_root: str, budget: ProbeBudget) -> Probe:
    notes: list[str] = []
    inputs = []
    probed = max(1, min(len(spec.inputs), budget.objects))
    # at submit each input's first row is read too (FIRST_ROW_BYTES): the budget holds both
    head = max(64 * 1024, budget.data_bytes // probed - (FIRST_ROW_BYTES if budget.refuse else 0))
    for i, raw in enumerate(spec.inputs[: budget.objects]):
        try:
            uri = access.input_uri(raw, store_root, f"inputs.{i}")
            rows, size, exact = _input_rows(uri, inference_input_format(raw), head)
        except ObjectNotFound as exc:
            if budget.refuse:  # at submit: the job's prepare step would fail on it
                raise SpecError(f"inputs.{i}: {exc}", [{"field": f"inputs.{i}", "error": str(exc)}]) from exc
            notes.append(
                f"inputs.{i} {raw}: {exc}: the job will fail at its prepare step; rows are not known"
            )
            continue
        except Exception as exc:  # noqa: BLE001 - any unreadable input becomes a note, as in the other kinds
            notes.append(
                f"inputs.{i} {raw}: {exc}: the job will fail at its prepare step; rows are not known"
            )
            continue
        inputs.append({"rows": rows, "bytes": size, "exact": exact})
        if budget.refuse:
            _refuse_absent_fields(spec, uri, inference_input_format(raw), i)
    if len(spec.inputs) > budget.objects:
        notes.append(f"{budget.objects} of {len(spec.inputs)} inputs probed; the rest assumed alike")
    model_bytes = 0  # the built-in MiniLM's are in WORKER_RUNTIME_BYTES
    folder: dict[str, Any] = {}
    if isinstance(spec.model, HFModel):
        folder = _folder_facts(spec, store_root)  # a folder that cannot do the task is refused here
        model_bytes = folder["bytes"]
    elif spec.model != "minilm":
        try:
            model_bytes = store.size(
                access.input_uri(spec.model.torchscript, store_root, "model.torchscript")
            )
        except Exception as exc:  # noqa: BLE001 - as for an input: the job fails at prepare, naming it
            notes.append(f"model.torchscript {spec.model.torchscript}: {exc}: its size is not known")
    if any(not x["exact"] for x in inputs):
        notes.append("row counts of large JSONL inputs extrapolated from their first bytes")
    facts = {
        "inputs": inputs,
        "probed": len(inputs),
        "of": len(spec.inputs),
        "worker_device": worker_device(store_root),
        "model_bytes": model_bytes,
        "folder": folder,
    }
    return Probe(facts=facts, notes=notes)


def _folder_facts(spec: InferenceSpec, store_root: str) -> dict[str, Any]:
    """What the plan needs of a Hugging Face folder: its weights' bytes as loaded (the spec's dtype), and
    for generate each token's key/value bytes and the hidden width; :class:`SpecError` naming ``model.hf``
    or ``task`` when the folder cannot do the job."""
    from shardfold.functions.inference import hf

    assert isinstance(spec.model, HFModel)
    folder = hf.list_folder(access.input_uri(spec.model.hf, store_root, "model.hf"))
    sizes = store.sizes(list(folder.files.values()))
    facts = hf.facts(folder, hf.read_json(folder, "config.json"), sizes)
    hf.check_task(spec.task, facts, spec.model.hf)
    loaded = facts.bytes_as(spec.model.dtype)
    element = loaded / max(1, facts.weight_bytes) * hf.DTYPE_BYTES.get(facts.dtype, 4)
    return {
        "bytes": loaded,
        "kv_bytes_per_token": int(2 * facts.layers * facts.kv_dim * element),
        "hidden": facts.hidden,
        "input_tokens": hf.input_tokens(spec.max_input_tokens, facts, spec.task),
    }


def worker_device(store_root: str) -> str:
    """Where the GPU stage's worker will run: ``"cuda"`` on AWS (an ``s3://`` store: a Batch job with one
    GPU) or on a machine with a visible NVIDIA GPU (the worker uses cuda when torch sees one), else
    ``"cpu"``. Read without torch, which the Lambda package does not have."""
    if is_s3(store_root):
        return "cuda"
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return "cpu"
    gpus = Path("/proc/driver/nvidia/gpus")
    return "cuda" if gpus.is_dir() and any(gpus.iterdir()) else "cpu"


def loads(spec: InferenceSpec, probed: Probe) -> Loads:
    n_shards, rows, shard_rows, shard_text = _shards(spec, probed.facts)
    shard_tokens = shard_rows * spec.max_input_tokens
    pre_bytes = shard_tokens * 4 + shard_rows * 3 * 8  # input_ids int32 + offsets, row_index, ids
    out_bytes = rows * EMBED_DIM * 4
    workers = max(1, min(spec.gpu_workers, n_shards))
    gpu_s = rows / GPU_ROWS_PER_S / workers  # per worker: the shards are shared out by claims
    # pyarrow is imported only to read Parquet inputs' footers
    parquet = any(inference_input_format(u) == "parquet" for u in spec.inputs)
    plan = TaskLoad(
        RUNTIME_BYTES if parquet else BASE_RUNTIME_BYTES,
        {
            f"an input's {READ_CHUNK // MiB} MiB reads": PLAN_READ_CHUNKS * READ_CHUNK,
            f"{n_shards:,} shards' entries": n_shards * PLAN_BYTES_PER_SHARD,
        },
        gets=len(spec.inputs),
        puts=2,
        duration_s=pricing.TASK_OVERHEAD_S,
    )
    preprocess = TaskLoad(
        RUNTIME_BYTES,  # with the tokenizer; the text, its encodings and the npz buffer: 3 copies each
        {"3 copies of a shard's text": 3 * shard_text, "3 copies of its token ids": 3 * pre_bytes},
        gets=3,
        puts=1,
        duration_s=pricing.TASK_OVERHEAD_S + shard_tokens / CPU_TOKENS_PER_S,
    )
    small = TaskLoad(RUNTIME_BYTES, gets=1, puts=1, duration_s=pricing.TASK_OVERHEAD_S)
    worker = TaskLoad(
        WORKER_RUNTIME_BYTES,  # torch, transformers and MiniLM
        _worker_buffers(spec, probed.facts, pre_bytes, shard_rows),
        gets=2 * -(-n_shards // workers) + 2,
        puts=3 * -(-n_shards // workers),
        duration_s=gpu_s,
    )
    # two shards at a time (one written while the next is read): each one's preprocessed file, and its
    # output as read (the .npz bytes and the arrays) and as Parquet (Arrow columns and the encoded row group)
    commit = TaskLoad(
        RUNTIME_BYTES,
        {
            "two shards' preprocessed files": 2 * pre_bytes,
            "their outputs as read and as Parquet row groups": 2 * 4 * shard_rows * EMBED_DIM * 4,
        },
        gets=2 * n_shards + 2,
        puts=3,
        duration_s=pricing.TASK_OVERHEAD_S + 2 * out_bytes / pricing.LAMBDA_NET_BYTES_PER_S,  # read, write
    )
    tasks = {
        wf.PREPARE: plan,
        wf.PREPROCESS_SHARD: preprocess,
        wf.CPU_DONE: small,
        wf.INFER: worker,
        wf.RECONCILE: replace(small, gets=2),
        wf.REPAIR_PREPROCESS_SHARD: preprocess,
        wf.REPAIR_INFER: worker,
        wf.COMMIT: commit,
    }
    # a clean run repairs nothing: the repair round's Maps have no children, so no repair job starts
    map_items = {
        wf.PREPROCESS: n_shards,
        wf.INFER_WORKERS: workers,
        wf.REPAIR_PREPROCESS: 0,
        wf.REPAIR_WORKERS: 0,
    }
    columns = ["rows", "shards", "CPU tasks", "GPU jobs", "preprocess MiB", "worker MiB", "commit MiB"]
    peaks = [round(t.peak_bytes / MiB) for t in (preprocess, worker, commit)]
    row = [rows, n_shards, n_shards, f"{workers} Batch job(s), 1 GPU each", *peaks]
    return Loads(
        items=rows,
        tasks=tasks,
        map_items=map_items,
        notes=_notes(spec, workers, gpu_s),
        output_bytes=out_bytes,
        details=[Table("inference plan", columns, [row])],
    )


def _shards(spec: InferenceSpec, facts: dict[str, Any]) -> tuple[int, int, int, int]:
    """(shards, rows, the largest shard's rows and text bytes): the inputs not probed like those probed."""
    inputs = facts["inputs"]
    if not inputs:
        return 1, spec.shard_rows, spec.shard_rows, spec.shard_rows * TEXT_BYTES_PER_ROW
    scale = facts["of"] / len(inputs)
    per_input = [x["rows"] for x in inputs]
    n_shards = max(1, round(scale * sum(math.ceil(r / spec.shard_rows) for r in per_input)))
    shard_rows = min(spec.shard_rows, max(per_input))
    bytes_per_row = max(x["bytes"] / max(1, x["rows"]) for x in inputs)
    return n_shards, round(scale * sum(per_input)), shard_rows, int(shard_rows * bytes_per_row)


def _worker_buffers(spec: InferenceSpec, facts: dict[str, Any], pre_bytes: int, shard_rows: int) -> dict:
    """What the worker holds on the host besides its runtime: shards, outputs, a user's model as it loads, a
    generator's keys and values, and on a GPU the CUDA context, on a CPU one batch's activations."""
    folder = facts.get("folder") or {}
    buffers = {
        f"{PREFETCH_SHARDS + 1} preprocessed shards": (PREFETCH_SHARDS + 1) * pre_bytes,
        # a shard's output being committed (the array, its .npy buffer and bytes) while the next one's fills
        "the outputs being written and filled": 4 * shard_rows * EMBED_DIM * 4,
        # a user's model: its file's bytes, held while torch builds its tensors from them (float32, as the
        # worker runs it), so twice the file at the load's peak (a 1 GiB file took a worker to 1.3 GiB
        # before it failed to load)
        "the model twice over as it loads": MODEL_LOAD_FACTOR * facts.get("model_bytes", 0),
    }
    gen = spec.generation
    if spec.task == "generate" and folder and gen is not None:
        # every running sequence's keys and values at their longest, twice while a joiner's are merged in
        kv = 2 * gen.max_num_seqs * (folder["input_tokens"] + gen.max_tokens) * folder["kv_bytes_per_token"]
        buffers[f"keys and values for {gen.max_num_seqs} sequences"] = kv
    if facts.get("worker_device", "cuda") == "cpu":
        budget = min(spec.batch_tokens, CPU_BATCH_TOKENS)
        width = max(1.0, folder.get("hidden", EMBED_DIM) / EMBED_DIM)  # activations scale with the width
        activations = int(budget * CPU_BYTES_PER_BATCH_TOKEN * width)
        return {**buffers, f"one {budget:,}-token CPU batch's activations": activations}
    return {"the CUDA context on the host (the activations live on the GPU)": CUDA_HOST_BYTES, **buffers}


def _notes(spec: InferenceSpec, workers: int, gpu_s: float) -> list[str]:
    """The GPU stage's jobs and pricing, and the repair round's."""
    rate = (
        f"~{gpu_s:,.0f} s each at ~{GPU_ROWS_PER_S} rows/s for MiniLM (order of magnitude)"
        if spec.model == "minilm"
        else f"timed as if at MiniLM's ~{GPU_ROWS_PER_S} rows/s (~{gpu_s:,.0f} s each): this model's "
        "speed is not known before it runs"
    )
    return [
        f"GPU stage: {workers} AWS Batch job(s) of 1 GPU, {rate}, priced as g5.xlarge on-demand "
        f"(${pricing.BATCH_GPU_USD_PER_HOUR}/h) with "
        f"~{pricing.BATCH_STARTUP_S:.0f} s of instance start per Batch job; "
        "the default Spot compute environment usually costs far less",
        "repair round (not priced): only for shards lacking a commit marker, none in a clean run; then one "
        f"more Batch job of 1 GPU (~{pricing.BATCH_STARTUP_S:.0f} s of instance start), a CPU task per shard",
    ]
