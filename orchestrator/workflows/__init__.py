"""The built-in job kinds' workflows: ``WORKFLOWS[kind] -> Workflow``.

Adding a kind: write ``orchestrator/workflows/<kind>.py`` that registers its handlers and defines
``WORKFLOW``::

    from orchestrator.plan import Map, Task, Workflow
    from orchestrator.registry import register

    register("mykind.plan", "functions.mykind.handlers:plan")
    register("mykind.work", "functions.mykind.handlers:work")
    WORKFLOW = Workflow(kind="mykind", steps=(
        Task("plan", "mykind.plan"),
        Map("work", items="$.plan.manifest", body=(Task("work", "mykind.work", mode="process"),)),
    ))

then add its module name to ``KIND_MODULES`` below (the registration point).
"""

from __future__ import annotations

import importlib

from aws_lambda_powertools import Logger

from orchestrator.plan import Workflow

logger = Logger(service="shardfold")

# The registration point: one module per job kind, each defining WORKFLOW.
KIND_MODULES: tuple[str, ...] = (
    "orchestrator.workflows.getbatch",
    "orchestrator.workflows.fedavg",
    "orchestrator.workflows.dpquery",
    "orchestrator.workflows.inference",
)

WORKFLOWS: dict[str, Workflow] = {}


def _load() -> None:
    for name in KIND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            # A kind whose module is not written yet; everything else keeps working without it.
            logger.warning("workflow module missing", extra={"module": name})
            continue
        workflow: Workflow = module.WORKFLOW
        WORKFLOWS[workflow.kind] = workflow


_load()
