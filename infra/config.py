"""Stack configuration: every ``shardfold:*`` key, its default, and its checks.

Set keys with ``pulumi config set shardfold:<key> <value>`` (objects and lists as JSON with ``--path``, e.g.
``pulumi config set --path 'shardfold:functionMemory["getbatch.gather"]' 2048``). Every key is optional.

General
  ``region``: the AWS Region (default: ``aws:region``, else the environment's).
  ``stage``: the name part of every resource, ``shardfold-<stage>-...``; 1-16 of [a-z0-9-] (default: the
  Pulumi stack name). ``tags``: extra tags on every resource (``{}``).

Lambda
  ``lambdaArchitecture``: ``arm64`` (default; cheaper per GB-s) or ``x86_64``.
  ``lambdaRuntime``: ``python3.12`` (default) or ``python3.13``; the package is built for it.
  ``functionMemory`` / ``functionTimeout`` / ``functionEphemeralStorage``: ``{function: MB | seconds | MB}``
  overrides; functions are named as registered (``getbatch.gather``), the bucket trigger ``dispatch``.
  Default: the largest ``memory_mb`` / ``timeout_s`` of the plan's Tasks calling the function (dispatch:
  512 MB, 60 s); /tmp 512 MB.
  ``lambdaImage``: the container image that the functions of kinds with ``lambda_package="image"``
  (dpquery) run, an Amazon ECR URI in the stack's account or another (``<account>.dkr.ecr.<region>.
  amazonaws.com/<repo>:<tag>`` or ``@sha256:<digest>``) in the stack's Region, built from
  ``Dockerfile.lambda`` for ``lambdaArchitecture`` as a single-platform image. Its repository's policy must
  let ``lambda.amazonaws.com`` pull (``ecr:BatchGetImage``, ``ecr:GetDownloadUrlForLayer``). Default: the
  stack's ``shardfold-<stage>-lambda`` repository, the image built and pushed there by pulumi-docker-build
  when it is installed, else ``<repository>:latest`` pushed by hand (see ``infra.lambda_image``).
  ``buildLambdaImage``: build ``Dockerfile.lambda`` with pulumi-docker-build when it is installed (true).

Logs and tracing
  ``logRetentionDays``: retention of every log group the stack creates (14).
  ``sfnLogLevel``: state machine log level, ALL, ERROR (default), FATAL or OFF.
  ``tracing``: X-Ray on functions and state machines (false).

Bucket
  ``bucketName``: the job bucket's name (default: ``shardfold-<stage>-jobs-<random>``).
  ``forceDestroy``: let ``pulumi destroy`` delete a non-empty bucket and an ECR repository holding images
  (false: destroy stops at them, so results are never lost by accident).
  ``sseAlgorithm``: default encryption, ``AES256`` (SSE-S3, default) or ``aws:kms``; ``kmsKeyArn``: a
  customer-managed key for ``aws:kms`` (default: the AWS managed ``aws/s3`` key).
  ``tempExpirationDays``: objects under ``tmp/`` expire after this (7).
  ``abortIncompleteUploadDays``: incomplete multipart uploads are aborted after this (2).
  ``jobsExpirationDays``: everything under ``jobs/`` (specs, reports, results) expires after this (0: never).
  ``outputPrefixes``: where in the job bucket jobs may write their outputs besides their own
  ``jobs/<id>/output/`` (``["results/"]``); the workers' roles may write only there and under ``jobs/``,
  and under ``ledger/`` only the functions of kinds that declare the ledger right (``JobKind.rights``).
  ``readBuckets`` / ``writeBuckets``: other buckets (``bucket`` or ``bucket/prefix``) the workers may read /
  read and write (``[]``). Submit and every task refuse a spec URI outside them, naming the key to add.

GPU queue (AWS Batch)
  ``batch``: create the GPU queue, ECR repository and job definitions (true).
  ``gpuInstanceTypes``: ``["g5.xlarge", "g4dn.xlarge"]``. ``maxVcpus``: the environment's cap (16).
  ``spot``: Spot capacity, reclaims retried (true), or On-Demand (false).
  ``gpuImageType``: ``ECS_AL2023_NVIDIA`` (default) or ``ECS_AL2_NVIDIA``.
  ``vpcId`` / ``subnetIds`` / ``securityGroupIds``: the instances' network (default: the default VPC, its
  subnets, one egress-only security group). Subnets need a route to ECR and S3 (public IPs, as in the
  default VPC, a NAT gateway, or VPC endpoints).
  ``workerImage``: the worker image URI (default: built from ``Dockerfile``; see ``infra.gpu``).
  ``buildWorkerImage``: build the ``Dockerfile`` with pulumi-docker-build when it is installed (true).
  ``instanceRoleManagedPolicy``: give instances AWS's AmazonEC2ContainerServiceforEC2Role instead of the
  stack's scoped policy (false; the managed policy has wildcard actions).
  ``runnableTimeoutSeconds``: cancel jobs stuck RUNNABLE (no capacity) after this (14400; 600..86400).
  ``batchVcpus`` / ``batchMemory`` / ``batchGpus`` / ``batchTimeout``: ``{entry point: vCPUs | MiB | GPUs |
  seconds}`` overrides of the GPU jobs' resources, keyed by the ``BatchJob``'s entry point
  (``pulumi config set --path 'shardfold:batchMemory["inference.worker"]' 30000``); they size the job
  definition and every state that submits to it. Default: the largest ``vcpus`` / ``memory_mb`` / ``gpus``
  / ``timeout_s`` of the plan's BatchJobs running the entry point. vCPUs 1..``maxVcpus`` (a job asking more
  never starts), memory at least 4 MiB, GPUs at least 0, the attempt timeout at least 60 s (Batch's floors).

Sizes
  The stack output ``sizes`` lists every function's and job definition's effective size and the key above
  that changes each (:func:`size_key`), so a plan refused for memory can name what to raise.

Trigger
  ``dispatchRetryAttempts``: EventBridge retries to the dispatch function (8; 0..185).
  ``dispatchMaxEventAgeSeconds``: the oldest event still delivered (3600; 60..86400).
  ``dlqRetentionDays``: how long failed trigger events stay in the dead-letter queue (14; 1..14).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardfold.functions.access import SYSTEM_PREFIXES, Grants
from shardfold.functions.errors import ShardfoldError

ARCHITECTURES = ("arm64", "x86_64")
# Amazon Linux 2023 runtimes: the Lambda package is built for their glibc (infra.package).
RUNTIMES = ("python3.12", "python3.13")
SFN_LOG_LEVELS = ("ALL", "ERROR", "FATAL", "OFF")
SSE_ALGORITHMS = ("AES256", "aws:kms")
# CloudWatch Logs accepts only these retention periods.
LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557)
GPU_IMAGE_TYPES = ("ECS_AL2023_NVIDIA", "ECS_AL2_NVIDIA")
LAMBDA_MEMORY_MB = (128, 10240)
LAMBDA_TIMEOUT_S = (1, 900)
LAMBDA_EPHEMERAL_MB = (512, 10240)
# AWS Batch floors (MEMORY >= 4 MiB, attemptDurationSeconds >= 60); vCPUs are capped by maxVcpus instead.
BATCH_MEMORY_MB = (4, None)
BATCH_GPUS = (0, None)
BATCH_TIMEOUT_S = (60, None)
# The per-function / per-entry-point maps that set each size the ``sizes`` output reports.
FUNCTION_SIZE_KEYS = {
    "memory_mb": "functionMemory",
    "ephemeral_mb": "functionEphemeralStorage",
    "timeout_s": "functionTimeout",
}
BATCH_SIZE_KEYS = {
    "vcpus": "batchVcpus",
    "memory_mb": "batchMemory",
    "gpus": "batchGpus",
    "timeout_s": "batchTimeout",
}
DISPATCH = "dispatch"  # the key of the dispatch (bucket trigger) function in the per-function maps
DISPATCH_MEMORY_MB = 512
DISPATCH_TIMEOUT_S = 60
_STAGE_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,15}$")
# A private Amazon ECR image, by tag or digest: the only images Lambda runs.
ECR_IMAGE_RE = re.compile(
    r"^(?P<account>\d{12})\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(\.cn)?/"
    r"(?P<repo>[a-z0-9][a-z0-9._/-]*)(:(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})|@sha256:[0-9a-f]{64})$"
)


@dataclass(frozen=True)
class StackConfig:
    """The whole configuration of one stack, with the documented defaults (see the module docstring)."""

    stage: str = "dev"
    region: str | None = None
    tags: Mapping[str, str] = field(default_factory=dict)
    lambda_architecture: str = "arm64"
    lambda_runtime: str = "python3.12"
    function_memory: Mapping[str, int] = field(default_factory=dict)
    function_timeout: Mapping[str, int] = field(default_factory=dict)
    function_ephemeral_storage: Mapping[str, int] = field(default_factory=dict)
    lambda_image: str | None = None
    build_lambda_image: bool = True
    log_retention_days: int = 14
    sfn_log_level: str = "ERROR"
    tracing: bool = False
    bucket_name: str | None = None
    force_destroy: bool = False
    sse_algorithm: str = "AES256"
    kms_key_arn: str | None = None
    temp_expiration_days: int = 7
    abort_incomplete_upload_days: int = 2
    jobs_expiration_days: int = 0
    output_prefixes: tuple[str, ...] = ("results/",)
    read_buckets: tuple[str, ...] = ()
    write_buckets: tuple[str, ...] = ()
    batch: bool = True
    gpu_instance_types: tuple[str, ...] = ("g5.xlarge", "g4dn.xlarge")
    max_vcpus: int = 16
    spot: bool = True
    gpu_image_type: str = "ECS_AL2023_NVIDIA"
    vpc_id: str | None = None
    subnet_ids: tuple[str, ...] = ()
    security_group_ids: tuple[str, ...] = ()
    worker_image: str | None = None
    build_worker_image: bool = True
    instance_role_managed_policy: bool = False
    runnable_timeout_seconds: int = 14400
    batch_vcpus: Mapping[str, int] = field(default_factory=dict)
    batch_memory: Mapping[str, int] = field(default_factory=dict)
    batch_gpus: Mapping[str, int] = field(default_factory=dict)
    batch_timeout: Mapping[str, int] = field(default_factory=dict)
    dispatch_retry_attempts: int = 8
    dispatch_max_event_age_seconds: int = 3600
    dlq_retention_days: int = 14

    def __post_init__(self) -> None:
        problems = []
        if not _STAGE_RE.match(self.stage):
            problems.append(
                f"stage {self.stage!r} must be 1-16 of [a-z0-9-], starting with a letter or digit"
            )
        if self.lambda_architecture not in ARCHITECTURES:
            problems.append(f"lambdaArchitecture must be one of {ARCHITECTURES}")
        if self.lambda_runtime not in RUNTIMES:
            problems.append(f"lambdaRuntime must be one of {RUNTIMES}")
        if self.lambda_image:
            m = ECR_IMAGE_RE.match(self.lambda_image)
            if not m:
                problems.append(
                    "lambdaImage must be a private Amazon ECR image, <account>.dkr.ecr.<region>."
                    "amazonaws.com/<repository>:<tag> or ...@sha256:<digest> (Lambda runs no other)"
                )
            elif self.region and m["region"] != self.region:
                problems.append(f"lambdaImage must be in the stack's Region {self.region}, not {m['region']}")
        if self.log_retention_days not in LOG_RETENTION_DAYS:
            problems.append(f"logRetentionDays must be one of {LOG_RETENTION_DAYS}")
        if self.sfn_log_level not in SFN_LOG_LEVELS:
            problems.append(f"sfnLogLevel must be one of {SFN_LOG_LEVELS}")
        if self.sse_algorithm not in SSE_ALGORITHMS:
            problems.append(f"sseAlgorithm must be one of {SSE_ALGORITHMS}")
        if self.kms_key_arn and self.sse_algorithm != "aws:kms":
            problems.append("kmsKeyArn needs sseAlgorithm aws:kms")
        if self.kms_key_arn and not self.kms_key_arn.startswith("arn:"):
            problems.append("kmsKeyArn must be a key ARN (arn:...:kms:...:key/...)")
        for name, value in (
            ("tempExpirationDays", self.temp_expiration_days),
            ("abortIncompleteUploadDays", self.abort_incomplete_upload_days),
        ):
            if value < 1:
                problems.append(f"{name} must be >= 1")
        if self.jobs_expiration_days < 0:
            problems.append("jobsExpirationDays must be >= 0 (0: never)")
        for prefix in self.output_prefixes:
            key = prefix.strip("/")
            system = key.split("/")[0] + "/" in SYSTEM_PREFIXES
            if not key or ".." in key.split("/") or system or "*" in key:
                problems.append(
                    f"outputPrefixes entry {prefix!r} must be a folder of the job bucket outside "
                    f"{', '.join(SYSTEM_PREFIXES)}, e.g. results/ (no '..', no wildcards)"
                )
        problems += _check_map("functionMemory", self.function_memory, LAMBDA_MEMORY_MB)
        problems += _check_map("functionTimeout", self.function_timeout, LAMBDA_TIMEOUT_S)
        problems += _check_map(
            "functionEphemeralStorage", self.function_ephemeral_storage, LAMBDA_EPHEMERAL_MB
        )
        if not self.gpu_instance_types:
            problems.append("gpuInstanceTypes must name at least one instance type")
        if self.max_vcpus < 1:
            problems.append("maxVcpus must be >= 1")
        if self.gpu_image_type not in GPU_IMAGE_TYPES:
            problems.append(f"gpuImageType must be one of {GPU_IMAGE_TYPES}")
        if self.subnet_ids and not self.vpc_id and not self.security_group_ids:
            problems.append("subnetIds without securityGroupIds needs vpcId (the security group's VPC)")
        problems += _check_map("batchVcpus", self.batch_vcpus, (1, self.max_vcpus), "maxVcpus")
        problems += _check_map("batchMemory", self.batch_memory, BATCH_MEMORY_MB)
        problems += _check_map("batchGpus", self.batch_gpus, BATCH_GPUS)
        problems += _check_map("batchTimeout", self.batch_timeout, BATCH_TIMEOUT_S)
        if not 600 <= self.runnable_timeout_seconds <= 86400:
            problems.append("runnableTimeoutSeconds must be within 600..86400")
        if not 0 <= self.dispatch_retry_attempts <= 185:
            problems.append("dispatchRetryAttempts must be within 0..185")
        if not 60 <= self.dispatch_max_event_age_seconds <= 86400:
            problems.append("dispatchMaxEventAgeSeconds must be within 60..86400")
        if not 1 <= self.dlq_retention_days <= 14:
            problems.append("dlqRetentionDays must be within 1..14 (SQS's limit)")
        if problems:
            raise ShardfoldError("invalid shardfold stack config: " + "; ".join(problems))

    @property
    def name_prefix(self) -> str:
        """``shardfold-<stage>``: the start of every named resource."""
        return f"shardfold-{self.stage}"

    def grants(self) -> Grants:
        """What the workers' IAM policy lets jobs touch, as submit and the tasks check it."""
        return Grants(self.output_prefixes, self.read_buckets, self.write_buckets)

    def batch_overrides(self) -> dict[str, Mapping[str, int]]:
        """``{BatchJob field: {entry point: value}}`` of the ``batch*`` keys (``{"memory_mb": {...}}``)."""
        return {
            "vcpus": self.batch_vcpus,
            "memory_mb": self.batch_memory,
            "gpus": self.batch_gpus,
            "timeout_s": self.batch_timeout,
        }


def size_key(key: str, name: str) -> str:
    """The config key that sets one function's or entry point's size, as ``pulumi config set --path``
    takes it: ``size_key("functionMemory", "getbatch.gather")`` is
    ``shardfold:functionMemory["getbatch.gather"]``."""
    return f'shardfold:{key}["{name}"]'


def _check_map(
    name: str, values: Mapping[str, Any], bounds: tuple[int, int | None], hi_name: str | None = None
) -> list[str]:
    lo, hi = bounds
    want = f"at least {lo}" if hi is None else f"within {lo}..{hi}" + (f" ({hi_name})" if hi_name else "")
    return [
        f"{name}[{fn!r}] = {v!r} must be an integer {want}"
        for fn, v in values.items()
        if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi)
    ]


def stage_from_stack(stack: str) -> str:
    """A valid stage from a Pulumi stack name (``Dev_Stack`` -> ``dev-stack``), cut to 16 characters."""
    stage = re.sub(r"[^a-z0-9-]+", "-", stack.lower()).strip("-")[:16].strip("-")
    return stage or "dev"


def load() -> StackConfig:
    """The :class:`StackConfig` of the running Pulumi program (``shardfold:*`` keys)."""
    import pulumi

    c = pulumi.Config("shardfold")
    defaults = StackConfig()

    def s(key: str, default: str | None) -> str | None:
        value = c.get(key)
        return value if value not in (None, "") else default

    def b(key: str, default: bool) -> bool:
        value = c.get_bool(key)
        return default if value is None else value

    def i(key: str, default: int) -> int:
        value = c.get_int(key)
        return default if value is None else value

    def lst(key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        raw = c.get(key)
        if raw is None or not raw.strip():
            return default
        if raw.lstrip().startswith("["):
            value = c.get_object(key)
        else:  # a comma-separated string is accepted too: g5.xlarge,g4dn.xlarge
            value = [v.strip() for v in raw.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ShardfoldError(f"shardfold:{key} must be a list (JSON) or comma-separated")
        return tuple(str(v) for v in value)

    def obj(key: str) -> dict[str, Any]:
        value = c.get_object(key) or {}
        if not isinstance(value, dict):
            raise ShardfoldError(f"shardfold:{key} must be an object")
        return dict(value)

    region = s("region", None) or pulumi.Config("aws").get("region")
    return StackConfig(
        stage=s("stage", None) or stage_from_stack(pulumi.get_stack()),
        region=region,
        tags={str(k): str(v) for k, v in obj("tags").items()},
        lambda_architecture=s("lambdaArchitecture", defaults.lambda_architecture),
        lambda_runtime=s("lambdaRuntime", defaults.lambda_runtime),
        function_memory=obj("functionMemory"),
        function_timeout=obj("functionTimeout"),
        function_ephemeral_storage=obj("functionEphemeralStorage"),
        lambda_image=s("lambdaImage", None),
        build_lambda_image=b("buildLambdaImage", defaults.build_lambda_image),
        log_retention_days=i("logRetentionDays", defaults.log_retention_days),
        sfn_log_level=s("sfnLogLevel", defaults.sfn_log_level),
        tracing=b("tracing", defaults.tracing),
        bucket_name=s("bucketName", None),
        force_destroy=b("forceDestroy", defaults.force_destroy),
        sse_algorithm=s("sseAlgorithm", defaults.sse_algorithm),
        kms_key_arn=s("kmsKeyArn", None),
        temp_expiration_days=i("tempExpirationDays", defaults.temp_expiration_days),
        abort_incomplete_upload_days=i("abortIncompleteUploadDays", defaults.abort_incomplete_upload_days),
        jobs_expiration_days=i("jobsExpirationDays", defaults.jobs_expiration_days),
        output_prefixes=lst("outputPrefixes", defaults.output_prefixes),
        read_buckets=lst("readBuckets", ()),
        write_buckets=lst("writeBuckets", ()),
        batch=b("batch", defaults.batch),
        gpu_instance_types=lst("gpuInstanceTypes", defaults.gpu_instance_types),
        max_vcpus=i("maxVcpus", defaults.max_vcpus),
        spot=b("spot", defaults.spot),
        gpu_image_type=s("gpuImageType", defaults.gpu_image_type),
        vpc_id=s("vpcId", None),
        subnet_ids=lst("subnetIds", ()),
        security_group_ids=lst("securityGroupIds", ()),
        worker_image=s("workerImage", None),
        build_worker_image=b("buildWorkerImage", defaults.build_worker_image),
        instance_role_managed_policy=b("instanceRoleManagedPolicy", defaults.instance_role_managed_policy),
        runnable_timeout_seconds=i("runnableTimeoutSeconds", defaults.runnable_timeout_seconds),
        batch_vcpus=obj("batchVcpus"),
        batch_memory=obj("batchMemory"),
        batch_gpus=obj("batchGpus"),
        batch_timeout=obj("batchTimeout"),
        dispatch_retry_attempts=i("dispatchRetryAttempts", defaults.dispatch_retry_attempts),
        dispatch_max_event_age_seconds=i(
            "dispatchMaxEventAgeSeconds", defaults.dispatch_max_event_age_seconds
        ),
        dlq_retention_days=i("dlqRetentionDays", defaults.dlq_retention_days),
    )
