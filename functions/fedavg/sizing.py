"""fedavg's side of the estimate (:mod:`functions.estimate`): :func:`probe` reads the clients' headers as the
prepare step does, and :func:`loads` turns the plan it builds into each step's task load
(:func:`functions.fedavg.shardplan.task_loads`), duration and notes. It imports the engine
(:mod:`functions.fedavg.core`), which imports :mod:`functions.fedavg.shardplan`, never the reverse.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from shardfold.functions import pricing
from shardfold.functions.errors import InvalidModelFile, ObjectNotFound, SpecError, StoreError, TooFewClients
from shardfold.functions.estimate import Loads, Probe, TaskLoad
from shardfold.functions.fedavg import core, dp, shardplan
from shardfold.functions.fedavg import workflow as wf
from shardfold.functions.fedavg.shardplan import MiB, ShardPlan, StepLoad
from shardfold.functions.tables import size_text

ESTIMATE_JOB_ID = "fedavg-plan-estimate"  # stands in for the job id in default output keys


def scaled(plan: ShardPlan, n: int, shards: int | None) -> ShardPlan:
    """``plan`` (built from a sample of the clients) sized for ``n`` clients: the sample's layouts repeat,
    and the shard count and chunk follow the rules for ``n``."""
    k = plan.n_clients
    clients = [plan.clients[i * k // n] for i in range(n)]
    out = ShardPlan(**{f.name: getattr(plan, f.name) for f in fields(ShardPlan)})
    out.clients = clients
    shardplan.cut_shards(out, shards)
    out.total_weight = None  # the sample's weights are not the round's
    return out


def probe(spec: Any, store_root: str, budget: Any) -> Any:
    """Client headers, as the job's prepare step reads them, for at most ``budget.objects`` clients (evenly
    sampled beyond); an unreadable update becomes a note (the job fails at its prepare step naming it)."""
    n = len(spec.clients)
    k = min(n, max(1, budget.objects))
    sample = (
        spec if k == n else spec.model_copy(update={"clients": [spec.clients[i * n // k] for i in range(k)]})
    )
    if spec.tolerant:  # the sizes of the updates there now; the round counts its clients when it runs
        sample = sample.model_copy(update={"min_clients": 1, "min_fraction": None})
    try:
        plan = core.inspect(sample, ESTIMATE_JOB_ID, store_root)
    except (StoreError, InvalidModelFile, TooFewClients) as exc:
        # at submit, a round that waits for no one fails at prepare on a missing or unreadable update:
        # refused now, naming it (a tolerant round may still see it arrive, or go on without it)
        if budget.refuse and not spec.tolerant and isinstance(exc, ObjectNotFound | InvalidModelFile):
            raise SpecError(f"clients: {exc}", [{"field": "clients", "error": str(exc)}]) from exc
        return Probe(
            facts={"clients": n, "headers_read": 0},
            notes=[f"{exc}: the job will fail at its prepare step; sizes, shards and memory are not known"],
        )
    notes = [] if k == n else [f"headers read for {k} of {n} clients (evenly sampled); the job reads all"]
    if plan.excluded:
        left = "; ".join(f"client {e['client']}: {e['reason']}" for e in plan.excluded[:5])
        notes.append(
            f"{len(plan.excluded)} of the {k} updates read would be left out now ({left}); the round needs "
            f"{spec.required_clients} of {n}"
            + (f" and waits up to {spec.wait_s:g} s for late ones" if spec.wait_s else "")
        )
    if k < n:
        plan = scaled(plan, n, spec.shards)
    facts = {"clients": n, "headers_read": k, "data_bytes": plan.data_bytes, "shards": plan.shards}
    return Probe(facts=facts, notes=notes, model=plan)


def loads(spec: Any, probed: Any) -> Any:
    plan: ShardPlan | None = probed.model
    if plan is None:  # unreadable: one shard, runtime memory, one read each
        return _unread_loads(spec)
    steps = shardplan.task_loads(plan, on_s3=True)  # the requests AWS would bill
    tasks = {wf.AWAIT_UPDATES: _await_task(spec), **_estimate_tasks(plan, steps)}
    return Loads(
        items=plan.n_clients,
        tasks=tasks,
        map_items={wf.NORMS: plan.shards if plan.dp is not None else 0, wf.AGGREGATE: plan.shards},
        notes=_notes(plan, steps, tasks[wf.AGGREGATE_SHARD].why),
        output_bytes=len(plan.header()) + plan.data_bytes,
    )


def _unread_loads(spec: Any) -> Any:
    """The loads of a round whose headers could not be read: one shard, runtime memory, one read each."""
    n = len(spec.clients)
    base = TaskLoad(shardplan.RUNTIME_BYTES, duration_s=pricing.TASK_OVERHEAD_S)
    return Loads(
        items=n,
        tasks={
            wf.AWAIT_UPDATES: _await_task(spec),
            wf.PREPARE: replace(base, gets=1 + 3 * n, puts=3),
            wf.NORMS_SHARD: replace(base, gets=2 + n, puts=1),
            wf.CLIP: replace(base, gets=3, puts=1),
            wf.AGGREGATE_SHARD: replace(base, gets=2 + n, puts=1),
            wf.COMMIT: replace(base, gets=4, puts=4),
        },
        map_items={wf.NORMS: 1 if spec.dp is not None else 0, wf.AGGREGATE: 1},
    )


def _await_task(spec: Any) -> TaskLoad:
    """The polling step's one look, a HEAD per update (all in flight), when the round waits for late ones
    (each later look is the same again; the waits between them run no Lambda); else a call that returns."""
    looks = len(spec.clients) if spec.wait_s else 0
    duration_s = pricing.TASK_OVERHEAD_S + (pricing.S3_GET_LATENCY_S if looks else 0)
    return TaskLoad(shardplan.RUNTIME_BYTES, duration_s=duration_s, gets=looks)


def _estimate_tasks(plan: ShardPlan, steps: dict[str, StepLoad]) -> dict:
    """Each step's task: its memory and requests from ``steps``, its duration at the assumed rates."""

    def task(step: StepLoad, duration_s: float, **counts: int) -> TaskLoad:
        counts = {"gets": step.gets, "puts": step.puts, **counts}
        return TaskLoad(step.runtime_bytes, step.buffers, duration_s=duration_s, **counts)

    def shared(step: StepLoad, puts: int) -> dict[str, int]:  # the shard tasks differ: the exact totals
        return dict(gets=-(-step.gets // max(m, 1)), puts=puts, total_gets=step.gets, total_puts=step.puts)

    p, a, c, nm, cl = (steps[k] for k in ("prepare", "aggregate", "commit", "norms", "clip"))
    overhead, latency, m = pricing.TASK_OVERHEAD_S, pricing.S3_GET_LATENCY_S, plan.shards
    return {
        # two rounds of concurrent ranged GETs (length prefixes, headers) beside the HEADs, then two PUTs
        wf.PREPARE: task(p, overhead + 4 * latency + p.read_bytes / pricing.LAMBDA_NET_BYTES_PER_S),
        wf.NORMS_SHARD: task(nm, overhead + nm.read_bytes / pricing.FEDAVG_READ_BYTES_PER_S, **shared(nm, 1)),
        wf.CLIP: task(cl, overhead + cl.gets * latency),
        wf.AGGREGATE_SHARD: task(a, _aggregate_s(plan, a), **shared(a, -(-a.puts // m))),
        # server-side copies, one by one: each a request plus its bytes at S3's copy rate
        wf.COMMIT: task(
            c, overhead + (c.gets + c.puts) * latency + plan.data_bytes / pricing.S3_COPY_BYTES_PER_S
        ),
    }


def _aggregate_s(plan: ShardPlan, a: StepLoad) -> float:
    """An aggregate task's seconds: the largest shard's N x bytes read at the budget's assumed rate (a DP
    round's at ``FEDAVG_READ_BYTES_PER_S``, then its noise drawn), then its part uploaded."""
    upload_s = a.write_bytes / pricing.LAMBDA_NET_BYTES_PER_S
    if plan.dp is None:
        return pricing.TASK_OVERHEAD_S + a.read_bytes / plan.budget.read_bytes_per_s + upload_s
    floats = sum(t.elements for t in plan.tensors if t.dt.kind == "float")
    noise_s = floats / plan.shards / dp.NOISE_SAMPLES_PER_S
    return pricing.TASK_OVERHEAD_S + a.read_bytes / pricing.FEDAVG_READ_BYTES_PER_S + noise_s + upload_s


def _notes(plan: ShardPlan, steps: dict[str, StepLoad], aggregate_why: str) -> list[str]:
    """The round's model, shards and reads, the aggregate task's peak, and what to do if it would not fit."""
    n, m = plan.n_clients, plan.shards
    p, a = steps["prepare"], steps["aggregate"]
    dtypes = ", ".join(f"{k} x{v}" for k, v in plan.dtype_counts().items())
    shard_bytes = max(b - a_ for a_, b in zip(plan.bounds, plan.bounds[1:], strict=False))
    notes = [
        f"{n} client(s); model {size_text(plan.data_bytes)} in {len(plan.tensors)} tensor(s) ({dtypes})",
        f"{m} shard(s) of up to {size_text(shard_bytes)}; each aggregate task reads N x its shard "
        f"(up to {size_text(a.read_bytes)}) as ranged GETs of {size_text(plan.chunk_bytes)} per client, "
        f"{plan.read_window} in flight",
        f"aggregate peak per task: {aggregate_why} (does not grow with the number of clients"
        + (")" if not plan.robust() else "; median/trimmed_mean shrink the chunk as N grows)"),
    ]
    if plan.weighted() and plan.total_weight is not None:
        notes.append(f"weighted mean: total weight {plan.total_weight:g} (from num_examples or the spec)")
    notes += plan.notes
    if a.peak_bytes > shardplan.AGGREGATE_MEMORY_MB * MiB:
        notes.append(
            "to fit: use aggregator='mean' (its memory does not depend on N), or average the clients in "
            "groups (several jobs, passing each group's num_examples on)"
        )
    if p.peak_bytes > shardplan.PLAN_MEMORY_MB * MiB:
        notes.append("to fit: the headers are too large for the plan function; merge small tensors")
    return notes
