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
from importlib.machinery import PathFinder, SourceFileLoader
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from benchutil import PeakRSS, child_main  # noqa: E402


class _FromSource(SourceFileLoader):
    """Compiles the module from its source, whatever ``__pycache__`` holds."""

    def get_code(self, fullname):
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)


class _AsDeployed:
    """The import system's path finder, as the deployed tasks see it:

    - it finds none of ``absent``: importing one fails, and ``importlib.util.find_spec`` answers None, as
      where it is not installed;
    - the repository's own modules compile from source, as in the Lambda package (which ships no bytecode):
      compiling leaves tens of MiB in the runtime baseline, so whether a developer's run wrote
      ``__pycache__`` (CI's environment sets PYTHONDONTWRITEBYTECODE) must not change the measurement."""

    def __init__(self, finder, absent: list[str]):
        self.finder, self.absent = finder, set(absent)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.absent:
            return None
        spec = self.finder.find_spec(fullname, path, target)
        if spec is not None and isinstance(spec.loader, SourceFileLoader) and _ours(spec.origin):
            spec.loader = _FromSource(fullname, spec.origin)
        return spec

    def __getattr__(self, name):  # invalidate_caches, find_distributions
        return getattr(self.finder, name)


def _ours(origin: str | None) -> bool:
    return origin is not None and Path(origin).resolve().is_relative_to(REPO) and ".venv" not in origin


def run_task(req: dict) -> dict:
    """``{"handler": "module:name", "event": {...}, "imports": [...], "absent": [...], "tracemalloc": bool}``:
    the packages in ``absent`` cannot be imported (as where they are not installed): :class:`_AsDeployed`."""
    absent = req.get("absent", ())
    sys.meta_path[:] = [_AsDeployed(f, absent) if f is PathFinder else f for f in sys.meta_path]
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
