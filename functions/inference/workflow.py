"""The inference workflow: prepare → Parallel(CPU Map + cpu_done | GPU workers) → reconcile → repair → commit.

The CPU branch tokenizes shards (one Lambda task each) while the GPU branch's workers (``gpu_workers`` AWS
Batch jobs, ``python -m functions.inference.worker``) claim each shard as soon as its preprocessed file
appears, so the two stages overlap. A worker that dies fails only itself unless every worker does: the
shards it held are left to the repair round. ``reconcile`` lists the shards lacking a commit marker; one
bounded repair round re-runs only those (their CPU tasks are no-ops where the preprocessed shard survived;
its GPU job is a Map of one child when shards are missing and of none otherwise, so a clean run submits
no repair job). The plan vocabulary has no loops, so the repair
round is a fixed pair of steps; ``commit`` fails naming any shard still missing, and resuming the job
repeats only that.

The kind deploys as container-image Lambda functions (``lambda_package="image"``): prepare, preprocess and
commit read and write Parquet with pyarrow, which is image-only (infra/package.py IMAGE_ONLY).
"""

from __future__ import annotations

from shardfold.functions.workflow import BatchJob, Map, Parallel, Task, Workflow

WORKER = dict(entry_point="inference.worker", vcpus=4, memory_mb=15000, gpus=1, timeout_s=4 * 3600)

PREPARE = Task("prepare", "inference.prepare", memory_mb=1024, timeout_s=900)
PREPROCESS_SHARD = Task(
    "preprocess_shard", "inference.preprocess", mode="process", memory_mb=2048, timeout_s=900
)
PREPROCESS = Map("preprocess", items="$.prepare.worklist", body=(PREPROCESS_SHARD,), max_concurrency=64)
CPU_DONE = Task("cpu_done", "inference.cpu_done", memory_mb=512, timeout_s=60)
INFER = BatchJob("infer", **WORKER)
# One Batch job per GPU worker (the spec's gpu_workers); they claim shards side by side. The stage fails only
# when every worker failed: a lost worker's shards go to repair.
INFER_WORKERS = Map(
    "infer_workers", items="$.prepare.workers", body=(INFER,), tolerated_failure_percentage=99
)
STAGES = Parallel("stages", branches=((PREPROCESS, CPU_DONE), (INFER_WORKERS,)))
RECONCILE = Task("reconcile", "inference.reconcile", memory_mb=512, timeout_s=300)
REPAIR_PREPROCESS_SHARD = Task(
    "repair_preprocess_shard", "inference.preprocess", mode="process", memory_mb=2048, timeout_s=900
)
REPAIR_PREPROCESS = Map(
    "repair_preprocess", items="$.reconcile.missing", body=(REPAIR_PREPROCESS_SHARD,), max_concurrency=64
)
REPAIR_INFER = BatchJob("repair_infer", **WORKER)
# A Map of one GPU job when shards are missing and of none otherwise: a clean run submits no repair job
REPAIR_WORKERS = Map("repair_workers", items="$.reconcile.repair_workers", body=(REPAIR_INFER,))
COMMIT = Task("commit", "inference.commit", memory_mb=3008, timeout_s=900)

WORKFLOW = Workflow(
    kind="inference",
    comment="Streaming batch inference: CPU tokenization overlapped with GPU inference",
    lambda_package="image",
    steps=(PREPARE, STAGES, RECONCILE, REPAIR_PREPROCESS, REPAIR_WORKERS, COMMIT),
)
