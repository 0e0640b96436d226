"""Helpers every benchmark script shares. Linux only (they read ``/proc``), like the benchmarks.

Contract:

* ``table`` formats a plain-text table; ``quiet_logs`` keeps library INFO lines out of it.
* Peak memory of a process is read INSIDE that process: ``PeakRSS()`` resets the kernel's high-water mark
  (``/proc/self/clear_refs`` 5) once the imports are done and ``.report()`` returns the peak ``VmHWM``, the
  RSS at the start and what the code in between added. Not ``wait4``/``RUSAGE_CHILDREN``: Linux folds the
  RSS a child had before ``exec`` -- its parent's, at fork -- into those (``descendants_max_rss`` says so).
* ``TreePeak`` samples the summed PSS of this process and all its descendants (shared pages split among
  their users, so a model mapped by several workers is not counted twice) in a thread: the peak memory of
  a method that runs in many processes (Ray's actors, an executor's pool), sampled, so a lower bound.
* ``Children`` runs a request in a fresh interpreter (``python SCRIPT --child REQ.json``); the child answers
  with one tagged JSON line written by ``child_main``. A time limit kills it; the reply says why it failed.
* ``LoadWatch`` records the load averages before and after a stretch of the run, and the CPU that OTHER
  processes used meanwhile: all CPU time the machine spent in user and kernel mode (``/proc/stat``), less
  this process tree's (``/proc/<pid>/stat``, self + descendants, waited-for children included), less kernel
  threads' (writeback, kworkers: reported apart). A window where others used more than ``NOISY_CORES``
  cores is marked noisy; every script prints the mark and writes ``LoadWatch.report()`` into its JSON.

Nothing here asserts on time.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULT_TAG = "@@BENCH-RESULT "
NOISY_CORES = 0.5  # other processes' average CPU use above which a measurement is marked noisy


# --------------------------------------------------------------------------------------------------------
# output


def table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    """A plain-text table; columns in ``right`` (default: all but the first and last) right-aligned."""
    n = len(headers)
    if right is None:
        right = set(range(1, n - 1))
    widths = [max(len(headers[i]), *(len(r[i]) for r in rows)) if rows else len(headers[i]) for i in range(n)]
    widths[-1] = 0

    def fmt(vals: list[str]) -> str:
        out = []
        for i, v in enumerate(vals):
            w = widths[i]
            out.append(v if not w else (f"{v:>{w}}" if i in right else f"{v:<{w}}"))
        return "  ".join(out).rstrip()

    lines = [fmt(headers), fmt(["-" * w if w else "----" for w in widths])]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def quiet_logs(verbose: bool) -> None:
    """Library INFO lines would bury the tables: show warnings only unless asked."""
    if not verbose and not (os.environ.get("POWERTOOLS_LOG_LEVEL") or os.environ.get("LOG_LEVEL")):
        os.environ["POWERTOOLS_LOG_LEVEL"] = "WARNING"


# --------------------------------------------------------------------------------------------------------
# peak memory, read inside the process that is measured


def status_bytes(key: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (VmRSS, VmHWM, ...) in bytes; 0 where absent."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss_now() -> int:
    return status_bytes("VmRSS")


def peak_rss() -> int:
    """This process's peak resident size since it started or since the last :func:`reset_peak`."""
    return status_bytes("VmHWM")


def reset_peak() -> bool:
    """Reset this process's peak RSS to its current RSS (Linux ``clear_refs`` 5, kernel >= 4.0), so a peak
    read later is what the code since then needed on top of what the interpreter and imports hold."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def descendants_max_rss() -> int:
    """The largest max RSS among this process's waited-for descendants (``RUSAGE_CHILDREN``), in bytes.
    An upper bound for a child that was forked: it includes the RSS the child inherited at fork."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def mem_available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRSS:
    """Peak RSS of this process over the code that runs between construction and :meth:`report`."""

    def __init__(self) -> None:
        self.baseline = rss_now()
        self.reset = reset_peak()

    def report(self) -> dict[str, Any]:
        peak = peak_rss()
        return {
            "peak_rss": peak,  # the whole process: interpreter and imports included
            "baseline_rss": self.baseline,  # RSS when the measurement started (after the imports)
            "added_rss": peak - self.baseline if self.reset else None,  # what the measured code added
            "peak_reset": self.reset,
        }


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # gone, or not ours to read
        pass
    return 0


def tree_pids(root: int | None = None) -> list[int]:
    """``root`` (default: this process) and every process descended from it, from /proc."""
    stats = _proc_stats()
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = [], [root or os.getpid()]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out


class TreePeak:
    """The largest summed PSS of this process tree seen by a thread sampling every ``interval_s``."""

    def __init__(self, interval_s: float = 0.5):
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while True:
            self.peak = max(self.peak, sum(_pss(pid) for pid in tree_pids()))
            self.samples += 1
            if self._stop.wait(interval_s):
                return

    def stop(self) -> int:
        """Stop sampling (after one last sample); the peak in bytes."""
        self._stop.set()
        self._thread.join()
        return self.peak


# --------------------------------------------------------------------------------------------------------
# child processes


@dataclass
class ChildRun:
    ok: bool
    result: dict
    wall_s: float
    rc: int | None
    note: str = ""
    max_rss: int = 0  # wait4's ru_maxrss: NOT the child's own peak (it includes the parent's RSS at fork)


class Children:
    """Starts ``python SCRIPT --child REQ.json`` children and kills any still running on :meth:`kill_all`.

    Requests and the children's stdout/stderr are files under ``workdir`` (a temp dir unless given), so a
    chatty child cannot block on a full pipe. The child's reply is the last ``RESULT_TAG`` line it prints.
    """

    def __init__(
        self,
        script: str | Path,
        workdir: Path | None = None,
        env: dict[str, str] | None = None,
        cwd: Path = REPO,
    ):
        self.script = str(Path(script).resolve())
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="shardfold-bench-child-"))
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.live: dict[int, subprocess.Popen] = {}
        self._n = 0
        self._lock = threading.Lock()

    def start(self, req: dict, env_extra: dict[str, str] | None = None) -> tuple[subprocess.Popen, Any, Any]:
        with self._lock:
            self._n += 1
            n = self._n
        req_path = self.workdir / f"child-{n}.json"
        req_path.write_text(json.dumps(req))
        out = open(self.workdir / f"child-{n}.out", "w+")  # noqa: SIM115 - closed in finish()
        err = open(self.workdir / f"child-{n}.err", "w+")  # noqa: SIM115
        p = subprocess.Popen(
            [sys.executable, self.script, "--child", str(req_path)],
            stdout=out,
            stderr=err,
            env={**self.env, **(env_extra or {})},
            cwd=str(self.cwd),
        )
        self.live[p.pid] = p
        return p, out, err

    def finish(self, started: tuple, timeout_s: float, t0: float) -> ChildRun:
        p, out, err = started
        timer = threading.Timer(timeout_s, p.kill)
        timer.daemon = True
        timer.start()
        try:
            _pid, status, ru = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - t0
        p.returncode = rc = os.waitstatus_to_exitcode(status)
        self.live.pop(p.pid, None)
        out.seek(0)
        err.seek(0)
        text, etext = out.read(), err.read()
        out.close()
        err.close()
        result: dict = {}
        # the tag line, wherever a child's redirection left it (a library's stdout redirected to stderr)
        for line in text.splitlines() + etext.splitlines():
            if line.startswith(RESULT_TAG):
                result = json.loads(line[len(RESULT_TAG) :])
        last_err = (etext.strip().splitlines() or ["no output"])[-1][:200]
        note = ""
        if rc and rc < 0:
            note = f"killed by signal {-rc}" + (
                f" (time limit {timeout_s:.0f} s)" if wall >= timeout_s - 0.5 else " (out of memory?)"
            )
        elif rc:
            note = f"exit {rc}: {last_err}"
        elif "error" in result:
            note = str(result["error"]).strip()[-300:]
        elif not result:
            note = f"no result line: {last_err}"
        return ChildRun(
            ok=not note, result=result, wall_s=wall, rc=rc, note=note, max_rss=ru.ru_maxrss * 1024
        )

    def run(self, req: dict, timeout_s: float, env_extra: dict[str, str] | None = None) -> ChildRun:
        t0 = time.perf_counter()
        return self.finish(self.start(req, env_extra), timeout_s, t0)

    def kill_all(self) -> None:
        for p in list(self.live.values()):
            with contextlib.suppress(OSError):
                p.kill()

    def close(self) -> None:
        self.kill_all()
        if self._own_dir:
            import shutil

            shutil.rmtree(self.workdir, ignore_errors=True)


def child_main(ops: dict[str, Callable[[dict], dict]], req_path: str) -> int:
    """The child's side of :class:`Children`: run ``ops[req["op"]](req)`` and print its tagged reply."""
    req = json.loads(Path(req_path).read_text())
    try:
        out = ops[req["op"]](req)
    except MemoryError:
        out = {"error": "MemoryError"}
    except Exception as exc:  # reported to the parent as a row note, with the traceback on stderr
        traceback.print_exc()
        out = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    sys.stdout.write(RESULT_TAG + json.dumps(out, default=str) + "\n")
    sys.stdout.flush()
    return 0


# --------------------------------------------------------------------------------------------------------
# load: what else ran on the machine while we measured


def _proc_stats() -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, own CPU ticks, waited-for children's CPU ticks) for every process, from /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                text = fh.read()
        except OSError:  # gone meanwhile
            continue
        rest = text[text.rfind(")") + 2 :].split()  # the command name may hold spaces and parentheses
        # fields 4 (ppid), 14-17 (utime, stime, cutime, cstime) of proc(5), counted from field 3 here
        out[int(name)] = (int(rest[1]), int(rest[11]) + int(rest[12]), int(rest[13]) + int(rest[14]))
    return out


def _cpu_snapshot() -> dict[str, float]:
    """Seconds of CPU so far: the machine's (user + nice + system), this process tree's, kernel threads',
    and the hypervisor's steal. Interrupt time is left out: on loopback it is our own traffic's, not
    attributed to any process."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    machine = f[0] + f[1] + f[2]  # guest time is already inside user
    steal = f[7] if len(f) > 7 else 0
    stats = _proc_stats()
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        kids.setdefault(ppid, []).append(pid)
    own, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        if pid in stats:
            own += stats[pid][1] + stats[pid][2]
        todo.extend(kids.get(pid, ()))
    kernel = sum(t for pid, (ppid, t, _) in stats.items() if pid == 2 or ppid == 2)
    return {
        "t": time.perf_counter(),
        "machine": machine / tick,
        "own": own / tick,
        "kernel": kernel / tick,
        "steal": steal / tick,
    }


class LoadWatch:
    """Load averages and other processes' CPU use over a window that starts at construction.

    ``others_cores`` = (machine CPU - this process tree's - kernel threads') / wall seconds. CPU of a
    descendant counts as ours once it was waited for (cutime) or while it runs; one that outlives its
    parent and is re-parented to init counts as another process's.
    """

    def __init__(self, label: str = "run"):
        self.label = label
        self.load_before = os.getloadavg()
        self._s0 = _cpu_snapshot()
        self.result: dict[str, Any] | None = None

    def stop(self) -> dict[str, Any]:
        """Close the window (once; later calls return the same report)."""
        if self.result is None:
            s1 = _cpu_snapshot()
            wall = max(s1["t"] - self._s0["t"], 1e-9)
            d = {k: s1[k] - self._s0[k] for k in ("machine", "own", "kernel", "steal")}
            others = max(0.0, d["machine"] - d["own"] - d["kernel"]) / wall
            self.result = {
                "label": self.label,
                "load_average_before": list(self.load_before),
                "load_average_after": list(os.getloadavg()),
                "wall_s": wall,
                "own_cores": d["own"] / wall,
                "others_cores": others,
                "kernel_threads_cores": d["kernel"] / wall,
                "steal_cores": d["steal"] / wall,
                "cpus": os.cpu_count(),
                "noisy": others > NOISY_CORES,
            }
        return self.result

    def report(self) -> dict[str, Any]:
        return self.stop()

    def mark(self) -> str:
        """A short tag for a table row or note: 'others 0.12 cores' or 'NOISY: others 0.80 cores'."""
        return mark(self.stop())


def load_start_line(watch: LoadWatch) -> str:
    a = watch.load_before
    return f"load average before: {a[0]:.2f} {a[1]:.2f} {a[2]:.2f} on {os.cpu_count()} CPUs"


def load_end_line(watch: LoadWatch) -> str:
    """Load before and after, and the run's noise mark (the same text goes to stdout for every script)."""
    r = watch.stop()
    a, b = r["load_average_before"], r["load_average_after"]
    verdict = (
        f"NOISY RUN: other processes used more than {NOISY_CORES:g} core on average"
        if r["noisy"]
        else f"quiet run: other processes used at most {NOISY_CORES:g} core on average"
    )
    return (
        f"load average {a[0]:.2f} {a[1]:.2f} {a[2]:.2f} before, {b[0]:.2f} {b[1]:.2f} {b[2]:.2f} after "
        f"({r['cpus']} CPUs); over {r['wall_s']:.0f} s this benchmark used {r['own_cores']:.2f} cores, "
        f"other processes {r['others_cores']:.2f}, kernel threads {r['kernel_threads_cores']:.2f}, "
        f"steal {r['steal_cores']:.2f} -> {verdict}"
    )


@contextlib.contextmanager
def watched(label: str, into: dict | None = None, key: str = "load") -> Iterator[LoadWatch]:
    """``with watched("stream", doc_part) as w:`` -- a :class:`LoadWatch` over the block; its report is
    stored in ``into[key]`` when the block ends (also on error)."""
    w = LoadWatch(label)
    try:
        yield w
    finally:
        rep = w.stop()
        if into is not None:
            into[key] = rep


def noisy_windows(reports: list[dict]) -> list[str]:
    """Labels of the noisy windows among ``reports`` (for a summary line)."""
    return [r["label"] for r in reports if r and r.get("noisy")]


def mark(report: dict | None) -> str:
    """The mark of a stored :meth:`LoadWatch.report`."""
    if not report:
        return "load not measured"
    return ("NOISY: " if report["noisy"] else "") + f"others {report['others_cores']:.2f} cores"
