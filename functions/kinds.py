"""Job kinds: the :class:`JobKind` descriptor, the one place a kind registers, and their discovery.

A kind is a package (``functions/<kind>/``) whose ``kind.py`` defines ``KIND = JobKind(...)``: its spec
model, its workflow, its sizing module (the task-load model beside its engine), what its functions may
touch beyond their job's folder, how its result is shown and, optionally, counters of progress that the
executors cannot see. Every table of kinds derives from the descriptors: the spec union, the executors'
workflows, the handler registry, the functions' IAM policies and every task's own access check, the plan
estimate, the CLI's result view and the progress counters.

**Discovery is by convention.** The built-in kinds are the subpackages of :mod:`functions` that have a
``kind.py``; more kind packages (a plugin, a test's temporary package) are named, comma-separated, in
``SHARDFOLD_KIND_PACKAGES`` — which the local executor's worker processes inherit. A kind's name is its
package's last component. Only the kind in use is imported: :func:`find` imports one descriptor, and the
descriptors import their sizing and progress modules only when asked.

**Handlers by convention too.** The workflow function ``<kind>.<name>`` runs ``<package>.handlers:<name>``
unless the descriptor's ``handlers`` maps it elsewhere (e.g. a Batch container's entry point).
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, Union

from pydantic import Field, TypeAdapter

from shardfold import functions
from shardfold.functions import extras
from shardfold.functions.access import Right
from shardfold.functions.errors import PlanError, SpecError
from shardfold.functions.specs import StrictModel
from shardfold.functions.tables import ResultView, result_fields
from shardfold.functions.workflow import Workflow

EXTRA_PACKAGES_ENV = "SHARDFOLD_KIND_PACKAGES"


@dataclass(frozen=True)
class JobKind:
    """Everything the platform needs to know about one job kind.

    * ``spec``: the pydantic model of its spec (``kind: Literal["<name>"]`` tags it).
    * ``workflow``: its steps (:mod:`functions.workflow`), compiled to ASL and run by the local executor.
    * ``sizing``: the module of its task-load model, with ``probe(spec, store_root, budget) -> Probe`` (what
      a bounded look at the inputs learns) and ``loads(spec, probe) -> Loads`` (per step, keyed by the
      workflow's step objects); see :mod:`functions.estimate`.
    * ``rights``: what its functions (Lambda tasks and Batch containers alike) may touch beyond their own
      job's folder (:class:`~functions.access.Right`: read inputs, write outputs, keep the budget ledger);
      none by default, so a kind that declares nothing fails with AccessDenied naming the right it needs.
      Their IAM policies are built from it, and every task checks its store calls against it
      (:class:`~functions.access.TaskScope`), so an undeclared reach fails on every backend, not only on AWS.
    * ``result_view``: the result document -> a :class:`~functions.tables.ResultView` the CLI prints.
    * ``progress``: ``"module:function"`` of ``(store_root, job_id) -> {counter: {"done", "total", "unit"}}``
      (:func:`counter`), work inside one step that the executors cannot count (an inference job's GPU
      shards), or counted in the user's units (rows, items, bytes) rather than tasks; or None. Each call
      should cost a few store requests: the SDK calls it every couple of seconds while a job runs.
    * ``handlers``: workflow function name -> ``"module:function"``, where the convention does not hold.
    * ``private_steps``: steps whose cost depends on private data; their telemetry withholds every measured
      figure (:mod:`functions.telemetry`).
    * ``extras``: spec -> the extras of the distribution (:mod:`functions.extras`) its tasks import where
      they run; checked at submit when they run on this machine.
    """

    name: str
    package: str
    spec: type[StrictModel]
    workflow: Workflow
    sizing: str
    rights: frozenset[Right] = frozenset()
    result_view: Callable[[dict[str, Any]], ResultView] = result_fields
    progress: str | None = None
    handlers: Mapping[str, str] = field(default_factory=dict)
    private_steps: frozenset[str] = frozenset()
    extras: Callable[[Any], tuple[str, ...]] = lambda spec: ()

    def __post_init__(self) -> None:
        if self.workflow.kind != self.name:
            raise PlanError(f"kind {self.name!r}: its workflow is for {self.workflow.kind!r}")
        tag = self.spec.model_fields.get("kind")
        if tag is None or tag.default != self.name:
            raise PlanError(f"kind {self.name!r}: its spec model needs kind: Literal[{self.name!r}]")
        unknown = [r for r in self.rights if not isinstance(r, Right)]
        if unknown:
            raise PlanError(f"kind {self.name!r}: rights {unknown} are not functions.access.Right members")
        names = {s.name for s in self.workflow.walk()}
        if not self.private_steps <= names:
            raise PlanError(
                f"kind {self.name!r}: private_steps {sorted(self.private_steps - names)} are no steps"
            )
        for function in self.workflow.functions():
            if function.split(".", 1)[0] != self.name:
                raise PlanError(f"kind {self.name!r}: function {function!r} must be named '{self.name}.<x>'")

    @property
    def workflow_file(self) -> str:
        """Where the workflow's steps (and their ``memory_mb``) are written, for messages."""
        return f"{self.package.replace('.', '/')}/workflow.py"

    def sizing_module(self) -> ModuleType:
        return importlib.import_module(self.sizing)

    def handler_path(self, function: str) -> str:
        """``module:function`` that runs the workflow function ``function`` of this kind."""
        if function in self.handlers:
            return self.handlers[function]
        return f"{self.package}.handlers:{function.split('.', 1)[1]}"

    def require_extras(self, spec: Any) -> None:
        """Refuse ``spec`` here, naming the extra, when this machine lacks one its tasks import."""
        for extra in self.extras(spec):
            extras.require(extra, f"this {self.name} job")

    def counters(self, store_root: str, job_id: str) -> dict[str, dict[str, Any]]:
        if self.progress is None:
            return {}
        module, _, name = self.progress.partition(":")
        return getattr(importlib.import_module(module), name)(store_root, job_id)


def counter(done: int, total: int | None, unit: str | None = None) -> dict[str, Any]:
    """One entry of a kind's progress counters: ``done`` of ``total`` (None while not known yet), ints as in
    ``JobStatus.steps``, and the ``unit`` they count (``"rows"``, ``"items"``, ``"bytes"``: the progress view
    shows them in it, with a rate and an ETA). No unit: counted like a step's tasks."""
    entry: dict[str, Any] = {"done": int(done), "total": None if total is None else int(total)}
    if unit is not None:
        entry["unit"] = unit
    return entry


def counted(
    from_result: Callable[[str, str], dict | None],
    from_parts: Callable[[str, str], dict],
    store_root: str,
    job_id: str,
) -> dict[str, dict[str, Any]]:
    """A kind's progress counters: from its result once written, else from the parts finished so far; a
    scratch object gone between two reads (the last step removes the scratch) means the result is there."""
    from shardfold.functions.errors import ObjectNotFound

    try:
        return from_result(store_root, job_id) or from_parts(store_root, job_id)
    except ObjectNotFound:
        return from_result(store_root, job_id) or {}


_lock = threading.Lock()
_loaded: dict[str, JobKind] = {}


@functools.cache
def _builtin() -> dict[str, str]:
    here = Path(functions.__file__).parent
    return {
        m.name: f"{functions.__name__}.{m.name}"
        for m in pkgutil.iter_modules([str(here)])
        if m.ispkg and (here / m.name / "kind.py").is_file()
    }


def packages() -> dict[str, str]:
    """``{kind name: package}`` of every kind: the built-in ones, then ``SHARDFOLD_KIND_PACKAGES``."""
    out = dict(_builtin())
    for package in filter(None, (p.strip() for p in os.environ.get(EXTRA_PACKAGES_ENV, "").split(","))):
        out.setdefault(package.rsplit(".", 1)[-1], package)
    return out


def names() -> list[str]:
    """Every kind's name, sorted (imports nothing)."""
    return sorted(packages())


def find(name: Any) -> JobKind:
    """The descriptor of kind ``name``; :class:`SpecError` naming the field ``kind`` when there is none."""
    known = packages()
    if name is None:
        msg = f"the spec has no 'kind': say which job it is, one of {', '.join(sorted(known))}"
        raise SpecError(msg, [{"field": "kind", "error": msg}])
    if not isinstance(name, str) or name not in known:
        msg = f"unknown job kind {name!r}; expected one of {sorted(known)}"
        raise SpecError(msg, [{"field": "kind", "error": msg}])
    with _lock:
        kind = _loaded.get(name)
    if kind is None:
        module = importlib.import_module(f"{known[name]}.kind")
        kind = module.KIND
        if not isinstance(kind, JobKind) or kind.name != name:
            raise PlanError(f"{known[name]}.kind.KIND must be the JobKind named {name!r}")
        with _lock:
            _loaded[name] = kind
    return kind


def rights_of(name: str) -> frozenset[Right]:
    """The rights kind ``name`` declares; none (its job's folder only) for a name no kind registers, such as
    a test's own handlers."""
    return find(name).rights if name in packages() else frozenset()


def every() -> list[JobKind]:
    """Every kind's descriptor (imports each kind's ``kind.py``), by name."""
    return [find(n) for n in names()]


def spec_union() -> TypeAdapter:
    """The pydantic discriminated union (on ``kind``) of every kind's spec model; its JSON schema is the
    schema of a spec document."""
    models = tuple(k.spec for k in every())
    union = models[0] if len(models) == 1 else Union[models]  # noqa: UP007 - built from a tuple
    return TypeAdapter(Annotated[union, Field(discriminator="kind")])


class Workflows(Mapping[str, Workflow]):
    """``{kind: workflow}`` over the registered kinds, importing a kind only when it is looked up."""

    def __getitem__(self, name: str) -> Workflow:
        if name not in packages():
            raise KeyError(name)
        return find(name).workflow

    def __iter__(self) -> Iterator[str]:
        return iter(names())

    def __len__(self) -> int:
        return len(packages())


WORKFLOWS: Mapping[str, Workflow] = Workflows()


def handler_path(function: str) -> str | None:
    """``module:function`` of a kind's workflow function (``getbatch.prepare``), or None if no kind has it."""
    name = function.split(".", 1)[0]
    if name not in packages():
        return None
    kind = find(name)
    return kind.handler_path(function) if function in kind.workflow.functions() else None
