"""What a GPU instance can give one Batch job, so a job definition that no allowed instance could run is
refused at deploy time instead of sitting RUNNABLE until the queue's time limit cancels it.

A job is placed only on an instance whose *registered* resources cover its vCPUs, memory and GPUs. The ECS
agent registers less memory than is installed: the AWS Batch guide "Compute resource memory management"
shows an m4.large (8 GiB) registering 7,985 MiB (97.5 %), and the Batch AMI reserves another 32 MiB for the
agent. :func:`registrable_mb` takes 95 % less 32 MiB, leaving room for the GPU AMI's driver daemons.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Instance:
    vcpus: int
    memory_gib: float
    gpus: int

    @property
    def registrable_mb(self) -> int:
        return registrable_mb(self.memory_gib)


def registrable_mb(memory_gib: float) -> int:
    """The memory (MiB) a job may ask for on an instance with ``memory_gib`` installed."""
    return int(memory_gib * 1024 * 0.95) - 32


def _sizes(family: str, rows: Iterable[tuple[str, int, float, int]]) -> dict[str, Instance]:
    return {f"{family}.{size}": Instance(v, m, g) for size, v, m, g in rows}


# vCPUs, installed memory (GiB) and GPUs of the GPU instance types a Batch queue is usually given (EC2's
# instance type pages). A type not listed here is not checked.
INSTANCES: dict[str, Instance] = {
    **_sizes(
        "g4dn",
        [
            ("xlarge", 4, 16, 1),
            ("2xlarge", 8, 32, 1),
            ("4xlarge", 16, 64, 1),
            ("8xlarge", 32, 128, 1),
            ("12xlarge", 48, 192, 4),
            ("16xlarge", 64, 256, 1),
            ("metal", 96, 384, 8),
        ],
    ),
    **{
        k: v
        for family in ("g5", "g6")
        for k, v in _sizes(
            family,
            [
                ("xlarge", 4, 16, 1),
                ("2xlarge", 8, 32, 1),
                ("4xlarge", 16, 64, 1),
                ("8xlarge", 32, 128, 1),
                ("12xlarge", 48, 192, 4),
                ("16xlarge", 64, 256, 1),
                ("24xlarge", 96, 384, 4),
                ("48xlarge", 192, 768, 8),
            ],
        ).items()
    },
    **_sizes(
        "g6e",
        [("xlarge", 4, 32, 1), ("2xlarge", 8, 64, 1), ("4xlarge", 16, 128, 1), ("12xlarge", 48, 384, 4)],
    ),
    **_sizes("p3", [("2xlarge", 8, 61, 1), ("8xlarge", 32, 244, 4), ("16xlarge", 64, 488, 8)]),
    **_sizes("p4d", [("24xlarge", 96, 1152, 8)]),
}


def known(instance_type: str) -> list[Instance]:
    """The listed instances an allowed type stands for: one for ``g5.xlarge``, every size for a family
    (``g5``), none for an unlisted type or ``optimal``."""
    if "." in instance_type:
        found = INSTANCES.get(instance_type)
        return [found] if found else []
    return [v for k, v in INSTANCES.items() if k.split(".", 1)[0] == instance_type]


def placement_problem(vcpus: int, memory_mb: int, gpus: int, instance_types: Iterable[str]) -> str | None:
    """Why a job of these needs fits none of the allowed instance types, or None when one fits (or when no
    allowed type is listed here, so nothing can be said)."""
    types = list(instance_types)
    candidates = [(t, i) for t in types for i in known(t)]
    if not candidates:
        return None
    if any(vcpus <= i.vcpus and memory_mb <= i.registrable_mb and gpus <= i.gpus for _, i in candidates):
        return None
    best = max(candidates, key=lambda c: c[1].registrable_mb)
    return (
        f"needs {vcpus} vCPUs, {memory_mb} MiB and {gpus} GPU(s), more than any of {', '.join(types)} can "
        f"give one job (the largest, {best[0]}, registers about {best[1].registrable_mb} MiB for jobs with "
        f"{best[1].vcpus} vCPUs and {best[1].gpus} GPU(s))"
    )
