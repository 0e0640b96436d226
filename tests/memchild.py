"""The child side of tests/test_memory.py: run ONE task handler in a fresh interpreter, measure its peak RSS.

``python tests/memchild.py --child REQ.json`` (started by ``bench/benchutil.Children``) imports the task's
modules (``imports``, then the handler's module), reads its resident size — the runtime baseline, a
process that has imported everything and done no work — resets the peak (``benchutil.PeakRSS``) and calls
``handler(event)``. The reply holds ``peak_rss`` (the whole process), ``baseline_rss`` and the handler's
result (and, when asked, the tracemalloc peak). Nothing else is imported here, so the baseline is the
task's runtime and not the test suite's.
"""

from __future__ import annotations

import gc
import importlib
import sys
import tracemalloc
from importlib.machinery import PathFinder
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from benchutil import PeakRSS, child_main  # noqa: E402


class _Absent:
    """The import system's path finder, except that it finds none of ``names``: importing one fails, and
    ``importlib.util.find_spec`` answers None, as where it is not installed."""

    def __init__(self, finder, names: list[str]):
        self.finder, self.names = finder, set(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            return None
        return self.finder.find_spec(fullname, path, target)

    def __getattr__(self, name):  # invalidate_caches, find_distributions
        return getattr(self.finder, name)


def run_task(req: dict) -> dict:
    """``{"handler": "module:name", "event": {...}, "imports": [...], "absent": [...], "tracemalloc": bool}``:
    the packages in ``absent`` cannot be imported (as where they are not installed)."""
    if req.get("absent"):
        sys.meta_path[:] = [_Absent(f, req["absent"]) if f is PathFinder else f for f in sys.meta_path]
    for name in req.get("imports", ()):
        importlib.import_module(name)
    module, name = req["handler"].split(":")
    handler = getattr(importlib.import_module(module), name)
    gc.collect()
    before = set(sys.modules)
    peak = PeakRSS()
    if not peak.reset:
        return {"error": "cannot reset the peak RSS (/proc/self/clear_refs)"}
    if req.get("tracemalloc"):
        tracemalloc.start()
    result = handler(req["event"])
    report = peak.report()
    if req.get("tracemalloc"):
        report["traced_peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    # packages the task imported on first use: part of its runtime, better listed in ``imports``
    report["late_imports"] = sorted({m.split(".")[0] for m in set(sys.modules) - before})
    return {**report, "result": result}


if __name__ == "__main__":
    sys.exit(child_main({"task": run_task}, sys.argv[2]))
