"""The task decorator every Lambda (and Batch) handler is built with, and the event they all share.

A handler is a pure call wrapped in :func:`task`::

    @task(GatherEvent, kind="getbatch")
    def gather(e: GatherEvent, spec: GetBatchSpec) -> dict:
        return core.gather(spec, e.job_id, e.store_root, e.item.part)

``gather`` is then ``gather(event, context=None)``: the Lambda signature that Lambda, the local executor,
the moto harness, ``shardfold invoke`` and the Batch worker call, under the same module and name (the
registry imports handlers by name). Each call:

1. validates ``event`` into the given :class:`JobEvent` model with Powertools' parser; a bad event raises
   :class:`SpecError` naming every field at fault;
2. binds ``job_id``, ``step`` (the registered function name, ``<kind>.<function>`` unless given) and
   ``task`` (the Map item's index, when the event has one) to the Powertools logger for this call only:
   they are thread-local keys set in a copy of the caller's context, so tasks that share a process on the
   local executor's threads never see each other's keys, and none outlive the call. With a Lambda context,
   its keys (function name, ARN, memory, request id) are bound too: on Lambda through
   ``Logger.inject_lambda_context`` (one invocation at a time per process), elsewhere thread-locally in
   the same way; ``context=None`` (local calls, Batch) binds none;
3. loads the job's spec through the per-process cache (below) and refuses a spec of another kind
   (:class:`SpecError`);
4. holds every store call of the task to its reach (:class:`functions.access.TaskScope`: its job's folder
   and what its kind's rights add), and every URI it resolves to the spec's own limits;
5. returns ``fn(event_model, spec)``, recording the call as one attempt of its task
   (:func:`functions.telemetry.recording`: times, peak memory, store requests, outcome, where its log is).

**Spec cache.** A spec is parsed once per process: the local executor's threads share one parse, a
process-pool worker or a warm Lambda instance parses each job's spec once. Entries are keyed by
``spec_uri`` and hold the bytes each was parsed from: specs are written once per job id and never change,
but the object is still read on every call (as it was before the cache) and compared with those bytes, so a
rewritten spec is parsed again, never served stale. At most :data:`SPEC_CACHE_SIZE` specs are kept, least
recently used first out, so a warm process that serves many jobs holds a bounded number. The cached spec
object is shared by every call that reads the same spec: cores must treat it as read-only.
"""

from __future__ import annotations

import contextvars
import functools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from aws_lambda_powertools.logging.lambda_context import build_lambda_context_model
from aws_lambda_powertools.utilities.parser import parse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shardfold.functions import access, collector, store, telemetry
from shardfold.functions.errors import SpecError
from shardfold.functions.log import logger
from shardfold.functions.specs import JobSpec, parse_spec

SPEC_CACHE_SIZE = 4  # specs kept per process; a 1.7 MB dpquery spec parses in ~2.4 s, so one hit pays

E = TypeVar("E", bound="JobEvent")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class JobEvent(BaseModel):
    """The workflow input every task sees: the job, its spec in the store, the store root."""

    model_config = ConfigDict(extra="allow")  # a task sees the whole state, including earlier results

    job_id: str
    spec_uri: str
    store_root: str
    index: int | None = Field(default=None, ge=0, description="the Map item's index (set by the Map)")
    map: str | None = Field(default=None, description="the Map's step name (set by the Map)")
    batch_step: str | None = Field(default=None, description="the BatchJob step (set by the container)")
    batch_job_id: str | None = Field(default=None, description="the AWS Batch job (set by the container)")


class Handler(Protocol[R_co]):
    """What :func:`task` returns: a Lambda handler."""

    def __call__(self, event: Any, context: Any = None) -> R_co: ...


def task(
    event_model: type[E], *, kind: str, step: str | None = None
) -> Callable[[Callable[[E, Any], R]], Handler[R]]:
    """Make ``fn(event: event_model, spec) -> result`` a Lambda handler ``(event, context=None)`` for
    ``kind`` jobs (see the module doc). ``step`` names the function in logs; default ``<kind>.<fn name>``."""

    def decorate(fn: Callable[[E, Any], R]) -> Handler[R]:
        name = step or f"{kind}.{fn.__name__}"

        def run(event: Any, context: Any) -> R:
            e = _parse_event(event, event_model)
            keys: dict[str, Any] = {"job_id": e.job_id, "step": name}
            if e.index is not None:
                keys["task"] = e.index
            if context is not None and not _on_lambda():
                keys.update(vars(build_lambda_context_model(context)))
            logger.thread_safe_append_keys(**keys)
            with (
                collector.relaxed(),
                telemetry.recording(
                    store_root=e.store_root,
                    job_id=e.job_id,
                    kind=kind,
                    function=name,
                    task=e.index,
                    map_name=e.map,
                    batch_step=e.batch_step,
                    batch_job_id=e.batch_job_id,
                    context=context,
                ),
            ):
                spec = load_spec(e.spec_uri, kind)
                # every URI the task resolves, under the spec's own limits; every store call, within its reach
                with access.policy(spec), store.scoped(_scope(e, kind).check):
                    return fn(e, spec)

        # Powertools keeps the Lambda context keys in the logger's shared state: right on Lambda, where a
        # process runs one invocation at a time, wrong for threads sharing a process (see _on_lambda).
        on_lambda = logger.inject_lambda_context(run)

        @functools.wraps(fn)
        def handler(event: Any, context: Any = None) -> R:
            entry = on_lambda if context is not None and _on_lambda() else run
            # a copied context: the thread-local keys set in it are gone when the call returns
            return contextvars.copy_context().run(entry, event, context)

        return handler

    return decorate


def _scope(e: JobEvent, kind: str) -> access.TaskScope:
    """What a task of ``kind`` may touch: its job's folder, and what the kind's declared rights add, within
    the deployment's grants (on an S3 store: the functions' environment carries them)."""
    from shardfold.functions import kinds  # kinds imports every kind's workflow; a handler imports this first

    grants = access.Grants.from_env() if store.is_s3(e.store_root) else None
    return access.TaskScope(e.store_root, e.job_id, kind, kinds.rights_of(kind), grants)


def _on_lambda() -> bool:
    """Whether this process is a Lambda runtime (which sets ``AWS_LAMBDA_RUNTIME_API``)."""
    return "AWS_LAMBDA_RUNTIME_API" in os.environ


def _parse_event(event: Any, model: type[E]) -> E:
    """Validate a handler's event with Powertools' parser; a bad event names every field at fault."""
    try:
        return parse(event=event, model=model)
    except ValidationError as exc:
        fields = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<event>'}: {e['msg']}" for e in exc.errors())
        raise SpecError(f"invalid {model.__name__}: {fields}") from exc
    except Exception as exc:  # Powertools wraps non-dict input in its own error type
        raise SpecError(f"invalid {model.__name__}: {exc}") from exc


class _SpecCache:
    """Parsed specs by URI with the bytes they were parsed from, least recently used out; a spec is served
    only for the very same bytes (compared whole: hashing a 3 MB spec on every call cost milliseconds a
    task); one parse per URI even under threads."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict[str, tuple[bytes, JobSpec]] = OrderedDict()
        self._parsing: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, uri: str) -> JobSpec:
        raw = store.get(uri)
        with self._lock:
            spec = self._hit(uri, raw)
            if spec is not None:
                return spec
            gate = self._parsing.setdefault(uri, threading.Lock())
        with gate:  # threads asking for the same spec wait for the first one's parse
            with self._lock:
                spec = self._hit(uri, raw)
            if spec is not None:
                return spec
            try:
                started = time.perf_counter()
                spec = parse_spec(raw)  # a bad spec raises and caches nothing
                seconds = round(time.perf_counter() - started, 3)
                logger.debug("spec parsed", extra={"spec_uri": uri, "bytes": len(raw), "seconds": seconds})
                self._keep(uri, raw, spec)
            finally:
                with self._lock:
                    self._parsing.pop(uri, None)
        return spec

    def remember(self, uri: str, raw: bytes, spec: JobSpec) -> None:
        """Cache ``spec`` as the parse of ``raw`` at ``uri`` (what submit parsed and wrote): a task of this
        process that reads the same bytes there takes it; other bytes are parsed as ever."""
        self._keep(uri, raw, spec)

    def _keep(self, uri: str, raw: bytes, spec: JobSpec) -> None:
        with self._lock:
            self._entries[uri] = (raw, spec)
            self._entries.move_to_end(uri)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def _hit(self, uri: str, raw: bytes) -> JobSpec | None:
        entry = self._entries.get(uri)
        if entry is None or entry[0] != raw:
            return None
        self._entries.move_to_end(uri)
        return entry[1]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_specs = _SpecCache(SPEC_CACHE_SIZE)


def load_spec(spec_uri: str, kind: str) -> JobSpec:
    """The validated spec of a job (parsed once per process), checked to be of the kind the caller runs."""
    spec = _specs.get(spec_uri)
    if spec.kind != kind:
        raise SpecError(f"{spec_uri} is a {spec.kind!r} spec, but this handler runs {kind!r} jobs")
    return spec


def remember_spec(spec_uri: str, raw: bytes, spec: JobSpec) -> None:
    """Submit's parse of the spec it wrote at ``spec_uri`` (``raw``), for this process's tasks: a job run
    here does not parse its spec twice (for 50,000 getbatch items that is a quarter of a second)."""
    _specs.remember(spec_uri, raw, spec)


def clear_spec_cache() -> None:
    """Forget every cached spec (tests; a process that wants the memory back)."""
    _specs.clear()
