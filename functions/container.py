"""Entry point of the AWS Batch container (GPU stages): ``python -m functions.container``.

The state machine's ``batch:submitJob.sync`` task passes everything in container environment variables:
``SHARDFOLD_HANDLER`` (``module:function``), ``SHARDFOLD_FUNCTION`` (the registered name, for logs),
``SHARDFOLD_STEP`` (the workflow step, for its telemetry) and ``SHARDFOLD_EVENT`` (the state as JSON). The
handler's result is discarded (outputs go to the store); a raised exception fails the Batch job, which fails
the task. The moto harness calls :func:`run` in-process.

A handler's module may also define ``preload()``: the local executor's container server calls it before
it forks the container, to import once what every such container imports
(:mod:`orchestrator.container_server`). It must only import: no I/O, no torch op, no GPU (a process that
forks must not have started them). On AWS nothing calls it.

Exit codes: 0 success; 75 (``EX_TEMPFAIL``) for a transient fault, which the job definition's retry table
retries; 1 for anything else, which it does not.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from shardfold.functions.log import logger
from shardfold.functions.store.retry import TransientError

EXIT_TRANSIENT = 75  # EX_TEMPFAIL: the Batch retry strategy retries this code
# Faults worth another attempt; the same names the workflows' Retry policies treat as transient.
TRANSIENT = (TransientError, ConnectionError, TimeoutError)


def run(environ: Mapping[str, str]) -> Any:
    """Call the handler named in ``environ`` with its event; return its result."""
    path = environ.get("SHARDFOLD_HANDLER", "")
    module, _, name = path.partition(":")
    if not module or not name:
        raise RuntimeError(f"SHARDFOLD_HANDLER must be 'module:function', got {path!r}")
    event = json.loads(environ.get("SHARDFOLD_EVENT") or "{}")
    if isinstance(event, dict):  # for the task's telemetry: which step's job this is, and which job
        if environ.get("SHARDFOLD_STEP"):
            event["batch_step"] = environ["SHARDFOLD_STEP"]
        if environ.get("AWS_BATCH_JOB_ID"):
            event["batch_job_id"] = environ["AWS_BATCH_JOB_ID"]
    handler = getattr(importlib.import_module(module), name)
    logger.info("batch worker start", extra={"function": environ.get("SHARDFOLD_FUNCTION"), "handler": path})
    return handler(event, None)


def _report(exc: BaseException) -> None:
    """Write why the job failed to ``SHARDFOLD_STATUS_FILE`` when the caller set one (the local executor's
    stand-in for Batch's status reason); the container on AWS logs it instead."""
    path = os.environ.get("SHARDFOLD_STATUS_FILE")
    if not path:
        return
    from shardfold.functions.errors import ShardfoldError

    status = {"error": type(exc).__name__, "message": str(exc), "user_error": isinstance(exc, ShardfoldError)}
    with open(path, "w") as fh:
        json.dump(status, fh)


def main() -> int:
    try:
        run(os.environ)
    except TRANSIENT as exc:
        logger.exception(
            "batch worker hit a transient fault", extra={"function": os.environ.get("SHARDFOLD_FUNCTION")}
        )
        _report(exc)
        return EXIT_TRANSIENT
    except Exception as exc:
        logger.exception("batch worker failed", extra={"function": os.environ.get("SHARDFOLD_FUNCTION")})
        _report(exc)
        return 1
    return 0


def exit_now(code: int) -> None:
    """Flush the logs and leave without the interpreter's teardown: every output is already durable in the
    store, and unloading torch and transformers takes about a second per container."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
