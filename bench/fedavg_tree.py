"""FedAvg as a lambda-FL tree beside the sharded job, both run for real on the same (local) executor.

The tree is ``bench/fedtree`` (a benchmark-only job kind): ⌈√N⌉ leaf tasks each GET their group's updates
whole and sum them (float32, ``acc += w * x``, as lambda-FL's aggregators do), then a root task sums the
leaves and divides by the total weight. The sharded job is Shardfold's ``fedavg`` on the same updates. For
each: the job's wall time (submit to end, best of ``--job-repeats``), input bytes per second, and every
task's peak memory as its telemetry record measured it (``shardfold report``'s figures; the aggregate, leaf
and root tasks run in worker processes of their own, the others in the executor's process, whose memory
they count). The two outputs are
compared (they round differently: the tree sums in groups). Nothing asserts on time.

    .venv/bin/python bench/fedavg_tree.py --quick      # 64 MiB model, N = 8 (~1 min)
    .venv/bin/python bench/fedavg_tree.py --model-mib 256 --job-n 32
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from benchutil import table  # noqa: E402
from fedavg_common import MiB, add_common_args, apply_common_quick, session, spec_doc  # noqa: E402

MB = 1e6


def run(doc: dict, repeats: int, timeout_s: float) -> dict:
    """Submit ``doc`` ``repeats`` times on one local client; the best run, its result and task records."""
    from shardfold.client import Client
    from shardfold.functions import store, telemetry

    best: dict = {}
    with Client() as client:
        for _ in range(repeats):
            t0 = time.perf_counter()
            job = client.submit(doc)
            status = job.wait(progress=False, timeout_s=timeout_s)
            seconds = time.perf_counter() - t0
            if status.state != "SUCCEEDED":
                raise RuntimeError(f"{doc['kind']} job {job.job_id}: {status.state}: {status.error}")
            result = job.result()
            if not best or seconds < best["seconds"]:
                records = telemetry.read_records(client.store_root, job.job_id)
                out = store.get(result["output"])
                best = {"seconds": seconds, "result": result, "records": records, "output": out}
    return best


def data_of(raw: bytes) -> np.ndarray:
    n = int.from_bytes(raw[:8], "little")
    return np.frombuffer(raw, np.float32, offset=8 + n)


def summary(name: str, run_: dict, input_bytes: int) -> dict:
    tasks = [r for r in run_["records"] if r.get("outcome") == "succeeded"]
    peaks: dict[str, float] = {}
    for r in tasks:
        peaks[r["step"]] = max(peaks.get(r["step"], 0.0), float(r.get("peak_memory_mib") or 0.0))
    return {
        "design": name,
        "seconds": run_["seconds"],
        "input_mb_per_s": input_bytes / run_["seconds"] / MB,
        "tasks": len(tasks),
        "task_seconds": sum(float(r.get("duration_s") or 0.0) for r in tasks),
        "peak_mib_by_step": peaks,
        "max_task_peak_mib": max(peaks.values(), default=0.0),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__)
    add_common_args(ap, "fedavg_tree.json")
    ap.add_argument("--job-repeats", type=int, default=2, help="runs of each job; the fastest counts (2)")
    args = ap.parse_args(argv)
    apply_common_quick(args)
    # the tree kind is found in bench/ by this process and by the executor's worker processes
    os.environ["SHARDFOLD_KIND_PACKAGES"] = "fedtree"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))
    with session("fedavg_tree", args) as ws:
        n = args.job_n
        if not ws.need_updates(n):
            return 1
        uris, weights = ws.uris_weights(n)
        input_bytes = n * ws.model_bytes
        timeout = 600.0
        print(f"\n== the sharded fedavg job, N={n}")
        sharded = run(spec_doc(uris, weights, {}), args.job_repeats, timeout)
        print(f"== the lambda-FL tree, N={n}: {math.ceil(n / math.ceil(math.sqrt(n)))} leaves and a root")
        tree_doc = {
            "kind": "fedtree",
            "clients": [{"uri": u, "weight": float(w)} for u, w in zip(uris, weights, strict=True)],
        }
        tree = run(tree_doc, args.job_repeats, timeout)
        a, b = data_of(sharded["output"]), data_of(tree["output"])
        scale = float(np.max(np.abs(a))) or 1.0
        diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) / scale
        rows = [
            summary("sharded (Shardfold fedavg)", sharded, input_bytes),
            summary("tree (lambda-FL)", tree, input_bytes),
        ]
        ws.doc["results"] = {"n": n, "model_bytes": ws.model_bytes, "designs": rows, "max_abs_diff_rel": diff}
        print(
            f"\nFedAvg on the local executor, N={n}, model {ws.model_bytes / MiB:,.0f} MiB float32 "
            f"(best of {args.job_repeats})"
        )
        print(
            table(
                [
                    "design",
                    "wall s",
                    "input MB/s",
                    "tasks",
                    "task-s",
                    "largest task peak MiB",
                    "peak by step (MiB)",
                ],
                [
                    [
                        r["design"],
                        f"{r['seconds']:.2f}",
                        f"{r['input_mb_per_s']:,.0f}",
                        str(r["tasks"]),
                        f"{r['task_seconds']:.2f}",
                        f"{r['max_task_peak_mib']:,.0f}",
                        ", ".join(f"{k} {v:,.0f}" for k, v in r["peak_mib_by_step"].items()),
                    ]
                    for r in rows
                ],
                right={1, 2, 3, 4, 5},
            )
        )
        print(f"outputs differ by at most {diff:.2e} of the largest value (float32 sums in another order)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
