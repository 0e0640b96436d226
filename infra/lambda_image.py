"""The container image of the Lambda functions too big for the zip (kinds with ``lambda_package="image"``).

One image (``Dockerfile.lambda``: AWS's Lambda Python base image, the project's runtime dependencies and the
``functions`` package) serves every such function; each function picks its handler with
``ImageConfig.Command``. Lambda runs only single-platform images from a private ECR repository in the
function's Region, built for the function's architecture (``shardfold:lambdaArchitecture``).

The image, in this order (mirroring the worker image in ``infra.gpu``, whose helpers this reuses):

* ``shardfold:lambdaImage``: any such ECR URI. The stack manages nothing about it; its repository's policy
  must let ``lambda.amazonaws.com`` pull (``ecr:BatchGetImage``, ``ecr:GetDownloadUrlForLayer``) and, for a
  repository in another account, that account must be allowed too (AWS's "Amazon ECR cross-account
  permissions" for Lambda).
* else the stack's own repository ``shardfold-<stage>-lambda`` (kept apart from the worker repository: its
  own lifecycle, and a pull policy for Lambda that the GPU image does not need), and:

  * with ``pulumi-docker-build`` installed and ``buildLambdaImage`` true (default): ``Dockerfile.lambda``
    built for ``linux/arm64`` or ``linux/amd64`` and pushed as ``:latest``; the functions run it pinned by
    digest (``<repository>@sha256:...``: Lambda refuses the ``:tag@digest`` form of the build's ``ref``), so
    a changed image updates them;
  * else ``<repository>:latest`` with a warning: push it before the functions can be created (Lambda
    resolves the image when a function is created or its code updated, so ``pulumi up`` fails on those
    functions until it is there; the repository itself is created first).

The stack's repository gets a policy letting the Lambda service pull, only for this stack's image functions
(``aws:SourceArn`` = their ARNs), granted explicitly rather than left to whatever the deploying identity
may let Lambda add to the policy when a function is created. It names no ``Resource`` (a repository policy
applies to its repository). The functions' execution roles need no ECR permission: Lambda pulls the image
with its own service access, when the function is created or its code updated, not when it runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pulumi
import pulumi_aws as aws

from shardfold.infra.context import Component, Context
from shardfold.infra.gpu import REPO_ROOT, docker_build_available, ecr_repository, push_image
from shardfold.orchestrator import iam

LAMBDA_DOCKERFILE = REPO_ROOT / "Dockerfile.lambda"
# Lambda's architecture -> the image platform it runs
PLATFORMS = {"arm64": "linux/arm64", "x86_64": "linux/amd64"}
PULL_ACTIONS = ("ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer")


def lambda_pull_policy(
    partition: str, region: str, account: str, function_names: Iterable[str]
) -> dict[str, Any]:
    """The repository policy: the Lambda service may pull, on behalf of the named functions only (their
    ARNs, and any qualified ARN of them: ``<arn>:<version or alias>``)."""
    prefix = f"arn:{partition}:lambda:{region}:{account}:function:"
    arns = [prefix + name for name in sorted(set(function_names))]
    st = iam.statement(
        PULL_ACTIONS,
        "*",
        sid="LambdaPull",
        principal={"Service": "lambda.amazonaws.com"},
        condition={"StringLike": {"aws:SourceArn": [a for arn in arns for a in (arn, f"{arn}:*")]}},
    )
    del st["Resource"]  # a repository policy applies to its repository; it names no resource
    return iam.document(st)


class LambdaImage(Component):
    """``uri`` (Output: what the image functions run), ``repository`` (None with ``lambdaImage``),
    ``depends_on`` (what the functions wait for: the repository policy)."""

    def __init__(self, ctx: Context, function_names: Iterable[str]):
        cfg = ctx.cfg
        super().__init__("LambdaImage", f"{cfg.name_prefix}-lambda-image", ctx)
        self.repository: aws.ecr.Repository | None = None
        self.repository_policy: aws.ecr.RepositoryPolicy | None = None
        self.depends_on: tuple[pulumi.Resource, ...] = ()
        if cfg.lambda_image:
            self.uri: pulumi.Output[str] = pulumi.Output.from_input(cfg.lambda_image)
            self.register_outputs({"uri": self.uri})
            return

        name = f"{cfg.name_prefix}-lambda"
        names = sorted(function_names)
        self.repository = ecr_repository(self, name)
        self.repository_policy = aws.ecr.RepositoryPolicy(
            f"{name}-policy",
            repository=self.repository.name,
            policy=pulumi.Output.all(ctx.partition, ctx.region, ctx.account_id).apply(
                lambda v: iam.to_json(lambda_pull_policy(v[0], v[1], v[2], names))
            ),
            opts=self.child(),
        )
        self.depends_on = (self.repository_policy,)
        platform = PLATFORMS[cfg.lambda_architecture]
        if cfg.build_lambda_image and docker_build_available():
            image = push_image(self, f"{name}-image", self.repository, LAMBDA_DOCKERFILE, platform)
            self.uri = pulumi.Output.all(self.repository.repository_url, image.digest).apply(
                lambda v: f"{v[0]}@{v[1]}"
            )
        else:
            pulumi.log.warn(
                f"no Lambda image for {', '.join(names)}: set shardfold:lambdaImage, or install "
                "pulumi-docker-build (pip install pulumi-docker-build) to build Dockerfile.lambda here. "
                f"These functions run <repository>:latest of the ECR repository {name} (stack output "
                "lambda_ecr_repository) and cannot be created until it is there: "
                f"docker buildx build --platform {platform} --provenance=false -f Dockerfile.lambda "
                "-t <repository_url>:latest --push . , then pulumi up again",
                resource=self,
            )
            self.uri = self.repository.repository_url.apply(lambda url: f"{url}:latest")
        self.register_outputs({"uri": self.uri})
