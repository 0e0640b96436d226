"""FedAvg benchmark, all three experiments in one run on one set of generated updates.

Each experiment is its own script, runnable alone; this one runs them in order, sharing the updates and
the shard-task measurements (N = ``--job-n`` is measured once and used by all three):

  1. ``fedavg_throughput.py``: input bytes aggregated per second by the job on the local executor, by one
     shard task and by ``core.aggregate_into``, against the fastest memory-bound kernel on all cores
     (``np.add``/``np.copyto``, threaded) and against all cores reading and summing the job's own files
     (mmap or pread, numpy), both measured in the same run.
  2. ``fedavg_memory.py``: peak RSS of one shard task per N in ``--sweep`` against Flower's
     ``aggregate_inplace`` and ``aggregate`` on the same updates, each in a fresh process.
  3. ``fedavg_cost.py``: a cost model on Lambda prices, the sharded design against a lambda-FL tree, using
     the shard task's rate measured in part 1 (``--skip-cost`` leaves it out).

Flags are the union of the three scripts' (see their ``--help``). It prints every table and the targets
of all parts, and writes bench/results/fedavg.json with sections ``throughput``, ``memory``, ``cost``, a
load window per measurement and one for the whole run. Nothing asserts on time.

    .venv/bin/python bench/fedavg.py                 # 256 MiB model, N = 8/32/128, 32-client job (~2-4 min)
    .venv/bin/python bench/fedavg.py --quick         # 64 MiB model, 8-client job (~1 min, ~2 GB disk)
    .venv/bin/python bench/fedavg.py --model-mib 128 --sweep 4,16,64 --skip-cost
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fedavg_cost  # noqa: E402
import fedavg_memory  # noqa: E402
import fedavg_throughput  # noqa: E402
from fedavg_common import add_common_args, apply_common_quick, print_targets, session  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    add_common_args(ap, "fedavg.json")
    fedavg_throughput.add_args(ap)
    fedavg_memory.add_args(ap)
    fedavg_cost.add_args(ap)
    ap.add_argument("--skip-cost", action="store_true", help="no cost model")
    args = ap.parse_args(argv)
    apply_common_quick(args)
    fedavg_throughput.apply_quick(args)
    sweep = fedavg_memory.sweep_of(args)
    with session("fedavg", args) as ws:
        ws.max_n = max([*sweep, args.job_n])  # one set of updates serves every part
        targets = fedavg_throughput.throughput_part(ws)
        targets += fedavg_memory.memory_part(ws, sweep)
        if not args.skip_cost:
            fedavg_cost.cost_part(ws)
        ws.doc["targets"] = targets
        print_targets(targets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
