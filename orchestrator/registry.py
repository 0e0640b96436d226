"""Function registry: a function name (``"getbatch.prepare"``) -> its handler (``"module:function"``).

Plans name functions, not callables, so the same plan drives every backend: the local executor imports
the handler (in a worker process too: the ``module:function`` string is all it needs), the moto harness
dispatches Lambda invocations to it, and infra deploys one Lambda function per name with
:func:`lambda_handler` as its handler setting and :func:`lambda_name` as its function name.

A job kind's functions run its ``handlers`` module by convention (:func:`functions.kinds.handler_path`);
tests register their own here. An explicit registration wins over the kinds' convention.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable
from typing import Any

from shardfold.functions.errors import PlanError

Handler = Callable[[dict[str, Any], Any], Any]

_FUNCTION_RE = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")
_PATH_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

_handlers: dict[str, str] = {}
_lock = threading.Lock()


def register(function: str, handler: str | Handler) -> str:
    """Register ``function`` -> ``handler`` (a ``"module:function"`` path or a top-level function).

    Registering the same pair again is a no-op; a different handler for a taken name is refused.
    Returns the handler path.
    """
    if not _FUNCTION_RE.match(function):
        raise PlanError(f"function name {function!r} must look like 'kind.step' (lower case, dot-separated)")
    path = handler if isinstance(handler, str) else _path_of(handler)
    if not _PATH_RE.match(path):
        raise PlanError(f"handler {path!r} for {function!r} must be 'package.module:function'")
    with _lock:
        old = _handlers.get(function)
        if old is not None and old != path:
            raise PlanError(f"function {function!r} is already registered to {old}, not {path}")
        _handlers[function] = path
    return path


def _path_of(fn: Handler) -> str:
    qualname = getattr(fn, "__qualname__", "")
    if not qualname or "." in qualname or "<" in qualname:
        raise PlanError(f"{fn!r} is not a top-level function; handlers must be importable by name")
    return f"{fn.__module__}:{qualname}"


def handler_path(function: str) -> str:
    """The ``module:function`` path that runs ``function``: registered here, or a kind's by convention."""
    from shardfold.functions import kinds

    path = _handlers.get(function) or kinds.handler_path(function)
    if path is None:
        known = sorted({*_handlers, *(f for k in kinds.every() for f in k.workflow.functions())})
        raise PlanError(f"no handler is registered for function {function!r}; known: {known}")
    return path


def import_handler(path: str) -> Handler:
    """Import ``module:function``."""
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise PlanError(f"cannot import handler {path}: {exc}") from exc


def resolve(function: str) -> Handler:
    """The handler callable registered for ``function``."""
    return import_handler(handler_path(function))


def registered() -> dict[str, str]:
    """Every function with its handler: every kind's, then the explicit registrations."""
    from shardfold.functions import kinds

    table = {f: k.handler_path(f) for k in kinds.every() for f in k.workflow.functions()}
    with _lock:
        table.update(_handlers)
    return table


def name_prefix(stage: str) -> str:
    """``shardfold-<stage>``: how every resource a deployment ``stage`` names begins (its Batch queue's
    whole name)."""
    return f"shardfold-{stage}"


def lambda_name(function: str, stage: str) -> str:
    """The Lambda function name for ``function`` in a deployment ``stage`` (<= 64 characters)."""
    name = f"{name_prefix(stage)}-{function.replace('.', '-').replace('_', '-')}"
    if len(name) > 64:
        raise PlanError(f"Lambda name {name!r} is longer than 64 characters; use a shorter stage or function")
    return name


def job_definition_name(entry_point: str, stage: str) -> str:
    """The AWS Batch job definition that runs BatchJob ``entry_point`` in a deployment ``stage``."""
    return f"{name_prefix(stage)}-{entry_point.replace('.', '-')}"


def state_machine_name(kind: str, stage: str) -> str:
    """The state machine that runs ``kind``'s workflow in a deployment ``stage``."""
    return f"{name_prefix(stage)}-{kind}"


def lambda_handler(function: str) -> str:
    """Lambda's ``Handler`` setting for ``function``: ``package.module.function``."""
    return handler_path(function).replace(":", ".")
