"""What the stack gives each Lambda function and Batch job definition, from the workflows: the ``sizes``
output's entries (``infra.program`` documents its shape). No Pulumi here: the moto harness
(``shardfold.dryrun``) and the emulator size their stacks with the same rules as ``pulumi up``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardfold.functions.workflow import BatchJob, Workflow
from shardfold.infra.config import BATCH_SIZE_KEYS, FUNCTION_SIZE_KEYS, size_key

LAMBDA_DEFAULT_EPHEMERAL_MB = 512  # Lambda's default /tmp, deployed unless configured


def plan_sizes(workflows: Mapping[str, Workflow]) -> dict[str, tuple[int, int]]:
    """``{function: (memory_mb, timeout_s)}``: the largest of each over the Tasks that call it."""
    sizes: dict[str, tuple[int, int]] = {}
    for wf in workflows.values():
        for step in wf.tasks():
            mem, tmo = sizes.get(step.function, (0, 0))
            sizes[step.function] = (max(mem, step.memory_mb), max(tmo, step.timeout_s))
    return sizes


def function_size(function: str, memory_mb: int, timeout_s: int, ephemeral_mb: int) -> dict[str, Any]:
    """One entry of the ``sizes`` output's ``functions`` map: the function's deployed memory, /tmp and
    timeout, and the config key that sets each."""
    return {
        "memory_mb": memory_mb,
        "ephemeral_mb": ephemeral_mb,
        "timeout_s": timeout_s,
        "config": {fld: size_key(key, function) for fld, key in FUNCTION_SIZE_KEYS.items()},
    }


def batch_steps(workflows: Mapping[str, Workflow]) -> dict[str, BatchJob]:
    """``{entry_point: step}`` over every BatchJob; an entry point used twice gets the larger of each need."""
    out: dict[str, BatchJob] = {}
    for wf in workflows.values():
        for step in wf.walk():
            if not isinstance(step, BatchJob):
                continue
            prev = out.get(step.entry_point)
            if prev is not None:
                step = BatchJob(
                    name=prev.name,
                    entry_point=step.entry_point,
                    vcpus=max(prev.vcpus, step.vcpus),
                    memory_mb=max(prev.memory_mb, step.memory_mb),
                    gpus=max(prev.gpus, step.gpus),
                    timeout_s=max(prev.timeout_s, step.timeout_s),
                )
            out[step.entry_point] = step
    return out


def batch_size(step: BatchJob) -> dict[str, Any]:
    """One entry of the ``sizes`` output's ``batch`` map: the job definition's resources and attempt
    timeout, and the config key that sets each."""
    return {
        "vcpus": step.vcpus,
        "memory_mb": step.memory_mb,
        "gpus": step.gpus,
        "timeout_s": step.timeout_s,
        "config": {fld: size_key(key, step.entry_point) for fld, key in BATCH_SIZE_KEYS.items()},
    }
