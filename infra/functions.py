"""Lambda functions: one per registered function the workflows call, each with its own role and log group.

Sizing comes from the plans: a function's memory and timeout are the largest any ``Task`` calling it asks
for (``Task.memory_mb``/``timeout_s``), unless ``shardfold:functionMemory``/``functionTimeout`` override
them (``functionEphemeralStorage``: /tmp, 512 MB by default); :meth:`FunctionSpec.size` is what the
``sizes`` stack output reports of each. Packaging comes from the kind (``Workflow.lambda_package``,
``infra.package.function_packages``):

* ``"zip"`` (most kinds, and the dispatch function): every such function runs the same zip
  (``infra.package.build_lambda_package``: the ``functions`` package and its dependencies built for Lambda's
  platform and architecture, without torch or the image-only dependencies); only the handler setting
  differs (``orchestrator.registry.lambda_handler``).
* ``"image"`` (kinds whose dependencies exceed the zip's 250 MB, dpquery): ``PackageType: Image`` functions
  running one container image (``Dockerfile.lambda``; ``infra.lambda_image``), the handler chosen per
  function by ``ImageConfig.Command`` = ``[lambda_handler(function)]``; the same architecture setting.

Each function's role may write its own log group and its job folders (``jobs/``), and what its kind's
declared rights add (``JobKind.rights``, ``orchestrator.iam.worker_statements``): reading the job bucket
(where users usually put their data) and the buckets listed in ``shardfold:readBuckets`` and
``shardfold:writeBuckets``; writing the ``shardfold:outputPrefixes`` and ``writeBuckets``; the budget
ledgers (``ledger/``). Data in any other bucket is unreachable until listed there; in another account, that
bucket's policy must also allow the role.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pulumi
import pulumi_aws as aws

from shardfold.functions.errors import ShardfoldError
from shardfold.functions.workflow import Workflow
from shardfold.infra.config import (
    DISPATCH,
    DISPATCH_MEMORY_MB,
    DISPATCH_TIMEOUT_S,
    StackConfig,
)
from shardfold.infra.context import Component, Context, role_name_args
from shardfold.infra.package import DISPATCH_HANDLER, function_packages
from shardfold.infra.sizes import LAMBDA_DEFAULT_EPHEMERAL_MB, function_size, plan_sizes
from shardfold.orchestrator import iam
from shardfold.orchestrator.registry import lambda_handler, lambda_name


@dataclass(frozen=True)
class FunctionSpec:
    """One Lambda function to deploy."""

    function: str  # the registered name ("getbatch.prepare"), or "dispatch"
    name: str  # the Lambda function name
    handler: str  # Lambda's Handler setting
    memory_mb: int
    timeout_s: int
    ephemeral_mb: int = LAMBDA_DEFAULT_EPHEMERAL_MB
    package: str = "zip"  # "zip" or "image" (infra.package.function_packages)

    def size(self) -> dict[str, Any]:
        """This function's entry of the ``sizes`` stack output's ``functions`` map."""
        return function_size(self.function, self.memory_mb, self.timeout_s, self.ephemeral_mb)


def function_specs(workflows: Mapping[str, Workflow], cfg: StackConfig) -> dict[str, FunctionSpec]:
    """The Lambda functions of the stack (the workflows' Tasks and the dispatch function), sized."""
    sizes = plan_sizes(workflows)
    known = set(sizes) | {DISPATCH}
    for key, overrides in (
        ("functionMemory", cfg.function_memory),
        ("functionTimeout", cfg.function_timeout),
        ("functionEphemeralStorage", cfg.function_ephemeral_storage),
    ):
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ShardfoldError(f"shardfold:{key} names unknown functions {unknown}; known: {sorted(known)}")
    packages = function_packages(workflows)
    specs: dict[str, FunctionSpec] = {}
    for function, (mem, tmo) in sizes.items():
        if tmo > 900:
            raise ShardfoldError(f"{function} asks for a {tmo} s timeout; Lambda allows at most 900 s")
        specs[function] = FunctionSpec(
            function=function,
            name=lambda_name(function, cfg.stage),
            handler=lambda_handler(function),
            memory_mb=cfg.function_memory.get(function, mem),
            timeout_s=cfg.function_timeout.get(function, tmo),
            ephemeral_mb=cfg.function_ephemeral_storage.get(function, LAMBDA_DEFAULT_EPHEMERAL_MB),
            package=packages[function],
        )
    specs[DISPATCH] = FunctionSpec(
        function=DISPATCH,
        name=f"{cfg.name_prefix}-dispatch",
        handler=DISPATCH_HANDLER,
        memory_mb=cfg.function_memory.get(DISPATCH, DISPATCH_MEMORY_MB),
        timeout_s=cfg.function_timeout.get(DISPATCH, DISPATCH_TIMEOUT_S),
        ephemeral_mb=cfg.function_ephemeral_storage.get(DISPATCH, LAMBDA_DEFAULT_EPHEMERAL_MB),
    )
    return specs


@dataclass(frozen=True)
class LambdaCode:
    """The package every function runs: the zip itself (up to Lambda's 50 MB direct-upload limit), or an
    object in the bucket (``s3_bucket``/``s3_key``) for a larger one."""

    path: Path
    sha256: str
    source_code_hash: str  # base64 sha256, as Lambda reports it
    direct_upload: bool = True
    s3_bucket: pulumi.Output[str] | None = None
    s3_key: pulumi.Output[str] | None = None

    @classmethod
    def from_zip(cls, path: str | Path) -> LambdaCode:
        from shardfold.infra.package import package_report

        report = package_report(path)
        # infra.package refuses these when it builds; a zip from anywhere else is checked here too.
        if report["has_torch"]:
            raise ShardfoldError(
                f"{path} holds torch or CUDA libraries; they belong in the worker image only"
            )
        if not report["fits"]:
            raise ShardfoldError(f"{path} is {report['unzipped_bytes']} bytes unzipped, over Lambda's limit")
        return cls(
            path=Path(path),
            sha256=report["sha256"],
            source_code_hash=report["source_code_hash"],
            direct_upload=report["direct_upload"],
        )

    def upload(self, storage: Any) -> LambdaCode:
        """Put the zip in the job bucket under ``deploy/``, named by its hash (a new build is a new key)."""
        key = f"deploy/lambda-{self.path.stem}-{self.sha256[:16]}.zip"
        obj = aws.s3.BucketObjectv2(
            "lambda-package",
            bucket=storage.bucket.id,
            key=key,
            source=pulumi.FileAsset(str(self.path)),
            opts=pulumi.ResourceOptions(parent=storage),
        )
        # obj.key (an Output), not the plain key: the functions then wait for the upload.
        return replace(self, s3_bucket=obj.bucket, s3_key=obj.key)

    def function_args(self) -> dict[str, Any]:
        if self.s3_key is None:
            return {"code": pulumi.FileArchive(str(self.path)), "source_code_hash": self.source_code_hash}
        return {"s3_bucket": self.s3_bucket, "s3_key": self.s3_key, "source_code_hash": self.source_code_hash}


@dataclass(frozen=True)
class ImageCode:
    """The container image the ``package == "image"`` functions run (``infra.lambda_image.LambdaImage``):
    ``image_uri`` (``<repository>:<tag>`` or ``<repository>@sha256:<digest>``, built for the functions'
    architecture) and the resources a function must wait for (the repository policy letting Lambda pull)."""

    image_uri: pulumi.Input[str]
    depends_on: tuple[pulumi.Resource, ...] = ()

    def function_args(self, handler: str) -> dict[str, Any]:
        # No Handler or Runtime for an image: the base image's runtime runs ImageConfig.Command's handler.
        return {
            "package_type": "Image",
            "image_uri": self.image_uri,
            "image_config": aws.lambda_.FunctionImageConfigArgs(commands=[handler]),
        }


ExtraInputs = list[pulumi.Input[Any]]


class LambdaFunction(Component):
    """A function with its role (trusting lambda.amazonaws.com), inline policy and log group."""

    def __init__(
        self,
        ctx: Context,
        spec: FunctionSpec,
        code: LambdaCode | ImageCode,
        bucket: pulumi.Output[str],
        environment: Mapping[str, pulumi.Input[str]],
        statements: Callable[..., list[dict[str, Any]]],
        extra: ExtraInputs | None = None,
        opts: pulumi.ResourceOptions | None = None,
    ):
        """``statements(partition, bucket, *extra)`` -> the role's statements besides its log group."""
        super().__init__("LambdaFunction", spec.name, ctx, opts)
        cfg = ctx.cfg
        self.spec = spec
        self.log_group = aws.cloudwatch.LogGroup(
            f"{spec.name}-logs",
            name=f"/aws/lambda/{spec.name}",
            retention_in_days=cfg.log_retention_days,
            opts=self.child(),
        )
        self.role = aws.iam.Role(
            f"{spec.name}-role",
            **role_name_args(f"{spec.name}-role"),
            assume_role_policy=iam.to_json(iam.assume_role("lambda.amazonaws.com")),
            description=f"Shardfold {cfg.stage}: Lambda function {spec.function}",
            opts=self.child(),
        )

        def policy(args: list[Any]) -> str:
            partition, bucket_name, log_arn, *rest = args
            doc = iam.lambda_policy(log_arn, statements(partition, bucket_name, *rest), tracing=cfg.tracing)
            return iam.to_json(doc)

        self.policy = aws.iam.RolePolicy(
            f"{spec.name}-policy",
            role=self.role.id,
            policy=pulumi.Output.all(ctx.partition, bucket, self.log_group.arn, *(extra or [])).apply(policy),
            opts=self.child(),
        )
        if isinstance(code, ImageCode):
            package_args = code.function_args(spec.handler)
            waits: list[pulumi.Resource] = list(code.depends_on)
        else:
            package_args = {**code.function_args(), "handler": spec.handler, "runtime": cfg.lambda_runtime}
            waits = []
        self.function = aws.lambda_.Function(
            spec.name,
            name=spec.name,
            role=self.role.arn,
            **package_args,
            # an image must be built for this architecture too (infra.lambda_image builds it so)
            architectures=[cfg.lambda_architecture],
            memory_size=spec.memory_mb,
            timeout=spec.timeout_s,
            ephemeral_storage=aws.lambda_.FunctionEphemeralStorageArgs(size=spec.ephemeral_mb),
            environment=aws.lambda_.FunctionEnvironmentArgs(variables=dict(environment)),
            logging_config=aws.lambda_.FunctionLoggingConfigArgs(
                log_format="JSON", log_group=self.log_group.name
            ),
            tracing_config=aws.lambda_.FunctionTracingConfigArgs(
                mode="Active" if cfg.tracing else "PassThrough"
            ),
            description=f"Shardfold {cfg.stage}: {spec.function}",
            # The role's policy and the log group exist before the first invocation can log (and, for an
            # image, the repository policy letting Lambda pull it, checked when the function is created).
            opts=self.child(depends_on=[self.policy, self.log_group, *waits]),
        )
        self.arn = self.function.arn
        self.name = self.function.name
        self.register_outputs({"arn": self.arn})


def base_environment(cfg: StackConfig, bucket: pulumi.Output[str] | str) -> dict[str, pulumi.Input[str]]:
    """Environment every function (and the Batch worker) gets (``bucket``: its name, or the Output of it)."""
    return {
        "POWERTOOLS_SERVICE_NAME": "shardfold",
        "POWERTOOLS_LOG_LEVEL": "INFO",
        "SHARDFOLD_STAGE": cfg.stage,
        # Handlers take their store root from the workflow input; this is the default for anything else.
        "SHARDFOLD_HOME": f"s3://{bucket}"
        if isinstance(bucket, str)
        else bucket.apply(lambda b: f"s3://{b}"),
        # what jobs may read and write: the tasks hold a spec to it as submit did (functions.access)
        **cfg.grants().env(),
    }


class WorkerFunctions(Component):
    """The workflows' Lambda functions. ``arns``/``names``: ``{function: Output}``.

    ``code`` is the zip the ``"zip"`` functions run; ``image`` the container image of the ``"image"``
    functions (needed when there is one)."""

    def __init__(
        self,
        ctx: Context,
        specs: Mapping[str, FunctionSpec],
        code: LambdaCode,
        bucket: pulumi.Output[str],
        image: ImageCode | None = None,
    ):
        super().__init__("WorkerFunctions", f"{ctx.cfg.name_prefix}-functions", ctx)
        cfg = ctx.cfg
        env = base_environment(cfg, bucket)
        grants = cfg.grants()

        self.functions: dict[str, LambdaFunction] = {}
        for function, spec in specs.items():
            if function == DISPATCH:
                continue

            statements = functools.partial(
                iam.worker_statements,
                grants=grants,
                rights=iam.function_rights(function),
                kms_key_arn=cfg.kms_key_arn,
            )

            if spec.package == "image" and image is None:
                raise ShardfoldError(f"{function} deploys as a container image, but no image was given")
            self.functions[function] = LambdaFunction(
                ctx,
                spec,
                image if spec.package == "image" and image is not None else code,
                bucket,
                env,
                statements,
                opts=self.child(),
            )
        self.arns = {fn: f.arn for fn, f in self.functions.items()}
        self.names = {fn: f.name for fn, f in self.functions.items()}
        self.register_outputs({"functions": self.arns})
