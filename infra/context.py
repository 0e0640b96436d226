"""What every component needs: the config, the AWS provider, and the account, Region and partition."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_aws as aws

from shardfold.infra.config import StackConfig


@dataclass
class Context:
    cfg: StackConfig
    provider: aws.Provider
    account_id: pulumi.Output[str]
    region: pulumi.Output[str]
    partition: pulumi.Output[str]

    @classmethod
    def create(cls, cfg: StackConfig) -> Context:
        tags = {"shardfold:stage": cfg.stage, "shardfold:managed-by": "pulumi", **cfg.tags}
        args: dict[str, Any] = {"default_tags": aws.ProviderDefaultTagsArgs(tags=tags)}
        if cfg.region:
            args["region"] = cfg.region
        # An explicit provider does not read the aws:* stack config; carry over the profile if one is set.
        profile = pulumi.Config("aws").get("profile")
        if profile:
            args["profile"] = profile
        provider = aws.Provider(f"{cfg.name_prefix}-aws", **args)
        invoke = pulumi.InvokeOptions(provider=provider)
        return cls(
            cfg=cfg,
            provider=provider,
            account_id=aws.get_caller_identity_output(opts=invoke).account_id,
            region=aws.get_region_output(opts=invoke).region,
            partition=aws.get_partition_output(opts=invoke).partition,
        )

    def opts(self, parent: pulumi.Resource | None = None, **kwargs: Any) -> pulumi.ResourceOptions:
        """Options for a resource: this stack's provider (inherited from ``parent`` when there is one)."""
        if parent is not None:
            return pulumi.ResourceOptions(parent=parent, **kwargs)
        return pulumi.ResourceOptions(provider=self.provider, **kwargs)

    def invoke_opts(self) -> pulumi.InvokeOptions:
        return pulumi.InvokeOptions(provider=self.provider)

    def arn(self, service: str, resource: str, *, region: bool = True) -> pulumi.Output[str]:
        """``arn:<partition>:<service>:<region>:<account>:<resource>`` as an Output."""
        return pulumi.Output.all(self.partition, self.region, self.account_id).apply(
            lambda v: f"arn:{v[0]}:{service}:{v[1] if region else ''}:{v[2]}:{resource}"
        )


class Component(pulumi.ComponentResource):
    """A named group of resources (``shardfold:<kind>``) whose children use the stack's provider."""

    def __init__(self, kind: str, name: str, ctx: Context, opts: pulumi.ResourceOptions | None = None):
        base = pulumi.ResourceOptions(providers={"aws": ctx.provider})
        super().__init__(f"shardfold:infra:{kind}", name, None, pulumi.ResourceOptions.merge(base, opts))
        self.ctx = ctx

    def child(self, **kwargs: Any) -> pulumi.ResourceOptions:
        return pulumi.ResourceOptions(parent=self, **kwargs)


IAM_NAME_MAX = 64
AUTONAME_SUFFIX = 8  # Pulumi appends "-" and 7 random characters to a resource name


def role_name_args(logical: str) -> dict[str, str]:
    """Keyword arguments naming an IAM role after its resource name ``logical``.

    Pulumi's autonaming (``logical`` plus a random suffix) when that fits IAM's 64 characters; otherwise an
    explicit name, cut short and made unique with a hash of the whole name.
    """
    if len(logical) + AUTONAME_SUFFIX <= IAM_NAME_MAX:
        return {}
    digest = hashlib.sha256(logical.encode()).hexdigest()[:8]
    return {"name": f"{logical[: IAM_NAME_MAX - 9]}-{digest}"}
