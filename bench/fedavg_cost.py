"""FedAvg cost on Lambda prices: the sharded design against a lambda-FL style tree, per round.

GB-seconds, invocations, S3 requests and Step Functions transitions per round for 43 MB, 528 MB and 5 GB
models at N = 20 and 100 (aggregation only: client uploads and downloads are the same in every design):

  sharded          the fedavg job's own design: plan, M aggregate tasks (ranged GETs overlapped with the
                   add, memory O(chunk)), commit; shards, memory and requests from
                   ``functions.fedavg.shardplan`` (``choose_shards`` + ``task_loads`` on a synthetic plan);
  tree (lambda-FL) as the paper's replication package runs it: ceil(sqrt N) clients per leaf, whole-object
                   GETs on one stream, 3 x model + 450 MB; the root adds the partial sums;
  tree, streamed   the same tree given the sharded design's engine (one full-model accumulator).

Per-byte compute time is the shard task's MEASURED rate (scaled by memory / 1769 MB: one numpy thread),
taken from, in order: ``--compute-mbps``; the shard task measured earlier in the same run (``fedavg.py``);
``--compute-from`` (default: bench/results/fedavg_throughput.json, else fedavg.json, when present); or a
shard task measured now (``--measure`` forces it; it writes ``--job-n`` updates of ``--model-mib``). S3
bandwidth is an assumption printed with the table (``--s3-stream-mbps`` per stream x the task's reads in
flight, capped per function by ``client/pricing.py``). It prints the crossover size, where 900 s or
10,240 MB rule a design out, a range-size what-if, and the model run with the paper's own settings against
its measured Lambda numbers. A model, not a measurement of AWS; nothing asserts.
Writes bench/results/fedavg_cost.json (``--out``).

    .venv/bin/python bench/fedavg_cost.py                         # rate from an earlier throughput run
    .venv/bin/python bench/fedavg_cost.py --compute-mbps 900 --s3-stream-mbps 80
    .venv/bin/python bench/fedavg_cost.py --measure --model-mib 64 --job-n 8
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
from benchutil import table, watched  # noqa: E402
from fedavg_common import (  # noqa: E402
    MB,
    RESULTS,
    FedAvgUnavailable,
    GiB,
    MiB,
    Workspace,
    add_common_args,
    apply_common_quick,
    fedavg_workflow,
    session,
    shard_row,
    split_workflow,
)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--s3-stream-mbps", type=float, default=50.0, help="assumed MB/s of one S3 stream (50)")
    ap.add_argument(
        "--streams", type=int, default=None, help="parallel GETs per shard task (default: the code's)"
    )
    ap.add_argument(
        "--chunk-mib", type=float, default=None, help="range GET size (default: the code's, else 8)"
    )
    ap.add_argument(
        "--compute-mbps", type=float, default=None, help="per-task aggregate rate in MB/s (default: measured)"
    )
    ap.add_argument(
        "--compute-from",
        default=None,
        help="a fedavg_throughput.json / fedavg.json to take the measured shard-task rate from",
    )
    ap.add_argument("--measure", action="store_true", help="measure the shard task now, whatever is on disk")


# --------------------------------------------------------------------------------------------------------
# part 3: cost model on Lambda prices

LAMBDA_MAX_MB = 10_240
LAMBDA_MIN_MB = 128
LAMBDA_TIMEOUT_S = 900.0
LAMBDA_MB_PER_VCPU = 1769  # AWS: 1,769 MB of memory = one vCPU's worth of CPU
ARM_USD_PER_GB_S = 0.0000133334
SINGLE_PUT_MAX = 5 * GiB
MEM_STEP_MB = 64


@dataclass
class CostParams:
    """Every assumption of the cost model; the measured ones say so."""

    compute_Bps: float  # MEASURED: one shard task's input bytes aggregated per second on one core here
    compute_source: str
    stream_Bps: float  # assumed: one S3 GET stream into a Lambda function (the paper's 45-57 MB/s)
    streams: int  # parallel range GETs of one sharded task (the engine's setting)
    streams_source: str
    nic_Bps: float  # assumed cap on one function's S3 throughput, all streams together
    chunk: int  # bytes per range GET of the sharded design
    part: int  # multipart part size for large PUTs
    overhead_s: float  # invoke + runtime start per task
    get_latency_s: float
    margin_s: float  # kept below Lambda's 900 s when sizing shards
    runtime_bytes: int  # a warm Python runtime with numpy and boto3 (functions.fedavg.shardplan's figure)
    plan_mb: int  # memory of the plan and commit tasks (the workflow's, else 1024 / 512)
    commit_mb: int
    usd_gb_s: dict[str, float] = field(default_factory=dict)
    usd_request: float = 0.0
    usd_get: float = 0.0
    usd_put: float = 0.0
    usd_transition: float = 0.0

    def cpu_Bps(self, mem_mb: float) -> float:
        """numpy's accumulate uses one thread: CPU grows with memory up to one vCPU, then stops."""
        return self.compute_Bps * min(1.0, mem_mb / LAMBDA_MB_PER_VCPU)

    def net_Bps(self, streams: int) -> float:
        return min(self.stream_Bps * streams, self.nic_Bps)

    def transitions(self, shards: int) -> int:
        """Step Functions Standard transitions of one sharded round, counted as ``shardfold plan`` does."""
        try:
            from shardfold.functions.estimate import transitions

            _pre, map_step, _post = split_workflow(fedavg_workflow())
            return int(transitions(fedavg_workflow().steps, {map_step: shards}))
        except Exception:
            return 3 + shards  # plan, the Map, one per child, commit


@dataclass
class Design:
    """One aggregation design for one (model size, N): what a round runs and costs."""

    design: str
    model_bytes: int
    n: int
    tasks: int  # Lambda invocations per round
    layout: str  # "M=4" or "5 leaves x 4 + root"
    memory_mb: int  # configured per task (the big tasks)
    needed_mb: float  # the design's own memory model
    task_s: float  # the longest task
    wall_s: float  # critical path of a round
    gb_s: float
    gets: int
    puts: int
    transitions: int = 0
    feasible: bool = True
    why: str = ""
    usd: dict[str, float] = field(default_factory=dict)
    usd_parts: dict[str, float] = field(default_factory=dict)

    def price(self, p: CostParams) -> None:
        s3 = self.gets * p.usd_get + self.puts * p.usd_put
        fixed = self.tasks * p.usd_request + s3 + self.transitions * p.usd_transition
        self.usd_parts = {
            "s3_requests": s3,
            "invocations": self.tasks * p.usd_request,
            "transitions": self.transitions * p.usd_transition,
        }
        for arch, rate in p.usd_gb_s.items():
            self.usd_parts[f"gb_s_{arch}"] = self.gb_s * rate
            self.usd[arch] = self.gb_s * rate + fixed


def put_requests(nbytes: int, part: int, streamed: bool) -> int:
    """PUT-class requests to write one object: one PUT, or create + parts + complete."""
    if not streamed and nbytes <= SINGLE_PUT_MAX:
        return 1
    return math.ceil(nbytes / part) + 2


def best_memory(needed_mb: float, seconds_at: Any) -> tuple[int, float]:
    """The configured memory (>= needed, 64 MB steps) that minimises GB-s, and the task time there."""
    lo = max(LAMBDA_MIN_MB, math.ceil(needed_mb / MEM_STEP_MB) * MEM_STEP_MB)
    best: tuple[float, int, float] | None = None
    for mem in range(lo, LAMBDA_MAX_MB + 1, MEM_STEP_MB):
        t = seconds_at(mem)
        cost = mem / 1024 * t
        if best is None or cost < best[0] - 1e-12:
            best = (cost, mem, t)
    if best is None:  # needed more than the ceiling: report it at the ceiling, infeasible
        return LAMBDA_MAX_MB, seconds_at(LAMBDA_MAX_MB)
    return best[1], best[2]


def sharded_task_model(model_bytes: int, n: int, p: CostParams, sizing: Any) -> dict:
    """Shards, per-task peak memory and requests of the sharded design, from ``functions.fedavg.shardplan``
    when it answers, otherwise from the reference design's rule (GradsSharding notes section 7)."""
    planner_error = ""
    if sizing is not None:
        try:
            return sizing(model_bytes, n)
        except FedAvgUnavailable as exc:
            planner_error = str(exc)
    peak = p.runtime_bytes + (p.streams + 2) * p.chunk  # in-flight ranges + accumulator + output piece
    per_task_bytes = (LAMBDA_TIMEOUT_S - p.margin_s - p.overhead_s) * p.net_Bps(p.streams)
    m = max(1, math.ceil(n * model_bytes / per_task_bytes), math.ceil(model_bytes / SINGLE_PUT_MAX))
    shard = math.ceil(model_bytes / m)
    return {
        "shards": m,
        "peak_bytes": peak,
        "gets_per_task": n * math.ceil(shard / p.chunk),
        "puts_per_task": math.ceil(shard / p.part),
        "plan_gets": 2 * n,
        "plan_puts": 2,
        "commit_puts": m + 2,
        "source": "reference rule (gradsharding.md section 7): acc + streams x chunk + runtime",
        "planner_error": planner_error,
    }


def model_sharded(
    model_bytes: int, n: int, p: CostParams, sizing: Any, fixed_mb: int | None = None
) -> Design:
    """The sharded design: plan, M aggregate tasks (ranged GETs overlapped with the add), commit.

    Memory: the cheapest size >= the task's need, or ``fixed_mb`` (the workflow's configured memory)."""
    t = sharded_task_model(model_bytes, n, p, sizing)
    m = int(t["shards"])
    shard = math.ceil(model_bytes / m)
    needed_mb = t["peak_bytes"] / MiB
    net = p.net_Bps(p.streams)

    def task_s(mem: int) -> float:
        # range GETs in flight while the previous chunk is added: the slower of the two sets the pace
        return p.overhead_s + n * shard / min(net, p.cpu_Bps(mem)) + shard / net

    if fixed_mb:
        mem, ts = fixed_mb, task_s(fixed_mb)
    else:
        mem, ts = best_memory(needed_mb, task_s)
    plan_s = p.overhead_s + math.ceil(n / 64) * 3 * p.get_latency_s
    commit_s = p.overhead_s + math.ceil(m / 64) * 0.2
    gb_s = m * mem / 1024 * ts + (p.plan_mb * plan_s + p.commit_mb * commit_s) / 1024
    d = Design(
        design=f"sharded @{fixed_mb} MB" if fixed_mb else "sharded",
        model_bytes=model_bytes,
        n=n,
        tasks=m + 2,
        layout=f"M={m}",
        memory_mb=mem,
        needed_mb=needed_mb,
        task_s=ts,
        wall_s=plan_s + ts + commit_s,
        gb_s=gb_s,
        gets=m * int(t["gets_per_task"]) + int(t["plan_gets"]),
        puts=m * int(t["puts_per_task"]) + int(t["plan_puts"]) + int(t["commit_puts"]),
        transitions=p.transitions(m),
    )
    if t.get("planner_error"):
        d.feasible, d.why = False, "planner refuses: " + t["planner_error"][:120]
    elif needed_mb > mem:
        d.feasible, d.why = False, f"a task needs {needed_mb:,.0f} MB > {mem:,}"
    elif ts > LAMBDA_TIMEOUT_S:
        d.feasible, d.why = False, f"a shard takes {ts:,.0f} s > 900 s: needs more shards"
    d.price(p)
    return d


def model_tree(model_bytes: int, n: int, p: CostParams, streamed: bool) -> Design:
    """A lambda-FL style tree: ceil(sqrt N) clients per leaf, leaves PUT partial sums, the root adds them.

    ``streamed=False`` is the replication package's tree: whole-object GETs one after another on one
    stream, ``np.load``, add (no overlap), memory 3 x model + 450 MB. ``streamed=True`` gives the tree the
    sharded design's engine: ranged GETs on the same parallel streams overlapped with the add, memory one
    full-model accumulator + the in-flight ranges + runtime (the least a tree node can hold)."""
    k = math.ceil(math.sqrt(n))
    leaves = math.ceil(n / k)
    b = model_bytes
    if streamed:
        needed_mb = (b + (p.streams + 1) * p.chunk + p.runtime_bytes) / MiB
        net = p.net_Bps(p.streams)

        def node_s(mem: int, inputs: int) -> float:
            return p.overhead_s + inputs * b / min(net, p.cpu_Bps(mem)) + b / net

        gets = (n + leaves) * math.ceil(b / p.chunk)
    else:
        needed_mb = 3 * b / MiB + 450
        net = p.stream_Bps

        def node_s(mem: int, inputs: int) -> float:
            return p.overhead_s + inputs * (b / net + b / p.cpu_Bps(mem)) + b / net

        gets = n + leaves
    puts = (leaves + 1) * put_requests(b, p.part, streamed)
    mem, leaf_s = best_memory(needed_mb, lambda m: node_s(m, k))
    root_s = node_s(mem, leaves)
    gb_s = mem / 1024 * (leaves * leaf_s + root_s)
    d = Design(
        design="tree, streamed" if streamed else "tree (lambda-FL)",
        model_bytes=b,
        n=n,
        tasks=leaves + 1,
        layout=f"{leaves} leaves x {k} + root",
        memory_mb=mem,
        needed_mb=needed_mb,
        task_s=max(leaf_s, root_s),
        wall_s=leaf_s + root_s,
        gb_s=gb_s,
        gets=gets,
        puts=puts,
    )
    if needed_mb > LAMBDA_MAX_MB:
        d.feasible, d.why = False, f"needs {needed_mb:,.0f} MB > {LAMBDA_MAX_MB:,} MB"
    elif d.task_s > LAMBDA_TIMEOUT_S:
        d.feasible, d.why = False, f"a node takes {d.task_s:,.0f} s > 900 s"
    d.price(p)
    return d


def crossover(n: int, p: CostParams, sizing: Any, streamed: bool, arch: str) -> dict:
    """Smallest model size from which the sharded design is cheaper than the tree (log grid 1 MB-10 GB),
    and the first size at which the tree cannot run at all."""
    sizes = np.unique(np.round(np.logspace(0, 4, 161) * MB).astype(np.int64)).tolist()
    cross = None
    infeasible = None
    last_tree_cheaper = None
    for b in sizes:
        s = model_sharded(b, n, p, sizing)
        t = model_tree(b, n, p, streamed)
        if not t.feasible:
            infeasible = infeasible or b
            continue
        if s.usd[arch] <= t.usd[arch]:
            cross = cross or b
        else:
            last_tree_cheaper = b
            cross = None
    return {
        "n": n,
        "tree": "tree, streamed" if streamed else "tree (lambda-FL)",
        "arch": arch,
        "sharded_cheaper_from_bytes": cross,
        "tree_cheaper_up_to_bytes": last_tree_cheaper,
        "tree_infeasible_from_bytes": infeasible,
    }


def tree_limits(n: int, p: CostParams, streamed: bool) -> dict:
    """Largest model a tree can aggregate: memory ceiling and 900 s, by bisection on size."""

    def ok(b: int) -> bool:
        return model_tree(b, n, p, streamed).feasible

    lo, hi = MB, 100_000 * MB
    if not ok(lo):
        return {"max_bytes": 0}
    while hi - lo > MB // 10:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    d = model_tree(hi, n, p, streamed)
    return {
        "max_bytes": lo,
        "limited_by": "900 s" if "900" in d.why else f"{LAMBDA_MAX_MB:,} MB",
        "why": d.why,
    }


def calibration(p: CostParams) -> list[dict]:
    """The model run with the paper's own settings (one stream, its memory sizes, M=4, N=20) against the
    replication package's measured Lambda results: a check of the model's shape, not of our code."""
    out = []
    vgg = 512.3 * MiB
    # GradsSharding in the paper: sequential whole-object GETs on one stream, no overlap, M=4, 835 MB
    m, n, mem = 4, 20, 835
    shard = vgg / m
    gs_s = p.overhead_s + n * (shard / p.stream_Bps + shard / p.cpu_Bps(mem)) + shard / p.stream_Bps
    gs_usd = m * mem / 1024 * gs_s * p.usd_gb_s["x86"] + m * p.usd_request + 80 * p.usd_get + 4 * p.usd_put
    out.append(
        {
            "config": "VGG-16, GS M=4, 835 MB",
            "model_s": gs_s,
            "paper_s": 67.2,
            "model_usd": gs_usd,
            "paper_usd": 0.003383,
        }
    )
    k, leaves, mem = 5, 4, 1987
    node = p.overhead_s + k * (vgg / p.stream_Bps + vgg / p.cpu_Bps(mem)) + vgg / p.stream_Bps
    root = p.overhead_s + leaves * (vgg / p.stream_Bps + vgg / p.cpu_Bps(mem)) + vgg / p.stream_Bps
    tree_usd = mem / 1024 * (leaves * node + root) * p.usd_gb_s["x86"] + 5 * p.usd_request
    tree_usd += 24 * p.usd_get + 5 * p.usd_put
    out.append(
        {
            "config": "VGG-16, lambda-FL, 1987 MB",
            "model_s": node + root,
            "paper_s": 117.3,
            "model_usd": tree_usd,
            "paper_usd": 0.010167,
        }
    )
    return out


# --------------------------------------------------------------------------------------------------------
# adapters to functions.fedavg (whatever of it is there)


def engine_settings() -> dict:
    """The aggregate task's range size and reads in flight, as ``functions.fedavg.shardplan`` sets them."""
    try:
        from shardfold.functions.fedavg import shardplan as sizing
    except Exception as exc:
        return {"chunk": None, "streams": None, "source": [], "error": f"{type(exc).__name__}: {exc}"}
    budget = sizing.Budget()
    chunk = int(budget.chunk_bytes)
    streams = int(sizing.read_window(chunk, budget))
    mem = {}
    try:  # the memory the workflow configures for each step, where the workflow is there
        from shardfold.functions.workflow import Map, Task

        for step in fedavg_workflow().steps:
            for task in step.body if isinstance(step, Map) else (step,):
                if isinstance(task, Task):
                    mem[task.function.split(".")[-1]] = task.memory_mb
    except Exception:
        pass
    return {
        "chunk": chunk,
        "streams": streams,
        "runtime_bytes": int(getattr(sizing, "RUNTIME_BYTES", 160 * MiB)),
        "configured_mb": mem.get("aggregate") or int(getattr(sizing, "AGGREGATE_MEMORY_MB", 0)) or None,
        "plan_mb": mem.get("plan") or int(getattr(sizing, "PLAN_MEMORY_MB", 1024)),
        "commit_mb": mem.get("commit") or int(getattr(sizing, "COMMIT_MEMORY_MB", 512)),
        "workflow_memory_mb": mem,
        "source": [f"sizing.Budget().chunk_bytes={chunk}", f"sizing.read_window()={streams}"],
    }


def _synthetic_plan(sizing: Any, model_bytes: int, n: int, budget_overrides: dict | None = None) -> Any:
    """A fedavg ShardPlan for an N-client float32 model of ``model_bytes`` (a tensor per 64 MiB, every client
    laid out like client 0), built with the planner's own shard and chunk rules, as on S3 (Lambda)."""
    from shardfold.functions.fedavg.layout import Tensor

    elems = max(1, model_bytes // 4)
    per = 16 * MiB  # elements per tensor (64 MiB)
    tensors, begin = [], 0
    for i in range(math.ceil(elems / per)):
        count = min(per, elems - i * per)
        tensors.append(Tensor(f"t{i}", "F32", (count,), begin, begin + 4 * count))
        begin += 4 * count
    # the budget the job gets on S3 (Lambda): the deployed sizes and as many shards as run at once there
    base = sizing.default_budget("s3://b") if hasattr(sizing, "default_budget") else sizing.Budget()
    budget = replace(base, **(budget_overrides or {}))
    header = len(sizing.encode_header(tensors, {}))
    clients = [sizing.ClientRef(f"s3://b/c{c}", 1.0, header, 0) for c in range(n)]
    plan = sizing.ShardPlan(
        job_id="fedavg-bench",
        output="s3://b/out",
        tensors=tensors,
        clients=clients,
        layouts=[[t.begin for t in tensors]],
        bounds=[],  # cut below, by the planner's own rules
        chunk_bytes=0,
        read_window=0,
        aggregator="mean",
        uniform=False,
        accumulate="float32",
        integer_policy="mean",
        trim_fraction=0.1,
        allow_nonfinite=False,
        metadata={},
        total_weight=float(n),
        budget=budget,
    )
    sizing.cut_shards(plan, None)
    return plan


def sizing_hook(budget_overrides: dict | None = None) -> tuple[Any, str]:
    """A callable (model_bytes, n) -> the sharded design's task model from ``functions.fedavg.shardplan``
    (``choose_shards`` + ``task_loads`` on a synthetic plan), or (None, why not)."""
    try:
        from shardfold.functions.fedavg import shardplan as sizing
    except Exception as exc:
        return None, f"shardfold.functions.fedavg.shardplan does not import ({exc})"
    cache: dict[tuple[int, int], dict] = {}

    def model(model_bytes: int, n: int) -> dict:
        key = (model_bytes, n)
        if key not in cache:
            try:
                plan = _synthetic_plan(sizing, model_bytes, n, budget_overrides)
                loads = sizing.task_loads(plan, on_s3=True)
            except Exception as exc:  # PlanError: no shard count fits the budget
                raise FedAvgUnavailable(f"{type(exc).__name__}: {exc}") from exc
            agg = loads["aggregate"]
            cache[key] = {
                "shards": plan.shards,
                "peak_bytes": agg.peak_bytes,
                "gets_per_task": math.ceil(agg.gets / agg.tasks),
                "puts_per_task": math.ceil(agg.puts / agg.tasks),
                "plan_gets": loads["prepare"].gets + loads["commit"].gets,
                "plan_puts": loads["prepare"].puts,
                "commit_puts": loads["commit"].puts,
                "source": "shardfold.functions.fedavg.shardplan.task_loads",
            }
        return cache[key]

    return model, "shardfold.functions.fedavg.shardplan (choose_shards, task_loads)"


COST_MODELS = [("43 MB (ResNet-18)", 44_726_568), ("528 MB", 528 * MiB), ("5 GB", 5 * GiB)]
COST_NS = (20, 100)


def _rate_in(path: Path) -> tuple[float, str] | None:
    """The shard-task rate a throughput (or all-parts) run recorded, with where it came from."""
    try:
        doc = json.loads(path.read_text())
        row = doc["throughput"]["shard_task"]
        bps = float(row["shard"]["Bps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    mib = doc.get("config", {}).get("model_bytes", 0) / MiB
    return bps, f"measured by {path.name} ({doc.get('created')}, {mib:,.0f} MiB model, N={row['n']})"


def compute_rate(ws: Workspace) -> tuple[float, str]:
    """The per-byte aggregate rate of one shard task (bytes/s) and where it came from."""
    args = ws.args
    if args.compute_mbps:
        return args.compute_mbps * MB, f"--compute-mbps {args.compute_mbps:g}"
    row = ws.shard_rows.get(args.job_n) or {}
    if (row.get("shard") or {}).get("Bps"):
        return row["shard"]["Bps"], f"measured: the shard task in this run (N={args.job_n})"
    if not args.measure:
        files = [Path(args.compute_from)] if args.compute_from else []
        files = files or [RESULTS / "fedavg_throughput.json", RESULTS / "fedavg.json"]
        for f in files:
            found = _rate_in(f)
            if found:
                return found
    ok, why = ws.fedavg_available()
    if ok and ws.need_updates(args.job_n):
        print(f"\n== measuring one shard task (N={args.job_n}) for the per-byte compute rate")
        with watched("shard task", ws.doc, "shard_task_load"):
            row = shard_row(ws, args.job_n)
        if (row.get("shard") or {}).get("Bps"):
            return row["shard"]["Bps"], f"measured: the shard task now (N={args.job_n})"
        why = row.get("shard_error", "no rate")
    return 1e9, f"nothing measured ({why}): 1 GB/s assumed"


def cost_part(ws: Workspace) -> None:
    """The cost model, printed; recorded in ``ws.doc["cost"]``."""
    from shardfold.functions import pricing

    args, doc = ws.args, ws.doc
    eng = engine_settings()
    chunk = int(args.chunk_mib * MiB) if args.chunk_mib else (eng["chunk"] or 8 * MiB)
    streams = args.streams or eng["streams"] or 8
    compute, source = compute_rate(ws)
    p = CostParams(
        compute_Bps=compute,
        compute_source=source,
        stream_Bps=args.s3_stream_mbps * MB,
        streams=streams,
        streams_source=(
            "--streams" if args.streams else "; ".join(eng["source"]) or "assumed 8 (not found in code)"
        ),
        nic_Bps=float(pricing.LAMBDA_NET_BYTES_PER_S),
        chunk=chunk,
        part=8 * MiB,  # s3transfer's multipart part size (uploads of partial sums and outputs)
        overhead_s=float(pricing.TASK_OVERHEAD_S),
        get_latency_s=float(pricing.S3_GET_LATENCY_S),
        margin_s=60.0,
        runtime_bytes=int(eng.get("runtime_bytes") or 160 * MiB),
        plan_mb=int(eng.get("plan_mb") or 1024),
        commit_mb=int(eng.get("commit_mb") or 512),
        usd_gb_s={"arm64": ARM_USD_PER_GB_S, "x86": float(pricing.LAMBDA_USD_PER_GB_S)},
        usd_request=float(pricing.LAMBDA_USD_PER_REQUEST),
        usd_get=float(pricing.S3_USD_PER_GET),
        usd_put=float(pricing.S3_USD_PER_PUT),
        usd_transition=float(pricing.SFN_USD_PER_TRANSITION),
    )
    sizing, sizing_why = sizing_hook()
    print(
        "\nCost model per round on Lambda prices (aggregation only: client uploads and downloads are the "
        "same in every design and left out)"
    )
    print(
        f"  per-byte aggregate time: {p.compute_source}; scaled by min(1, memory/1769 MB) (one numpy thread)"
    )
    print(
        f"  S3: {p.stream_Bps / MB:.0f} MB/s per stream (assumed; the paper measured 45-57), sharded tasks "
        f"and the streamed tree use {p.streams} streams ({p.streams_source}), "
        f"capped at {p.nic_Bps / MB:.0f} MB/s per function (client/pricing.py); "
        f"range GETs of {p.chunk / MiB:g} MiB"
    )
    print(f"  sharded task memory: {'shardfold.functions.fedavg.shardplan' if sizing else sizing_why}")
    print(
        f"  memory per design = the cheapest size >= its model's need (64 MB steps); prices: arm64 "
        f"${ARM_USD_PER_GB_S}/GB-s, x86 ${pricing.LAMBDA_USD_PER_GB_S}/GB-s, $0.20/1M invokes, "
        f"S3 GET ${pricing.S3_USD_PER_GET * 1000:g}/1k, PUT ${pricing.S3_USD_PER_PUT * 1000:g}/1k, "
        f"sharded adds Step Functions transitions ${pricing.SFN_USD_PER_TRANSITION * 1000:g}/1k"
    )
    designs: list[Design] = []
    for _label, b in COST_MODELS:
        for n in COST_NS:
            designs.append(model_sharded(b, n, p, sizing))
            if eng.get("configured_mb"):
                designs.append(model_sharded(b, n, p, sizing, fixed_mb=eng["configured_mb"]))
            designs.append(model_tree(b, n, p, streamed=False))
            designs.append(model_tree(b, n, p, streamed=True))
    rows = []
    labels = dict((b, label) for label, b in COST_MODELS)
    for d in designs:
        rows.append(
            [
                labels[d.model_bytes],
                str(d.n),
                d.design,
                d.layout,
                f"{d.memory_mb:,}",
                f"{d.needed_mb:,.0f}",
                f"{d.task_s:,.1f}",
                f"{d.wall_s:,.1f}",
                f"{d.gb_s:,.1f}",
                str(d.tasks),
                f"{d.gets:,}",
                f"{d.puts:,}",
                f"{d.usd['arm64']:.6f}",
                f"{d.usd['x86']:.6f}",
                f"{d.usd_parts['s3_requests'] + d.usd_parts['transitions']:.6f}",
                "ok" if d.feasible else f"NO: {d.why}",
            ]
        )
    print(
        table(
            [
                "model",
                "N",
                "design",
                "layout",
                "mem MB",
                "need MB",
                "task s",
                "round s",
                "GB-s",
                "invokes",
                "GET",
                "PUT",
                "$ arm64",
                "$ x86",
                "of which S3+SFN",
                "feasible",
            ],
            rows,
        )
    )

    # ratios at each point
    print("\n  tree / sharded cost (arm64), feasible pairs only:")
    for _label, b in COST_MODELS:
        for n in COST_NS:
            s = next(d for d in designs if d.model_bytes == b and d.n == n and d.design == "sharded")
            parts = []
            for t in (d for d in designs if d.model_bytes == b and d.n == n and d.design.startswith("tree")):
                parts.append(
                    f"{t.design}: "
                    + (f"{t.usd['arm64'] / s.usd['arm64']:.2f}x" if t.feasible else "infeasible")
                )
            print(f"    {labels[b]:<18} N={n:<4} " + "; ".join(parts))

    cross = []
    for n in COST_NS:
        for streamed in (False, True):
            for arch in ("arm64", "x86"):
                cross.append(crossover(n, p, sizing, streamed, arch))
    limits = {
        f"{n}/{'streamed' if s else 'lambda-FL'}": tree_limits(n, p, s)
        for n in COST_NS
        for s in (False, True)
    }
    print("\nCrossover (log grid 1 MB - 10 GB): the model size from which sharded is cheaper")
    crows = []
    for c in cross:
        lim = limits[f"{c['n']}/{'streamed' if 'streamed' in c['tree'] else 'lambda-FL'}"]
        crows.append(
            [
                str(c["n"]),
                c["tree"],
                c["arch"],
                "-"
                if c["sharded_cheaper_from_bytes"] is None
                else f"{c['sharded_cheaper_from_bytes'] / MB:,.0f} MB",
                "-"
                if c["tree_cheaper_up_to_bytes"] is None
                else f"{c['tree_cheaper_up_to_bytes'] / MB:,.0f} MB",
                f"{lim['max_bytes'] / MB:,.0f} MB ({lim.get('limited_by', '')})",
                "",
            ]
        )
    print(
        table(
            ["N", "vs", "arch", "sharded cheaper from", "tree cheaper up to", "tree feasible up to", ""],
            crows,
        )
    )
    shard_rows = []
    for n in COST_NS:
        per_task = (LAMBDA_TIMEOUT_S - p.margin_s - p.overhead_s) * min(
            p.net_Bps(p.streams), p.cpu_Bps(LAMBDA_MB_PER_VCPU)
        )
        shard_rows.append(
            f"N={n}: a task covers <= {per_task / n / MB:,.0f} MB of the model in 900 s, so 900 s alone asks "
            f"M >= {math.ceil(n * 5 * GiB / per_task)} for 5 GB (the planner cuts 64 MiB shards anyway)"
        )
    print("  900 s, sharded design (memory never binds):\n    " + "\n    ".join(shard_rows))
    # what-if: the range size of the sharded task (GETs are most of a big round's bill)
    whatif = []
    wrows = []
    for chunk_mib in (4, 8, 16, 32):
        c = chunk_mib * MiB
        hook, _ = sizing_hook({"chunk_bytes": c, "inflight_bytes": p.streams * c})
        pc = CostParams(**{**asdict(p), "chunk": c})
        for label, b in COST_MODELS[1:]:
            d = model_sharded(b, 100, pc, hook)
            whatif.append({"chunk": c, **asdict(d)})
            wrows.append(
                [
                    f"{chunk_mib} MiB",
                    label,
                    "100",
                    f"{d.needed_mb:,.0f}",
                    f"{d.gets:,}",
                    f"{d.usd_parts['s3_requests']:.6f}",
                    f"{d.usd['arm64']:.6f}",
                    "",
                ]
            )
    print(f"\nWhat-if: range size of the sharded task ({p.streams} reads in flight; N=100)")
    print(table(["range", "model", "N", "need MB", "GET", "S3 $", "$ arm64", ""], wrows))
    cal = calibration(p)
    print(
        "\nModel check against the paper's measured Lambda runs "
        "(its settings: 1 stream, fixed memory, N=20, x86)"
    )
    print(
        table(
            ["config", "model s", "paper s", "model $", "paper $", ""],
            [
                [
                    c["config"],
                    f"{c['model_s']:.1f}",
                    f"{c['paper_s']:.1f}",
                    f"{c['model_usd']:.6f}",
                    f"{c['paper_usd']:.6f}",
                    "",
                ]
                for c in cal
            ],
        )
    )
    doc["cost"] = {
        "params": asdict(p),
        "engine_settings": eng,
        "sizing": "shardfold.functions.fedavg.shardplan" if sizing else sizing_why,
        "designs": [asdict(d) for d in designs],
        "crossover": cross,
        "tree_limits": limits,
        "sharded_900s": shard_rows,
        "calibration": cal,
        "whatif_chunk": whatif,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    add_common_args(ap, "fedavg_cost.json")
    add_args(ap)
    args = ap.parse_args(argv)
    apply_common_quick(args)
    with session("fedavg_cost", args) as ws:
        cost_part(ws)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
