"""dpquery benchmark: planning at scale, the measure step's noise throughput, and the job end to end.

Synthetic 10^d domains (every attribute has 10 values) with the workload "all marginals of at most 3
attributes" (the 0-way total included), the ResidualPlanner "Synth-n^d" setting. Parts, each a section
below, registered in ``PARTS`` and run in order (``--parts plan,measure,e2e``; default: all registered):

  plan     Planning time and predicted error for d = 10, 20, 50, 100 (``--plan-d``). Each d runs in a fresh
           child process pinned to one core (sched_setaffinity, BLAS/OpenMP threads = 1): expand the
           workload from a DPQuerySpec spec, then ``planner.plan(spec)`` (best of ``--plan-repeats``). It
           reports |C(W)| (residual sets), workload marginals, queries (cells), noise samples, the largest
           marginal, the predicted workload RMSE and max per-cell stddev at ρ (``--rho``, default 1/2, i.e.
           privacy cost 2ρ = 1, the reference's unit), ε at δ by CKS and by the exact Gaussian curve, the
           plan document's size and encode/decode time, and the peak memory the planning added (VmHWM
           after resetting it once the imports and the workload are in memory). ``--plan-maxvar-d`` also
           times the ``max_variance`` (cvxpy) plan for the listed d.
           Target: d = 100 (166,751 residual sets) planned in under 10 s on one core.
  measure  (added with the data path) noise samples per second per core of the measure step vs OpenDP's
           sampler called directly on the same vector; target >= 0.8x.
  e2e      (added with the data path) end-to-end time for d = 20 on a 1,000,000-row dataset.
  queries  General linear queries (a spec's ``queries``, planned by functions/dpquery/planner.py with
           QuerySmasher's strategies): the prefix workloads of the RP+ paper's datasets (CPS, Adult, Loans;
           prefix on their leading ordinal attributes, 1-, 2-, 3- and <=3-way) at privacy cost 2ρ = 1: RMSE
           of the job's plan against ResidualPlanner's identity plan with each prefix query answered by
           summing its cells, and against the authors' QuerySmasher (bench/qs_reference.py) where it
           finishes; plan time and peak memory.

  mixed    Workloads on [n]^d (n = 10, 20, 40; d = 10 … 50): every attribute's 1-way ranges, every pair's
           2-way affine queries and every 3-way marginal's prefixes (--mixed-shape kron: less the affine
           queries; cycle: all 1/2/3-way marginals with attribute i asked as range, prefix or
           circular_range by i mod 3): the job's plan time, memory and RMSE, the authors' QuerySmasher on
           the same workload at d = 10 (Kronecker shapes only), and the largest d planned in under 60 s
           at n = 10.

The benchmark prints tables and writes JSON to bench/results/dpquery.json. It never asserts on timing:
targets are reported as PASS/FAIL lines. Children run through ``benchutil.Children`` (peak memory read
inside them with ``benchutil.PeakRSS``). Every measurement, and the whole run, records a
``benchutil.LoadWatch`` window: load averages and the CPU other processes used, marked NOISY above half a
core; the plan table shows it per d, the other parts under their tables.

    .venv/bin/python bench/dpquery.py                      # every registered part
    .venv/bin/python bench/dpquery.py --parts plan --plan-d 10,20,50,100 --plan-repeats 3
    .venv/bin/python bench/dpquery.py --quick              # plan d = 10, 20, 50, one repeat
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
from benchutil import (  # noqa: E402
    Children,
    LoadWatch,
    PeakRSS,
    child_main,
    load_end_line,
    load_start_line,
    mark,
    quiet_logs,
    table,
    watched,
)

MiB = 1024 * 1024
ONE_CORE_ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "RAYON_NUM_THREADS": "1",
}


# --------------------------------------------------------------------------------------------------------
# small helpers (shared by every part)


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }
    from importlib.metadata import PackageNotFoundError, version

    for mod in ("numpy", "scipy", "cvxpy", "opendp", "pyarrow"):
        try:
            out[mod] = version(mod)
        except PackageNotFoundError:
            out[mod] = None
    try:
        with open("/proc/meminfo") as fh:
            out["mem_total"] = int(fh.readline().split()[1]) * 1024
    except OSError:
        out["mem_total"] = None
    return out


def pin_one_core() -> int | None:
    """Pin this process to one CPU (the first it may use); returns it, or None where unsupported."""
    try:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return cpu
    except (AttributeError, OSError):
        return None


_children: Children | None = None  # started in main(); the child processes of this run


def run_child(request: dict, timeout_s: float) -> dict:
    """Run ``request`` in a fresh ``python bench/dpquery.py --child REQ.json`` process with one BLAS/OpenMP
    thread (``benchutil.Children``); its result, or ``{"error": ...}`` with the child's traceback."""
    global _children
    if _children is None:
        _children = Children(Path(__file__))
    r = _children.run({**request, "op": request["child"]}, timeout_s, env_extra=ONE_CORE_ENV)
    if r.ok:
        return r.result
    return {"error": r.result.get("trace") or r.note}


CHILDREN: dict[str, Callable[[dict], dict]] = {}  # child entry points by name, for run_child


def synthetic_spec(d: int, n: int = 10, k: int = 3, rho: float = 0.5, loss: str = "sum_of_variances") -> dict:
    """A DPQuerySpec document over n^d with all marginals of at most k attributes."""
    return {
        "kind": "dpquery",
        "dataset": "bench/synthetic.parquet",
        "schema": [{"name": f"a{i:03d}", "range": [0, n - 1]} for i in range(d)],
        "workload": {"all_marginals_up_to": k},
        "budget": {"rho": rho},
        "loss": loss,
        "dataset_id": f"bench-synth-{n}-{d}",
    }


# --------------------------------------------------------------------------------------------------------
# part "plan": planning time, predicted error, memory


def child_plan(req: dict) -> dict:
    cpu = pin_one_core()
    quiet_logs(False)
    from shardfold.functions.dpquery.planner import Plan, plan
    from shardfold.functions.specs import parse_spec

    t0 = time.perf_counter()
    spec = parse_spec(synthetic_spec(req["d"], req["n"], req["k"], req["rho"], req["loss"]))
    marginals = spec.marginals()
    expand_s = time.perf_counter() - t0
    mem = PeakRSS()  # the planning's own peak, on top of the imports and the expanded workload
    times = []
    p = None
    for _ in range(req["repeats"]):
        p = None  # free the previous plan first: the peak is one plan's
        t = time.perf_counter()
        p = plan(spec)
        times.append(time.perf_counter() - t)
    peak = mem.report()
    t = time.perf_counter()
    text = json.dumps(p.to_doc())
    encode_s = time.perf_counter() - t
    t = time.perf_counter()
    Plan.from_doc(json.loads(text))
    decode_s = time.perf_counter() - t
    summary = p.summary()
    return {
        "d": req["d"],
        "loss": req["loss"],
        "cpu": cpu,
        "workload_marginals": len(marginals),
        "expand_s": expand_s,
        "plan_s": min(times),
        "plan_s_all": times,
        "peak_added_mib": None if peak["added_rss"] is None else peak["added_rss"] / MiB,
        "peak_rss_mib": peak["peak_rss"] / MiB,
        "doc_mib": len(text) / MiB,
        "doc_encode_s": encode_s,
        "doc_decode_s": decode_s,
        "measure_groups": len(p.residual_groups()),
        "reconstruct_groups": len(p.marginal_groups()),
        "summary": summary,
    }


CHILDREN["plan"] = child_plan


def add_plan_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--plan-d", default="10,20,50,100", help="attribute counts d to plan (10,20,50,100)")
    ap.add_argument("--plan-n", type=int, default=10, help="values per attribute (10)")
    ap.add_argument("--plan-k", type=int, default=3, help="all marginals of at most k attributes (3)")
    ap.add_argument("--plan-repeats", type=int, default=3, help="plans per d; the fastest counts (3)")
    ap.add_argument(
        "--plan-maxvar-d", default="10,20", help="d for which the max_variance plan is also timed (10,20)"
    )
    ap.add_argument("--rho", type=float, default=0.5, help="zCDP budget of the plans (0.5: 2ρ = 1)")
    ap.add_argument("--plan-target-s", type=float, default=10.0, help="target seconds at d = 100 (10)")


def part_plan(args: argparse.Namespace, doc: dict, notes: list[str]) -> int:
    ds = [int(x) for x in args.plan_d.split(",") if x.strip()]
    maxvar = [int(x) for x in args.plan_maxvar_d.split(",") if x.strip()]
    runs = [(d, "sum_of_variances") for d in ds] + [(d, "max_variance") for d in maxvar]
    print(
        f"\n== plan: {args.plan_n}^d, all <= {args.plan_k}-way marginals, rho = {args.rho} "
        f"(one core per child, best of {args.plan_repeats})"
    )
    results = []
    for d, loss in runs:
        req = {
            "child": "plan",
            "d": d,
            "n": args.plan_n,
            "k": args.plan_k,
            "rho": args.rho,
            "loss": loss,
            "repeats": 1 if loss == "max_variance" else args.plan_repeats,
        }
        with watched(f"plan d={d} {loss}") as w:
            res = run_child(req, timeout_s=args.child_timeout_s)
        res.setdefault("d", d)
        res.setdefault("loss", loss)
        res["load"] = w.report()
        results.append(res)
        if "error" in res:
            print(f"  d={d} {loss}: FAILED {res['error'].strip().splitlines()[-1]}")
            notes.append(f"plan d={d} {loss}: {res['error']}")
    rows = []
    for r in results:
        if "error" in r:
            continue
        s = r["summary"]
        pr = s["privacy"]
        rows.append(
            [
                f"{r['d']}" + (" maxvar" if r["loss"] == "max_variance" else ""),
                f"{s['residual_sets']:,}",
                f"{s['queries']:,}",
                f"{s['noise_samples']:,}",
                f"{s['largest_marginal_cells']:,}",
                f"{r['plan_s']:.3f}",
                f"{r['expand_s']:.2f}",
                "-" if r["peak_added_mib"] is None else f"{r['peak_added_mib']:.0f}",
                f"{r['doc_mib']:.2f}",
                f"{s['rmse']:.4f}",
                f"{s['max_cell_stddev']:.3f}",
                f"{pr['epsilon_cks']:.3f}/{pr['epsilon_gaussian']:.3f}",
                mark(r.get("load")),
            ]
        )
    delta = results[0].get("summary", {}).get("privacy", {}).get("delta") if results else None
    print(
        table(
            [
                "d",
                "residual sets",
                "queries",
                "noise samples",
                "max cells",
                "plan s",
                "spec s",
                "+MiB",
                "doc MiB",
                "RMSE",
                "max sd",
                f"eps CKS/Gauss @{delta}",
                "load",
            ],
            rows,
        )
    )
    print(
        "  plan s: planner.plan(spec), best of the repeats; spec s: parse + expand the workload;\n"
        "  +MiB: peak RSS the planning added (max_variance: includes importing cvxpy);"
        " doc: Plan.to_doc() as JSON"
    )
    doc["plan"] = {"config": {"n": args.plan_n, "k": args.plan_k, "rho": args.rho}, "runs": results}
    big = next((r for r in results if r.get("d") == 100 and r.get("loss") == "sum_of_variances"), None)
    rc = 0
    if big is not None and "error" not in big:
        ok = big["plan_s"] < args.plan_target_s and big["summary"]["residual_sets"] == 166_751
        line = (
            f"TARGET plan d=100: {big['summary']['residual_sets']:,} residual sets in {big['plan_s']:.2f} s "
            f"on one core (< {args.plan_target_s:g} s): {'PASS' if ok else 'FAIL'}"
        )
        print(line)
        doc.setdefault("targets", []).append({"name": "plan_d100", "pass": ok, "line": line})
    elif 100 in ds:
        rc = 1
    return rc


# --------------------------------------------------------------------------------------------------------
# part "measure": noise samples per second per core, the measure step against OpenDP called directly


def synthetic_dataset(path: Path, d: int, rows: int, n: int = 10, seed: int = 0) -> float:
    """Write an n^d Parquet dataset of ``rows`` uniform rows (columns a000.., int8); returns seconds taken.
    (numpy's generator makes the *data* here; noise only ever comes from OpenDP.)"""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    cols = {f"a{i:03d}": rng.integers(0, n, rows, dtype=np.int8) for i in range(d)}
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path, row_group_size=1 << 18)
    return time.perf_counter() - t0


def _start_job(executor: Any, root: str, doc: dict) -> str:
    """Record a spec and start the job on ``executor`` (Client.submit without the plan estimate)."""
    from shardfold.functions import store
    from shardfold.functions.jobs import new_job_id
    from shardfold.functions.specs import parse_spec
    from shardfold.functions.store.uri import join

    spec = parse_spec(doc)
    job_id = new_job_id("dpquery")
    spec_uri = join(root, "jobs", job_id, "spec.json")
    store.put_json(spec_uri, spec.model_dump(mode="json", exclude_none=True))
    executor.start(job_id, "dpquery", spec_uri)
    return job_id


def child_measure(req: dict) -> dict:
    """One core: pick a measure group of 3-way residual sets of the d-attribute plan and time, best of
    ``rounds`` interleaved rounds, (direct) OpenDP's make_gaussian built and invoked on each set's E_S x_S,
    (sampling) our measure_sets on the same marginals (transform, sensitivity, map check, draw), and
    (step) the whole measure task, core.measure (read the data, count the marginals, measure, write)."""
    import math
    import tempfile

    cpu = pin_one_core()
    quiet_logs(False)
    import opendp.prelude as dp

    from shardfold.functions.dpquery import core, data, planner
    from shardfold.functions.dpquery import measure as mz
    from shardfold.functions.specs import parse_spec

    dp.enable_features("contrib")
    tmp = Path(tempfile.mkdtemp(prefix="dpq-measure-"))
    root = f"file://{tmp}/store"
    gen_s = synthetic_dataset(tmp / "store" / "data" / "synth.parquet", req["d"], req["rows"])
    doc = synthetic_spec(req["d"])
    doc.update(
        dataset=f"{root}/data/synth.parquet",
        noise_samples_per_task=req["samples"],
        dataset_budget_rho=1e9,
        dataset_id="bench-measure",
    )
    spec = parse_spec(doc)
    pl = planner.plan(spec)
    groups = pl.residual_groups(req["samples"])
    # the first group made only of 3-way sets (the bulk of the samples)
    g = next(i for i, (s, t) in enumerate(groups) if len(pl.residual(s)) == 3 and t - s > 1)
    start, stop = groups[g]
    sets = [
        mz.SetSpec(
            k,
            pl.residual(k),
            tuple(int(pl.domains[a]) for a in pl.residual(k)),
            math.sqrt(float(pl.sigma2[k])),
            float(pl.rho_s[k]),
        )
        for k in range(start, stop)
    ]
    t = time.perf_counter()
    hist = data.marginals(spec.dataset, "parquet", spec.attributes, [s.attrs for s in sets])
    hist_s = time.perf_counter() - t
    ys = [mz.residual(hist[s.attrs]) for s in sets]
    samples = int(sum(y.size for y in ys))
    direct, sampling, step = [], [], []
    for r in range(req["rounds"]):
        t = time.perf_counter()
        for s, y in zip(sets, ys, strict=True):
            meas = dp.m.make_gaussian(
                dp.vector_domain(dp.atom_domain(T=float, nan=False), size=y.size),
                dp.l2_distance(T=float),
                scale=s.scale,
            )
            meas(y)
        direct.append(time.perf_counter() - t)
        mz.gaussian.cache_clear()  # our cache must not make our side look better than a cold build
        t = time.perf_counter()
        mz.measure_sets(sets, hist.__getitem__)
        sampling.append(time.perf_counter() - t)
        job_id = f"dpquery-20000101T000000-{r:06x}"
        core.prepare(spec, job_id, root)
        mz.gaussian.cache_clear()
        t = time.perf_counter()
        out = core.measure(spec, job_id, root, g)
        step.append(time.perf_counter() - t)
        assert out["samples"] == samples and not out["reused"]
    return {
        "cpu": cpu,
        "d": req["d"],
        "rows": req["rows"],
        "group": g,
        "sets": stop - start,
        "samples": samples,
        "generate_s": gen_s,
        "histogram_s": hist_s,
        "direct_s": direct,
        "sampling_s": sampling,
        "step_s": step,
    }


CHILDREN["measure"] = child_measure


def add_measure_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--measure-d", type=int, default=20, help="attributes of the measure part's data (20)")
    ap.add_argument("--measure-rows", type=int, default=1_000_000, help="rows of its dataset (1,000,000)")
    ap.add_argument("--measure-samples", type=int, default=100_000, help="noise samples of the group (100k)")
    ap.add_argument("--measure-rounds", type=int, default=3, help="interleaved rounds; best counts (3)")
    ap.add_argument("--measure-target", type=float, default=0.8, help="target: step >= this x direct (0.8)")


def part_measure(args: argparse.Namespace, doc: dict, notes: list[str]) -> int:
    if args.quick:
        args.measure_rows = min(args.measure_rows, 200_000)
        args.measure_samples = min(args.measure_samples, 30_000)
        args.measure_rounds = min(args.measure_rounds, 2)
    req = {
        "child": "measure",
        "d": args.measure_d,
        "rows": args.measure_rows,
        "samples": args.measure_samples,
        "rounds": args.measure_rounds,
    }
    print(
        f"\n== measure: one task's group of 3-way residual sets, d = {args.measure_d}, "
        f"{args.measure_rows:,} rows (one core, best of {args.measure_rounds} interleaved rounds)"
    )
    with watched("measure") as w:
        res = run_child(req, timeout_s=args.child_timeout_s)
    res["load"] = w.report()
    doc["measure"] = res
    if "error" in res:
        print(f"  FAILED {res['error'].strip().splitlines()[-1]}")
        notes.append(f"measure: {res['error']}")
        return 1
    n = res["samples"]
    best = {k: min(res[k + "_s"]) for k in ("direct", "sampling", "step")}
    rate = {k: n / v for k, v in best.items()}
    rows = [
        [
            "OpenDP make_gaussian + invoke, per set (direct)",
            f"{best['direct']:.2f}",
            f"{rate['direct']:,.0f}",
            "1.00",
            "",
        ],
        [
            "measure_sets: E_S x_S, map check, OpenDP draw",
            f"{best['sampling']:.2f}",
            f"{rate['sampling']:,.0f}",
            f"{rate['sampling'] / rate['direct']:.2f}",
            "",
        ],
        [
            "measure task: read + count + measure + write",
            f"{best['step']:.2f}",
            f"{rate['step']:,.0f}",
            f"{rate['step'] / rate['direct']:.2f}",
            "",
        ],
    ]
    print(
        f"  group {res['group']}: {res['sets']} residual sets, {n:,} noise samples; "
        f"histograms alone {res['histogram_s']:.2f} s"
    )
    print(table(["path", "seconds", "samples/s/core", "x direct", ""], rows))
    print(f"  (one core; {mark(res['load'])} during the run)")
    ratio = rate["step"] / rate["direct"]
    ok = ratio >= args.measure_target
    line = (
        f"TARGET measure: the measure task draws {rate['step']:,.0f} samples/s on one core, "
        f"{ratio:.2f}x OpenDP called directly (>= {args.measure_target:g}x): {'PASS' if ok else 'FAIL'}"
    )
    print(line)
    doc.setdefault("targets", []).append({"name": "measure_vs_opendp", "pass": ok, "line": line})
    return 0


# --------------------------------------------------------------------------------------------------------
# part "e2e": the whole job on the local executor, d = 20, 1,000,000 rows


def add_e2e_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--e2e-d", type=int, default=20, help="attributes (20)")
    ap.add_argument("--e2e-rows", type=int, default=1_000_000, help="rows (1,000,000)")
    ap.add_argument("--e2e-k", type=int, default=3, help="all marginals of at most k attributes (3)")
    ap.add_argument(
        "--e2e-samples-per-task", type=int, default=0, help="measure fan-out (0: about 4 tasks per CPU)"
    )
    ap.add_argument("--e2e-processes", type=int, default=0, help="local executor processes (0: all CPUs)")
    ap.add_argument("--e2e-check", type=int, default=200, help="3-way marginals checked against truth (200)")


def part_e2e(args: argparse.Namespace, doc: dict, notes: list[str]) -> int:
    import math
    import tempfile

    import numpy as np
    import pyarrow.parquet as pq

    from shardfold.functions import store
    from shardfold.functions.dpquery import data, planner
    from shardfold.functions.specs import parse_spec
    from shardfold.orchestrator.local import LocalExecutor

    if args.quick:
        args.e2e_d = min(args.e2e_d, 10)
        args.e2e_rows = min(args.e2e_rows, 100_000)
    cpus = os.cpu_count() or 1
    procs = args.e2e_processes or cpus
    tmp = Path(tempfile.mkdtemp(prefix="dpq-e2e-"))
    root = f"file://{tmp}/store"
    gen_s = synthetic_dataset(tmp / "store" / "data" / "synth.parquet", args.e2e_d, args.e2e_rows)
    spec_doc = synthetic_spec(args.e2e_d, k=args.e2e_k)
    spec_doc.update(dataset=f"{root}/data/synth.parquet", dataset_budget_rho=1.0, dataset_id="bench-e2e")
    pl = planner.plan(parse_spec(spec_doc))
    per_task = args.e2e_samples_per_task or math.ceil(pl.total_noise_samples / (4 * procs))
    spec_doc["noise_samples_per_task"] = per_task
    print(
        f"\n== e2e: d = {args.e2e_d}, {args.e2e_rows:,} rows (Parquet, generated in {gen_s:.1f} s), all <= "
        f"{args.e2e_k}-way marginals, local executor with {procs} processes"
    )
    marks: dict[str, float] = {}
    watch = LoadWatch("e2e")
    with LocalExecutor(store_root=root, processes=procs, retry_delay_scale=0) as ex:
        t0 = time.perf_counter()
        job_id = _start_job(ex, root, spec_doc)
        while True:  # the benchmark may poll: it measures time, it asserts nothing
            st = ex.status(job_id)
            now = time.perf_counter() - t0
            for name, prog in (st.steps or {}).items():
                total = prog.get("total")
                if name not in marks and total is not None and prog.get("done", 0) >= max(total, 1):
                    marks[name] = now
            if st.finished:
                break
            time.sleep(0.1)
        total_s = time.perf_counter() - t0
    load = watch.report()
    if st.state != "SUCCEEDED":
        print(f"  FAILED: {st.error}")
        notes.append(f"e2e: {st.error}")
        doc["e2e"] = {"error": st.error}
        return 1
    result = store.get_json(f"{root}/jobs/{job_id}/result.json")
    report = result["report"]
    # observed error: every 0/1/2-way marginal and the first --e2e-check 3-way ones, against the truth
    index = store.get_json(result["tables_index"])
    checked = [t for t in index if len(t["attributes"]) < 3] + [
        t for t in index if len(t["attributes"]) == 3
    ][: args.e2e_check]
    spec = parse_spec(spec_doc)
    pos = {a.name: i for i, a in enumerate(spec.attributes)}
    t = time.perf_counter()
    truth = data.marginals(
        spec.dataset, "parquet", spec.attributes, [tuple(pos[a] for a in e["attributes"]) for e in checked]
    )
    truth_s = time.perf_counter() - t
    sq, cells, pred = 0.0, 0, 0.0
    for e in checked:
        est = pq.read_table(e["parquet"][len("file://") :]).column("estimate").to_numpy()
        x = truth[tuple(pos[a] for a in e["attributes"])].reshape(-1)
        sq += float(np.sum((est - x) ** 2))
        cells += x.size
        pred += e["variance"] * x.size
    steps = ["plan", "measure", "reconstruct", "finalize"]
    prev = 0.0
    rows = []
    for name in steps:
        end = marks.get(name, total_s if name == "finalize" else float("nan"))
        rows.append([name, f"{end - prev:.1f}", f"{end:.1f}", ""])
        prev = end
    rows.append(["total", f"{total_s:.1f}", "", ""])
    print(
        f"  {report['residual_sets']:,} residual sets, {report['marginals']:,} marginals, "
        f"{report['cells']:,} cells, {report['noise_samples']:,} noise samples; "
        f"{report['measure_tasks']} measure tasks ({per_task:,} samples each), "
        f"{report['reconstruct_tasks']} reconstruct tasks"
    )
    print(table(["step", "seconds", "ends at", ""], rows))
    print(f"  ({mark(load)} during the job)")
    measure_s = marks.get("measure", float("nan")) - marks.get("plan", 0.0)
    rate = report["noise_samples"] / measure_s if measure_s > 0 else float("nan")
    direct = doc.get("measure", {})
    direct_rate = (
        direct["samples"] / min(direct["direct_s"]) if direct and "direct_s" in direct else float("nan")
    )
    print(
        f"  measure step: {rate:,.0f} samples/s on {procs} processes ({rate / procs:,.0f} per process); "
        f"OpenDP alone would need {report['noise_samples'] / (direct_rate * procs):.1f} s at the measure "
        f"part's direct rate ({direct_rate:,.0f}/s/core)"
    )
    print(
        f"  error: predicted workload RMSE {report['predicted_rmse']:.3f}; on {len(checked):,} checked "
        f"marginals ({cells:,} cells) observed RMSE {math.sqrt(sq / cells):.3f} vs predicted "
        f"{math.sqrt(pred / cells):.3f}  (truth counted in {truth_s:.1f} s, never printed)"
    )
    print(
        f"  privacy: rho spent {report['rho_spent']:.10f} of {report['rho_budget']}; "
        f"eps CKS {report['epsilon_cks']:.3f} / Gaussian {report['epsilon_gaussian']:.3f} "
        f"at delta {report['delta']}"
    )
    doc["e2e"] = {
        "d": args.e2e_d,
        "rows": args.e2e_rows,
        "processes": procs,
        "samples_per_task": per_task,
        "generate_s": gen_s,
        "steps_end_s": marks,
        "total_s": total_s,
        "load": load,
        "measure_samples_per_s": rate,
        "report": report,
        "observed_rmse_checked": math.sqrt(sq / cells),
        "predicted_rmse_checked": math.sqrt(pred / cells),
        "checked_marginals": len(checked),
    }
    return 0


# --------------------------------------------------------------------------------------------------------
# registry and main


# --------------------------------------------------------------------------------------------------------
# part "queries": general linear queries (QuerySmasher) against summing ResidualPlanner's cells


# The RP+ paper's datasets (domains, and how many leading attributes are ordinal and queried by prefix):
# reference §3.1, issue 14.
RP_PLUS_DATASETS = {
    "CPS": ([50, 100, 7, 4, 2], 2),
    "Adult": ([100, 100, 100, 99, 85, 42, 16, 15, 9, 7, 6, 5, 2, 2], 5),
    "Loans": ([101, 101, 101, 101, 3, 8, 36, 6, 51, 4, 5, 15], 4),
}
WORKLOADS = {"1-way": (1,), "2-way": (2,), "3-way": (3,), "<=3-way": (0, 1, 2, 3)}
# The RP+ paper's published RMSE on these prefix workloads (its journal version's Table 8, as quoted in the
# QuerySmasher authors' repository, exp/paper_section8_2.py): privacy cost 1, prefix on the leading
# ordinal attributes, identity on the rest, "<=3-way" with the 0-way total.
RP_PLUS_PUBLISHED = {
    "CPS": {"1-way": 3.081, "2-way": 5.823, "3-way": 7.302, "<=3-way": 7.570},
    "Adult": {"1-way": 5.081, "2-way": 17.274, "3-way": 45.223, "<=3-way": 45.174},
    "Loans": {"1-way": 4.681, "2-way": 14.502, "3-way": 34.168, "<=3-way": 34.144},
}
BOUND_MAX_DIM = 6000  # the SVD bound's largest eigendecomposition (functions/dpquery/bounds.py)


def child_queries(req: dict) -> dict:
    """One (dataset, workload) row: the job's plan of the prefix workload (functions.dpquery.planner with
    ``queries``: QuerySmasher's strategies) and ResidualPlanner's identity plan with each prefix query
    answered by summing its cells, both at privacy cost 2ρ = 1."""
    import itertools
    import math

    import numpy as np

    cpu = pin_one_core()
    from shardfold.functions.dpquery import smasher
    from shardfold.functions.dpquery.planner import plan as rp_plan

    domains, ordinal = req["domains"], req["ordinal"]
    d = len(domains)
    sets = [c for k in req["ways"] for c in itertools.combinations(range(d), k)]
    kinds = {i: "prefix" for i in range(ordinal)}
    asked = [{i: kinds[i] for i in a if i in kinds} for a in sets]
    mem = PeakRSS()
    t = time.perf_counter()
    qs = rp_plan(domains=domains, workload=[(a, 1.0) for a in sets], rho=0.5, queries=asked)
    qs_s = time.perf_counter() - t
    queries = qs.num_queries
    peak = mem.report()
    split = sorted(qs.totals)  # the (type, size) groups measured through RP+'s Schur split
    # the ablation: residuals orthogonal to the total only (QuerySmasher's class, the plan before the split)
    orthogonal = rp_plan(
        domains=domains, workload=[(a, 1.0) for a in sets], rho=0.5, queries=asked, split_totals=False
    )
    # the substitute: RP's identity plan; Σ over a Kronecker family of Var = Σ_{S⊆A} σ_S² ∏_{i∈S} ‖W_iP_i‖_F²
    # ∏_{i∈A∖S} ‖W_i1/n_i‖² (its rows are every combination of the attributes' rows)
    t = time.perf_counter()
    rp = rp_plan(domains=domains, workload=[(a, 1.0) for a in sets], rho=0.5)
    rp_s = time.perf_counter() - t
    f, c = [], []
    for i, n in enumerate(domains):
        w = smasher.attribute_queries(kinds.get(i, "identity"), n)
        f.append(float(np.sum((w - w.mean(axis=1, keepdims=True)) ** 2)))
        c.append(float(np.sum((w.sum(axis=1) / n) ** 2)))
    sse_rp = 0.0
    for j in range(rp.num_marginals):
        a = rp.marginal(j)
        for s_idx in rp.subsets(j):
            s_set = set(rp.residual(s_idx))
            sse_rp += float(rp.sigma2[s_idx]) * math.prod(f[i] if i in s_set else c[i] for i in a)
    # the authors' code takes no 0-way entry: the comparison with it is on the workload without the total
    ref_ways = tuple(k for k in req["ways"] if k > 0)
    rmse_ref_ways = qs.rmse
    if ref_ways != tuple(req["ways"]):
        kept = [k for k, a in enumerate(sets) if a]
        rmse_ref_ways = rp_plan(
            domains=domains,
            workload=[(sets[k], 1.0) for k in kept],
            rho=0.5,
            queries=[asked[k] for k in kept],
        ).rmse
    from shardfold.functions.dpquery.bounds import TooLarge, svd_bound_rmse

    t = time.perf_counter()
    try:  # the SVD lower bound: no plan of this workload at this privacy cost has a lower RMSE
        bound = svd_bound_rmse(
            domains, [kinds.get(i, "identity") for i in range(d)], sets, 1.0, BOUND_MAX_DIM
        )
        bound_note = ""
    except TooLarge as exc:
        bound, bound_note = None, str(exc)
    bound_s = time.perf_counter() - t
    return {
        "cpu": cpu,
        "queries": queries,
        "svd_bound": bound,
        "svd_bound_note": bound_note,
        "svd_bound_s": bound_s,
        "ref_ways": list(ref_ways),
        "rmse_qs_ref_ways": rmse_ref_ways,
        "partitions": qs.num_residuals,
        "rmse_qs": qs.rmse,
        "rmse_orthogonal": orthogonal.rmse,
        "split": split,
        "rmse_rp_cells": math.sqrt(sse_rp / queries),
        "plan_s": qs_s,
        "rp_plan_s": rp_s,
        "peak_added_mib": None if peak["added_rss"] is None else peak["added_rss"] / MiB,
    }


CHILDREN["queries"] = child_queries


def add_queries_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--queries-datasets", default="CPS,Adult,Loans", help="RP+ datasets (CPS,Adult,Loans)")
    ap.add_argument("--queries-workloads", default="1-way,2-way,3-way,<=3-way", help="workloads")
    ap.add_argument(
        "--queries-reference-timeout",
        type=float,
        default=300.0,
        help="seconds per row for the authors' QuerySmasher (bench/qs_reference.py; 0: skip it) (300)",
    )


def _reference_row(domains: list[int], ordinal: int, ways: list[int], timeout_s: float) -> dict:
    """The authors' QuerySmasher on the row's workload less its 0-way total, which their code does not take
    (its best-of-solvers ``convex``, one thread), or why not."""
    import qs_reference

    if timeout_s <= 0:
        return {"status": "skipped", "why": "--queries-reference-timeout 0"}
    if not (qs_reference.reference_dir() / "smasher.py").exists():
        return {"status": "skipped", "why": "no exported checkout: see bench/qs_reference.py (export)"}
    workload = [e for k in ways for e in qs_reference.kway_workload(domains, k, range(ordinal))]
    return qs_reference.reference_rmse_in_child(domains, workload, 1.0, "convex", timeout_s, threads=1)


def part_queries(args: argparse.Namespace, doc: dict, notes: list[str]) -> int:
    print(
        "\n== queries: prefix workloads of the RP+ paper's datasets, privacy cost 2ρ = 1 (one core per child)"
    )
    results, rows = [], []
    for name in [x.strip() for x in args.queries_datasets.split(",") if x.strip()]:
        domains, ordinal = RP_PLUS_DATASETS[name]
        for wl in [x.strip() for x in args.queries_workloads.split(",") if x.strip()]:
            req = {"child": "queries", "domains": domains, "ordinal": ordinal, "ways": WORKLOADS[wl]}
            with watched(f"queries {name} {wl}") as w:
                res = run_child(req, timeout_s=args.child_timeout_s)
            res.update(dataset=name, workload=wl, load=w.report())
            with watched(f"reference {name} {wl}") as w:
                res["reference"] = _reference_row(
                    domains, ordinal, res.get("ref_ways", []), args.queries_reference_timeout
                )
            res["reference"]["load"] = w.report()
            results.append(res)
            if "error" in res:
                print(f"  {name} {wl}: FAILED {res['error'].strip().splitlines()[-1]}")
                notes.append(f"queries {name} {wl}: {res['error']}")
                continue
            ref = res["reference"]
            ok = ref.get("status") == "ok"
            published = RP_PLUS_PUBLISHED[name][wl]
            res["rp_plus_published"] = published
            bound = res.get("svd_bound")
            rows.append(
                [
                    name,
                    wl,
                    f"{res['queries']:,}",
                    f"{res['partitions']:,}",
                    f"{res['rmse_qs']:.4f}",
                    f"{res['rmse_orthogonal']:.4f}",
                    f"{published:.3f}",
                    f"{res['rmse_qs'] / published:.3f}",
                    "n/a" if bound is None else f"{bound:.4f}",
                    "" if bound is None else f"{res['rmse_qs'] / bound:.3f}",
                    f"{res['rmse_rp_cells']:.3f}",
                    f"{res['rmse_rp_cells'] / res['rmse_qs']:.2f}x",
                    f"{ref['rmse']:.3f}" if ok else str(ref.get("error") or ref.get("status", "?"))[:24],
                    f"{res['rmse_qs_ref_ways'] / ref['rmse']:.4f}" if ok else "",
                    f"{res['plan_s']:.2f}",
                    f"{ref['seconds']:.2f}" if ok else "",
                    "-" if res["peak_added_mib"] is None else f"{res['peak_added_mib']:.0f}",
                    mark(res.get("load")),
                ]
            )
    headers = ["dataset", "workload", "queries", "partitions", "RMSE", "no split", "RP+ paper", "/RP+"]
    headers += ["SVD bound"]
    headers += ["/bound", "RMSE RP cells", "RP/ours"]
    headers += ["RMSE ref", "ours/ref", "plan s", "ref s", "+MiB", "load"]
    print(table(headers, rows))
    print(
        "  prefix queries on the leading ordinal attributes, each value of the others;"
        " RMSE = sqrt(SSE/queries);\n"
        "  RP cells: ResidualPlanner's identity marginals, each prefix query answered by summing its cells;\n"
        "  RMSE: the job's plan (residuals orthogonal to the total, or RP+'s Schur split where it is better);"
        " no split:\n  residuals orthogonal to the total only (planner.plan(split_totals=False), the plan"
        " before the split)"
    )
    print(
        "  RP+ paper: the RP+ journal version's published RMSE (Table 8); SVD bound: no plan of the workload"
        " at this\n  privacy cost has a lower RMSE (functions/dpquery/bounds.py; n/a where its eigen-"
        f"decomposition would pass {BOUND_MAX_DIM:,}\n  dimensions: two ordinal attributes of ~100 values in"
        " one marginal)"
    )
    print(
        "  ref: the authors' QuerySmasher (cmla-psu/QuerySmasherMatrixMechanism, its 'convex' solver: the"
        " best of convex,\n  Fourier and the RP+ basis per partition), one thread, optimize() timed; a row it"
        " does not finish says timeout;\n  ours/ref compares the two without the 0-way total, which the"
        " authors' code does not take (<=3-way)"
    )
    doc["queries"] = {"runs": results}
    done = [r for r in results if "error" not in r]
    if done:
        at_or_below = sum(r["rmse_qs"] <= r["rp_plus_published"] * (1 + 1e-9) for r in done)
        line = (
            f"TARGET queries: RMSE <= the RP+ paper's published value on every row: {at_or_below} of "
            f"{len(done)}: {'PASS' if at_or_below == len(done) else 'FAIL'}"
        )
        print(line)
        doc.setdefault("targets", []).append(
            {"name": "queries_rmse_vs_rp_plus_published", "pass": at_or_below == len(done), "line": line}
        )
    if done:
        slowest = max(done, key=lambda r: r["plan_s"])
        ok = slowest["plan_s"] < 1.0
        line = (
            f"TARGET queries: every row planned in under 1 s on one core: slowest {slowest['dataset']} "
            f"{slowest['workload']} {slowest['plan_s']:.2f} s: {'PASS' if ok else 'FAIL'}"
        )
        print(line)
        doc.setdefault("targets", []).append({"name": "queries_plan_under_1s", "pass": ok, "line": line})
    compared = [r for r in results if r.get("reference", {}).get("status") == "ok" and "error" not in r]
    if compared:
        worst = max(r["rmse_qs_ref_ways"] / r["reference"]["rmse"] for r in compared)
        ok = worst <= 1 + 1e-9
        line = (
            f"TARGET queries: RMSE <= the reference QuerySmasher on every row it finished ({len(compared)}): "
            f"worst ours/ref {worst:.6f}: {'PASS' if ok else 'FAIL'}"
        )
        print(line)
        doc.setdefault("targets", []).append({"name": "queries_rmse_vs_reference", "pass": ok, "line": line})
    return 0 if all("error" not in r for r in results) else 1


# --------------------------------------------------------------------------------------------------------
# part "mixed": general query types on [n]^d at scale, and the authors' QuerySmasher on the same workloads

MIXED_TYPES = ("range", "prefix", "circular_range")  # attribute i is queried as MIXED_TYPES[i % 3]


def mixed_workload(d: int, shape: str = "issue") -> tuple[list, list]:
    """``issue``: every attribute's 1-way ranges, every pair's 2-way affine queries and every 3-way
    marginal's prefixes: each 1- and 2-way residual set is reached by a 2-way type and by Kronecker
    entries, so it is solved whole (pairs of one structure solve once). ``kron``: the same less the
    affine queries (the Kronecker solver alone). ``cycle``: all marginals of 1 to 3 attributes, attribute i
    asked as MIXED_TYPES[i % 3] wherever it appears."""
    import itertools

    if shape in ("issue", "kron"):
        ones = [(i,) for i in range(d)]
        twos = list(itertools.combinations(range(d), 2)) if shape == "issue" else []
        threes = list(itertools.combinations(range(d), 3))
        asked = [{i: "range"} for (i,) in ones] + [{a: "affine", b: "affine"} for a, b in twos]
        return ones + twos + threes, asked + [{i: "prefix" for i in a} for a in threes]
    sets = [c for k in (1, 2, 3) for c in itertools.combinations(range(d), k)]
    return sets, [{i: MIXED_TYPES[i % 3] for i in a} for a in sets]


def child_mixed(req: dict) -> dict:
    """The job's plan of the mixed workload on [n]^d (privacy cost 2ρ = 1): time, memory, RMSE."""
    cpu = pin_one_core()
    from shardfold.functions.dpquery import planner

    n, d = req["n"], req["d"]
    sets, asked = mixed_workload(d, req.get("shape", "issue"))
    mem = PeakRSS()
    t = time.perf_counter()
    pl = planner.plan(domains=[n] * d, workload=[(a, 1.0) for a in sets], rho=0.5, queries=asked)
    seconds = time.perf_counter() - t
    peak = mem.report()
    return {
        "cpu": cpu,
        "marginals": len(sets),
        "queries": pl.num_queries,
        "partitions": pl.num_residuals,
        "rmse": pl.rmse,
        "plan_s": seconds,
        "peak_added_mib": None if peak["added_rss"] is None else peak["added_rss"] / MiB,
    }


CHILDREN["mixed"] = child_mixed


def add_mixed_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--mixed-n", default="10,20,40", help="domain sizes n of [n]^d (10,20,40)")
    ap.add_argument(
        "--mixed-shape",
        default="issue",
        choices=["issue", "kron", "cycle"],
        help="the workload (see mixed_workload)",
    )
    ap.add_argument("--mixed-d", default="10,20,30,50", help="numbers of attributes d (10,20,30,50)")
    ap.add_argument(
        "--mixed-reference-d",
        default="10",
        help="the d for which the authors' QuerySmasher runs too, at every n (10; '' skips it)",
    )
    ap.add_argument(
        "--mixed-reference-timeout", type=float, default=600.0, help="seconds per reference row (600)"
    )
    ap.add_argument(
        "--mixed-largest",
        default="100,150,200,300,330",
        help="at n = 10, the d tried in turn until a plan takes 60 s or more (100,150,200,300,330)",
    )


def part_mixed(args: argparse.Namespace, doc: dict, notes: list[str]) -> int:
    import qs_reference

    if args.mixed_shape == "issue":
        print("\n== mixed: [n]^d, every attribute's 1-way ranges, every pair's 2-way affine queries and")
        print("   every 3-way marginal's prefixes,")
    elif args.mixed_shape == "kron":
        print("\n== mixed: [n]^d, every attribute's 1-way ranges and every 3-way marginal's prefixes,")
    else:
        print("\n== mixed: all 1-, 2- and 3-way marginals of [n]^d, attribute i asked as range, prefix or")
        print("   circular_range by i mod 3,")
    print("   privacy cost 2ρ = 1 (one core per child)")
    results, rows, refusals = [], [], []
    ref_d = {int(x) for x in args.mixed_reference_d.split(",") if x.strip()}
    for n in [int(x) for x in args.mixed_n.split(",") if x.strip()]:
        for d in [int(x) for x in args.mixed_d.split(",") if x.strip()]:
            with watched(f"mixed n={n} d={d}") as w:
                req = {"child": "mixed", "n": n, "d": d, "shape": args.mixed_shape}
                res = run_child(req, timeout_s=args.child_timeout_s)
            res.update(n=n, d=d, load=w.report())
            ref: dict = {"status": "skipped"}
            if d in ref_d and "error" not in res and args.mixed_shape == "issue":
                ref = {"status": "skipped", "why": "the reference is run on Kronecker entries only"}
            elif d in ref_d and "error" not in res:
                sets, asked = mixed_workload(d, args.mixed_shape)
                workload = [(a, q) for a, q in zip(sets, asked, strict=True)]
                if not (qs_reference.reference_dir() / "smasher.py").exists():
                    ref = {"status": "skipped", "why": "no exported checkout: see bench/qs_reference.py"}
                else:
                    with watched(f"reference n={n} d={d}") as w:
                        ref = qs_reference.reference_rmse_in_child(
                            [n] * d, workload, 1.0, "convex", args.mixed_reference_timeout, threads=1
                        )
                    ref["load"] = w.report()
            res["reference"] = ref
            results.append(res)
            if "error" in res:
                why = res["error"].strip().splitlines()[-1]
                if (
                    "PlanError" in why or "SpecError" in why
                ):  # the job's own refusal: a finding, not a failure
                    res["refused"] = why
                    rows.append([str(n), str(d), "refused"] + [""] * 10)
                    refusals.append(f"  n={n} d={d} refused by the planner: {why.split(': ', 1)[-1]}")
                    continue
                print(f"  n={n} d={d}: FAILED {why}")
                notes.append(f"mixed n={n} d={d}: {res['error']}")
                continue
            ok = ref.get("status") == "ok"
            rows.append(
                [
                    str(n),
                    str(d),
                    f"{res['marginals']:,}",
                    f"{res['queries']:,}",
                    f"{res['partitions']:,}",
                    f"{res['rmse']:.3f}",
                    f"{res['plan_s']:.2f}",
                    "-" if res["peak_added_mib"] is None else f"{res['peak_added_mib']:.0f}",
                    f"{ref['rmse']:.3f}" if ok else str(ref.get("error") or ref.get("status", "?"))[:24],
                    f"{res['rmse'] / ref['rmse']:.4f}" if ok else "",
                    f"{ref['seconds']:.1f}" if ok else "",
                    f"{ref['seconds'] / res['plan_s']:.0f}x" if ok else "",
                    mark(res.get("load")),
                ]
            )
    headers = ["n", "d", "marginals", "queries", "partitions", "RMSE", "plan s", "+MiB"]
    headers += ["RMSE ref", "ours/ref", "ref s", "speed-up", "load"]
    print(table(headers, rows))
    print("\n".join(dict.fromkeys(refusals)))
    # the largest d planned in under 60 s on one core, at n = 10
    largest = None
    tried = []
    for d in [int(x) for x in args.mixed_largest.split(",") if x.strip()]:
        res = run_child({"child": "mixed", "n": 10, "d": d, "shape": args.mixed_shape}, args.child_timeout_s)
        res.update(n=10, d=d)
        tried.append(res)
        if "error" in res:
            print(f"  largest: n=10 d={d}: {res['error'].strip().splitlines()[-1]}")
            break
        print(f"  largest: n=10 d={d}: {res['marginals']:,} marginals planned in {res['plan_s']:.1f} s")
        if res["plan_s"] >= 60:
            break
        largest = d
    doc["mixed"] = {"runs": results, "largest": {"tried": tried, "d_under_60s": largest}}
    compared = [r for r in results if r.get("reference", {}).get("status") == "ok" and "error" not in r]
    if compared:
        worst = max(r["rmse"] / r["reference"]["rmse"] for r in compared)
        slowest = min(r["reference"]["seconds"] / r["plan_s"] for r in compared)
        ok = worst <= 1 + 1e-9 and slowest >= 10
        line = (
            f"TARGET mixed: RMSE <= the reference and plans >= 10x faster on every row it finished "
            f"({len(compared)}): worst RMSE ratio {worst:.4f}, least speed-up {slowest:.0f}x: "
            f"{'PASS' if ok else 'FAIL'}"
        )
        print(line)
        doc.setdefault("targets", []).append({"name": "mixed_vs_reference", "pass": ok, "line": line})
    return 0 if all("error" not in r or "refused" in r for r in results) else 1


@dataclass
class Part:
    name: str
    title: str
    run: Callable[[argparse.Namespace, dict, list[str]], int]  # returns a process exit code (0 = ok)
    add_args: Callable[[argparse.ArgumentParser], None] | None = None


PARTS: dict[str, Part] = {
    "plan": Part("plan", "planning time and predicted RMSE", part_plan, add_plan_args),
    "measure": Part(
        "measure", "noise samples/s of the measure step vs OpenDP", part_measure, add_measure_args
    ),
    "e2e": Part("e2e", "the whole job, d = 20 on 1,000,000 rows", part_e2e, add_e2e_args),
    "queries": Part(
        "queries",
        "prefix workloads: QuerySmasher vs summing ResidualPlanner's cells",
        part_queries,
        add_queries_args,
    ),
    "mixed": Part("mixed", "range/prefix/circular workloads on [n]^d at scale", part_mixed, add_mixed_args),
}


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--child":
        return child_main(CHILDREN, sys.argv[2])
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument("--parts", default=",".join(PARTS), help=f"parts to run ({','.join(PARTS)})")
    ap.add_argument("--quick", action="store_true", help="smaller sizes, one repeat")
    ap.add_argument("--child-timeout-s", type=float, default=600.0, help="limit per child process (600)")
    ap.add_argument("--verbose", action="store_true", help="keep the library's INFO logs")
    ap.add_argument("--out", default=str(HERE / "results" / "dpquery.json"), help="JSON output path")
    for part in PARTS.values():
        if part.add_args is not None:
            part.add_args(ap)
    args = ap.parse_args(argv)
    if args.quick and "plan" in PARTS:
        args.plan_d = ",".join(x for x in args.plan_d.split(",") if x.strip() and int(x) <= 50)
        args.plan_repeats = 1
        args.plan_maxvar_d = "10"
    selected = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in selected if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; available: {list(PARTS)}")
    quiet_logs(args.verbose)
    t_start = time.perf_counter()
    watch = LoadWatch("run")
    doc: dict[str, Any] = {
        "benchmark": "dpquery",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": vars(args),
        "environment": versions(),
        "load_average_start": list(watch.load_before),
        "parts": selected,
    }
    env = doc["environment"]
    mem = env["mem_total"]
    ram = "?" if mem is None else f"{mem / 2**30:.1f} GiB"
    print(
        f"dpquery benchmark: parts {selected}; {env['cpus']} CPUs, {ram} RAM, "
        f"numpy {env['numpy']}, opendp {env['opendp']}"
    )
    print(load_start_line(watch))
    notes: list[str] = []
    rc = 0
    for name in selected:
        try:
            rc = max(rc, PARTS[name].run(args, doc, notes))
        except Exception:  # noqa: BLE001 - report the part's failure and go on with the others
            tb = traceback.format_exc()
            print(f"\n!! part {name} failed:\n{tb}")
            notes.append(f"part {name} failed: {tb}")
            rc = 1
    if _children is not None:
        _children.close()
    doc["elapsed_s"] = time.perf_counter() - t_start
    doc["load"] = watch.report()
    doc["load_average_end"] = doc["load"]["load_average_after"]
    doc["notes"] = notes
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str))
    print(f"\n{load_end_line(watch)}")
    print(f"wrote {out} ({doc['elapsed_s']:.0f} s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
