"""The dpquery workflow: plan → Map(measure a group of residual sets) → Map(reconstruct a group of
marginals) → finalize (ResidualPlanner under zCDP).

The plan allocates the noise without data, validates the dataset in one scan and reserves the budget on
the dataset's ledger before anything is measured; it writes two manifests (Distributed Map's
``ItemReader`` reads them on AWS). Each measure task writes one measurement object with put-if-absent, so a
retried task reads it back instead of drawing new noise; each reconstruct task writes one table per
marginal; finalize records the ρ spent on the ledger and writes the result. Only references cross the
control plane.
"""

from __future__ import annotations

from orchestrator.plan import Map, Task, Workflow
from orchestrator.registry import register

register("dpquery.plan", "functions.dpquery.handlers:plan")
register("dpquery.measure", "functions.dpquery.handlers:measure")
register("dpquery.reconstruct", "functions.dpquery.handlers:reconstruct")
register("dpquery.finalize", "functions.dpquery.handlers:finalize")

# measure is CPU-bound (OpenDP's sampler): a process locally, 1769 MB (one full vCPU) on Lambda. Its memory
# is the group's marginals plus one record batch; the plan sizes groups by noise samples.
WORKFLOW = Workflow(
    kind="dpquery",
    lambda_package="image",
    comment="DP marginal queries: ResidualPlanner noise plan, OpenDP Gaussian measurements, reconstruction",
    steps=(
        Task("plan", "dpquery.plan", memory_mb=1769, timeout_s=900),
        Map(
            "measure",
            items="$.plan.measure",
            body=(Task("measure_group", "dpquery.measure", mode="process", memory_mb=1769, timeout_s=900),),
        ),
        Map(
            "reconstruct",
            items="$.plan.reconstruct",
            body=(Task("reconstruct_group", "dpquery.reconstruct", memory_mb=1769, timeout_s=900),),
        ),
        Task("finalize", "dpquery.finalize", memory_mb=1024, timeout_s=900),
    ),
)
