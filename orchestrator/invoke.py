"""Call one handler the way Lambda would, outside Lambda (local executor, moto harness, ``shardfold invoke``).

The event and the result go through JSON, as they do on Lambda, so a handler that returns something
Lambda could not serialise, or a result over the 256 KiB state limit, fails here too. Any failure comes
back as :class:`HandlerFailed` carrying the error name Step Functions would see (the exception's class
name), so retry policies match the same names on every backend. ``HandlerFailed`` pickles cleanly, which
lets a process-pool worker report any exception (even one whose constructor takes extra arguments).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from shardfold.functions.errors import ShardfoldError
from shardfold.functions.workflow import LAMBDA_TIMEOUT
from shardfold.orchestrator.registry import import_handler

MAX_STATE_BYTES = 256 * 1024  # Step Functions' limit on a state's input/output


class HandlerFailed(Exception):
    """A handler raised. ``error`` is the Step Functions error name; ``user_error`` marks ShardfoldError."""

    def __init__(self, error: str, message: str, user_error: bool = False, trace: str = ""):
        super().__init__(error, message, user_error, trace)
        self.error = error
        self.message = message
        self.user_error = user_error
        self.trace = trace

    def __str__(self) -> str:
        return f"{self.error}: {self.message}"

    def payload(self) -> dict[str, Any]:
        """Lambda's error payload for an unhandled exception."""
        return {
            "errorType": self.error,
            "errorMessage": self.message,
            "stackTrace": self.trace.splitlines()[-20:],
        }


@dataclass
class LocalContext:
    """The parts of Lambda's context object handlers and Powertools use; the one stand-in for it, which
    :func:`call` passes for every backend that runs handlers outside Lambda."""

    function_name: str
    memory_limit_in_mb: int = 1024
    timeout_s: int = 900
    invoked_function_arn: str = ""
    aws_request_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    function_version: str = "$LATEST"
    log_group_name: str = "local"
    log_stream_name: str = "local"
    _deadline: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        self._deadline = time.monotonic() + self.timeout_s
        if not self.invoked_function_arn:
            self.invoked_function_arn = f"arn:aws:lambda:local:000000000000:function:{self.function_name}"

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


class _Expired(Exception):
    """Raised into a handler by :func:`_alarm` when its time is up."""


@contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise _Expired

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class ResultTooLarge(Exception):
    """A handler returned more than a state may hold; it must write data to the store instead."""


def call(
    handler_path: str,
    event: dict[str, Any],
    *,
    function_name: str,
    memory_mb: int = 1024,
    timeout_s: int = 900,
    enforce_timeout: bool = False,
    context: dict[str, Any] | None = None,
) -> Any:
    """Run the handler at ``handler_path`` on a JSON copy of ``event``; return its JSON-normalised result.

    ``enforce_timeout`` (a process of its own, on its main thread: a local executor's pool worker): a
    handler still running after ``timeout_s`` is stopped, as Lambda stops it, and fails with Lambda's
    :data:`functions.workflow.LAMBDA_TIMEOUT`. The clock starts with the handler, after its module is
    imported (Lambda's init phase), not with the process. ``context``: fields of the Lambda context other than
    the name, memory and timeout (a request id, the log group and stream the moto harness writes)."""
    if enforce_timeout and threading.current_thread() is threading.main_thread():
        try:
            import_handler(
                handler_path
            )  # Lambda's init: imports are not timed (the call below reports errors)
        except Exception:  # noqa: BLE001, S110
            pass
        with _alarm(timeout_s):
            try:
                return call(
                    handler_path, event, function_name=function_name, memory_mb=memory_mb, timeout_s=timeout_s
                )
            except HandlerFailed as failure:
                if failure.error != _Expired.__name__:
                    raise
                raise HandlerFailed(
                    LAMBDA_TIMEOUT,
                    f"{function_name} ran past its timeout of {timeout_s} s (the step's timeout_s)",
                ) from None
    try:
        handler = import_handler(handler_path)
        payload = json.loads(json.dumps(event))
        lambda_context = LocalContext(
            function_name=function_name, memory_limit_in_mb=memory_mb, timeout_s=timeout_s, **(context or {})
        )
        result = handler(payload, lambda_context)
        text = json.dumps(result)
        if len(text.encode()) > MAX_STATE_BYTES:
            raise ResultTooLarge(
                f"{function_name} returned {len(text.encode())} bytes; a task result must stay under "
                f"{MAX_STATE_BYTES} bytes: write data to the store and return its URI"
            )
        return json.loads(text)
    except Exception as exc:
        name = "States.DataLimitExceeded" if isinstance(exc, ResultTooLarge) else type(exc).__name__
        if isinstance(exc, TypeError | ValueError) and "JSON serializable" in str(exc):
            name = "States.Runtime"
        raise HandlerFailed(name, str(exc), isinstance(exc, ShardfoldError), traceback.format_exc()) from None


def call_in_worker(
    environ: dict[str, str], sys_path: list[str], handler_path: str, event: dict[str, Any], **kw: Any
) -> Any:
    """A local process-pool worker's entry: :func:`call` with ``enforce_timeout``, in the environment and on
    the import path of the process running the job. A worker is forked from the pool's fork server, which
    holds the environment of the moment it started; the job's process may have changed its own since (as a
    Lambda function runs with its configured environment, not the one it was created with)."""
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    if sys.path != sys_path:
        sys.path[:] = sys_path
        importlib.invalidate_caches()
    return call(handler_path, event, enforce_timeout=True, **kw)
