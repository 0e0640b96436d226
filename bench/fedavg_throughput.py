"""FedAvg throughput: input bytes aggregated per second, against the machine's memory-bound limit.

Measured in one run, on generated float32 updates (see ``fedavg_common``):

  (limit) the fastest memory-bound kernel over in-memory float32 arrays, on ALL cores: ``np.add(a, b,
          out=a)`` and ``np.copyto(a, b)``, the arrays cut into one slice per thread, every thread at once
          (numpy releases the GIL there); the faster of the two, best of ``--stream-repeats``. The same
          kernels on one thread give the single-process limit, and ``a += w*b`` on one thread (the issue's
          original yardstick) is shown beside them.
  (job)   the whole ``fedavg`` job on the local executor (``Client().submit(spec)``, wait; best of
          ``--job-repeats``), with its steps also run one after another in this process and timed;
  (files) the all-core limit on the job's OWN files, right after the job (same page cache): one thread
          per core, each a contiguous slice of the model, reads it from all N files in 4 MiB chunks and
          sums it, with nothing else (no plan, store, part or process start): each file mapped (``mmap``)
          and summed with ``np.add`` (the ceiling) or with the job's weighted fold (``kernels.axpy``), or
          read like ``cat`` (``preadv`` into a reused page-aligned buffer) and folded; the fastest is the
          limit (``--file-repeats``, interleaved). The job's MB/s and its ratio to that limit are printed
          beside the number of aggregate tasks it ran and the worker processes it had, and its ratio to
          the weighted-fold limit (the fastest kernel with the job's ``x * w`` then ``+``: FedAvg must
          weight, so that one is what the job's arithmetic can reach).
  (CPU)   CPU seconds per GB of input of the job (one more run on a warm executor: its process tree, the
          pool's workers included; with its tasks' start and end from their telemetry), the shard task,
          ``aggregate_into`` and each file kernel, with the MB/s that much CPU allows on every core: the job
          keeps the cores busy, so where it falls short of a limit this table says which work it is.
  (task)  one shard task (its handler, in a fresh process, best of ``--core-repeats``), and
          ``core.aggregate_into`` alone (ranged reads + the weighted sum, without the part upload).

Every rate is INPUT bytes (N x the model, or one client's array for the kernels) per second. The job is
compared with the all-core limits, single-process figures with the one-thread limit. Outputs are checked
against a float64 reference at sampled positions. Targets (PASS/FAIL lines, official at 256 MiB and N = 32;
the file-sum one at N = 32 and any model): the job >= 50% of the memory-bound limit and >= 70% of the
all-core file-sum limit; the shard task >= 50% of the one-thread limit; informative, the job >= 70% of the
weighted-fold file limit. Nothing asserts on time.
Writes bench/results/fedavg_throughput.json (``--out``), the file limit under ``throughput.file_limit``.

    .venv/bin/python bench/fedavg_throughput.py            # 256 MiB, 32-client job (~1-2 min, ~8.5 GB disk)
    .venv/bin/python bench/fedavg_throughput.py --quick    # 64 MiB model, 8-client job
    .venv/bin/python bench/fedavg_throughput.py --model-mib 64   # the issue's case: 64 MiB, N = 32
    .venv/bin/python bench/fedavg_throughput.py --model-mib 32 --job-n 4 --job-repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import LoadWatch, mark, table, watched  # noqa: E402
from fedavg_common import (  # noqa: E402
    MB,
    GiB,
    MiB,
    Workspace,
    add_common_args,
    apply_common_quick,
    data_start,
    is_default_model,
    job_breakdown,
    max_rel_err,
    mbps,
    print_targets,
    read_samples,
    run_job,
    session,
    shard_row,
    spec_doc,
    target,
)

AXPY = "a += w*b"
FAST = ("np.add(a, b, out=a)", "np.copyto(a, b)")  # the memory-bound kernels the limit is taken from


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--job-repeats", type=int, default=3, help="throughput jobs; the best counts (3)")
    ap.add_argument("--stream-mib", type=int, default=256, help="array size of the memory limit (256)")
    ap.add_argument("--stream-repeats", type=int, default=5, help="timed repeats per kernel (5)")
    ap.add_argument(
        "--threads", type=int, default=None, help="threads of the all-core limits (default: the CPU count)"
    )
    ap.add_argument("--file-repeats", type=int, default=3, help="timed runs of each file-sum limit (3)")


def apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.job_repeats = min(args.job_repeats, 2)
        args.stream_mib = min(args.stream_mib, 128)
        args.stream_repeats = min(args.stream_repeats, 3)
        args.file_repeats = min(args.file_repeats, 2)


# --------------------------------------------------------------------------------------------------------
# the part


def limits(stream: dict) -> dict[str, Any]:
    """The all-core limit, the one-thread limit (fastest kernel each) and one thread's ``a += w*b``."""
    out: dict[str, Any] = {}
    if not stream.get("one_thread"):
        return out
    threads = stream.get("threads", 1)
    one = {k: v["best_Bps"] for k, v in stream["one_thread"].items() if k in FAST}
    k = max(one, key=one.__getitem__)
    out["one"], out["one_kernel"] = one[k], k
    out["axpy"] = stream["one_thread"][AXPY]["best_Bps"]
    # the limit is the fastest of all: when other processes hold cores, threads can come out slower
    cands = {f"{k}, {threads} threads": v["best_Bps"] for k, v in (stream.get("threaded") or {}).items()}
    cands.update({f"{k}, 1 thread": v for k, v in one.items()})
    k = max(cands, key=cands.__getitem__)
    out["all"], out["all_kernel"] = cands[k], k
    return out


def throughput_part(ws: Workspace) -> list[dict]:
    """Measure, print the tables, record ``ws.doc["throughput"]``; returns the targets."""
    args = ws.args
    threads = args.threads or os.cpu_count() or 1
    part: dict[str, Any] = {}
    ws.doc["throughput"] = part

    # ---- the limit ----------------------------------------------------------------------------------
    print(
        f"\n== memory-bound limit: {args.stream_mib} MiB float32 arrays, best of {args.stream_repeats}, "
        f"one thread and {threads} threads"
    )
    stream: dict[str, Any] = {"array_bytes": args.stream_mib * MiB, "repeats": args.stream_repeats}
    with watched("limit", stream) as w:
        req = {"op": "stream", "elems": args.stream_mib * MiB // 4, "repeats": args.stream_repeats}
        run = ws.children.run({**req, "threads": threads}, timeout_s=180)
    if run.ok:
        stream.update(run.result)
    else:
        stream["note"] = run.note
        print(f"  measurement failed: {run.note}")
    part["stream"] = stream
    lim = limits(stream)
    part["limits"] = lim
    if lim:
        rows = []
        for name, v in stream["one_thread"].items():
            t = (stream.get("threaded") or {}).get(name, {})
            rows.append(
                [
                    name,
                    mbps(v["best_Bps"]),
                    mbps(v["median_Bps"]),
                    mbps(t.get("best_Bps")),
                    mbps(t.get("median_Bps")),
                    "",
                ]
            )
        print(
            table(
                [
                    "kernel (input bytes/s)",
                    "1 thread best MB/s",
                    "median",
                    f"{threads} threads best",
                    "median",
                    "",
                ],
                rows,
            )
        )

    # ---- the whole job ------------------------------------------------------------------------------
    ok, _why = ws.fedavg_available()
    n = args.job_n
    job: dict[str, Any] = {}
    if ok and ws.need_updates(n):
        uris, weights = ws.uris_weights(n)
        print(
            f"\n== fedavg job on the local executor: N={n}, {n * ws.model_bytes / GiB:.1f} GiB in, "
            f"{args.job_repeats} run(s)"
        )
        with watched("job", job) as w:
            try:
                job.update(
                    run_job(ws.store_root, spec_doc(uris, weights, {}), args.job_repeats, timeout_s=600)
                )
                job["input_bytes"] = n * ws.model_bytes
                job["best_Bps"] = n * ws.model_bytes / min(job["seconds"])
            except Exception as exc:
                job["error"] = f"{type(exc).__name__}: {exc}"
                print(f"  job failed: {job['error']}")
                traceback.print_exc()
        if "error" not in job:
            if job.get("output_path"):
                got = read_samples(Path(job["output_path"]), ws.positions)
                job["max_rel_err_vs_float64"] = max_rel_err(got, ws.reference(n))
            runs = ", ".join(f"{s:.2f}" for s in job["seconds"])
            print(f"  runs {runs} s -> best {job['best_Bps'] / MB:,.0f} MB/s of input ({w.mark()})")
            if "max_rel_err_vs_float64" in job:
                print(
                    f"  output vs float64 reference at {sum(map(len, ws.positions.values()))} positions: "
                    f"max rel err {job['max_rel_err_vs_float64']:.2e}"
                )
            try:
                bd = job_breakdown(ws.store_root, spec_doc(uris, weights, {}))
                job["breakdown"] = bd
                sh = bd["shards_s"]
                print(
                    f"  the same steps one after another in this process: plan {bd['plan_s']:.2f} s, "
                    f"{len(sh)} shard task(s) {sum(sh):.2f} s ({min(sh):.2f}-{max(sh):.2f} s each), "
                    f"commit {bd['after_map_s']:.2f} s; total {bd['total_s']:.2f} s = "
                    f"{n * ws.model_bytes / bd['total_s'] / MB:,.0f} MB/s"
                )
            except Exception as exc:
                job["breakdown_error"] = f"{type(exc).__name__}: {exc}"
                print(f"  breakdown failed: {job['breakdown_error']}")
            try:
                job["cpu_run"] = cpu_run = job_cpu_run(ws.store_root, spec_doc(uris, weights, {}))
                print_job_cpu_run(cpu_run, n * ws.model_bytes)
            except Exception as exc:
                job["cpu_run_error"] = f"{type(exc).__name__}: {exc}"
                print(f"  CPU run failed: {job['cpu_run_error']}")
    part["job"] = job

    # ---- the all-core limit on the job's own files -------------------------------------------------------
    files: dict[str, Any] = {}
    if ok and ws.distinct and ws.need_updates(n):
        files = file_limit(ws, n, threads)
    part["file_limit"] = files

    # ---- one shard task -----------------------------------------------------------------------------
    row: dict[str, Any] = {}
    if ok and ws.distinct:
        print(f"\n== one shard task of the N={n} job in a fresh process, best of {args.core_repeats}")
        with watched("shard task", part, "shard_task_load") as w:
            row = shard_row(ws, n, core_split=True)
        if row.get("shard_error"):
            print(f"  failed: {row['shard_error']}")
    part["shard_task"] = row

    # ---- the table ----------------------------------------------------------------------------------
    la, l1, axpy = lim.get("all"), lim.get("one"), lim.get("axpy")

    def vs(x: float | None, ref: float | None) -> str:
        return f"{x / ref:.0%}" if x and ref else "-"

    trows = []
    if la:
        trows.append(
            [
                f"limit: {lim['all_kernel']}",
                mbps(la),
                "100%",
                vs(la, l1),
                "in-memory arrays; the fastest memory-bound kernel measured",
            ]
        )
    if l1:
        trows.append([f"{lim['one_kernel']}, 1 thread", mbps(l1), vs(l1, la), "100%", "in-memory arrays"])
    if axpy:
        trows.append(
            [f"{AXPY}, 1 thread", mbps(axpy), vs(axpy, la), vs(axpy, l1), "the issue's first yardstick"]
        )
    if job.get("best_Bps"):
        b = job["best_Bps"]
        trows.append(
            [
                f"fedavg job, local executor (N={n})",
                mbps(b),
                vs(b, la),
                vs(b, l1),
                f"submit -> wait, best of {len(job['seconds'])}, {os.cpu_count()} worker processes; "
                + mark(job["load"]),
            ]
        )
    sh = row.get("shard") or {}
    if sh.get("Bps"):
        b = sh["Bps"]
        trows.append(
            [
                f"shard task (handler), 1 process (N={n}, M={row.get('shards')})",
                mbps(b),
                vs(b, la),
                vs(b, l1),
                f"fresh process, warm page cache, one shard, best of {len(sh['runs_seconds'])}"
                + (f", {sh['cpu_s'] / sh['seconds']:.2f} cores busy" if sh.get("cpu_s") else ""),
            ]
        )
        split = row.get("core_split") or {}
        if split.get("aggregate_into_s"):
            b = sh["input_bytes"] / split["aggregate_into_s"]
            trows.append(
                [
                    "  core.aggregate_into alone (reads + sum)",
                    mbps(b),
                    vs(b, la),
                    vs(b, l1),
                    f"{split['aggregate_into_cpu_s'] / split['aggregate_into_s']:.2f} cores busy; "
                    f"then the part upload {split['upload_s'] * 1000:.0f} ms, "
                    f"plan load {split['load_plan_s'] * 1000:.0f} ms",
                ]
            )
    print(
        "\nThroughput (input bytes aggregated per second; the limit = the fastest memory-bound kernel on all "
        "cores, same run)"
    )
    print(table(["what", "MB/s", "vs limit", "vs 1-thread limit", "note"], trows))
    if part.get("shard_task_load"):
        print(f"  (shard task: {mark(part['shard_task_load'])}; limit: {mark(stream.get('load'))})")
    print_file_table(job, files, n, threads)
    part["cpu_per_gb"] = cpu = cpu_per_gb(job, files, row)
    print_cpu_table(cpu, files, n)
    return throughput_targets(ws, job, sh.get("Bps"), lim) + file_targets(ws, job, files)


def job_cpu_run(store_root: str, doc: dict) -> dict[str, Any]:
    """One more job on a warm executor (a first run starts the worker pool), its process tree's CPU measured
    (the pool's workers are descendants) and its tasks' times read from their telemetry records: how much
    CPU the job spends per GB, and where its wall time goes."""
    from shardfold.client import Client
    from shardfold.functions import store
    from shardfold.functions.store.uri import local_path

    with Client() as cl:
        warm = cl.submit(doc)
        warm.wait(progress=False, timeout_s=600)
        store.delete(warm.result()["output"])
        watch = LoadWatch("job cpu run")
        t0 = time.time()
        job = cl.submit(doc)
        job.wait(progress=False, timeout_s=600)
        t1 = time.time()
        load = watch.stop()
        result = job.result()
    tasks = []
    for rec in sorted(
        local_path(store_root).joinpath("jobs", result["job_id"], "telemetry").glob("*/*.json")
    ):
        doc_ = json.loads(rec.read_text())
        tasks.append(
            {
                "step": doc_["step"],
                "task": doc_.get("task"),
                "start_s": doc_["started_at"] - t0,
                "end_s": doc_["ended_at"] - t0,
                "pid": doc_.get("pid"),
            }
        )
    store.delete(result["output"])
    return {"seconds": t1 - t0, "cpu_s": load["own_cores"] * load["wall_s"], "load": load, "tasks": tasks}


def print_job_cpu_run(run: dict[str, Any], input_bytes: int) -> None:
    agg = [t for t in run["tasks"] if t["step"] == "aggregate_shard"]
    after = [t for t in run["tasks"] if t["step"] == "commit"]
    gb = input_bytes / 1e9
    line = (
        f"  one more run on the warm executor: {run['seconds']:.2f} s, {run['cpu_s']:.2f} CPU-s "
        f"({run['cpu_s'] / gb:.3f} CPU-s/GB, {run['cpu_s'] / run['seconds']:.2f} cores busy; "
        f"{mark(run['load'])})"
    )
    if agg:
        a0, a1 = min(t["start_s"] for t in agg), max(t["end_s"] for t in agg)
        each = [t["end_s"] - t["start_s"] for t in agg]
        pids = len({t["pid"] for t in agg})
        line += (
            f"\n    before the aggregate tasks {a0:.2f} s; {len(agg)} aggregate task(s) on {pids} "
            f"process(es) {a1 - a0:.2f} s ({min(each):.2f}-{max(each):.2f} s each)"
        )
        if after:
            c = after[0]
            line += (
                f"; commit {c['end_s'] - c['start_s']:.2f} s; after it {run['seconds'] - c['end_s']:.2f} s"
            )
    print(line)


def file_limit(ws: Workspace, n: int, threads: int) -> dict[str, Any]:
    """The all-core file-sum limit on the job's N files (``fedavg_common.child_filesum``), in a fresh
    process: what reading and summing these very files costs with every core on it and nothing else."""
    args = ws.args
    try:
        from shardfold.functions.fedavg.shardplan import Budget

        chunk = Budget().chunk_bytes
    except Exception:  # an older checkout: the engine's documented chunk
        chunk = 4 * MiB
    paths = ws.paths(n)
    _uris, weights = ws.uris_weights(n)
    print(
        f"\n== all-core limit on the job's own {n} files: {threads} threads, a slice of the model each, "
        f"{chunk / MiB:g} MiB chunks, best of {args.file_repeats}"
    )
    files: dict[str, Any] = {}
    with watched("file limit", files) as w:
        req = {
            "op": "filesum",
            "paths": [str(p) for p in paths],
            "weights": weights,
            "data_starts": [data_start(p) for p in paths],
            "data_bytes": ws.model_bytes,
            "threads": threads,
            "chunk_bytes": chunk,
            "repeats": args.file_repeats,
        }
        run = ws.children.run(req, timeout_s=300)
    if not run.ok:
        files["note"] = run.note
        print(f"  measurement failed: {run.note}")
        return files
    files.update(run.result)
    best = max(files["kernels"], key=lambda k: files["kernels"][k]["best_Bps"])
    files["limit_kernel"], files["limit_Bps"] = best, files["kernels"][best]["best_Bps"]
    print(f"  limit {files['limit_Bps'] / MB:,.0f} MB/s ({best}; {w.mark()})")
    return files


def print_file_table(job: dict, files: dict, n: int, threads: int) -> None:
    """The job against the all-core limit on its own files (same run, same page cache)."""
    if not files.get("kernels"):
        return
    lim = files["limit_Bps"]
    wname, wlim = weighted_limit(files)

    def of(x: float, ref: float | None) -> str:
        return f"{x / ref:.0%}" if ref else "-"

    rows = []
    for name, k in files["kernels"].items():
        notes = [f"{k['cpu_s_per_GB']:.3f} CPU-s/GB"]
        if name == files["limit_kernel"]:
            notes.append("the limit")
        if name == wname:
            notes.append("the weighted-fold limit")
        rows.append(
            [
                f"{name}, {threads} threads",
                mbps(k["best_Bps"]),
                mbps(k["median_Bps"]),
                of(k["best_Bps"], lim),
                of(k["best_Bps"], wlim),
                "; ".join(notes),
            ]
        )
    if job.get("best_Bps"):
        res = job.get("result") or {}
        secs = job["seconds"]
        rows.append(
            [
                f"fedavg job, local executor (N={n})",
                mbps(job["best_Bps"]),
                mbps(job["input_bytes"] / sorted(secs)[len(secs) // 2]),
                of(job["best_Bps"], lim),
                of(job["best_Bps"], wlim),
                f"{res.get('shards', '?')} aggregate task(s) on {os.cpu_count()} worker processes; "
                f"best of {len(secs)}; " + mark(job.get("load")),
            ]
        )
    print(
        f"\nThe job against the all-core limit on its own {n} files (input MB/s; same run, page cache warm; "
        f"limit: {mark(files.get('load'))}). FedAvg must weight each update (Flower's x * n, then the sum), "
        "so the weighted fold's limit is the one the job can reach"
    )
    print(table(["what", "best MB/s", "median", "of the limit", "of the weighted-fold limit", "note"], rows))


def weighted_limit(files: dict) -> tuple[str | None, float | None]:
    """The fastest file kernel that folds with the job's weights (``kernels.axpy``): what FedAvg can reach."""
    weighted = {k: v["best_Bps"] for k, v in (files.get("kernels") or {}).items() if "weighted" in k}
    if not weighted:
        return None, None
    name = max(weighted, key=weighted.__getitem__)
    return name, weighted[name]


def cpu_per_gb(job: dict, files: dict, row: dict) -> dict[str, Any]:
    """CPU seconds per GB of input of the job, one shard task and the file kernels (same run): on a machine
    whose cores the job keeps busy, its MB/s is at most ``cores / CPU-s per GB``."""
    out: dict[str, Any] = {"cores": os.cpu_count() or 1}
    run = job.get("cpu_run") or {}
    if run.get("cpu_s") and job.get("input_bytes"):
        out["job"] = run["cpu_s"] / (job["input_bytes"] / 1e9)
    sh = row.get("shard") or {}
    if sh.get("cpu_s") and sh.get("input_bytes"):
        out["shard_task"] = sh["cpu_s"] / (sh["input_bytes"] / 1e9)
    split = row.get("core_split") or {}
    if split.get("aggregate_into_cpu_s") and sh.get("input_bytes"):
        out["aggregate_into"] = split["aggregate_into_cpu_s"] / (sh["input_bytes"] / 1e9)
    for name, k in (files.get("kernels") or {}).items():
        out[name] = k["cpu_s_per_GB"]
    return out


def print_cpu_table(cpu: dict[str, Any], files: dict, n: int) -> None:
    """Where the CPU goes, per GB of input, and the MB/s that CPU allows on every core."""
    cores = cpu["cores"]
    names = [k for k in ("job", "shard_task", "aggregate_into") if k in cpu]
    names += [k for k in (files.get("kernels") or {}) if k in cpu]
    if not names:
        return
    label = {
        "job": f"fedavg job (N={n}; one run on a warm executor, all its processes)",
        "shard_task": "one shard task (handler, fresh process)",
        "aggregate_into": "  core.aggregate_into alone (reads + fold)",
    }
    rows = [[label.get(k, f"file limit: {k}"), f"{cpu[k]:.3f}", mbps(cores / cpu[k] * 1e9)] for k in names]
    print(
        f"\nCPU per GB of input (process CPU, all threads; same run): at C CPU-s/GB, {cores} fully busy "
        "cores aggregate at most cores / C"
    )
    print(table(["what", "CPU-s/GB", f"MB/s if CPU-bound on {cores} cores"], rows))


def file_targets(ws: Workspace, job: dict, files: dict) -> list[dict]:
    out: list[dict] = []
    name = "job vs the all-core file-sum limit"
    official = ws.args.job_n == 32
    if files.get("limit_Bps") and job.get("best_Bps"):
        x = job["best_Bps"] / files["limit_Bps"]
        detail = (
            f"{job['best_Bps'] / MB:,.0f} vs {files['limit_Bps'] / MB:,.0f} MB/s ({files['limit_kernel']}, "
            f"{files['threads']} threads, the job's files) = {x:.0%}"
        )
        target(out, name, ">= 70%", x, x >= 0.7, detail, official)
    else:
        why = job.get("error") or files.get("note", "not measured")
        target(out, name, ">= 70%", None, None, why, official)
    wname, wlim = weighted_limit(files)
    if wlim and job.get("best_Bps"):
        x = job["best_Bps"] / wlim
        detail = (
            f"{job['best_Bps'] / MB:,.0f} vs {wlim / MB:,.0f} MB/s ({wname}: FedAvg's own arithmetic on the "
            f"job's files) = {x:.0%}"
        )
        target(out, "  job vs the weighted-fold file limit", ">= 70%", x, x >= 0.7, detail, False)
    return out


def throughput_targets(ws: Workspace, job: dict, task_Bps: float | None, lim: dict) -> list[dict]:
    out: list[dict] = []
    official = is_default_model(ws.model_bytes) and ws.args.job_n == 32
    la, l1, axpy = lim.get("all"), lim.get("one"), lim.get("axpy")
    name = "job throughput vs the memory-bound limit"
    if la and job.get("best_Bps"):
        x = job["best_Bps"] / la
        detail = f"{job['best_Bps'] / MB:,.0f} vs {la / MB:,.0f} MB/s ({lim['all_kernel']}) = {x:.0%}"
        target(out, name, ">= 50%", x, x >= 0.5, detail, official)
    else:
        target(out, name, ">= 50%", None, None, job.get("error", "not measured"), official)
    if l1 and task_Bps:
        x = task_Bps / l1
        detail = f"{task_Bps / MB:,.0f} vs {l1 / MB:,.0f} MB/s ({lim['one_kernel']}, 1 thread) = {x:.0%}"
        target(out, "shard task vs the 1-thread limit", ">= 50%", x, x >= 0.5, detail, official)
    if axpy and job.get("best_Bps"):
        x = job["best_Bps"] / axpy
        detail = f"{x:.0%}: the issue's first yardstick, kept for comparison with earlier runs"
        target(out, f"  job vs {AXPY} on one core", ">= 50%", x, x >= 0.5, detail, False)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    add_common_args(ap, "fedavg_throughput.json")
    add_args(ap)
    args = ap.parse_args(argv)
    apply_common_quick(args)
    apply_quick(args)
    with session("fedavg_throughput", args) as ws:
        ws.doc["targets"] = targets = throughput_part(ws)
        print_targets(targets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
