"""The dpquery workflow: prepare → Map(measure a group of residual sets) → Map(reconstruct a group of
marginals) → finalize (ResidualPlanner under zCDP).

The prepare step allocates the noise without data, validates the dataset in one scan and reserves the budget
on the dataset's ledger before anything is measured; it writes two work lists (Distributed Map's
``ItemReader`` reads them on AWS). Each measure task writes one measurement object with put-if-absent, so a
retried task reads it back instead of drawing new noise; each reconstruct task writes one table per
marginal; finalize records the ρ spent on the ledger and writes the result. Only references cross the
control plane.
"""

from __future__ import annotations

from shardfold.functions.workflow import Map, Task, Workflow

# measure is CPU-bound (OpenDP's sampler): a process locally, 1769 MB (one full vCPU) on Lambda. Its memory
# is the group's marginals plus one record batch; the prepare step sizes groups by noise samples.
PREPARE = Task("prepare", "dpquery.prepare", memory_mb=1769, timeout_s=900)
MEASURE_GROUP = Task("measure_group", "dpquery.measure", mode="process", memory_mb=1769, timeout_s=900)
MEASURE = Map("measure", items="$.prepare.measure", body=(MEASURE_GROUP,))
RECONSTRUCT_GROUP = Task("reconstruct_group", "dpquery.reconstruct", memory_mb=1769, timeout_s=900)
RECONSTRUCT = Map("reconstruct", items="$.prepare.reconstruct", body=(RECONSTRUCT_GROUP,))
FINALIZE = Task("finalize", "dpquery.finalize", memory_mb=1024, timeout_s=900)

WORKFLOW = Workflow(
    kind="dpquery",
    lambda_package="image",
    comment="DP marginal queries: ResidualPlanner noise plan, OpenDP Gaussian measurements, reconstruction",
    steps=(PREPARE, MEASURE, RECONSTRUCT, FINALIZE),
)
