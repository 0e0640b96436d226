"""``shardfold plan`` for fedavg jobs: the core's own plan geometry, without writing anything.

The estimate reads every client's safetensors header exactly as the job's plan step does
(:func:`functions.fedavg.core.inspect`: two ranged GETs and a HEAD per client), so the shard count, chunk
size and per-task peak memory it reports are the ones the job will use; the S3 request counts come from
:func:`functions.fedavg.sizing.task_loads` (exact for the plan's geometry, counted as on S3). An update that
is missing or unreadable does not stop the estimate: a note names the client, and the job would fail at its
plan step naming it too.
"""

from __future__ import annotations

from typing import Any

from client import pricing
from client.planning import KindEstimate, MiB, TaskLoad, estimator, map_names_for
from functions.errors import InvalidModelFile, StoreError

ESTIMATE_JOB_ID = "fedavg-plan-estimate"  # stands in for the job id in default output keys


def _fmt_mib(n: float) -> str:
    return f"{n / MiB:,.1f} MiB" if n >= 0.1 * MiB else f"{n / 1024:,.1f} KiB"


def _unreadable(spec: Any, exc: Exception) -> KindEstimate:
    """A baseline estimate when the headers cannot be read: one shard, runtime memory, one read each."""
    from functions.fedavg import sizing

    n = len(spec.clients)
    base = sizing.RUNTIME_BYTES
    return KindEstimate(
        items=n,
        loads={
            "plan": TaskLoad(peak_bytes=base, gets=1 + 3 * n, puts=2, duration_s=pricing.TASK_OVERHEAD_S),
            "aggregate": TaskLoad(peak_bytes=base, gets=2 + n, puts=1, duration_s=pricing.TASK_OVERHEAD_S),
            "commit": TaskLoad(peak_bytes=base, gets=4, puts=4, duration_s=pricing.TASK_OVERHEAD_S),
        },
        map_items=map_names_for("fedavg", 1),
        notes=[f"{exc}: the job will fail at its plan step; sizes, shards and memory are not known"],
    )


@estimator("fedavg")
def estimate_fedavg(spec: Any, store_root: str, probe_limit: int) -> KindEstimate:
    from functions.fedavg import core, sizing

    try:
        plan = core.inspect(spec, ESTIMATE_JOB_ID, store_root)
    except (StoreError, InvalidModelFile) as exc:  # a missing or bad update: report it, let the job fail
        return _unreadable(spec, exc)
    loads = sizing.task_loads(plan, on_s3=True)  # the requests AWS would bill
    p, a, c = loads["plan"], loads["aggregate"], loads["commit"]
    net = pricing.LAMBDA_NET_BYTES_PER_S
    latency = pricing.S3_GET_LATENCY_S
    n, m = plan.n_clients, plan.shards
    header_bytes = len(plan.header())

    plan_load = TaskLoad(
        peak_bytes=p.peak_bytes,
        gets=p.gets,
        puts=p.puts,
        # two rounds of concurrent ranged GETs (length prefixes, headers) beside the HEADs, then two PUTs
        duration_s=pricing.TASK_OVERHEAD_S + 4 * latency + p.read_bytes / net,
    )
    aggregate_load = TaskLoad(
        peak_bytes=a.peak_bytes,
        gets=-(-a.gets // m),
        puts=-(-a.puts // m),
        # the largest shard: N x its bytes read at the budget's assumed per-function throughput, then uploaded
        duration_s=pricing.TASK_OVERHEAD_S
        + a.read_bytes / plan.budget.read_bytes_per_s
        + a.write_bytes / net,
        total_gets=a.gets,
        total_puts=a.puts,
    )
    commit_load = TaskLoad(
        peak_bytes=c.peak_bytes,
        gets=c.gets,
        puts=c.puts,
        duration_s=pricing.TASK_OVERHEAD_S + (c.gets + c.puts) * latency,  # server-side copies, one by one
    )

    dtypes = ", ".join(f"{k} x{v}" for k, v in plan.dtype_counts().items())
    shard_bytes = max(b - a_ for a_, b in zip(plan.bounds, plan.bounds[1:], strict=False))
    notes = [
        f"{n} client(s); model {_fmt_mib(plan.data_bytes)} in {len(plan.tensors)} tensor(s) ({dtypes})",
        f"{m} shard(s) of up to {_fmt_mib(shard_bytes)}; each aggregate task reads N x its shard "
        f"(up to {_fmt_mib(a.read_bytes)}) as ranged GETs of {_fmt_mib(plan.chunk_bytes)} per client, "
        f"{plan.read_window} in flight",
        "aggregate peak per task: "
        + ", ".join(f"{k} {_fmt_mib(v)}" for k, v in a.components.items())
        + " (does not grow with the number of clients"
        + (")" if not plan.robust() else "; median/trimmed_mean shrink the chunk as N grows)"),
    ]
    if plan.weighted():
        notes.append(f"weighted mean: total weight {plan.total_weight:g} (from num_examples or the spec)")
    notes += plan.notes
    if a.peak_bytes > sizing.AGGREGATE_MEMORY_MB * MiB:
        notes.append(
            "to fit: use aggregator='mean' (its memory does not depend on N), or average the clients in "
            "groups (several jobs, passing each group's num_examples on)"
        )
    if p.peak_bytes > sizing.PLAN_MEMORY_MB * MiB:
        notes.append("to fit: the headers are too large for the plan function; merge small tensors")
    return KindEstimate(
        items=n,
        loads={"plan": plan_load, "aggregate": aggregate_load, "commit": commit_load},
        map_items=map_names_for("fedavg", m),
        notes=notes,
        output_bytes=header_bytes + plan.data_bytes,
    )
