"""The bucket trigger: S3 "Object Created" for ``jobs/*.json`` -> EventBridge rule -> the dispatch function.

Event pattern (EventBridge's ``wildcard`` operator: ``*`` matches any run of characters, ``/`` included)::

    {"source": ["aws.s3"], "detail-type": ["Object Created"],
     "detail": {"bucket": {"name": [<bucket>]}, "object": {"key": [{"wildcard": "jobs/*.json"}]}}}

It matches every ``.json`` key under ``jobs/``: the specs users drop (``jobs/<name>.json``), but also the
dispatch reports beside them and the JSON records under ``jobs/<id>/`` (spec, status, work lists, result).
EventBridge cannot say "no further ``/``" (wildcards have no character classes, and several matchers on one
field are OR'ed), so the dispatch function drops those by key shape before reading anything
(``functions.trigger.ignore_reason``): a few millisecond invocations per job. The pattern still keeps
everything else (TAR fragments, parts, archives, user data: the bulk of the writes) from invoking it.

Delivery: EventBridge retries the target (``dispatchRetryAttempts``, ``dispatchMaxEventAgeSeconds``) and
then sends the event to the dead-letter queue; the function's own failures (after Lambda's two async
retries) go to the same queue through an on-failure destination. Messages stay ``dlqRetentionDays`` days;
re-drop the spec (or replay the message) to retry.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pulumi
import pulumi_aws as aws

from shardfold.functions import access
from shardfold.functions.access import Right
from shardfold.functions.trigger import SIZES_ENV
from shardfold.infra.context import Component, Context
from shardfold.infra.functions import FunctionSpec, LambdaCode, LambdaFunction, base_environment
from shardfold.orchestrator import iam

SPEC_KEY_WILDCARD = "jobs/*.json"
LAMBDA_ASYNC_RETRIES = 2


def event_pattern(bucket: str) -> dict[str, Any]:
    """The rule's pattern: S3 Object Created events for ``jobs/*.json`` in ``bucket``."""
    return {
        "source": ["aws.s3"],
        "detail-type": ["Object Created"],
        "detail": {
            "bucket": {"name": [bucket]},
            "object": {"key": [{"wildcard": SPEC_KEY_WILDCARD}]},
        },
    }


def sizes_env(sizes: Mapping[str, Any]) -> str:
    """The dispatch function's ``SHARDFOLD_SIZES``: what is deployed, for the plan check of a dropped spec;
    memory only (Lambda's environment is capped at 4 KB), the settings' names follow from the keys."""
    memory = {
        t: {k: {"memory_mb": v["memory_mb"]} for k, v in sizes[t].items()} for t in ("functions", "batch")
    }
    return json.dumps(memory, sort_keys=True, separators=(",", ":"))


def dlq_policy(queue_arn: str, rule_arn: str) -> dict[str, Any]:
    """EventBridge may send this rule's undeliverable events to the queue, nothing else may."""
    return iam.document(
        iam.statement(
            ["sqs:SendMessage"],
            queue_arn,
            sid="EventBridgeDeadLetters",
            principal={"Service": "events.amazonaws.com"},
            condition={"ArnEquals": {"aws:SourceArn": rule_arn}},
        )
    )


class Trigger(Component):
    """The DLQ, the dispatch function, the rule and its target."""

    def __init__(
        self,
        ctx: Context,
        spec: FunctionSpec,
        code: LambdaCode,
        bucket: pulumi.Output[str],
        state_machine_arns: Mapping[str, pulumi.Output[str]],
        sizes: Mapping[str, Any],
        depends_on: list[pulumi.Resource] | None = None,
    ):
        super().__init__("Trigger", f"{ctx.cfg.name_prefix}-trigger", ctx)
        cfg = ctx.cfg
        prefix = cfg.name_prefix
        self.dlq = aws.sqs.Queue(
            f"{prefix}-dispatch-dlq",
            name=f"{prefix}-dispatch-dlq",
            message_retention_seconds=cfg.dlq_retention_days * 86400,
            sqs_managed_sse_enabled=True,
            opts=self.child(),
        )
        kinds = sorted(state_machine_arns)
        env = dict(base_environment(cfg, bucket))
        env["SHARDFOLD_STATE_MACHINES"] = pulumi.Output.all(*(state_machine_arns[k] for k in kinds)).apply(
            lambda arns: json.dumps(dict(zip(kinds, arns, strict=True)), sort_keys=True)
        )
        env[SIZES_ENV] = sizes_env(sizes)

        def statements(partition: str, bucket_name: str, dlq_arn: str, *arns: str) -> list[dict[str, Any]]:
            return iam.dispatch_statements(
                partition,
                bucket_name,
                state_machine_arns=list(arns),
                dlq_arn=dlq_arn,
                kms_key_arn=cfg.kms_key_arn,
                read_refs=access.reach({Right.INPUTS}, cfg.grants(), bucket_name)[0],
            )

        self.function = LambdaFunction(
            ctx,
            spec,
            code,
            bucket,
            env,
            statements,
            extra=[self.dlq.arn, *(state_machine_arns[k] for k in kinds)],
            opts=self.child(),
        )
        aws.lambda_.FunctionEventInvokeConfig(
            f"{prefix}-dispatch-async",
            function_name=self.function.name,
            maximum_retry_attempts=LAMBDA_ASYNC_RETRIES,
            maximum_event_age_in_seconds=cfg.dispatch_max_event_age_seconds,
            destination_config=aws.lambda_.FunctionEventInvokeConfigDestinationConfigArgs(
                on_failure=aws.lambda_.FunctionEventInvokeConfigDestinationConfigOnFailureArgs(
                    destination=self.dlq.arn
                )
            ),
            opts=self.child(depends_on=[self.function.policy]),
        )
        self.rule = aws.cloudwatch.EventRule(
            f"{prefix}-job-specs",
            name=f"{prefix}-job-specs",
            description=f"Shardfold {cfg.stage}: a job spec dropped at jobs/<name>.json starts the job",
            event_pattern=bucket.apply(lambda b: json.dumps(event_pattern(b), sort_keys=True)),
            opts=self.child(depends_on=depends_on or []),
        )
        self.permission = aws.lambda_.Permission(
            f"{prefix}-dispatch-from-events",
            action="lambda:InvokeFunction",
            function=self.function.name,
            principal="events.amazonaws.com",
            source_arn=self.rule.arn,
            opts=self.child(),
        )
        aws.sqs.QueuePolicy(
            f"{prefix}-dispatch-dlq-policy",
            queue_url=self.dlq.url,
            policy=pulumi.Output.all(self.dlq.arn, self.rule.arn).apply(
                lambda v: iam.to_json(dlq_policy(v[0], v[1]))
            ),
            opts=self.child(),
        )
        self.target = aws.cloudwatch.EventTarget(
            f"{prefix}-job-specs-dispatch",
            rule=self.rule.name,
            arn=self.function.arn,
            retry_policy=aws.cloudwatch.EventTargetRetryPolicyArgs(
                maximum_retry_attempts=cfg.dispatch_retry_attempts,
                maximum_event_age_in_seconds=cfg.dispatch_max_event_age_seconds,
            ),
            dead_letter_config=aws.cloudwatch.EventTargetDeadLetterConfigArgs(arn=self.dlq.arn),
            opts=self.child(depends_on=[self.permission]),
        )
        self.register_outputs({"dispatch_function": self.function.arn})
