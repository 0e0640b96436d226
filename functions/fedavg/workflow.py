"""The fedavg workflow: await_updates → prepare → Map(norms) → clip → Map(aggregate one shard each) → commit
(GradsSharding).

norms and clip are DP-FedAvg's (:mod:`functions.fedavg.dp`): each norms task reads its shard from every
client once to sum each client's squared update there, and clip turns the sums into clip factors. A round
without DP runs them empty: a Map of no items and a clip task that returns at once.

The prepare step reads every client's safetensors header, checks them and writes the shard work list
(Distributed Map's ``ItemReader`` reads it on AWS); each aggregate task streams one byte range of the model
from all N clients and writes one part; commit joins the parts server-side into one safetensors object. Only
references cross the control plane.
"""

from __future__ import annotations

from shardfold.functions.fedavg.shardplan import (
    AGGREGATE_MEMORY_MB,
    COMMIT_MEMORY_MB,
    LAMBDA_TIMEOUT_S,
    PLAN_MEMORY_MB,
)
from shardfold.functions.workflow import Map, Task, Workflow

# aggregate is CPU-bound once its reads overlap (a process locally; 1769 MB = one full vCPU on Lambda). Its
# memory does not grow with N or the model size; the prepare step sizes shards to the 900 s timeout.
# A round that waits for late updates (wait_s) looks for them every few seconds, the waits between looks the
# state machine's (a Wait state): no Lambda is billed while the round waits. Without wait_s: one call that
# returns at once. prepare then reads the headers in well under 300 s.
AWAIT_UPDATES = Task(
    "await_updates", "fedavg.await_updates", memory_mb=PLAN_MEMORY_MB, timeout_s=300, poll=True
)
PREPARE = Task("prepare", "fedavg.prepare", memory_mb=PLAN_MEMORY_MB, timeout_s=300)
AGGREGATE_SHARD = Task(
    "aggregate_shard",
    "fedavg.aggregate",
    mode="process",
    memory_mb=AGGREGATE_MEMORY_MB,
    timeout_s=LAMBDA_TIMEOUT_S,
)
# DP-FedAvg's first pass (each client's squared norm, shard by shard) and its clip factors; for a round
# without DP the norms work list is empty and clip returns at once.
NORMS_SHARD = Task(
    "norms_shard", "fedavg.norms", mode="process", memory_mb=AGGREGATE_MEMORY_MB, timeout_s=LAMBDA_TIMEOUT_S
)
NORMS = Map("norms", items="$.prepare.norms", body=(NORMS_SHARD,))
CLIP = Task("clip", "fedavg.clip", memory_mb=COMMIT_MEMORY_MB, timeout_s=300)
AGGREGATE = Map("aggregate", items="$.prepare.worklist", body=(AGGREGATE_SHARD,))
COMMIT = Task("commit", "fedavg.commit", memory_mb=COMMIT_MEMORY_MB, timeout_s=LAMBDA_TIMEOUT_S)
# When a step fails: a DP round's clip factors (each client's exact update norm) are not kept for `clean`
SCRUB = Task("scrub", "fedavg.scrub", memory_mb=COMMIT_MEMORY_MB, timeout_s=300)

WORKFLOW = Workflow(
    kind="fedavg",
    comment="FedAvg: N client updates averaged shard by shard into one safetensors file",
    steps=(AWAIT_UPDATES, PREPARE, NORMS, CLIP, AGGREGATE, COMMIT),
    on_failure=SCRUB,
    # DP-FedAvg's noise is OpenDP's, which only the container image holds (too big for a zip)
    lambda_package="image",
)
