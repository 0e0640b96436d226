"""Step Functions: one Standard state machine per workflow, compiled by ``orchestrator.asl`` with the
deployed ARNs bound in, each with its own role and log group.

A state machine's role may:

* invoke exactly the functions its workflow calls (and their versions/aliases: ``<arn>:*``);
* for a Distributed Map: start executions of itself (the Map's children) and describe, stop and redrive
  those executions; read the work list the ``ItemReader`` loads (``s3:GetObject`` on ``jobs/*`` of the
  bucket);
* for a ``BatchJob``: submit jobs to the stack's queue with its job definitions, terminate and describe
  them, and manage the managed rule ``StepFunctionsGetEventsForBatchJobsRule`` that ``.sync`` relies on;
* deliver its logs (the CloudWatch Logs vended-delivery actions, which take no resource) and, with
  ``shardfold:tracing``, send X-Ray traces.

Logging is on for every state machine (``shardfold:sfnLogLevel``, ERROR by default: failures with their
cause; execution data is not logged, since it holds only references). The log group is under
``/aws/vendedlogs/states/``, the prefix AWS recommends so its resource policy stays small.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pulumi
import pulumi_aws as aws

from shardfold.functions.errors import ShardfoldError
from shardfold.functions.workflow import BatchJob, Workflow
from shardfold.infra.context import Component, Context, role_name_args
from shardfold.orchestrator import iam
from shardfold.orchestrator.asl import compile_workflow
from shardfold.orchestrator.registry import state_machine_name


class _Resolver:
    """An ``orchestrator.asl.Resolver`` over resolved ARNs (plain strings inside ``Output.apply``)."""

    def __init__(self, functions: Mapping[str, str], queue: str | None, definitions: Mapping[str, str]):
        self.functions = functions
        self.queue = queue
        self.definitions = definitions

    def function_arn(self, function: str) -> str:
        try:
            return self.functions[function]
        except KeyError as exc:
            raise ShardfoldError(f"no deployed Lambda function for {function!r}") from exc

    def batch_job_queue(self, step: BatchJob) -> str:
        if not self.queue:
            raise ShardfoldError(
                f"BatchJob {step.name!r} needs the GPU queue; it is off (shardfold:batch false)"
            )
        return self.queue

    def batch_job_definition(self, step: BatchJob) -> str:
        try:
            return self.definitions[step.entry_point]
        except KeyError as exc:
            raise ShardfoldError(f"no Batch job definition for {step.entry_point!r}") from exc


def definition_json(
    workflow: Workflow, functions: Mapping[str, str], queue: str | None, definitions: Mapping[str, str]
) -> str:
    """The state machine definition of ``workflow`` with these ARNs, as JSON."""
    asl = compile_workflow(workflow, _Resolver(functions, queue, definitions))
    return json.dumps(asl, sort_keys=True)


def workflow_functions(workflow: Workflow) -> list[str]:
    """Functions the workflow runs on Lambda (its Tasks; BatchJob entry points run in containers)."""
    out: list[str] = []
    for step in workflow.tasks():
        if step.function not in out:
            out.append(step.function)
    return out


class StateMachines(Component):
    """``arns``: ``{kind: Output[arn]}``; ``definitions``: ``{kind: Output[json]}``."""

    def __init__(
        self,
        ctx: Context,
        workflows: Mapping[str, Workflow],
        bucket: pulumi.Output[str],
        function_arns: Mapping[str, pulumi.Output[str]],
        queue: pulumi.Output[str] | None,
        job_definitions: Mapping[str, pulumi.Output[str]],
        job_definition_names: Mapping[str, str],
    ):
        super().__init__("StateMachines", f"{ctx.cfg.name_prefix}-workflows", ctx)
        cfg = ctx.cfg
        self.machines: dict[str, aws.sfn.StateMachine] = {}
        self.log_groups: dict[str, aws.cloudwatch.LogGroup] = {}
        self.definitions: dict[str, pulumi.Output[str]] = {}
        for kind, wf in workflows.items():
            name = state_machine_name(kind, cfg.stage)
            fns = workflow_functions(wf)
            entry_points = sorted({s.entry_point for s in wf.walk() if isinstance(s, BatchJob)})
            missing = [e for e in entry_points if e not in job_definitions]
            if missing:
                raise ShardfoldError(f"workflow {kind!r} needs Batch job definitions for {missing}")
            log_group = aws.cloudwatch.LogGroup(
                f"{name}-logs",
                name=f"/aws/vendedlogs/states/{name}",
                retention_in_days=cfg.log_retention_days,
                opts=self.child(),
            )
            # aws:SourceAccount: only Step Functions acting for this account may assume it (confused deputy).
            role = aws.iam.Role(
                f"{name}-role",
                **role_name_args(f"{name}-role"),
                assume_role_policy=ctx.account_id.apply(
                    lambda acct: iam.to_json(iam.assume_role("states.amazonaws.com", source_account=acct))
                ),
                description=f"Shardfold {cfg.stage}: state machine {kind}",
                opts=self.child(),
            )

            def policy(
                args: list[Any],
                wf: Workflow = wf,
                name: str = name,
                n_fns: int = len(fns),
                entry_points: list[str] = entry_points,
            ) -> str:
                partition, region, account, bucket_name, queue_arn, *arns = args
                return iam.to_json(
                    iam.document(
                        *iam.state_machine_statements(
                            wf,
                            partition=partition,
                            region=region,
                            account=account,
                            name=name,
                            bucket=bucket_name,
                            function_arns=arns[:n_fns],
                            queue=queue_arn,
                            definition_names=[job_definition_names[e] for e in entry_points],
                            tracing=cfg.tracing,
                            kms_key_arn=cfg.kms_key_arn,
                        )
                    )
                )

            role_policy = aws.iam.RolePolicy(
                f"{name}-policy",
                role=role.id,
                policy=pulumi.Output.all(
                    ctx.partition, ctx.region, ctx.account_id, bucket, queue, *(function_arns[f] for f in fns)
                ).apply(policy),
                opts=self.child(),
            )

            def definition(
                args: list[Any],
                wf: Workflow = wf,
                fns: list[str] = fns,
                entry_points: list[str] = entry_points,
            ) -> str:
                queue_arn, *rest = args
                arns = dict(zip(fns, rest[: len(fns)], strict=True))
                defs = dict(zip(entry_points, rest[len(fns) :], strict=True))
                return definition_json(wf, arns, queue_arn, defs)

            self.definitions[kind] = pulumi.Output.all(
                queue, *(function_arns[f] for f in fns), *(job_definitions[e] for e in entry_points)
            ).apply(definition)
            logging_config = aws.sfn.StateMachineLoggingConfigurationArgs(
                level=cfg.sfn_log_level,
                include_execution_data=False,
                log_destination=log_group.arn.apply(lambda arn: f"{arn}:*"),
            )
            self.machines[kind] = aws.sfn.StateMachine(
                name,
                name=name,
                type="STANDARD",
                role_arn=role.arn,
                definition=self.definitions[kind],
                logging_configuration=logging_config,
                tracing_configuration=aws.sfn.StateMachineTracingConfigurationArgs(enabled=cfg.tracing),
                # Step Functions checks the role's log delivery permissions when it creates the machine.
                opts=self.child(depends_on=[role_policy]),
            )
            self.log_groups[kind] = log_group
        self.arns = {kind: sm.arn for kind, sm in self.machines.items()}
        self.register_outputs({"state_machine_arns": self.arns})
