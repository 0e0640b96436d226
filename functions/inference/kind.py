"""The inference kind's registration: a torch model over a dataset, CPU stage on Lambda, GPU on Batch."""

from __future__ import annotations

from shardfold.functions.access import Right
from shardfold.functions.inference.spec import InferenceSpec
from shardfold.functions.inference.workflow import WORKFLOW
from shardfold.functions.kinds import JobKind

KIND = JobKind(
    name="inference",
    package=__package__,
    spec=InferenceSpec,
    workflow=WORKFLOW,
    sizing="shardfold.functions.inference.sizing",
    rights=frozenset({Right.INPUTS, Right.OUTPUTS}),
    # the GPU workers' shards: the executors see the whole GPU stage as one step
    progress="shardfold.functions.inference.pipeline:progress",
    # the Batch container's entry point keeps torch out of the Lambda handlers' module
    handlers={"inference.worker": "shardfold.functions.inference.worker:handler"},
    extras=lambda spec: ("inference",),
)
