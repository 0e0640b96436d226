"""Compile a :class:`~functions.workflow.Workflow` to Amazon States Language, and validate ASL.

The output is JSONPath ASL for a Standard state machine (moto's interpreter cannot evaluate JSONata, and
tests run the compiled ASL there). Shapes, and why:

* Task -> ``"Resource": <function ARN>`` (the Lambda integration's legacy form). Its result is the
  function's payload itself, so ``ResultPath: $.<name>`` gives exactly the plan's data-flow rule;
  ``arn:aws:states:::lambda:invoke`` would wrap it in ``{"Payload": ...}``. AWS and moto run both forms,
  and the Lambda.* error names are the same.
* Map -> Distributed Map (``ProcessorConfig: DISTRIBUTED``, ``STANDARD`` children) reading the work list
  with ``ItemReader`` ``arn:aws:states:::s3:getObject`` (``InputType: JSON``; bucket and key from the
  work-list reference in the state), children built by ``ItemSelector`` from ``$$.Map.Item.Value``/``Index``,
  ``ResultPath: null`` so no child output ever comes back into the state. A Distributed Map still gathers
  every child's output into its result, and that result must fit the 256 KiB payload limit even under
  ``ResultPath: null`` (aws-cdk#24799), so each child's last state has ``OutputPath: null`` (its output is
  ``{}``: 3 bytes a child) and a work list holds at most ``functions.worklist.MAX_MAP_ITEMS`` items.
* A polling Task -> the Task, then a Choice ``<name>-ready`` (``$.<name>.ready`` true: on to the next step)
  whose default is a Wait ``<name>-wait`` of ``SecondsPath: $.<name>.wait_s`` back to the Task. The wait
  is the state machine's, not a running Lambda's.
* BatchJob -> ``arn:aws:states:::batch:submitJob.sync``; the state travels to the container as
  ``SHARDFOLD_EVENT`` (``States.JsonToString($)``) and ``functions.container`` calls the handler.
* Every step retries per its plan and catches ``States.ALL`` into a Fail state whose cause names the step
  (and the item, inside a Map), so a failed job fails cleanly with a readable error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from shardfold.functions.errors import PlanError
from shardfold.functions.workflow import (
    BATCH_ATTEMPTS,
    BatchJob,
    Map,
    Parallel,
    Retry,
    Step,
    Task,
    Workflow,
    selectable,
)
from shardfold.orchestrator.registry import handler_path, job_definition_name, lambda_name, name_prefix

BATCH_SYNC = "arn:aws:states:::batch:submitJob.sync"
S3_GET_OBJECT = "arn:aws:states:::s3:getObject"


class Resolver(Protocol):
    """Supplies the ARNs a compiled workflow calls."""

    def function_arn(self, function: str) -> str: ...

    def batch_job_queue(self, step: BatchJob) -> str: ...

    def batch_job_definition(self, step: BatchJob) -> str: ...


@dataclass(frozen=True)
class NamingResolver:
    """ARNs derived from the naming scheme (``registry.lambda_name``): for ``shardfold asl``, linting, and
    any stack that names its resources the same way."""

    region: str = "us-east-1"
    account: str = "123456789012"
    stage: str = "dev"
    partition: str = "aws"

    def function_arn(self, function: str) -> str:
        name = lambda_name(function, self.stage)
        return f"arn:{self.partition}:lambda:{self.region}:{self.account}:function:{name}"

    def batch_job_queue(self, step: BatchJob) -> str:
        return f"arn:{self.partition}:batch:{self.region}:{self.account}:job-queue/{name_prefix(self.stage)}"

    def batch_job_definition(self, step: BatchJob) -> str:
        name = job_definition_name(step.entry_point, self.stage)
        return f"arn:{self.partition}:batch:{self.region}:{self.account}:job-definition/{name}"


@dataclass(frozen=True)
class StackResolver:
    """ARNs from stack outputs: ``functions`` {function: ARN}, ``batch_job_queue``,
    ``batch_job_definitions`` {entry point: ARN}."""

    outputs: dict[str, Any] = field(hash=False)

    def function_arn(self, function: str) -> str:
        try:
            return self.outputs["functions"][function]
        except KeyError as exc:
            raise PlanError(f"the stack has no Lambda function for {function!r}; redeploy") from exc

    def batch_job_queue(self, step: BatchJob) -> str:
        queue = self.outputs.get("batch_job_queue")
        if not queue:
            raise PlanError(f"BatchJob {step.name!r} needs a Batch job queue and the stack has none")
        return queue

    def batch_job_definition(self, step: BatchJob) -> str:
        try:
            return self.outputs["batch_job_definitions"][step.entry_point]
        except KeyError as exc:
            raise PlanError(f"the stack has no Batch job definition for {step.entry_point!r}") from exc


def compile_workflow(workflow: Workflow, resolver: Resolver | None = None) -> dict[str, Any]:
    """The ASL definition (a dict; ``json.dumps`` it for the API) of ``workflow``."""
    compiler = _Compiler(resolver or NamingResolver())
    states, start = compiler.chain(workflow.steps, in_map=False, on_failure=workflow.on_failure)
    comment = workflow.comment or f"Shardfold {workflow.kind} job (generated by shardfold.orchestrator.asl)"
    return {"Comment": comment, "StartAt": start, "States": states}


def fail_state_name(step: str) -> str:
    # '-' never occurs in a step name, so this cannot collide with one.
    return f"{step}-failed"


def poll_state_names(step: str) -> tuple[str, str]:
    """The Choice and the Wait of a polling Task (``-``: no step's name)."""
    return f"{step}-ready", f"{step}-wait"


@dataclass
class _Compiler:
    resolver: Resolver

    def chain(
        self, steps: tuple[Step, ...], in_map: bool, map_body: bool = False, on_failure: Task | None = None
    ) -> tuple[dict[str, Any], str]:
        states: dict[str, Any] = {}
        for i, step in enumerate(steps):
            nxt = steps[i + 1].name if i + 1 < len(steps) else None
            state = self.state(step, in_map)
            state.update({"Next": nxt} if nxt else {"End": True})
            if map_body and not nxt:
                # A Map child's output is its last state's; Distributed Map gathers every child's output
                # into the Map's result, which must fit 256 KiB even under ResultPath null. OutputPath
                # null makes each child's output {}.
                state["OutputPath"] = None
            states[step.name] = state
            if isinstance(step, Task) and step.poll:
                states.update(self.poll_states(step, state))
            states[fail_state_name(step.name)] = self.fail(step, in_map)
            if on_failure is not None:  # the Catch passes through the workflow's on_failure task first
                state["Catch"][0]["Next"] = cleanup = f"{step.name}-{on_failure.name}"
                states[cleanup] = self.on_failure(on_failure, fail_state_name(step.name))
        return states, steps[0].name

    def poll_states(self, step: Task, state: dict[str, Any]) -> dict[str, Any]:
        """The Choice and Wait after a polling Task: the Task's own ``Next`` becomes the Choice's ready
        branch; where the Task ended its chain, a Succeed state does (with a Map child's ``OutputPath``)."""
        ready, wait = poll_state_names(step.name)
        out: dict[str, Any] = {}
        then = state.pop("Next", None)
        if then is None:
            del state["End"]
            then = f"{step.name}-done"
            out[then] = {"Type": "Succeed"}
            if "OutputPath" in state:
                out[then]["OutputPath"] = state.pop("OutputPath")
        state["Next"] = ready
        out[ready] = {
            "Type": "Choice",
            "Choices": [{"Variable": f"$.{step.name}.ready", "BooleanEquals": True, "Next": then}],
            "Default": wait,
        }
        out[wait] = {"Type": "Wait", "SecondsPath": f"$.{step.name}.wait_s", "Next": step.name}
        return out

    def on_failure(self, task: Task, fail: str) -> dict[str, Any]:
        """The workflow's on_failure task before a Fail state: it keeps the caught ``$.error`` (ResultPath
        null) for the Fail state's cause, and its own failure goes on to the same Fail state."""
        state: dict[str, Any] = {
            "Type": "Task",
            "Resource": self.resolver.function_arn(task.function),
            "TimeoutSeconds": lambda_state_timeout(task),
            "ResultPath": None,
            "Catch": [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.on_failure_error", "Next": fail}],
            "Next": fail,
        }
        if task.retry:
            state["Retry"] = [retry_entry(r) for r in task.retry]
        return state

    def state(self, step: Step, in_map: bool) -> dict[str, Any]:
        if isinstance(step, Task):
            state: dict[str, Any] = {
                "Type": "Task",
                "Resource": self.resolver.function_arn(step.function),
                "TimeoutSeconds": lambda_state_timeout(step),
                "ResultPath": f"$.{step.name}",
            }
        elif isinstance(step, BatchJob):
            state = {
                "Type": "Task",
                "Resource": BATCH_SYNC,
                "Parameters": self.batch_parameters(step, in_map),
                "TimeoutSeconds": batch_state_timeout(step),
                "ResultPath": None,
            }
        elif isinstance(step, Map):
            state = self.map_state(step)
        else:
            state = self.parallel_state(step, in_map)
        retry = getattr(step, "retry", ())
        if retry:
            state["Retry"] = [retry_entry(r) for r in retry]
        state["Catch"] = [
            {"ErrorEquals": ["States.ALL"], "ResultPath": "$.error", "Next": fail_state_name(step.name)}
        ]
        return state

    def fail(self, step: Step, in_map: bool) -> dict[str, Any]:
        # The error is the project's own name (a Fail state may not pass on a States.* name: LocalStack
        # refuses it); the caught error's name goes into the cause, where the executors read it back.
        if isinstance(step, Parallel):
            cause = "$.error.Cause"  # a branch's own Fail state already named the step, item and error
        elif in_map:
            cause = (
                f"States.Format('step {step.name} (item {{}}) failed: {{}}: {{}}', $.index, $.error.Error, "
                "$.error.Cause)"
            )
        else:
            cause = f"States.Format('step {step.name} failed: {{}}: {{}}', $.error.Error, $.error.Cause)"
        return {"Type": "Fail", "Error": STEP_FAILED, "CausePath": cause}

    def map_state(self, step: Map) -> dict[str, Any]:
        states, start = self.chain(step.body, in_map=True, map_body=True)
        state: dict[str, Any] = {
            "Type": "Map",
            "ItemReader": {
                "Resource": S3_GET_OBJECT,
                "ReaderConfig": {"InputType": "JSON"},
                "Parameters": {"Bucket.$": f"{step.items}.bucket", "Key.$": f"{step.items}.key"},
            },
            "ItemSelector": {
                "job_id.$": "$.job_id",
                "spec_uri.$": "$.spec_uri",
                "store_root.$": "$.store_root",
                "item.$": "$$.Map.Item.Value",
                "index.$": "$$.Map.Item.Index",
                "map": step.name,
            },
            "ItemProcessor": {
                "ProcessorConfig": {"Mode": "DISTRIBUTED", "ExecutionType": "STANDARD"},
                "StartAt": start,
                "States": states,
            },
            # the Map Run's ARN carries the label, so a run listed before its history event is named by step
            "Label": step.name,
            "ResultPath": None,
        }
        if step.max_concurrency:
            state["MaxConcurrency"] = step.max_concurrency
        if step.tolerance() is not None:
            # A float: moto (5.2.5) rejects an integer here, AWS accepts either.
            state["ToleratedFailurePercentage"] = step.tolerance()
        return state

    def parallel_state(self, step: Parallel, in_map: bool) -> dict[str, Any]:
        branches = []
        selector: dict[str, str] = {}
        for i, branch in enumerate(step.branches):
            states, start = self.chain(branch, in_map)
            branches.append({"StartAt": start, "States": states})
            for name in selectable(branch):
                selector[f"{name}.$"] = f"$[{i}].{name}"
        state: dict[str, Any] = {"Type": "Parallel", "Branches": branches}
        if selector:
            state["ResultSelector"] = selector
            state["ResultPath"] = f"$.{step.name}"
        else:
            state["ResultPath"] = None
        return state

    def batch_parameters(self, step: BatchJob, in_map: bool) -> dict[str, Any]:
        if in_map:
            job_name = f"States.Format('{{}}-{step.name}-{{}}', $.job_id, $.index)"
        else:
            job_name = f"States.Format('{{}}-{step.name}', $.job_id)"
        resources = [
            {"Type": "VCPU", "Value": str(step.vcpus)},
            {"Type": "MEMORY", "Value": str(step.memory_mb)},
        ]
        if step.gpus:
            resources.append({"Type": "GPU", "Value": str(step.gpus)})
        return {
            # The name starts with the job id: the AWS executor finds a job's Batch jobs by it to cancel them.
            "JobName.$": job_name,
            "JobQueue": self.resolver.batch_job_queue(step),
            "JobDefinition": self.resolver.batch_job_definition(step),
            "ContainerOverrides": {
                "Environment": [
                    {"Name": "SHARDFOLD_FUNCTION", "Value": step.entry_point},
                    {"Name": "SHARDFOLD_STEP", "Value": step.name},
                    {"Name": "SHARDFOLD_HANDLER", "Value": handler_path(step.entry_point)},
                    {"Name": "SHARDFOLD_EVENT", "Value.$": "States.JsonToString($)"},
                ],
                "ResourceRequirements": resources,
            },
            "Timeout": {"AttemptDurationSeconds": step.timeout_s},
        }


# The error of every Fail state (the failed step's own error name is the start of its cause).
STEP_FAILED = "Shardfold.StepFailed"
# A Lambda state outlives its function by this much: the function's own timeout ends a slow invocation first
# and names it (Sandbox.Timedout); the state's guards one whose answer never comes back.
LAMBDA_STATE_MARGIN_S = 60
# A Batch state waits for a place (the queue cancels a job RUNNABLE longer than runnableTimeoutSeconds, at
# most 86,400 s) and then for every attempt, each bounded by its AttemptDurationSeconds plus its start-up.
BATCH_RUNNABLE_MAX_S = 86_400
BATCH_STARTUP_S = 600


def lambda_state_timeout(step: Task) -> int:
    return step.timeout_s + LAMBDA_STATE_MARGIN_S


def batch_state_timeout(step: BatchJob) -> int:
    return BATCH_RUNNABLE_MAX_S + BATCH_ATTEMPTS * (step.timeout_s + BATCH_STARTUP_S)


def retry_entry(r: Retry) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "ErrorEquals": list(r.errors),
        "IntervalSeconds": r.interval_s,
        "MaxAttempts": r.max_attempts,
        "BackoffRate": float(r.backoff),
    }
    if r.max_delay_s is not None:
        entry["MaxDelaySeconds"] = r.max_delay_s
    if r.jitter:
        entry["JitterStrategy"] = "FULL"
    return entry


# --- validation -------------------------------------------------------------------------------------------

# statelint 3.1.0 predates parts of Distributed Map. Each entry: a problem it reports on valid ASL that AWS
# and moto accept. This table is the only allowance; anything else statelint reports fails validation.
STATELINT_FALSE_REPORTS: tuple[re.Pattern[str], ...] = (
    # ItemReader.ReaderConfig.InputType (JSON, CSV...), which Distributed Map requires for s3:getObject.
    re.compile(r'^Field "InputType" not allowed in .*\.ItemReader\.ReaderConfig$'),
    # statelint types ToleratedFailurePercentage as an integer; AWS takes any number in 0..100 and moto
    # (5.2.5) takes only a float, so a Map that sets it is emitted as a float. Only Maps that set a
    # tolerance hit this one (the built-in workflows do not).
    re.compile(r"\.ToleratedFailurePercentage is [-+0-9.eE]+ but should be an Integer$"),
    # A Map state's Label (Distributed Map; it names the Map Run in its ARN), which statelint 3.1.0 predates.
    re.compile(r'^Field "Label" not allowed in State Machine\.(States|.*\.States)\.[A-Za-z0-9_]+$'),
)


def lint(asl: dict[str, Any]) -> list[str]:
    """statelint's problems with ``asl``, less its known false reports."""
    from statelint.linter import Linter  # dev dependency: only linting needs it

    problems = Linter.validate(asl)
    return [p for p in problems if not any(rx.search(p) for rx in STATELINT_FALSE_REPORTS)]


def moto_check(asl: dict[str, Any]) -> None:
    """Parse ``asl`` with moto's ASL parser, the check moto's ``CreateStateMachine`` runs."""
    from moto.stepfunctions.parser.models import StepFunctionsParserBackend  # dev dependency

    try:
        StepFunctionsParserBackend._validate_definition(json.dumps(asl))
    except Exception as exc:  # moto raises its own InvalidDefinition
        raise PlanError(f"moto rejects the ASL: {getattr(exc, 'message', exc)}") from exc


def validate(asl: dict[str, Any]) -> None:
    """Raise :class:`PlanError` unless ``asl`` passes statelint (less its false reports) and moto's parser."""
    problems = lint(asl)
    if problems:
        raise PlanError("statelint rejects the ASL: " + "; ".join(problems))
    moto_check(asl)
