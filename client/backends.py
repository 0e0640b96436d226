"""Backend wiring: which executor and which store root each ``Client(backend=...)`` gets.

Kept apart from the SDK so ``import client`` stays light: orchestrator (and moto, for the moto backend) is
imported only when a client is created.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardfold.client.errors import BackendError
from shardfold.client.stack import load_stack_outputs
from shardfold.functions.store.uri import store_root

Closer = Callable[[], None]


def make(backend: str, stack: dict[str, Any] | str | None) -> tuple[Any, str, list[Closer]]:
    """``(executor, store_root, closers)`` for a backend; closers release it (last first)."""
    if backend == "local":
        from shardfold.orchestrator.local import LocalExecutor

        root = store_root()
        executor = LocalExecutor(store_root=root)
        return executor, root, _closers_of(executor)
    if backend == "aws":
        outputs = load_stack_outputs(stack)  # first: a missing stack is the error to show
        from shardfold.orchestrator.aws import AwsExecutor

        executor = AwsExecutor(outputs)
        return executor, f"s3://{outputs['bucket']}", _closers_of(executor)
    if backend == "moto":
        return _moto()
    raise BackendError(f"unknown backend {backend!r}; choose local, aws or moto")


def _closers_of(executor: Any) -> list[Closer]:
    close = getattr(executor, "close", None)
    return [close] if callable(close) else []


def _moto() -> tuple[Any, str, list[Closer]]:
    """A whole Shardfold stack inside moto (bucket, functions, state machines), driven by the AWS executor."""
    try:
        import moto  # noqa: F401 - the harness imports it only once the stack starts

        from shardfold import dryrun
    except ImportError as exc:  # moto is a dev dependency
        raise BackendError(f"the moto backend needs the dev extra ('shardfold[dev]'): {exc}") from None
    from shardfold.orchestrator.aws import AwsExecutor

    stack = dryrun.MotoStack()
    outputs = stack.start()
    executor = AwsExecutor(outputs)
    return executor, f"s3://{outputs['bucket']}", [stack.stop, *_closers_of(executor)]


def compile_asl(kind: str, *, region: str, account: str, stage: str) -> dict[str, Any]:
    """The validated ASL of ``kind``'s workflow, with ARNs from the naming scheme."""
    from shardfold.functions.errors import PlanError
    from shardfold.functions.kinds import WORKFLOWS
    from shardfold.orchestrator.asl import NamingResolver, compile_workflow, validate

    if kind not in WORKFLOWS:
        raise PlanError(f"no workflow for job kind {kind!r}; known: {', '.join(sorted(WORKFLOWS)) or 'none'}")
    asl = compile_workflow(WORKFLOWS[kind], NamingResolver(region=region, account=account, stage=stage))
    try:
        validate(asl)
    except ImportError:  # statelint/moto are dev dependencies; the ASL is still what AWS will run
        pass
    return asl


def handler_target(function: str) -> str:
    """``module:function`` registered for a workflow function name such as ``getbatch.prepare``."""
    from shardfold.orchestrator.registry import handler_path

    return handler_path(function)
