"""Worker processes of the local executor end when the process that started them ends.

The local executor starts two kinds of worker process: the process pool's (CPU-bound tasks) and the Batch
containers (``python -m functions.container`` as a child, or forked by :mod:`orchestrator.container_server`,
which ends with the process that started it, its children with it). When the process running the job ends
in an orderly way (``shardfold run`` gets SIGTERM, SIGINT or SIGHUP) it kills them itself
(:meth:`orchestrator.local.LocalExecutor.interrupt`). When it is killed outright (``kill -9``, the
out-of-memory killer) nothing runs in it, so each worker watches for itself:

* a Batch container polls ``os.getppid()`` on a daemon thread (:func:`watch_parent`) and exits once its
  parent is gone (the kernel then gives it another parent), within :data:`POLL_S`;
* a process-pool worker's parent is the pool's fork server, which lives as long as any worker does (each
  holds the server's "alive" pipe), so a worker watches the process running the job instead
  (:func:`watch_process`, a pidfd: woken the moment it ends, with no pid-reuse race); then the server
  ends too;
* a Batch container is also started through this module (``python -m orchestrator.lifeline
  functions.container``), which on Linux asks the kernel for SIGKILL when its parent thread ends
  (``PR_SET_PDEATHSIG``) before running the container module as ``__main__``. The thread that starts a
  container waits for it, so it never ends first. (The process pool's workers do not use it: the pool
  starts them from whichever thread submits first, which may end long before the pool does.)
"""

from __future__ import annotations

import os
import runpy
import select
import signal
import sys
import threading
import time

PARENT_ENV = "SHARDFOLD_PARENT_PID"
POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


def _orphaned(parent: int) -> bool:
    return os.getppid() != parent


def _leave() -> None:
    os._exit(128 + signal.SIGHUP)  # as if hung up: the parent that owned this work is gone


def watch_parent(parent: int, poll_s: float = POLL_S) -> None:
    """Exit this process once ``parent`` is no longer its parent (checked now, then every ``poll_s``)."""
    if _orphaned(parent):
        _leave()

    def loop() -> None:
        while True:
            time.sleep(poll_s)
            if _orphaned(parent):
                _leave()

    threading.Thread(target=loop, name="shardfold-lifeline", daemon=True).start()


def watch_process(pid: int, poll_s: float = POLL_S) -> None:
    """Exit this process once process ``pid`` has ended: woken by a pidfd on Linux, else by polling."""
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        _leave()
    except (AttributeError, OSError):  # no pidfds here (not Linux, or older than 5.3)
        fd = None

    def loop() -> None:
        if fd is not None:
            select.select([fd], [], [])  # readable once the process has ended
            _leave()
        while True:
            time.sleep(poll_s)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                _leave()
            except PermissionError:
                pass

    threading.Thread(target=loop, name="shardfold-lifeline", daemon=True).start()


def kill_with_parent() -> bool:
    """Linux: have the kernel SIGKILL this process when its parent (thread) ends. False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def pool_worker_init(owner: int) -> None:
    """``ProcessPoolExecutor`` initializer: the worker exits once ``owner`` (the process whose pool it is)
    has ended, and ignores Ctrl-C, which the terminal sends its whole process group: the owner stops its
    workers itself (:meth:`LocalExecutor.interrupt`), without a traceback from each."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_process(owner)


def child_command(module: str) -> list[str]:
    """The command that runs ``python -m module`` tied to this process; set :data:`PARENT_ENV` to
    ``str(os.getpid())`` in its environment."""
    return [sys.executable, "-m", "shardfold.orchestrator.lifeline", module]


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m shardfold.orchestrator.lifeline MODULE")
    parent = int(os.environ.pop(PARENT_ENV, "0") or 0) or os.getppid()
    kill_with_parent()
    watch_parent(parent)  # also covers a parent that ended before prctl took effect
    sys.argv = [argv[0]]
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
