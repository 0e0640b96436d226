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

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, ValidationError, ValidationInfo, model_validator
from pydantic.alias_generators import to_camel as _key  # a field's config key: lambda_runtime, lambdaRuntime
from pydantic.alias_generators import to_snake
from pydantic.dataclasses import dataclass

from shardfold.functions.access import SYSTEM_PREFIXES, Grants
from shardfold.functions.errors import ShardfoldError
from shardfold.orchestrator.registry import name_prefix

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


def _checked(problems: Callable[[Any, ValidationInfo], list[str]]) -> BeforeValidator:
    """A field's check: ``problems(value, info)`` (``info.data``: the fields above it), as one error."""

    def check(value: Any, info: ValidationInfo) -> Any:
        if found := problems(value, info):
            raise ValueError("; ".join(found))
        return value

    return BeforeValidator(check)


def _rule(ok: Callable[[Any], Any], problem: str) -> BeforeValidator:
    """``problem`` (``{key}``: the field's config key, ``{v}``: its value) unless ``ok(value)``."""
    return _checked(lambda v, info: [] if ok(v) else [problem.format(key=_key(info.field_name), v=v)])


def _one_of(choices: tuple) -> BeforeValidator:
    """One of ``choices``."""
    return _rule(lambda v: v in choices, f"{{key}} must be one of {choices}")


def _at_least(lo: int, why: str = "") -> BeforeValidator:
    """At least ``lo``."""
    return _rule(lambda v: v >= lo, f"{{key}} must be >= {lo}{why}")


def _within(lo: int, hi: int, why: str = "") -> BeforeValidator:
    """Within ``lo..hi``."""
    return _rule(lambda v: lo <= v <= hi, f"{{key}} must be within {lo}..{hi}{why}")


def _sizes(bounds: tuple[int, int | None]) -> BeforeValidator:
    """Per-function or per-entry-point sizes, each an integer within ``bounds``."""
    return _checked(lambda v, info: _check_map(_key(info.field_name), v, bounds))


def _image_problems(image: str | None, info: ValidationInfo) -> list[str]:
    """lambdaImage: a private Amazon ECR image in the stack's Region."""
    found = ECR_IMAGE_RE.match(image) if image else None
    region = info.data.get("region")
    if image and not found:
        return [
            "lambdaImage must be a private Amazon ECR image, <account>.dkr.ecr.<region>."
            "amazonaws.com/<repository>:<tag> or ...@sha256:<digest> (Lambda runs no other)"
        ]
    if found and region and found["region"] != region:
        return [f"lambdaImage must be in the stack's Region {region}, not {found['region']}"]
    return []


def _kms_problems(arn: str | None, info: ValidationInfo) -> list[str]:
    """kmsKeyArn: a key ARN, for sseAlgorithm aws:kms."""
    if not arn:
        return []
    wrong = (
        ("kmsKeyArn needs sseAlgorithm aws:kms", info.data.get("sse_algorithm") != "aws:kms"),
        ("kmsKeyArn must be a key ARN (arn:...:kms:...:key/...)", not arn.startswith("arn:")),
    )
    return [problem for problem, bad in wrong if bad]


def _prefix_problems(prefixes: tuple[str, ...], info: ValidationInfo) -> list[str]:
    """outputPrefixes: folders of the job bucket outside the system prefixes."""
    return [
        f"outputPrefixes entry {prefix!r} must be a folder of the job bucket outside "
        f"{', '.join(SYSTEM_PREFIXES)}, e.g. results/ (no '..', no wildcards)"
        for prefix in prefixes
        if not (key := prefix.strip("/"))
        or ".." in key.split("/")
        or key.split("/")[0] + "/" in SYSTEM_PREFIXES
        or "*" in key
    ]


def _network_problems(groups: tuple[str, ...], info: ValidationInfo) -> list[str]:
    """securityGroupIds: given with subnetIds, or a vpcId to make one in."""
    if info.data.get("subnet_ids") and not info.data.get("vpc_id") and not groups:
        return ["subnetIds without securityGroupIds needs vpcId (the security group's VPC)"]
    return []


def _vcpu_problems(values: Mapping[str, Any], info: ValidationInfo) -> list[str]:
    """batchVcpus: each within 1..maxVcpus (a job asking more never starts)."""
    return _check_map("batchVcpus", values, (1, info.data.get("max_vcpus", 0)), "maxVcpus")


_STAGE = "{key} {v!r} must be 1-16 of [a-z0-9-], starting with a letter or digit"
_NO_TYPES = "{key} must name at least one instance type"
_Sizes = Mapping[str, int]  # {function or entry point: MB, seconds, vCPUs or GPUs}


def _none() -> Any:
    """No sizes given: each is the plan's."""
    return dataclasses.field(default_factory=dict)


# Validated by pydantic, every field's problems at once; fields stand in the order their problems are listed.
@dataclass(frozen=True, config=ConfigDict(validate_default=True))
class StackConfig:
    """The whole configuration of one stack, with the documented defaults (see the module docstring)."""

    stage: Annotated[str, _rule(_STAGE_RE.match, _STAGE)] = "dev"
    region: str | None = None
    tags: Mapping[str, str] = dataclasses.field(default_factory=dict)
    lambda_architecture: Annotated[str, _one_of(ARCHITECTURES)] = "arm64"
    lambda_runtime: Annotated[str, _one_of(RUNTIMES)] = "python3.12"
    lambda_image: Annotated[str | None, _checked(_image_problems)] = None
    build_lambda_image: bool = True
    log_retention_days: Annotated[int, _one_of(LOG_RETENTION_DAYS)] = 14
    sfn_log_level: Annotated[str, _one_of(SFN_LOG_LEVELS)] = "ERROR"
    tracing: bool = False
    bucket_name: str | None = None
    force_destroy: bool = False
    sse_algorithm: Annotated[str, _one_of(SSE_ALGORITHMS)] = "AES256"
    kms_key_arn: Annotated[str | None, _checked(_kms_problems)] = None
    temp_expiration_days: Annotated[int, _at_least(1)] = 7
    abort_incomplete_upload_days: Annotated[int, _at_least(1)] = 2
    jobs_expiration_days: Annotated[int, _at_least(0, " (0: never)")] = 0
    output_prefixes: Annotated[tuple[str, ...], _checked(_prefix_problems)] = ("results/",)
    read_buckets: tuple[str, ...] = ()
    write_buckets: tuple[str, ...] = ()
    function_memory: Annotated[_Sizes, _sizes(LAMBDA_MEMORY_MB)] = _none()
    function_timeout: Annotated[_Sizes, _sizes(LAMBDA_TIMEOUT_S)] = _none()
    function_ephemeral_storage: Annotated[_Sizes, _sizes(LAMBDA_EPHEMERAL_MB)] = _none()
    batch: bool = True
    gpu_instance_types: Annotated[tuple[str, ...], _rule(bool, _NO_TYPES)] = ("g5.xlarge", "g4dn.xlarge")
    max_vcpus: Annotated[int, _at_least(1)] = 16
    spot: bool = True
    gpu_image_type: Annotated[str, _one_of(GPU_IMAGE_TYPES)] = "ECS_AL2023_NVIDIA"
    vpc_id: str | None = None
    subnet_ids: tuple[str, ...] = ()
    security_group_ids: Annotated[tuple[str, ...], _checked(_network_problems)] = ()
    worker_image: str | None = None
    build_worker_image: bool = True
    instance_role_managed_policy: bool = False
    batch_vcpus: Annotated[_Sizes, _checked(_vcpu_problems)] = _none()
    batch_memory: Annotated[_Sizes, _sizes(BATCH_MEMORY_MB)] = _none()
    batch_gpus: Annotated[_Sizes, _sizes(BATCH_GPUS)] = _none()
    batch_timeout: Annotated[_Sizes, _sizes(BATCH_TIMEOUT_S)] = _none()
    runnable_timeout_seconds: Annotated[int, _within(600, 86400)] = 14400
    dispatch_retry_attempts: Annotated[int, _within(0, 185)] = 8
    dispatch_max_event_age_seconds: Annotated[int, _within(60, 86400)] = 3600
    dlq_retention_days: Annotated[int, _within(1, 14, " (SQS's limit)")] = 14

    @model_validator(mode="wrap")
    @classmethod
    def _one_error(cls, values: Any, handler: Callable[[Any], Any]) -> Any:
        """Every problem of the configuration in one :class:`ShardfoldError`."""
        try:
            return handler(values)
        except ValidationError as exc:
            problems = [
                str(e["ctx"]["error"])
                if e["type"] == "value_error"
                else f"{_key(str(e['loc'][0]))}: {e['msg']}"
                for e in exc.errors()
            ]
            raise ShardfoldError("invalid shardfold stack config: " + "; ".join(problems)) from None

    @property
    def name_prefix(self) -> str:
        """``shardfold-<stage>``: the start of every named resource."""
        return name_prefix(self.stage)

    def grants(self) -> Grants:
        """What the workers' IAM policy lets jobs touch, as submit and the tasks check it."""
        return Grants(self.output_prefixes, self.read_buckets, self.write_buckets)

    def batch_overrides(self) -> dict[str, Mapping[str, int]]:
        """``{BatchJob field: {entry point: value}}`` of the ``batch*`` keys (``{"memory_mb": {...}}``)."""
        return {name: getattr(self, to_snake(key)) for name, key in BATCH_SIZE_KEYS.items()}


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
    """The :class:`StackConfig` of the running Pulumi program: each field from the ``shardfold:*`` key of its
    name in camelCase (``lambda_runtime``: ``shardfold:lambdaRuntime``), its default where that is unset."""
    import pulumi

    c = pulumi.Config("shardfold")
    given = {f.name: _read(c, _key(f.name), f) for f in dataclasses.fields(StackConfig)}
    given = {name: value for name, value in given.items() if value is not None}
    given["stage"] = given.get("stage") or stage_from_stack(pulumi.get_stack())
    given["region"] = given.get("region") or pulumi.Config("aws").get("region")
    given["tags"] = {str(k): str(v) for k, v in given["tags"].items()}
    return StackConfig(**given)


def _read(c: Any, key: str, f: dataclasses.Field) -> Any:
    """One key, read as the kind of value its field holds (the field's default tells); None when unset."""
    if f.default_factory is not dataclasses.MISSING:
        value = c.get_object(key) or {}
        if not isinstance(value, dict):
            raise ShardfoldError(f"shardfold:{key} must be an object")
        return dict(value)
    if isinstance(f.default, bool):
        return c.get_bool(key)
    if isinstance(f.default, int):
        return c.get_int(key)
    if not isinstance(f.default, tuple):
        return c.get(key) or None  # text; "" is unset
    raw = c.get(key)
    if raw is None or not raw.strip():
        return None
    if raw.lstrip().startswith("["):
        value = c.get_object(key)
    else:  # a comma-separated string is accepted too: g5.xlarge,g4dn.xlarge
        value = [v.strip() for v in raw.split(",") if v.strip()]
    if not isinstance(value, list):
        raise ShardfoldError(f"shardfold:{key} must be a list (JSON) or comma-separated")
    return tuple(str(v) for v in value)
