"""FedAvg memory: the peak RSS of one shard task per client count N, against Flower on the same updates.

For every N in ``--sweep`` (default 8, 32, 128), each in a fresh process (see ``fedavg_common``):

  shard task     shard 0 of an N-client fedavg job, its handler as the local executor runs it; peak RSS
                 the max over ``--core-repeats`` runs, and once more with ``MALLOC_ARENA_MAX=1`` (an
                 allocator diagnostic; ``--no-arena-diag`` skips it); beside it, what
                 ``functions.fedavg.shardplan.task_loads`` plans for that task;
  Flower         ``aggregate_inplace`` (the FedAvg strategy's default) holding the FitRes list a Flower
                 server holds, and ``aggregate`` holding the NDArrays list, on the same files. A case whose
                 estimated need exceeds ``--flower-ram-frac`` of MemAvailable is reported as
                 "would need X GiB (not run)".

Peaks are ``VmHWM`` read inside the child after resetting it once the imports are done
(``benchutil.PeakRSS``), shown whole and less the RSS after the imports. Flower's outputs are checked
against a float64 reference at sampled positions. Targets (PASS/FAIL lines, official at 256 MiB): the shard
peak flat in N (every N within +-5% of the mean); ``aggregate_inplace`` >= 10x the shard task's peak at
N = 32. Memory, not time; nothing asserts. Writes bench/results/fedavg_memory.json (``--out``).

    .venv/bin/python bench/fedavg_memory.py              # 256 MiB, N = 8/32/128 (~1-2 min, ~8.5 GB disk)
    .venv/bin/python bench/fedavg_memory.py --quick      # 64 MiB model
    .venv/bin/python bench/fedavg_memory.py --model-mib 32 --sweep 4,16 --skip-flower
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import mark, mem_available, table, watched  # noqa: E402
from fedavg_common import (  # noqa: E402
    GiB,
    MiB,
    Workspace,
    add_common_args,
    apply_common_quick,
    fmt_mb,
    is_default_model,
    max_rel_err,
    mbps,
    print_targets,
    session,
    shard_row,
    target,
)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sweep", default="8,32,128", help="client counts N for the memory sweep (8,32,128)")
    ap.add_argument(
        "--flower-ram-frac",
        type=float,
        default=0.6,
        help="run a Flower case only if its estimated need is below this share of MemAvailable (0.6)",
    )
    ap.add_argument("--skip-flower", action="store_true", help="no Flower runs")
    ap.add_argument(
        "--no-arena-diag",
        dest="arena_diag",
        action="store_false",
        help="skip the second shard run per N with MALLOC_ARENA_MAX=1 (an allocator diagnostic)",
    )


def sweep_of(args: argparse.Namespace) -> list[int]:
    sweep = sorted({int(s) for s in args.sweep.split(",") if s.strip()})
    if not sweep or min(sweep) < 1:
        raise SystemExit("client counts must be >= 1")
    return sweep


def flower_case(ws: Workspace, n: int, mode: str, row: dict) -> dict:
    """Flower's ``aggregate_inplace`` (mode "inplace") or ``aggregate`` ("plain") on N updates."""
    # what the process must hold: inplace keeps every FitRes (serialized, ~N x model) plus the running sum
    # and one deserialized client; plain keeps N NDArrays and N weighted copies
    need = (n + 2) * ws.model_bytes if mode == "inplace" else (2 * n + 1) * ws.model_bytes
    row[f"flower_{mode}_need"] = need
    if ws.args.skip_flower:
        return {"skipped": "--skip-flower"}
    avail = mem_available()
    if need > ws.args.flower_ram_frac * avail:
        return {"skipped": f"would need ~{need / GiB:.1f} GiB (not run; {avail / GiB:.1f} GiB available)"}
    _uris, weights = ws.uris_weights(n)
    req = {
        "op": "flower",
        "mode": mode,
        "paths": [str(p) for p in ws.paths(n)],
        "weights": weights,
        "names": ws.names,
        "positions": ws.positions,
    }
    r = ws.children.run(req, timeout_s=600)
    if not r.ok:
        return {"error": r.note}
    res = r.result
    return {
        "peak_rss": res["peak_rss"],
        "baseline_rss": res["baseline_rss"],
        "wait4_maxrss_incl_parent_at_fork": r.max_rss,
        "load_s": res["load_s"],
        "aggregate_s": res["aggregate_s"],
        "max_rel_err_vs_float64": max_rel_err(res["samples"], ws.reference(n)),
    }


def memory_part(ws: Workspace, sweep: list[int]) -> list[dict]:
    """Measure every N, print the table, record ``ws.doc["memory"]``; returns the targets."""
    args = ws.args
    mem_rows: list[dict] = []
    ws.doc["memory"] = mem_rows
    ok, _why = ws.fedavg_available()
    if not ws.need_updates(max(sweep)):
        return []
    print(f"\n== memory: one shard task per N in a fresh process; Flower in a fresh process (N={sweep})")
    for n in sweep:
        row: dict[str, Any] = {"n": n, "input_bytes": n * ws.model_bytes}
        with watched(f"memory N={n}", row):
            if ok:
                row.update(shard_row(ws, n, arena_diag=args.arena_diag))
            for mode in ("inplace", "plain"):
                row[f"flower_{mode}"] = flower_case(ws, n, mode, row)
        mem_rows.append(row)
        sh = row.get("shard") or {}
        fi = row.get("flower_inplace") or {}
        print(
            f"  N={n:>4}: shard peak {fmt_mb(sh.get('peak_rss'))} MiB "
            f"({sh.get('seconds', 0):.2f} s), Flower inplace "
            f"{fmt_mb(fi.get('peak_rss')) if 'peak_rss' in fi else fi.get('skipped') or fi.get('error')}"
            f" ({mark(row.get('load'))})"
        )
    print_memory_table(ws, mem_rows)
    return memory_targets(ws, mem_rows)


def print_memory_table(ws: Workspace, mem_rows: list[dict]) -> None:
    print(f"\nMemory: peak RSS (MiB) of one aggregation process, model {ws.model_bytes / MiB:,.0f} MiB")
    mrows = []
    for r in mem_rows:
        sh = r.get("shard") or {}

        def cell(key: str, r: dict = r) -> str:
            v = r.get(key) or {}
            if "peak_rss" in v:
                return fmt_mb(v["peak_rss"])
            if v.get("skipped") == "--skip-flower":
                return "skipped"
            if "skipped" in v:
                return f"({r[key + '_need'] / GiB:.0f} GiB, not run)"
            return "error"

        fi = (r.get("flower_inplace") or {}).get("peak_rss")
        ratio = f"{fi / sh['peak_rss']:.1f}x" if fi and sh.get("peak_rss") else "-"
        mrows.append(
            [
                str(r["n"]),
                str(r.get("shards", "-")),
                fmt_mb(sh.get("peak_rss")) if sh else r.get("shard_error", "-")[:40],
                fmt_mb(sh["peak_rss"] - sh["baseline_rss"]) if sh else "-",
                fmt_mb((r.get("shard_arena1") or {}).get("peak_rss")),
                fmt_mb(r["planned_peak"] - r["planned_runtime"]) if r.get("planned_peak") else "-",
                mbps(sh.get("Bps")) if sh else "-",
                cell("flower_inplace"),
                cell("flower_plain"),
                ratio,
                mark(r.get("load")),
            ]
        )
    print(
        table(
            [
                "N",
                "M",
                "shard task",
                "of which task",
                "arena max 1",
                "planned task",
                "shard MB/s",
                "Flower inplace",
                "Flower aggregate",
                "inplace/shard",
                "load",
            ],
            mrows,
        )
    )
    base = [r["shard"]["baseline_rss"] for r in mem_rows if r.get("shard")]
    fbase = [
        r[k]["baseline_rss"]
        for r in mem_rows
        for k in ("flower_inplace", "flower_plain")
        if isinstance(r.get(k), dict) and "baseline_rss" in r[k]
    ]
    print(
        "  peak RSS over the process (interpreter and imports included; 'of which task' subtracts the RSS "
        "after imports"
        + (f": {max(base) / MiB:,.0f} MiB for the shard task" if base else "")
        + (f", {max(fbase) / MiB:,.0f} MiB for Flower" if fbase else "")
        + "); 'arena max 1': the same shard task with MALLOC_ARENA_MAX=1; 'planned task': "
        "shardfold.functions.fedavg.shardplan.task_loads for this plan (local store) less its assumed "
        "runtime, to set beside 'of which task'"
    )
    errs = [
        (r["n"], k, r[k]["max_rel_err_vs_float64"])
        for r in mem_rows
        for k in ("flower_inplace", "flower_plain")
        if isinstance(r.get(k), dict) and "max_rel_err_vs_float64" in r[k]
    ]
    if errs:
        print(
            "  Flower outputs vs float64 reference: "
            + ", ".join(f"N={n} {k[7:]} {e:.1e}" for n, k, e in errs)
        )


def memory_targets(ws: Workspace, mem_rows: list[dict]) -> list[dict]:
    out: list[dict] = []
    official = is_default_model(ws.model_bytes)
    peaks = [
        (r["n"], r["shard"]["peak_rss"], r["shard"]["peak_rss"] - r["shard"]["baseline_rss"])
        for r in mem_rows
        if r.get("shard")
    ]

    def spread(values: list[float]) -> float:
        """Largest deviation from the mean, as a fraction of it (the reference's "within +-5% across N")."""
        mean = sum(values) / len(values)
        return max(abs(v - mean) for v in values) / mean

    if len(peaks) >= 2:
        x = spread([p for _, p, _ in peaks])
        detail = (
            f"+-{x:.1%} of the mean; "
            + ", ".join(f"N={n}: {p / MiB:,.0f} MiB" for n, p, _ in peaks)
            + f" (max/min {max(p for _, p, _ in peaks) / min(p for _, p, _ in peaks):.3f})"
        )
        target(out, "shard peak RSS flat in N", "within +-5%", x, x <= 0.05, detail, official)
        thi, tlo = max(t for _, _, t in peaks), min(t for _, _, t in peaks)
        detail = f"+-{spread([t for _, _, t in peaks]):.1%}; " + ", ".join(
            f"N={n}: {t / MiB:,.0f} MiB" for n, _, t in peaks
        )
        target(
            out,
            "  task's own part (peak - imports) flat in N",
            "informative",
            thi / max(tlo, 1),
            None,
            detail,
            False,
        )
        a1 = [
            (r["n"], r["shard_arena1"]["peak_rss"])
            for r in mem_rows
            if (r.get("shard_arena1") or {}).get("peak_rss")
        ]
        if len(a1) >= 2:
            x1 = spread([v for _, v in a1])
            detail = f"+-{x1:.1%}; " + ", ".join(f"N={n}: {v / MiB:,.0f} MiB" for n, v in a1)
            target(out, "  same task, MALLOC_ARENA_MAX=1", "within +-5%", x1, x1 <= 0.05, detail, False)
    else:
        target(
            out,
            "shard peak RSS flat in N",
            "within +-5%",
            None,
            None,
            "fewer than two shard measurements",
            official,
        )
    r32 = next((r for r in mem_rows if r["n"] == 32), None)
    for mode, goal_official in (("inplace", True), ("plain", False)):
        name = f"Flower {'aggregate_inplace' if mode == 'inplace' else 'aggregate'} / shard at N=32"
        f = (r32 or {}).get(f"flower_{mode}") or {}
        s = (r32 or {}).get("shard") or {}
        if f.get("peak_rss") and s.get("peak_rss"):
            x = f["peak_rss"] / s["peak_rss"]
            detail = f"{f['peak_rss'] / MiB:,.0f} vs {s['peak_rss'] / MiB:,.0f} MiB"
            detail += f" (model {ws.model_bytes / MiB:,.0f} MiB)"
            target(out, name, ">= 10x", x, x >= 10, detail, official and goal_official)
        elif r32 is not None and s.get("peak_rss") and "skipped" in f:
            x = r32[f"flower_{mode}_need"] / s["peak_rss"]
            detail = f"not run: {f['skipped']}; the estimate is {x:.0f}x"
            target(out, name, ">= 10x", x, None, detail, official and goal_official)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    add_common_args(ap, "fedavg_memory.json")
    add_args(ap)
    args = ap.parse_args(argv)
    apply_common_quick(args)
    sweep = sweep_of(args)
    with session("fedavg_memory", args) as ws:
        ws.doc["targets"] = targets = memory_part(ws, sweep)
        print_targets(targets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
