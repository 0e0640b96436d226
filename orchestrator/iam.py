"""IAM policy documents as plain dicts: the stack's roles, and the one list of places where a ``*``
resource is allowed.

Everything here is pure (no Pulumi): ``infra`` builds documents from ARNs it already resolved (inside
``Output.apply``), and the moto harness and the emulator tier build the same documents for the roles they
run each handler under, so what the tests enforce is what ``pulumi up`` deploys. :func:`check_policy`
refuses any document that breaks the rules below before it reaches AWS; the tests run the same check over
every policy of the stack.

What a worker (a Lambda task or a Batch container) may touch comes from its kind's declared rights
(``JobKind.rights``, :func:`functions.access.reach`); no kind is named here.

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
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from shardfold.functions import access, claims, kinds
from shardfold.functions.access import Grants, Right
from shardfold.functions.errors import ShardfoldError
from shardfold.functions.workflow import BatchJob, Map, Workflow

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
                        f"actions {bad} are granted on Resource '*'; only those in shardfold.orchestrator."
                        f"iam.WILDCARD_RESOURCE_ACTIONS may be: {sorted(WILDCARD_RESOURCE_ACTIONS)}"
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


# --- the stack's roles ------------------------------------------------------------------------------------

# The rule Step Functions' Batch .sync integration manages to hear of a job's end.
BATCH_EVENTS_RULE = "StepFunctionsGetEventsForBatchJobsRule"


def function_rights(function: str) -> frozenset[Right]:
    """The rights of a workflow function (a Lambda task or a Batch entry point): its kind's declaration;
    none for a function of no registered kind (a test's own handler): its job's folder only."""
    return kinds.rights_of(function.split(".", 1)[0])


def batch_rights(workflows: Mapping[str, Workflow]) -> frozenset[Right]:
    """The rights of the one Batch job role every container runs under: those of every kind with a
    ``BatchJob`` step."""
    out: set[Right] = set()
    for wf in workflows.values():
        for step in wf.walk():
            if isinstance(step, BatchJob):
                out |= function_rights(step.entry_point)
    return frozenset(out)


def worker_statements(
    partition: str,
    bucket: str,
    grants: Grants,
    rights: Iterable[Right],
    kms_key_arn: str | None = None,
) -> list[dict[str, Any]]:
    """S3 (and KMS) statements of a worker holding ``rights`` (:func:`functions.access.reach`). Reading the
    job bucket does not reach the budget ledgers without the ledger right: an explicit Deny, as the task's own
    check refuses them."""
    rights = frozenset(rights)
    read, write = access.reach(rights, grants, bucket)
    statements = s3_statements(partition, write, write=True, sid="Write")
    statements += s3_statements(partition, read, write=False, sid="Read")
    if Right.INPUTS in rights and Right.LEDGER not in rights:
        ledger = f"{bucket_arn(partition, bucket)}/{access.LEDGER_PREFIX}*"
        statements.append(statement(["s3:GetObject"], ledger, sid="NoLedger", effect="Deny"))
    key = kms_statement(kms_key_arn)
    if key:
        statements.append(key)
    return statements


def lambda_policy(
    log_group_arn: str, statements: Iterable[dict[str, Any]], *, tracing: bool
) -> dict[str, Any]:
    """A Lambda function's role policy: its own log group, ``statements``, and X-Ray when tracing."""
    return document(log_stream_statement(log_group_arn), *statements, xray_statement() if tracing else None)


def batch_job_statements(
    partition: str, bucket: str, grants: Grants, rights: Iterable[Right], kms_key_arn: str | None = None
) -> list[dict[str, Any]]:
    """The Batch containers' role: a worker's statements, and whether another Batch job has ended."""
    return [
        *worker_statements(partition, bucket, grants, rights, kms_key_arn),
        # Resource "*": DescribeJobs has no resource type (WILDCARD_RESOURCE_ACTIONS); a worker asks whether
        # the Batch job holding a shard's claim has ended.
        statement(["batch:DescribeJobs"], "*", sid="ClaimHolderAlive"),
    ]


def dispatch_statements(
    partition: str,
    bucket: str,
    *,
    state_machine_arns: list[str],
    dlq_arn: str | None,
    kms_key_arn: str | None,
    read_refs: Sequence[tuple[str, str]] = (),
) -> list[dict[str, Any]]:
    """The dispatch function submits a dropped spec as the SDK does: it reads specs and writes reports and
    job records under ``jobs/``, claims the job's outputs under ``claims/``, reads what the workers read
    (``read_refs``: submit's probe sizes a job from its inputs), starts the deployed state machines, and
    sends its failed events to the DLQ."""
    b = bucket_arn(partition, bucket)
    out = [
        statement(
            ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
            [f"{b}/{access.JOBS_PREFIX}*", f"{b}/{claims.CLAIMS_PREFIX}*"],
            sid="JobObjects",
        ),
        # HEAD of a missing report must answer 404, not 403.
        statement(["s3:ListBucket"], b, sid="JobList"),
        *s3_statements(partition, read_refs, write=False, sid="Read"),
        statement(["states:StartExecution"], sorted(state_machine_arns), sid="StartJobs"),
    ]
    if dlq_arn:
        out.append(statement(["sqs:SendMessage"], dlq_arn, sid="FailedEvents"))
    key = kms_statement(kms_key_arn)
    if key:
        out.append(key)
    return out


def state_machine_statements(
    workflow: Workflow,
    *,
    partition: str,
    region: str,
    account: str,
    name: str,
    bucket: str,
    function_arns: list[str],
    queue: str | None,
    definition_names: list[str],
    tracing: bool,
    kms_key_arn: str | None = None,
) -> list[dict[str, Any]]:
    """Every statement of the role of state machine ``name`` running ``workflow``: what its steps need
    (invoking its functions, a Distributed Map's children and work list, a BatchJob's queue and
    definitions), and its logs."""
    steps = list(workflow.walk())
    states = f"arn:{partition}:states:{region}:{account}"
    out: list[dict[str, Any]] = []
    if function_arns:
        out.append(
            statement(
                ["lambda:InvokeFunction"],
                [*function_arns, *(f"{a}:*" for a in function_arns)],
                sid="InvokeFunctions",
            )
        )
    if any(isinstance(s, Map) for s in steps):
        out += [
            statement(["states:StartExecution"], f"{states}:stateMachine:{name}", sid="MapStartChildren"),
            statement(
                ["states:DescribeExecution", "states:StopExecution"],
                [f"{states}:execution:{name}:*", f"{states}:execution:{name}/*"],
                sid="MapManageChildren",
            ),
            # Redriving the parent redrives a Map Run's failed children (execution:<name>/<label>:<id>).
            statement(["states:RedriveExecution"], f"{states}:execution:{name}/*", sid="MapRedriveChildren"),
            # The ItemReader loads the work list the plan step wrote under jobs/<id>/.
            statement(["s3:GetObject"], f"{bucket_arn(partition, bucket)}/jobs/*", sid="MapReadManifest"),
        ]
        key = kms_statement(kms_key_arn)  # the work list is encrypted with the bucket's key
        if key:
            out.append(key)
    if any(isinstance(s, BatchJob) for s in steps):
        if not queue:
            raise ShardfoldError(f"workflow {workflow.kind!r} has a BatchJob but the stack has no GPU queue")
        batch = f"arn:{partition}:batch:{region}:{account}"
        definitions = [f"{batch}:job-definition/{n}" for n in definition_names]
        out += [
            statement(
                ["batch:SubmitJob"],
                [queue, *definitions, *(f"{d}:*" for d in definitions)],
                sid="BatchSubmit",
            ),
            statement(["batch:TerminateJob"], f"{batch}:job/*", sid="BatchTerminate"),
            # Resource "*": DescribeJobs has no resource type (WILDCARD_RESOURCE_ACTIONS); .sync polls it.
            statement(["batch:DescribeJobs"], "*", sid="BatchDescribe"),
            statement(
                ["events:PutTargets", "events:PutRule", "events:DescribeRule"],
                f"arn:{partition}:events:{region}:{account}:rule/{BATCH_EVENTS_RULE}",
                sid="BatchSyncRule",
            ),
        ]
    out.append(sfn_log_delivery_statement())
    if tracing:
        out.append(xray_statement())
    return out
