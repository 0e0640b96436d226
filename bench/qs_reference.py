"""The authors' QuerySmasher (arXiv:2604.00868; GitHub ``cmla-psu/QuerySmasherMatrixMechanism``) as a
baseline for the dpquery benchmark: the total variance of its plan for a Kronecker workload, for comparison
with :func:`plan_kron` of the tests' reference planners (tests/smash_reference.py) in the same run.

Their code is never vendored into the package and never imported by it. It is loaded at bench time from
an exported checkout named by ``$QS_REF_DIR`` (default ``bench/results/qs_reference``, which git ignores):

    # once: fetch the repository (the session's ``fetch`` tool gives a bare git dir, e.g.
    # /work/.mirror/cmla-psu+QuerySmasherMatrixMechanism/repo; a plain ``git clone --bare`` works too)
    .venv/bin/python bench/qs_reference.py export \
        --git-dir /work/.mirror/cmla-psu+QuerySmasherMatrixMechanism/repo
    # a run: CPS, prefix on attributes 0 and 1, all 1-way marginals, 120 s limit, ours alongside
    .venv/bin/python bench/qs_reference.py run --domains 50,100,7,4,2 --ways 1 --prefix 0,1 \
        --timeout 120 --ours

The repository carries no LICENSE file (commit 2210155, "Initial release"): all rights reserved by
default, so it is only run locally as a measuring stick, never copied into this project's tree.

**Their API** (``query.py``, ``smasher.py``, ``solver.py``; needs numpy, scipy, cvxpy, torch; only their
``baselines/resplan`` imports gurobipy, which this adapter never loads). ``KronQuery(domains, attrs,
factors, weight)`` is the family ⊗ factors over the marginal on ``attrs`` (one factor per attribute, in
the order of ``attrs``; their decomposition keys partitions by the sorted subset, so ``attrs`` must be
sorted). ``Smasher(domains, privacy_cost, default_solver)`` → ``add_queries_to_workload`` → ``optimize()``
→ ``workload_variance()``: Σ over partitions of L_{A'}·σ²_{A'}, i.e. Σ_q weight_q·Var(q) over every row of
every query, with σ²_{A'} = γ/√L_{A'}, γ = Σ√L/privacy_cost (Algorithm 1), so the total is
(Σ√L)²/privacy_cost. Each partition is solved at pcost = max diag(BᵀΣ⁻¹B) = 1 (Definition 3, the squared
L2 sensitivity), so Σ_{A'} pcost/σ² = privacy_cost and a Gaussian mechanism of squared sensitivity Δ² and
variance σ² costs ρ = Δ²/(2σ²) in zCDP: **privacy_cost = c = 2ρ**, ours exactly. Checked numerically by
``check`` (an identity workload agrees with ours, which is ResidualPlanner's plan, to 1e-12 relative).
Their ``'convex'`` solver already keeps, per partition, the best of convex (L-BFGS-B with a log barrier,
warm-started from Fourier), Fourier (WFF) and the RP+ P-basis; ``'fourier'`` is WFF alone.

:func:`reference_rmse` runs in this process; :func:`reference_rmse_in_child` runs it in a fresh
interpreter (``benchutil.Children``) with a time limit and returns ``{"status": "timeout"}`` past it.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _path in (HERE, REPO):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import benchutil  # noqa: E402

ENV_DIR = "QS_REF_DIR"
ENV_GIT_DIR = "QS_REF_GIT_DIR"
DEFAULT_DIR = HERE / "results" / "qs_reference"
UPSTREAM = "https://github.com/cmla-psu/QuerySmasherMatrixMechanism"
COMMIT_FILE = ".qs_reference_commit"
REQUIRED = ("query.py", "smasher.py", "solver.py")
SOLVERS = ("fourier", "convex", "best")
KINDS = ("identity", "prefix", "range", "circular_range")  # functions.dpquery.smasher.intervals
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# what their paper scripts pass as convex_kwargs (exp/paper_section8_2.py KRON_TIGHT_KWARGS), which also
# applies to the dense single-attribute partitions; None gives their Smasher's adaptive defaults
PAPER_CONVEX_KWARGS = {"mu_schedule": [0.1, 0.01, 0.001, 0.0001], "ftol": 1e-10, "maxcor": 50}

Workload = Sequence[tuple[Sequence[int], Mapping[int, str]]]


# --------------------------------------------------------------------------------------------------------
# getting their code


def export_reference(
    dest: Path | str | None = None, git_dir: Path | str | None = None, rev: str = "HEAD"
) -> Path:
    """Export ``rev`` of the authors' repository from the bare git dir ``git_dir`` (default
    ``$QS_REF_GIT_DIR``) into ``dest`` (default ``$QS_REF_DIR`` or ``bench/results/qs_reference``):
    ``git --git-dir=GIT_DIR archive REV | tar -x -C DEST``. Records the commit in
    ``DEST/.qs_reference_commit`` and returns ``dest``. The session's ``fetch`` tool for
    ``github:cmla-psu/QuerySmasherMatrixMechanism`` answers with that git dir
    (``/work/.mirror/cmla-psu+QuerySmasherMatrixMechanism/repo``); elsewhere ``git clone --bare`` the
    upstream URL."""
    git_dir = git_dir or os.environ.get(ENV_GIT_DIR)
    if not git_dir:
        raise ValueError(f"no git dir: pass git_dir or set ${ENV_GIT_DIR} (a bare clone of {UPSTREAM})")
    dest = Path(dest or os.environ.get(ENV_DIR) or DEFAULT_DIR)
    dest.mkdir(parents=True, exist_ok=True)
    git = ["git", f"--git-dir={git_dir}"]
    commit = subprocess.run(
        [*git, "rev-parse", rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    archive = subprocess.Popen([*git, "archive", commit], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    archive.stdout.close()
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {commit} failed (rc {archive.returncode})")
    (dest / COMMIT_FILE).write_text(commit + "\n")
    reference_dir(dest)  # checks the files are there
    return dest


def reference_dir(ref_dir: Path | str | None = None) -> Path:
    """The exported checkout: ``ref_dir``, else ``$QS_REF_DIR``, else ``bench/results/qs_reference``."""
    path = Path(ref_dir or os.environ.get(ENV_DIR) or DEFAULT_DIR).resolve()
    missing = [f for f in REQUIRED if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"no QuerySmasher reference checkout at {path} (missing {', '.join(missing)}); run "
            f"`bench/qs_reference.py export --git-dir BARE_CLONE` or set ${ENV_DIR}"
        )
    return path


def reference_commit(ref_dir: Path | str | None = None) -> str | None:
    f = reference_dir(ref_dir) / COMMIT_FILE
    return f.read_text().strip() if f.is_file() else None


def _load(ref_dir: Path) -> tuple[Any, Any]:
    """Their ``query.KronQuery`` and ``smasher.Smasher``. They import each other by the bare names
    ``query``/``solver``/``smasher``, so the directory goes on sys.path; a same-named module already loaded
    from elsewhere is an error (run in a child, :func:`reference_rmse_in_child`, to be safe)."""
    for name in ("query", "solver", "smasher"):
        mod = sys.modules.get(name)
        if mod is not None and Path(getattr(mod, "__file__", "") or "").resolve().parent != ref_dir:
            raise ImportError(f"a module {name!r} from {getattr(mod, '__file__', '?')} is already loaded")
    if str(ref_dir) not in sys.path:
        sys.path.insert(0, str(ref_dir))
    import query  # type: ignore[import-not-found]
    import smasher  # type: ignore[import-not-found]

    return query.KronQuery, smasher.Smasher


# --------------------------------------------------------------------------------------------------------
# workloads


def normalise_workload(
    domains: Sequence[int], workload: Workload
) -> list[tuple[tuple[int, ...], dict[int, str]]]:
    """Entries as (sorted attribute tuple, {attribute: type}), checked: attributes distinct and in range,
    query types of :data:`KINDS` (``identity`` the default, left out), only for attributes of the entry."""
    out = []
    for j, (attrs, kinds) in enumerate(workload):
        a = tuple(sorted(int(i) for i in attrs))
        if len(set(a)) != len(a) or any(not 0 <= i < len(domains) for i in a):
            raise ValueError(
                f"workload.{j}: attributes {tuple(attrs)} must be distinct indices of the domains"
            )
        kinds = {int(i): str(k) for i, k in dict(kinds).items()}
        bad = {i: k for i, k in kinds.items() if k not in KINDS or i not in a}
        if bad:
            raise ValueError(f"workload.{j}: query types {bad}: only {KINDS} on the entry's own attributes")
        out.append((a, {i: k for i, k in kinds.items() if k != "identity"}))
    return out


def kway_workload(domains: Sequence[int], ways: int, prefix: Sequence[int] = ()) -> list:
    """All ``ways``-way marginals of ``domains``, prefix on the attributes in ``prefix`` (identity else)."""
    pre = set(prefix)
    return [
        (attrs, {i: "prefix" for i in attrs if i in pre})
        for attrs in itertools.combinations(range(len(domains)), ways)
    ]


def attribute_matrix(kind: str, n: int):
    """One attribute's query matrix: the rows of ours (functions.dpquery.smasher.attribute_queries)."""
    from shardfold.functions.dpquery.smasher import attribute_queries

    return attribute_queries(kind, n)


def query_count(domains: Sequence[int], workload: Workload) -> int:
    """An entry has ∏ m_i queries, m_i the rows of its attributes' query matrices."""
    from shardfold.functions.dpquery.smasher import intervals

    rows = {}

    def m(i: int, kind: str) -> int:
        if (i, kind) not in rows:
            rows[(i, kind)] = len(intervals(kind, int(domains[i])))
        return rows[(i, kind)]

    return sum(math.prod(m(i, dict(k).get(i, "identity")) for i in attrs) for attrs, k in workload)


# --------------------------------------------------------------------------------------------------------
# the measurement


def _one(domains, entries, privacy_cost, solver, ref_dir, convex_kwargs) -> dict[str, Any]:
    kron_query, smasher_cls = _load(ref_dir)
    qs = smasher_cls(
        list(domains),
        privacy_cost=privacy_cost,
        default_solver=solver,
        noise=False,
        verbose=False,
        convex_kwargs=dict(convex_kwargs) if convex_kwargs else None,
    )
    qs.add_queries_to_workload(
        [
            kron_query(
                list(domains), attrs, [attribute_matrix(kinds.get(i, "identity"), domains[i]) for i in attrs]
            )
            for attrs, kinds in entries
        ]
    )
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # their progress prints stay off our stdout
        qs.optimize()
    seconds = time.perf_counter() - t0
    sse = float(qs.workload_variance())
    return {
        "sse": sse,
        "seconds": seconds,
        "phase_times": dict(getattr(qs, "phase_times", {}) or {}),
        "partitions": len(qs.solvers),
    }


def reference_rmse(
    domains: Sequence[int],
    workload: Workload,
    privacy_cost: float,
    solver: str = "fourier",
    ref_dir: Path | str | None = None,
    convex_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The authors' QuerySmasher on ``workload`` (entries (attributes, {attribute: "prefix"}), unit weights)
    at privacy cost ``privacy_cost`` (= 2ρ, as ours). Returns ``sse`` (the sum of the variances of all
    queries), ``queries``, ``rmse`` = √(sse/queries), ``seconds`` (wall time of ``optimize()``), ``solver``.
    ``solver="best"`` runs ``fourier`` and ``convex`` and keeps the lower sse; its ``seconds`` is the sum of
    both optimize() times (``runs`` has each). ``convex_kwargs`` goes to their Smasher (their paper scripts
    pass :data:`PAPER_CONVEX_KWARGS`); None = their adaptive defaults. Runs in this process: see
    :func:`reference_rmse_in_child` for a time limit and a thread count. Their convex solver runs torch and
    BLAS multi-threaded, which on a loaded machine can be >10x slower than one thread (CPS 1-way: 1.2 s
    with one thread, 13-218 s with two threads on a busy 2-core machine), and its L-BFGS-B path then
    depends on the reduction order (sse differs in the 5th digit): pin ``threads=1`` to time it."""
    if solver not in SOLVERS:
        raise ValueError(f"solver {solver!r}: expected one of {SOLVERS}")
    if not privacy_cost > 0:
        raise ValueError("privacy_cost must be positive")
    domains = [int(n) for n in domains]
    entries = normalise_workload(domains, workload)
    path = reference_dir(ref_dir)
    names = ("fourier", "convex") if solver == "best" else (solver,)
    runs = {s: _one(domains, entries, float(privacy_cost), s, path, convex_kwargs) for s in names}
    won = min(runs, key=lambda s: runs[s]["sse"])
    queries = query_count(domains, entries)
    out = {
        "status": "ok",
        "sse": runs[won]["sse"],
        "queries": queries,
        "rmse": math.sqrt(runs[won]["sse"] / queries),
        "seconds": sum(r["seconds"] for r in runs.values()),
        "solver": solver if solver != "best" else f"best:{won}",
        "privacy_cost": float(privacy_cost),
        "phase_times": runs[won]["phase_times"],
        "partitions": runs[won]["partitions"],
        "commit": reference_commit(path),
    }
    if solver == "best":
        out["runs"] = runs
    return out


# The reference child's address space: a partition its dense solver cannot hold fails it (MemoryError)
# instead of taking the machine's memory from everything else.
CHILD_MEMORY_LIMIT = 8 * 2**30


def _child_op(req: dict) -> dict:
    import resource

    limit = int(req.get("memory_limit") or CHILD_MEMORY_LIMIT)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    threads = req.get("threads")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    _load(reference_dir(req["ref_dir"]))  # imports (torch, cvxpy) before the peak-memory window
    peak = benchutil.PeakRSS()
    out = reference_rmse(
        req["domains"],
        [(tuple(a), {int(k): v for k, v in kinds.items()}) for a, kinds in req["workload"]],
        req["privacy_cost"],
        req["solver"],
        req["ref_dir"],
        req.get("convex_kwargs"),
    )
    out["memory"] = peak.report()
    return out


def reference_rmse_in_child(
    domains: Sequence[int],
    workload: Workload,
    privacy_cost: float,
    solver: str = "fourier",
    timeout_s: float = 600.0,
    ref_dir: Path | str | None = None,
    convex_kwargs: Mapping[str, Any] | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """:func:`reference_rmse` in a fresh interpreter (``python bench/qs_reference.py --child REQ``), killed
    after ``timeout_s`` (imports included). ``threads`` pins OpenMP/MKL/OpenBLAS and torch to that many
    threads. Returns its dict plus ``status: "ok"``, ``wall_s`` (the whole child) and ``memory`` (its peak
    RSS after the imports, benchutil.PeakRSS); or ``{"status": "timeout", ...}`` past the limit;
    or ``{"status": "error", "error": ...}`` (an exception, or a kill such as the OOM killer's)."""
    if solver not in SOLVERS:
        raise ValueError(f"solver {solver!r}: expected one of {SOLVERS}")
    domains = [int(n) for n in domains]
    entries = normalise_workload(domains, workload)
    path = reference_dir(ref_dir)
    req = {
        "op": "rmse",
        "domains": domains,
        "workload": [[list(a), {str(i): k for i, k in kinds.items()}] for a, kinds in entries],
        "privacy_cost": float(privacy_cost),
        "solver": solver,
        "ref_dir": str(path),
        "convex_kwargs": dict(convex_kwargs) if convex_kwargs else None,
        "threads": threads,
    }
    env = {v: str(threads) for v in THREAD_VARS} if threads else None
    base = {"solver": solver, "queries": query_count(domains, entries), "privacy_cost": float(privacy_cost)}
    children = benchutil.Children(__file__)
    try:
        run = children.run(req, timeout_s, env_extra=env)
    finally:
        children.close()
    if run.ok:
        return {**run.result, "wall_s": run.wall_s}
    if run.rc is not None and run.rc < 0 and run.wall_s >= timeout_s - 0.5:
        return {**base, "status": "timeout", "timeout_s": timeout_s, "wall_s": run.wall_s}
    return {**base, "status": "error", "error": run.note, "rc": run.rc, "wall_s": run.wall_s}


# --------------------------------------------------------------------------------------------------------
# command line: export, run, check (the last two also plan with ours, importing this project's package)


def _ours(domains: Sequence[int], workload: Workload, privacy_cost: float) -> dict[str, Any]:
    for path in (str(REPO), str(REPO / "tests")):  # the package, and the reference planner beside its tests
        if path not in sys.path:
            sys.path.insert(0, path)
    from smash_reference import Entry, plan_kron

    entries = normalise_workload(domains, workload)
    t0 = time.perf_counter()
    plan = plan_kron(domains, [Entry(a, 1.0, k) for a, k in entries], privacy_cost / 2)
    seconds = time.perf_counter() - t0
    queries = query_count(domains, entries)
    return {
        "sse": plan.total,
        "queries": queries,
        "rmse": math.sqrt(plan.total / queries),
        "seconds": seconds,
    }


def _ours_in_child(domains, workload, privacy_cost, timeout_s) -> dict[str, Any]:
    children = benchutil.Children(__file__)
    req = {
        "op": "ours",
        "domains": list(domains),
        "workload": [[list(a), {str(i): k for i, k in kinds.items()}] for a, kinds in workload],
        "privacy_cost": privacy_cost,
    }
    try:
        run = children.run(req, timeout_s)
    finally:
        children.close()
    if run.ok:
        return {**run.result, "status": "ok", "wall_s": run.wall_s}
    if run.rc is not None and run.rc < 0 and run.wall_s >= timeout_s - 0.5:
        return {"status": "timeout", "timeout_s": timeout_s, "wall_s": run.wall_s}
    return {"status": "error", "error": run.note, "rc": run.rc, "wall_s": run.wall_s}


def _ours_op(req: dict) -> dict:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import shardfold.functions.dpquery.smasher  # noqa: F401 - imports before the peak-memory window

    peak = benchutil.PeakRSS()
    out = _ours(
        req["domains"],
        [(tuple(a), {int(k): v for k, v in kinds.items()}) for a, kinds in req["workload"]],
        req["privacy_cost"],
    )
    out["memory"] = peak.report()
    return out


CHECK_CASES = [
    ("identity [3,4,5]", [3, 4, 5], [((0, 1), {}), ((2,), {}), ((0, 2), {})]),
    ("prefix [6,4]", [6, 4], [((0, 1), {0: "prefix"}), ((0,), {0: "prefix"})]),
]


def _fmt(r: dict) -> str:
    if r.get("status", "ok") != "ok":
        return (
            f"{r['status']} ({r.get('error') or ''}{r.get('timeout_s', '')}) after {r.get('wall_s', 0):.1f} s"
        )
    mem = r.get("memory", {}).get("peak_rss")
    added = r.get("memory", {}).get("added_rss")
    return (
        f"sse {r['sse']:.6f}  rmse {r['rmse']:.6f}  optimize {r['seconds']:.2f} s"
        + (f"  child {r['wall_s']:.1f} s" if "wall_s" in r else "")
        + (f"  peak {mem / 2**20:.0f} MiB" if mem else "")
        + (f" (+{added / 2**20:.0f} after imports)" if added is not None else "")
        + (f"  [{r['solver']}]" if "solver" in r else "")
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="export a bare clone of the authors' repo to QS_REF_DIR")
    ex.add_argument("--git-dir", default=os.environ.get(ENV_GIT_DIR))
    ex.add_argument("--dest", default=None)
    ex.add_argument("--rev", default="HEAD")
    rn = sub.add_parser("run", help="one workload, in a child with a time limit")
    rn.add_argument("--domains", required=True, help="comma-separated domain sizes")
    rn.add_argument("--ways", type=int, default=1)
    rn.add_argument("--prefix", default="", help="comma-separated attributes queried as prefixes")
    rn.add_argument("--solver", choices=SOLVERS, default="convex")
    rn.add_argument("--cost", type=float, default=1.0, help="privacy cost 2ρ")
    rn.add_argument("--timeout", type=float, default=120.0)
    rn.add_argument("--threads", type=int, default=None)
    rn.add_argument("--paper-kwargs", action="store_true", help="their paper scripts' convex_kwargs")
    rn.add_argument("--ours", action="store_true", help="also plan with ours, in its own child")
    sub.add_parser("check", help="normalisation: tiny identity and prefix workloads, theirs vs ours")
    args = ap.parse_args(argv)

    if args.cmd == "export":
        print(export_reference(args.dest, args.git_dir, args.rev))
        return 0
    if args.cmd == "run":
        domains = [int(x) for x in args.domains.split(",")]
        prefix = [int(x) for x in args.prefix.split(",") if x]
        wl = kway_workload(domains, args.ways, prefix)
        print(f"domains {domains}, {args.ways}-way, prefix on {prefix}, cost {args.cost}")
        if args.ours:
            print("  ours  ", _fmt(_ours_in_child(domains, wl, args.cost, args.timeout)), flush=True)
        kwargs = PAPER_CONVEX_KWARGS if args.paper_kwargs else None
        res = reference_rmse_in_child(
            domains, wl, args.cost, args.solver, args.timeout, convex_kwargs=kwargs, threads=args.threads
        )
        print("  theirs", _fmt(res))
        print(json.dumps(res, default=str))
        return 0
    for name, domains, wl in CHECK_CASES:
        for cost in (1.0, 2.0):
            ours = _ours(domains, wl, cost)
            print(f"{name} cost {cost}: ours    {_fmt(ours)}")
            for solver in ("fourier", "convex"):
                res = reference_rmse_in_child(domains, wl, cost, solver, timeout_s=120)
                rel = (res["sse"] - ours["sse"]) / ours["sse"] if res["status"] == "ok" else float("nan")
                print(f"{' ' * len(name)} {' ' * 9}theirs  {_fmt(res)}  (theirs/ours - 1 = {rel:+.2e})")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(benchutil.child_main({"rmse": _child_op, "ours": _ours_op}, sys.argv[2]))
    sys.exit(main())
