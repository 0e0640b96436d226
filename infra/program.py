"""The whole stack: bucket -> GPU queue -> functions -> state machines -> trigger, and its outputs.

:func:`build` creates every resource for a :class:`~infra.config.StackConfig` and returns the stack
outputs, exactly the keys the ``aws`` backend reads (``client.stack.load_stack_outputs``, the same shape
``shardfold.dryrun.build_stack`` gives the moto twin) plus a few for people and tools:

==========================  ============================================================================
``backend``                 ``"aws"``
``bucket``, ``region``      the job bucket and its Region
``stage``, ``account``      the stage name; the AWS account id
``state_machine_arns``      ``{kind: state machine ARN}``
``functions``               ``{function: Lambda ARN}`` for every function the workflows call
``function_names``          ``{function: Lambda function name}``
``batch_job_queue``         the GPU job queue ARN (absent with ``shardfold:batch`` false)
``batch_job_definitions``   ``{entry point: job definition ARN}`` (empty when no workflow has a BatchJob)
``dispatch_function``       the bucket trigger's function name
``dead_letter_queue``       the URL of the trigger's dead-letter queue
``ecr_repository``          the worker image repository URL (absent with ``shardfold:batch`` false)
``worker_image``            the image the job definitions run (absent when there are none)
``lambda_image``            the image the container-image functions run (absent when no kind has
                            ``lambda_package="image"``)
``lambda_ecr_repository``   its ECR repository URL (absent with ``shardfold:lambdaImage`` or no such kind)
``log_groups``              ``{function or kind or "batch": log group name}``
``sizes``                   the deployed size of every function and job definition, after the config
                            overrides, with the key that changes each (below)
``output_prefixes``         the folders of the bucket jobs may write outputs under (``outputPrefixes``)
``read_buckets``            other buckets (or bucket/prefix) jobs may read (``readBuckets``)
``write_buckets``           other buckets (or bucket/prefix) jobs may read and write (``writeBuckets``)
==========================  ============================================================================

``sizes`` (plain values, no ARNs; the same shape from the moto twin; ``client.stack.deployed_sizes``
reads it)::

    {"functions": {"getbatch.gather": {"memory_mb": 1024, "ephemeral_mb": 512, "timeout_s": 900,
                                       "config": {"memory_mb": 'shardfold:functionMemory["getbatch.gather"]',
                                                  "ephemeral_mb": 'shardfold:functionEphemeralStorage[...]',
                                                  "timeout_s": 'shardfold:functionTimeout[...]'}},
                   ..., "dispatch": {...}},
     "batch": {"inference.worker": {"vcpus": 4, "memory_mb": 15000, "gpus": 1, "timeout_s": 14400,
                                    "config": {"vcpus": 'shardfold:batchVcpus["inference.worker"]',
                                               "memory_mb": 'shardfold:batchMemory[...]',
                                               "gpus": 'shardfold:batchGpus[...]',
                                               "timeout_s": 'shardfold:batchTimeout[...]'}}}}

``functions`` is keyed by registered function name (and ``dispatch``), ``batch`` by BatchJob entry point
(the keys of ``batch_job_definitions``; empty when there is no job definition). Batch memory is in MiB,
timeouts in seconds (a job definition's attempt duration).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardfold.functions.errors import ShardfoldError
from shardfold.functions.workflow import Workflow
from shardfold.infra.config import DISPATCH, StackConfig
from shardfold.infra.context import Context
from shardfold.infra.functions import FunctionSpec, ImageCode, LambdaCode, WorkerFunctions, function_specs
from shardfold.infra.gpu import GpuQueue, sized_workflows
from shardfold.infra.lambda_image import LambdaImage
from shardfold.infra.sizes import batch_size, batch_steps
from shardfold.infra.storage import Storage
from shardfold.infra.trigger import Trigger
from shardfold.infra.workflows import StateMachines

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_DIR = REPO_ROOT / ".shardfold" / "build"


def lambda_code(cfg: StackConfig) -> LambdaCode:
    """The Lambda package for the configured architecture and runtime (built by ``infra.package``)."""
    from shardfold.infra import package

    python_version = cfg.lambda_runtime.removeprefix("python")
    path = package.build_lambda_package(cfg.lambda_architecture, BUILD_DIR, python_version=python_version)
    return LambdaCode.from_zip(path)


class Stack:
    """Every component of one deployment; ``outputs`` maps output names to values or Outputs."""

    def __init__(
        self,
        cfg: StackConfig,
        workflows: Mapping[str, Workflow] | None = None,
        code: LambdaCode | None = None,
    ):
        if workflows is None:
            from shardfold.functions.kinds import WORKFLOWS

            workflows = WORKFLOWS
        if not workflows:
            raise ShardfoldError(
                "no workflows to deploy (no job kind is registered: shardfold.functions.kinds)"
            )
        if batch_steps(workflows) and not cfg.batch:
            raise ShardfoldError(
                "a workflow has a BatchJob (GPU) step but shardfold:batch is false; turn it on to deploy"
            )
        self.cfg = cfg
        # The BatchJob steps as deployed (shardfold:batch* applied): job definitions and state machines alike.
        self.workflows = sized_workflows(workflows, cfg)
        self.ctx = Context.create(cfg)
        self.specs = function_specs(self.workflows, cfg)
        code = code if code is not None else lambda_code(cfg)

        self.storage = Storage(self.ctx)
        bucket = self.storage.bucket_name
        if not code.direct_upload:
            # Over the 50 MB direct-upload limit: Lambda takes the zip from the bucket instead.
            code = code.upload(self.storage)
        self.gpu = GpuQueue(self.ctx, self.workflows, bucket) if cfg.batch else None
        image_functions = [s.name for s in self.specs.values() if s.package == "image"]
        self.lambda_image = LambdaImage(self.ctx, image_functions) if image_functions else None
        image = ImageCode(self.lambda_image.uri, self.lambda_image.depends_on) if self.lambda_image else None
        self.functions = WorkerFunctions(self.ctx, self.specs, code, bucket, image)
        self.state_machines = StateMachines(
            self.ctx,
            self.workflows,
            bucket,
            self.functions.arns,
            self.gpu.queue_arn if self.gpu else None,
            self.gpu.job_definition_arns if self.gpu else {},
            self.gpu.job_definition_names if self.gpu else {},
        )
        self.trigger = Trigger(
            self.ctx,
            self.specs[DISPATCH],
            code,
            bucket,
            self.state_machines.arns,
            # the plan check of bucket-submitted jobs sizes tasks against what is deployed
            sizes=self.sizes(),
            # S3 must be sending events before the rule is useful; the trigger comes up last.
            depends_on=[self.storage.notification],
        )
        self.outputs = self._outputs()

    def _outputs(self) -> dict[str, Any]:
        log_groups: dict[str, Any] = {fn: f.log_group.name for fn, f in self.functions.functions.items()}
        log_groups.update({kind: lg.name for kind, lg in self.state_machines.log_groups.items()})
        log_groups[DISPATCH] = self.trigger.function.log_group.name
        out: dict[str, Any] = {
            "backend": "aws",
            "bucket": self.storage.bucket_name,
            "region": self.ctx.region,
            "stage": self.cfg.stage,
            "account": self.ctx.account_id,
            "state_machine_arns": self.state_machines.arns,
            "functions": self.functions.arns,
            "function_names": self.functions.names,
            "dispatch_function": self.trigger.function.name,
            "dead_letter_queue": self.trigger.dlq.url,
            "log_groups": log_groups,
            "sizes": self.sizes(),
            "output_prefixes": list(self.cfg.output_prefixes),
            "read_buckets": list(self.cfg.read_buckets),
            "write_buckets": list(self.cfg.write_buckets),
        }
        if self.gpu is not None:
            log_groups["batch"] = self.gpu.log_group.name
            out["batch_job_queue"] = self.gpu.queue_arn
            out["batch_job_definitions"] = self.gpu.job_definition_arns
            out["ecr_repository"] = self.gpu.repository.repository_url
            if self.gpu.image is not None:
                out["worker_image"] = self.gpu.image
        if self.lambda_image is not None:
            out["lambda_image"] = self.lambda_image.uri
            if self.lambda_image.repository is not None:
                out["lambda_ecr_repository"] = self.lambda_image.repository.repository_url
        return out

    def sizes(self) -> dict[str, Any]:
        """The ``sizes`` output: every function's and job definition's effective size (module docstring)."""
        return sizes_output(self.cfg, self.specs, self.workflows if self.gpu is not None else {})


def sizes_output(
    cfg: StackConfig, specs: Mapping[str, FunctionSpec], workflows: Mapping[str, Workflow]
) -> dict[str, Any]:
    """The ``sizes`` output of functions ``specs`` and the BatchJob steps of ``workflows`` (sized)."""
    return {
        "functions": {fn: spec.size() for fn, spec in sorted(specs.items())},
        "batch": {ep: batch_size(step) for ep, step in sorted(batch_steps(workflows).items())},
        "lambda_architecture": cfg.lambda_architecture,  # the plan prices Lambda at its rate
    }


def build(
    cfg: StackConfig,
    workflows: Mapping[str, Workflow] | None = None,
    code: LambdaCode | None = None,
) -> Stack:
    """Create the stack's resources (in a Pulumi program or under mocks) and return it."""
    return Stack(cfg, workflows, code)
