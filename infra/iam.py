"""IAM policy documents as plain dicts, and the one list of places where a ``*`` resource is allowed.

Everything here is pure (no Pulumi): the resource modules build documents from ARNs they already resolved
(inside ``Output.apply``), and :func:`check_policy` refuses any document that breaks the rules below before
it reaches AWS. The tests run the same check over every policy of the stack.

Rules:

* No wildcard in an allowed action (``s3:*``, ``ecs:Submit*``): every action granted is named. A Deny
  grants nothing, so the bucket's TLS-only statement denies ``s3:*`` (AWS's documented form: a list of
  actions would leave the unlisted ones open over plain HTTP).
* A ``"*"`` resource only for an action in :data:`WILDCARD_RESOURCE_ACTIONS`: actions for which AWS offers
  no resource type to scope to (the Service Authorization Reference lists none), each with the reason.
  A statement with a ``"*"`` resource holds only such actions.
* Any other resource is an ARN naming this stack's own resources (a wildcard may end it, for object keys,
  executions or versions of a named resource).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from shardfold.functions.errors import ShardfoldError

VERSION = "2012-10-17"

# The only actions ever granted on Resource "*", and why nothing narrower exists. Each place that grants one
# says so in a comment too; tests read this table.
WILDCARD_RESOURCE_ACTIONS: Mapping[str, str] = {
    # Step Functions' Batch .sync integration polls the job; DescribeJobs has no resource-level permissions.
    "batch:DescribeJobs": "no resource type (AWS Batch service authorization reference)",
    # Step Functions logging to CloudWatch Logs: the vended-logs delivery APIs take no resource ARN
    # (the Step Functions "Logging using CloudWatch Logs" IAM policy uses "*").
    "logs:CreateLogDelivery": "vended log delivery has no resource type",
    "logs:GetLogDelivery": "vended log delivery has no resource type",
    "logs:UpdateLogDelivery": "vended log delivery has no resource type",
    "logs:DeleteLogDelivery": "vended log delivery has no resource type",
    "logs:ListLogDeliveries": "vended log delivery has no resource type",
    "logs:PutResourcePolicy": "account-level log resource policy; no resource type",
    "logs:DescribeResourcePolicies": "account-level; no resource type",
    "logs:DescribeLogGroups": "list call; no resource type",
    # X-Ray tracing (only when shardfold:tracing is on): the segment and sampling APIs take no resource.
    "xray:PutTraceSegments": "no resource type",
    "xray:PutTelemetryRecords": "no resource type",
    "xray:GetSamplingRules": "no resource type",
    "xray:GetSamplingTargets": "no resource type",
    # Batch GPU instances: the ECS agent and the image pull. An ECR token is account-wide; the ECS poll
    # endpoint discovery names no cluster.
    "ecr:GetAuthorizationToken": "registry-wide token; no resource type",
    "ecs:DiscoverPollEndpoint": "no resource type",
}


def statement(
    actions: Iterable[str],
    resources: Iterable[str] | str,
    *,
    sid: str | None = None,
    effect: str = "Allow",
    condition: Mapping[str, Any] | None = None,
    principal: Mapping[str, Any] | str | None = None,
) -> dict[str, Any]:
    """One statement; actions sorted and de-duplicated so documents are stable across runs."""
    res = [resources] if isinstance(resources, str) else list(dict.fromkeys(resources))
    st: dict[str, Any] = {}
    if sid:
        st["Sid"] = sid
    st["Effect"] = effect
    if principal is not None:
        st["Principal"] = principal
    st["Action"] = sorted(set(actions))
    st["Resource"] = res[0] if len(res) == 1 else res
    if condition:
        st["Condition"] = dict(condition)
    return st


def document(*statements: dict[str, Any] | None) -> dict[str, Any]:
    """A policy document of the given statements (``None`` entries are skipped)."""
    return {"Version": VERSION, "Statement": [s for s in statements if s]}


def to_json(doc: Mapping[str, Any]) -> str:
    """``doc`` checked by :func:`check_policy`, as compact, key-sorted JSON."""
    check_policy(doc)
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def assume_role(*services: str, source_account: str | None = None) -> dict[str, Any]:
    """Trust policy letting AWS ``services`` (``lambda.amazonaws.com``...) assume a role.

    ``source_account`` adds the ``aws:SourceAccount`` condition (confused-deputy protection) where the
    service sets it (Step Functions, EventBridge, Lambda do).
    """
    st = statement(
        ["sts:AssumeRole"],
        "*",
        principal={"Service": sorted(services) if len(services) > 1 else services[0]},
        condition={"StringEquals": {"aws:SourceAccount": source_account}} if source_account else None,
    )
    del st["Resource"]  # a trust policy names the principal, not a resource
    return document(st)


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def check_policy(doc: Mapping[str, Any]) -> None:
    """Raise :class:`ShardfoldError` if ``doc`` has a wildcard action or an unlisted ``*`` resource."""
    for st in _as_list(doc.get("Statement", [])):
        if "NotAction" in st or "NotResource" in st:
            raise ShardfoldError(f"NotAction/NotResource are not used by this stack: {st}")
        actions = _as_list(st.get("Action", []))
        if st.get("Effect") == "Deny":
            continue  # a Deny grants nothing (the bucket's TLS-only Deny covers s3:* on purpose)
        for action in actions:
            if "*" in action or "?" in action:
                raise ShardfoldError(f"wildcard action {action!r} in {st}")
        if "Resource" not in st:
            continue  # a trust policy names a principal, not a resource
        for resource in _as_list(st["Resource"]):
            if resource == "*":
                bad = [a for a in actions if a not in WILDCARD_RESOURCE_ACTIONS]
                if bad:
                    raise ShardfoldError(
                        f"actions {bad} are granted on Resource '*'; only those in shardfold.infra.iam."
                        f"WILDCARD_RESOURCE_ACTIONS may be: {sorted(WILDCARD_RESOURCE_ACTIONS)}"
                    )
            elif not resource.startswith("arn:"):
                raise ShardfoldError(f"resource {resource!r} is not an ARN")


# --- statement builders shared by the roles --------------------------------------------------------------


def bucket_arn(partition: str, bucket: str) -> str:
    return f"arn:{partition}:s3:::{bucket}"


def s3_statements(
    partition: str,
    refs: Iterable[tuple[str, str]],
    *,
    write: bool,
    sid: str,
) -> list[dict[str, Any]]:
    """Object access under each ``(bucket, prefix)`` (``""``: the whole bucket), ListBucket on the buckets.

    Reads are GetObject (ranged GETs, HEAD, and the source of UploadPartCopy); writes add PutObject (plain,
    conditional and multipart, the target of UploadPartCopy), DeleteObject (also DeleteObjects) and
    AbortMultipartUpload. ListBucket lets HEAD of a missing key answer 404 instead of 403, which the store
    relies on, and serves list/delete-prefix.
    """
    refs = list(refs)
    if not refs:
        return []
    objects = []
    buckets = []
    for bucket, prefix in refs:
        arn = bucket_arn(partition, bucket)
        objects.append(f"{arn}/{prefix}/*" if prefix else f"{arn}/*")
        buckets.append(arn)
    actions = ["s3:GetObject"]
    if write:
        actions += ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
    return [
        statement(actions, objects, sid=f"{sid}Objects"),
        statement(["s3:ListBucket"], buckets, sid=f"{sid}List"),
    ]


def kms_statement(key_arn: str | None, sid: str = "BucketKey") -> dict[str, Any] | None:
    """Use of the bucket's customer-managed KMS key (SSE-KMS), when there is one."""
    if not key_arn:
        return None
    return statement(["kms:Decrypt", "kms:GenerateDataKey"], key_arn, sid=sid)


def log_stream_statement(log_group_arn: str, sid: str = "Logs") -> dict[str, Any]:
    """Write to one log group (created by the stack with its retention; no CreateLogGroup granted, so the
    service cannot re-create it without one)."""
    return statement(["logs:CreateLogStream", "logs:PutLogEvents"], [f"{log_group_arn}:*"], sid=sid)


def xray_statement() -> dict[str, Any]:
    # Resource "*": X-Ray's segment and sampling APIs have no resource type (WILDCARD_RESOURCE_ACTIONS).
    return statement(
        [
            "xray:PutTraceSegments",
            "xray:PutTelemetryRecords",
            "xray:GetSamplingRules",
            "xray:GetSamplingTargets",
        ],
        "*",
        sid="XRay",
    )


def sfn_log_delivery_statement() -> dict[str, Any]:
    # Resource "*": CloudWatch Logs vended-delivery APIs take no resource ARN (WILDCARD_RESOURCE_ACTIONS);
    # this is the policy AWS documents for Step Functions logging.
    return statement(
        [
            "logs:CreateLogDelivery",
            "logs:GetLogDelivery",
            "logs:UpdateLogDelivery",
            "logs:DeleteLogDelivery",
            "logs:ListLogDeliveries",
            "logs:PutResourcePolicy",
            "logs:DescribeResourcePolicies",
            "logs:DescribeLogGroups",
        ],
        "*",
        sid="LogDelivery",
    )
