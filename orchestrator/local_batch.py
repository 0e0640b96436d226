"""Run a BatchJob step on this machine the way AWS Batch runs its container (local executor).

The step runs as a child process of the container's entry point, ``python -m functions.container``, with the
same environment contract (``SHARDFOLD_HANDLER``, ``SHARDFOLD_FUNCTION``, ``SHARDFOLD_STEP``,
``SHARDFOLD_EVENT``), so a local run exercises the code path the GPU container runs, and the worker is a real
process that can be killed. The job definition's retry table is followed: exit code 75 (the worker's
"transient fault") is retried up to :data:`BATCH_ATTEMPTS` attempts in all; any other exit fails the job, as
does running past the step's ``timeout_s`` (Batch's attempt duration, which Batch does not retry). A death by
signal (``kill -9``, the out-of-memory killer) is exit 137 in a container, which the table does not retry
either.

On Linux the child is forked from :mod:`orchestrator.container_server`, a process that imported the heavy
modules (torch, the model's code) once, rather than started afresh: the container's code, environment, pid
and exit code are the same, and a GPU worker starts in a fraction of a second instead of ~5 s of imports.
Elsewhere, or with ``SHARDFOLD_CONTAINER_SERVER=0``, it is a fresh ``python -m orchestrator.lifeline
functions.container``. Either way it dies with this process even when this process is killed outright;
``children`` (a set the caller owns) holds the running child so the caller can kill it at once
(:meth:`orchestrator.local.LocalExecutor.interrupt`).

The child writes why it failed to ``SHARDFOLD_STATUS_FILE`` (Batch's status reason), so the failure names
the handler's error and message; its log lines go to this process's stdout and stderr.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import shardfold
from shardfold.functions.container import EXIT_TRANSIENT
from shardfold.functions.log import logger
from shardfold.functions.workflow import BATCH_ATTEMPTS
from shardfold.orchestrator import container_server
from shardfold.orchestrator.invoke import HandlerFailed
from shardfold.orchestrator.lifeline import PARENT_ENV, child_command

_TERMINATE_GRACE_S = 10.0  # SIGTERM, then SIGKILL after this long (as ECS's stop timeout)


Container = subprocess.Popen | container_server.Container  # a running container, fresh or forked


class Cancelled(Exception):
    """The job was cancelled while its container ran; the child was terminated."""


def _environment(
    handler_path: str, function: str, event: dict[str, Any], status_file: str, step: str
) -> dict[str, str]:
    env = dict(os.environ)
    # the child imports what this process can (as a spawned process-pool worker does): this code, installed
    # or not, and handlers registered from modules on this process's path
    root = str(Path(shardfold.__file__).resolve().parent.parent)
    paths = [root, *(p or os.getcwd() for p in sys.path), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    env.update(
        SHARDFOLD_HANDLER=handler_path,
        SHARDFOLD_FUNCTION=function,
        SHARDFOLD_STEP=step,
        SHARDFOLD_EVENT=json.dumps(event),
        SHARDFOLD_STATUS_FILE=status_file,
    )
    env[PARENT_ENV] = str(os.getpid())
    return env


def _start(handler_path: str, env: dict[str, str]) -> Container:
    if container_server.enabled():
        try:
            module = importlib.import_module(handler_path.partition(":")[0])
            preload = callable(getattr(module, "preload", None))
        except Exception:  # the container reports it, as a fresh one would
            preload = False
        try:
            return container_server.start(handler_path, env, preload=preload)
        except OSError as exc:
            logger.warning("starting the container afresh: %s", exc)
    return subprocess.Popen(child_command("shardfold.functions.container"), env=env)


def _stop(proc: Container) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(_TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _failure(returncode: int, status_file: Path, function: str, pid: int) -> HandlerFailed:
    try:
        status = json.loads(status_file.read_text())
    except (OSError, ValueError):
        status = None
    if status:
        return HandlerFailed(status["error"], status["message"], bool(status.get("user_error")))
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
        return HandlerFailed(
            "Batch.JobFailed", f"the container running {function} (pid {pid}) was killed by {name}"
        )
    return HandlerFailed("Batch.JobFailed", f"the container running {function} exited with code {returncode}")


def _wait(proc: Container, function: str, timeout_s: float, cancel: threading.Event, poll_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return proc.wait(poll_s)
        except subprocess.TimeoutExpired:
            pass
        if cancel.is_set():
            _stop(proc)
            raise Cancelled(function)
        if time.monotonic() > deadline:
            _stop(proc)
            raise HandlerFailed(
                "States.Timeout", f"{function} ran past its attempt duration of {timeout_s:.0f} s"
            )


def run_container(
    handler_path: str,
    function: str,
    event: dict[str, Any],
    *,
    timeout_s: float,
    cancel: threading.Event,
    attempts: int = BATCH_ATTEMPTS,
    poll_s: float = 0.2,
    children: set[Container] | None = None,
    step: str = "",
) -> None:
    """Run the container entry point on ``event`` until it succeeds, fails for good, or is cancelled.

    Raises :class:`HandlerFailed` naming the failure, or :class:`Cancelled`. The result is discarded, as
    Step Functions discards a Batch job's (outputs go to the store).
    """
    for attempt in range(1, attempts + 1):
        with tempfile.TemporaryDirectory(prefix="shardfold-batch-") as tmp:
            status_file = Path(tmp) / "status.json"
            env = _environment(handler_path, function, event, str(status_file), step or function)
            proc = _start(handler_path, env)
            if children is not None:
                children.add(proc)
            logger.info(
                "batch container started", extra={"function": function, "pid": proc.pid, "attempt": attempt}
            )
            try:
                code = _wait(proc, function, timeout_s, cancel, poll_s)
            finally:
                if children is not None:
                    children.discard(proc)
            if code == 0:
                return
            failure = _failure(code, status_file, function, proc.pid)
        if code != EXIT_TRANSIENT or attempt == attempts:
            raise failure
        logger.warning(
            "batch container asked for a retry (exit 75)",
            extra={"function": function, "attempt": attempt, "error": str(failure)},
        )
