"""The moto harness itself: each patch fills one moto gap, and everything is undone on stop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import pytest
import toyflow
from botocore.exceptions import ClientError
from toyflow import fail_switch, toy_workflow, write_spec

from shardfold import dryrun
from shardfold.dryrun import MotoStack
from shardfold.functions import store
from shardfold.functions.jobs import new_job_id
from shardfold.functions.store.uri import join
from shardfold.functions.workflow import BatchJob, Map, Task, Workflow
from shardfold.orchestrator.aws import AwsExecutor
from shardfold.orchestrator.local import LocalExecutor
from shardfold.orchestrator.registry import register

pytestmark = pytest.mark.slow

WAIT_S = 120
HERE = Path(__file__).resolve().parent


def batch_fail(event, context):
    raise RuntimeError("gpu on fire")


def boom(event, context):
    raise KeyError("missing thing")


def half_big(event, context):
    return {"blob": "x" * 150_000}  # under the limit alone; two of them in the state are over it


WIDEST = {"threads": 0}  # the most threads alive while a toy.thread_count child ran


def thread_count(event, context):
    WIDEST["threads"] = max(WIDEST["threads"], threading.active_count())
    return {"i": event["index"]}


register("toy.half_big", f"{__name__}:half_big")
register("toy.thread_count", f"{__name__}:thread_count")
register("toy.batch_fail", f"{__name__}:batch_fail")
register("toy.boom", f"{__name__}:boom")

FLOWS = {
    "toy": toy_workflow(),
    "toytol": Workflow(
        "toytol",
        (
            Task("plan", "toy.plan"),
            Map(
                "squares", "$.plan.worklist", (Task("square", "toy.square"),), tolerated_failure_percentage=25
            ),
            Task("total", "toy.total"),
        ),
    ),
    "toybatch": Workflow("toybatch", (BatchJob("gpu", "toy.batch_fail", timeout_s=60),)),
    "toyboom": Workflow("toyboom", (Task("boom", "toy.boom"),)),
    "toyscrub": toyflow.toy_scrubbed(),
    "toypoll": toyflow.polled(),
    "toypolllast": toyflow.polled(last=True),
    "toybig": Workflow("toybig", (Task("a", "toy.half_big"), Task("b", "toy.half_big"))),
    # no MaxConcurrency: moto would start a thread per child
    "toywide": Workflow(
        "toywide",
        (Task("plan", "toy.plan"), Map("wide", "$.plan.worklist", (Task("count", "toy.thread_count"),))),
    ),
}


_STOP_UNDOES_EVERYTHING = """
import os
import pytest
from moto.awslambda_simple.models import LambdaSimpleBackend
from moto.stepfunctions.responses import StepFunctionResponse
from toyflow import toy_workflow
from shardfold import dryrun
from shardfold.dryrun import MotoStack
from shardfold.functions.errors import ShardfoldError

before_invoke = LambdaSimpleBackend.invoke
before_env = os.environ.get("AWS_ENDPOINT_URL")
with MotoStack({"toy": toy_workflow()}) as stack:
    assert os.environ["AWS_ENDPOINT_URL"] == stack.endpoint_url
    assert LambdaSimpleBackend.invoke is not before_invoke
    assert hasattr(StepFunctionResponse, "redrive_execution")
    with pytest.raises(ShardfoldError, match="already running"):
        MotoStack({"toy": toy_workflow()}).start()
assert LambdaSimpleBackend.invoke is before_invoke
assert not hasattr(StepFunctionResponse, "redrive_execution")
assert os.environ.get("AWS_ENDPOINT_URL") == before_env
assert dryrun._active is None and not dryrun._originals
"""


def test_stop_undoes_everything(tmp_path):
    """A stack's lifetime leaves no trace in the process: checked in a fresh interpreter, since this module's
    own stack (a module fixture) may already run in this one, whatever order the workers take tests in."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env["SHARDFOLD_HOME"] = str(tmp_path / "home")
    done = subprocess.run(
        [sys.executable, "-c", _STOP_UNDOES_EVERYTHING], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def stack():
    with MotoStack(FLOWS) as s:
        yield s


@pytest.fixture
def aws(stack) -> AwsExecutor:
    return AwsExecutor(stack.outputs, FLOWS)


def test_stack_outputs(stack):
    out = stack.outputs
    assert out["backend"] == "moto" and out["bucket"] == "shardfold-moto"
    assert set(out["state_machine_arns"]) == set(FLOWS)
    assert set(out["functions"]) == {
        "toy.plan",
        "toy.square",
        "toy.total",
        "toy.boom",
        "toy.half_big",
        "toy.thread_count",
        "toy.scrub",
        "toy.look",
        "toy.stamp",
    }
    assert out["batch_job_definitions"].keys() == {"toy.batch_fail"}
    sfn = boto3.client("stepfunctions", region_name=out["region"])
    definition = json.loads(
        sfn.describe_state_machine(stateMachineArn=out["state_machine_arns"]["toy"])["definition"]
    )
    assert definition["States"]["squares"]["ItemReader"]["ReaderConfig"] == {
        "InputType": "JSON"
    }  # ASL unchanged


def test_stack_outputs_list_the_deployed_sizes(stack):
    from shardfold.client.stack import deployed_sizes

    sizes = stack.outputs["sizes"]
    assert set(sizes["functions"]) == set(stack.outputs["functions"])  # no dispatch function in moto
    lam = boto3.client("lambda", region_name=stack.region)
    for function, size in sizes["functions"].items():
        conf = lam.get_function_configuration(FunctionName=stack.outputs["function_names"][function])
        assert (conf["MemorySize"], conf["EphemeralStorage"]["Size"], conf["Timeout"]) == (
            size["memory_mb"],
            size["ephemeral_mb"],
            size["timeout_s"],
        )
    assert sizes["functions"]["toy.plan"]["config"]["memory_mb"] == 'shardfold:functionMemory["toy.plan"]'
    assert sizes["batch"] == {
        "toy.batch_fail": {
            "vcpus": 4,
            "memory_mb": 16384,
            "gpus": 0,
            "timeout_s": 60,
            "config": {
                "vcpus": 'shardfold:batchVcpus["toy.batch_fail"]',
                "memory_mb": 'shardfold:batchMemory["toy.batch_fail"]',
                "gpus": 'shardfold:batchGpus["toy.batch_fail"]',
                "timeout_s": 'shardfold:batchTimeout["toy.batch_fail"]',
            },
        }
    }
    batch = boto3.client("batch", region_name=stack.region)
    arn = stack.outputs["batch_job_definitions"]["toy.batch_fail"]
    (jd,) = batch.describe_job_definitions(jobDefinitions=[arn])["jobDefinitions"]
    reqs = {r["type"]: r["value"] for r in jd["containerProperties"]["resourceRequirements"]}
    assert reqs == {"VCPU": "4", "MEMORY": "16384"} and jd["timeout"]["attemptDurationSeconds"] == 60
    assert deployed_sizes(stack.outputs).of("toy.batch_fail").timeout_s == 60


def test_sizes_are_the_largest_any_step_asks_for():
    flows = {
        "sizes": Workflow(
            "sizes",
            (
                Task("small", "toy.plan", memory_mb=256, timeout_s=600),
                Task("big", "toy.plan", memory_mb=3008, timeout_s=30),
                BatchJob("wide", "toy.batch_fail", vcpus=8, memory_mb=2048, gpus=1, timeout_s=60),
                BatchJob("long", "toy.batch_fail", vcpus=2, memory_mb=4096, timeout_s=7200),
            ),
        )
    }
    sizes = dryrun.stack_sizes(flows)
    plan = sizes["functions"]["toy.plan"]
    assert (plan["memory_mb"], plan["ephemeral_mb"], plan["timeout_s"]) == (3008, 512, 600)
    job = sizes["batch"]["toy.batch_fail"]
    assert (job["vcpus"], job["memory_mb"], job["gpus"], job["timeout_s"]) == (8, 4096, 1, 7200)
    assert dryrun.stack_sizes(flows, batch=False)["batch"] == {}


def test_lambda_invoke_runs_the_registered_handler(stack, aws):
    lam = boto3.client("lambda", region_name=stack.region)
    root = aws.store_root
    job_id = new_job_id("toy")
    event = {"job_id": job_id, "spec_uri": write_spec(root, job_id, n=3), "store_root": root}
    resp = lam.invoke(FunctionName=stack.outputs["function_names"]["toy.plan"], Payload=json.dumps(event))
    assert "FunctionError" not in resp
    assert json.loads(resp["Payload"].read())["worklist"]["count"] == 3
    resp = lam.invoke(FunctionName=stack.outputs["functions"]["toy.boom"], Payload=b"{}")  # by ARN too
    assert resp["FunctionError"] == "Unhandled"
    payload = json.loads(resp["Payload"].read())
    assert payload["errorType"] == "KeyError" and payload["errorMessage"] == "'missing thing'"
    with pytest.raises(ClientError):
        lam.invoke(FunctionName="shardfold-moto-not-there", Payload=b"{}")


def test_failed_children_fail_the_map_and_are_listed_like_aws(aws):
    sfn = aws._sfn
    root = aws.store_root
    job_id = new_job_id("toy")
    spec = write_spec(root, job_id, n=5, fail=[1, 3])
    fail_switch(root, job_id, True)
    aws.start(job_id, "toy", spec)
    status = aws.wait(job_id, timeout_s=WAIT_S)
    assert status.state == "FAILED"
    assert status.error == "step square (item 1) failed: ValueError: item 1 is bad"  # the lowest failed item
    desc = sfn.describe_execution(executionArn=status.execution_arn)
    # the Fail state's own error name (never a States.* one); the caught error starts the cause
    assert desc["error"] == "Shardfold.StepFailed"
    assert desc["cause"].startswith(
        "step squares failed: States.ExceedToleratedFailureThreshold: The specified tolerated failure"
    )
    (run,) = sfn.list_map_runs(executionArn=status.execution_arn)["mapRuns"]
    assert sfn.describe_map_run(mapRunArn=run["mapRunArn"])["itemCounts"]["failed"] == 2
    failed = sfn.list_executions(mapRunArn=run["mapRunArn"], statusFilter="FAILED")["executions"]
    assert len(failed) == 2
    child = sfn.describe_execution(executionArn=failed[0]["executionArn"])
    assert child["status"] == "FAILED" and child["error"] == "Shardfold.StepFailed"
    assert json.loads(child["input"])["index"] == 1
    assert child["cause"].startswith("step square (item 1) failed: ValueError: {")
    assert len(sfn.list_executions(mapRunArn=run["mapRunArn"], statusFilter="SUCCEEDED")["executions"]) == 3


def test_tolerated_failures_pass_on_both_backends(tmp_path, aws):
    root = aws.store_root
    job_id = new_job_id("toytol")
    spec = write_spec(root, job_id, n=4, fail=[2])  # 1 of 4 = 25%: tolerated
    fail_switch(root, job_id, True)
    aws.start(job_id, "toytol", spec)
    assert aws.wait(job_id, timeout_s=WAIT_S).state == "SUCCEEDED"

    local_root = f"file://{tmp_path}"
    with LocalExecutor(store_root=local_root, workflows=FLOWS, retry_delay_scale=0) as local:
        lid = new_job_id("toytol")
        spec = write_spec(local_root, lid, n=4, fail=[2])
        fail_switch(local_root, lid, True)
        local.start(lid, "toytol", spec)
        assert local.wait(lid, timeout_s=WAIT_S).state == "SUCCEEDED"
        for r in (local_root, root):  # and 2 of 4 is not
            j = new_job_id("toytol")
            spec = write_spec(r, j, n=4, fail=[1, 2])
            fail_switch(r, j, True)
            ex = local if r == local_root else aws
            ex.start(j, "toytol", spec)
            assert (
                ex.wait(j, timeout_s=WAIT_S).error == "step square (item 1) failed: ValueError: item 1 is bad"
            )


@pytest.mark.parametrize("backend", ["local", "moto"])
def test_batch_sync_runs_the_worker_in_process(tmp_path, aws, backend):
    local = LocalExecutor(f"file://{tmp_path}", FLOWS, retry_delay_scale=0)
    ex, root = (aws, aws.store_root) if backend == "moto" else (local, f"file://{tmp_path}")
    job_id = new_job_id("toybatch")
    with local:
        ex.start(job_id, "toybatch", write_spec(root, job_id, n=1))
        status = ex.wait(job_id, timeout_s=WAIT_S)
    assert status.error == "step gpu failed: States.TaskFailed: RuntimeError: gpu on fire"
    if backend == "moto":
        cause = aws._sfn.describe_execution(executionArn=status.execution_arn)["cause"]
        error, _, described = cause.partition(" failed: ")[2].partition(": ")
        described = json.loads(described)  # the .sync result: the job, PascalCase
        assert error == "States.TaskFailed"
        assert described["JobName"] == f"{job_id}-gpu" and described["Status"] == "FAILED"


def test_top_level_task_failure_reads_well(aws):
    job_id = new_job_id("toyboom")
    aws.start(job_id, "toyboom", write_spec(aws.store_root, job_id, n=1))
    assert aws.wait(job_id, timeout_s=WAIT_S).error == "step boom failed: KeyError: 'missing thing'"


def test_redrive_is_refused_cleanly(aws):
    sfn = aws._sfn
    job_id = new_job_id("toy")
    aws.start(job_id, "toy", write_spec(aws.store_root, job_id, n=1))
    status = aws.wait(job_id, timeout_s=WAIT_S)
    t0 = time.monotonic()
    with pytest.raises(ClientError) as err:
        sfn.redrive_execution(executionArn=status.execution_arn)
    assert err.value.response["Error"]["Code"] == "ExecutionNotRedrivable"
    assert err.value.response["ResponseMetadata"]["RetryAttempts"] == 0  # a 400, so nothing was retried
    assert time.monotonic() - t0 < WAIT_S


def test_definite_json_paths_yield_the_node(stack):
    from moto.stepfunctions.parser.asl.component.common.string import string_expression
    from moto.stepfunctions.parser.asl.utils import json_path

    data = [{"a": 1}, {"stamp": {"job": "x"}, "list": [5, 6]}]
    for fn in (json_path.extract_json, string_expression.extract_json):
        assert fn("$[1].stamp", data) == {"job": "x"}
        assert fn("$[1].list[0]", data) == 5
        assert fn("$[0]", data) == {"a": 1}
        assert fn("$[*].a", data) == [1]  # non-definite paths keep moto's behaviour
        with pytest.raises(json_path.NoSuchJsonPathError):
            fn("$[5].a", data)


def test_a_map_run_is_named_by_its_step_even_before_its_history_event(aws, monkeypatch):
    """The Map state's Label is the step's name, so the Map Run's ARN names the step; a run listed before
    the history shows its MapRunStarted event is counted under that step, never under a UUID."""
    from shardfold.orchestrator.aws import map_run_label

    root = aws.store_root
    job_id = new_job_id("toy")
    spec = write_spec(root, job_id, n=4)
    aws.start(job_id, "toy", spec)
    status = aws.wait(job_id, timeout_s=WAIT_S)
    assert status.state == "SUCCEEDED", status.error
    (run,) = aws._sfn.list_map_runs(executionArn=status.execution_arn)["mapRuns"]
    assert map_run_label(run["mapRunArn"]) == "squares"
    history = aws._history
    monkeypatch.setattr(
        aws, "_history", lambda arn: [e for e in history(arn) if e["type"] != "MapRunStarted"]
    )
    steps = aws._steps("toy", status.execution_arn)
    assert set(steps) == {"plan", "squares", "total"} and steps["squares"] == {"done": 4, "total": 4}


def test_a_state_output_over_256_kib_fails_the_execution(aws):
    """Step b's output (two 150 KB results) is over 256 KiB: States.DataLimitExceeded, which the step's
    Catch of States.ALL does not match (a terminal error on AWS), so the execution itself fails with it."""
    job_id = new_job_id("toybig")
    aws.start(job_id, "toybig", write_spec(aws.store_root, job_id, n=1))
    status = aws.wait(job_id, timeout_s=WAIT_S)
    assert status.state == "FAILED"
    desc = aws._sfn.describe_execution(executionArn=status.execution_arn)
    assert desc["error"] == "States.DataLimitExceeded", desc
    assert "size exceeding" in desc["cause"]


def _run_raw(stack, name: str, definition: dict, payload: dict) -> dict:
    sfn = boto3.client("stepfunctions", region_name=stack.region)
    role = f"arn:aws:iam::{dryrun.ACCOUNT}:role/shardfold-{stack.stage}"
    arn = sfn.create_state_machine(name=name, definition=json.dumps(definition), roleArn=role)[
        "stateMachineArn"
    ]
    ex = sfn.start_execution(stateMachineArn=arn, input=json.dumps(payload))["executionArn"]
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        desc = sfn.describe_execution(executionArn=ex)
        if desc["status"] != "RUNNING":
            return desc
        time.sleep(0.2)
    raise AssertionError("the execution did not finish")


def _gathering_map(catch: bool) -> dict:
    state = {
        "Type": "Map",
        "ItemsPath": "$.items",
        "ItemSelector": {"blob.$": "$.blob"},
        "ItemProcessor": {
            "ProcessorConfig": {"Mode": "DISTRIBUTED", "ExecutionType": "STANDARD"},
            "StartAt": "echo",
            "States": {"echo": {"Type": "Pass", "End": True}},
        },
        "ResultPath": None,
        "End": True,
    }
    if catch:
        state["Catch"] = [{"ErrorEquals": ["States.ALL"], "Next": "caught"}]
    return {"StartAt": "m", "States": {"m": state, "caught": {"Type": "Succeed"}}}


@pytest.mark.parametrize("catch", [False, True])
def test_a_maps_gathered_result_counts_even_under_result_path_null(stack, catch):
    """Three children each output a 90 KB blob: 270 KB gathered, over 256 KiB, and ResultPath null does not
    save the Map (aws-cdk#24799); States.ALL does not catch it."""
    desc = _run_raw(
        stack, f"gather-{catch}", _gathering_map(catch), {"items": [1, 2, 3], "blob": "x" * 90_000}
    )
    assert desc["status"] == "FAILED" and desc["error"] == "States.DataLimitExceeded", desc
    assert dryrun.gathered_results(desc["executionArn"])["m"]["bytes"] > 256 * 1024
    # two children (180 KB) fit
    desc = _run_raw(stack, f"gather2-{catch}", _gathering_map(catch), {"items": [1, 2], "blob": "x" * 90_000})
    assert desc["status"] == "SUCCEEDED", desc
    size = len(json.dumps([{"blob": "x" * 90_000}] * 2))
    assert dryrun.gathered_results(desc["executionArn"]) == {"m": {"children": 2, "bytes": size}}


def test_a_state_input_over_256_kib_fails(stack):
    """A Pass state builds an input over the limit for the next state: States.DataLimitExceeded."""
    definition = {
        "StartAt": "twice",
        "States": {
            "twice": {"Type": "Pass", "Parameters": {"a.$": "$.blob", "b.$": "$.blob"}, "Next": "last"},
            "last": {"Type": "Pass", "End": True},
        },
    }
    desc = _run_raw(stack, "input-big", definition, {"blob": "x" * 140_000})
    assert desc["status"] == "FAILED" and desc["error"] == "States.DataLimitExceeded", desc


def test_a_wide_map_runs_its_children_on_few_threads_and_never_recurses(aws, monkeypatch):
    """moto's Map worker took each next child by recursing, a few frames per child (past ~970 children:
    RecursionError, the job never closed, the execution RUNNING for ever), and with no MaxConcurrency it
    started a thread per child. One worker thread (the harness's cap, lowered) runs 300 children: its stack
    is as deep at the last child as at the first, and the threads stay few."""
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.itemprocessor import (
        distributed_item_processor_worker as dipw,
    )

    Worker = dipw.DistributedItemProcessorWorker

    depths = []  # the worker thread's stack depth as it takes each child
    eval_job = Worker._eval_job

    def measured(self, *args, **kwargs):
        depth, frame = 0, sys._getframe()
        while frame is not None:
            depth, frame = depth + 1, frame.f_back
        depths.append(depth)
        return eval_job(self, *args, **kwargs)

    monkeypatch.setattr(Worker, "_eval_job", measured)
    monkeypatch.setattr(dryrun, "MAP_WORKER_THREADS", 1)
    WIDEST["threads"] = 0
    before = threading.active_count()
    job_id = new_job_id("toywide")
    aws.start(job_id, "toywide", write_spec(aws.store_root, job_id, n=300))
    status = aws.wait(job_id, timeout_s=WAIT_S)
    assert status.state == "SUCCEEDED", status.error
    assert status.steps["count"] == {"done": 300, "total": 300}  # the Map shows as its one task
    assert len(depths) == 300 and max(depths) == min(depths), (min(depths), max(depths))
    # each child outputs {} (its last state's OutputPath is null): the gathered result stays small
    gathered = dryrun.gathered_results(status.execution_arn)
    assert gathered == {"wide": {"children": 300, "bytes": len(json.dumps([{}] * 300))}}
    # the worker, its task's timeout thread, and the server's request threads (the executor polling)
    assert WIDEST["threads"] - before < 20, (before, WIDEST)


def test_a_task_calling_an_unknown_function_fails_through_motos_own_path(stack):
    """The harness calls our functions directly; any other function ARN still goes through moto's Invoke."""
    arn = f"arn:aws:lambda:{stack.region}:{dryrun.ACCOUNT}:function:shardfold-moto-not-there"
    definition = {"StartAt": "t", "States": {"t": {"Type": "Task", "Resource": arn, "End": True}}}
    desc = _run_raw(stack, "unknown-function", definition, {})
    assert desc["status"] == "FAILED", desc


def test_on_failure_runs_from_the_catch_and_the_job_fails_as_before(aws):
    """The compiled ASL passes every top-level step's Catch through the on_failure task, which sees the
    caught error; the Fail state's cause is unchanged."""
    job_id = new_job_id("toyscrub")
    toyflow.fail_switch(aws.store_root, job_id, True)
    aws.start(job_id, "toyscrub", write_spec(aws.store_root, job_id, n=3, fail=[1]))
    status = aws.wait(job_id, timeout_s=WAIT_S)
    assert status.state == "FAILED" and "item 1 is bad" in status.error, status.error
    seen = toyflow.scrubbed(aws.store_root, job_id)
    assert seen is not None and seen["error"]["Error"]  # handed the caught error (here the Map's)
    ok = new_job_id("toyscrub")
    aws.start(ok, "toyscrub", write_spec(aws.store_root, ok, n=2))
    assert (
        aws.wait(ok, timeout_s=WAIT_S).state == "SUCCEEDED" and toyflow.scrubbed(aws.store_root, ok) is None
    )


@pytest.mark.parametrize("kind", ["toypoll", "toypolllast"])
def test_a_polling_task_waits_between_calls_until_ready_on_both_backends(tmp_path, aws, kind):
    """The Task, its Choice and its Wait state on moto's interpreter; the executor's wait locally: the task
    is called until its result says ready, handed its last result each time, and the step shows done once."""
    runs = {}
    with LocalExecutor(f"file://{tmp_path}", FLOWS, retry_delay_scale=0) as local:
        for ex, root in ((aws, aws.store_root), (local, f"file://{tmp_path}")):
            job_id = new_job_id(kind)
            ex.start(job_id, kind, write_spec(root, job_id, looks=2))
            status = ex.wait(job_id, timeout_s=WAIT_S)
            looks = store.list_uris(join(root, "jobs", job_id, "toy", "looks") + "/")
            runs[ex is aws] = (status.state, status.steps, [u.rsplit("/", 1)[1][:3] for u in looks])
    assert runs[True] == runs[False]
    state, steps, looks = runs[True]
    assert state == "SUCCEEDED" and looks == ["001", "002"] and steps["look"] == {"done": 1, "total": 1}


def test_a_polling_step_shows_done_only_once_its_choice_lets_it_go_on():
    """The AWS executor's progress from the history: a look that was not ready is not the step's end."""
    ex = AwsExecutor.__new__(AwsExecutor)
    ex.workflows = FLOWS
    ex._map_runs = lambda arn: []
    history = []

    def happen(kind, name):
        details = "stateEnteredEventDetails" if kind.endswith("Entered") else "stateExitedEventDetails"
        history.append({"id": len(history) + 1, "type": kind, details: {"name": name}})

    ex._history = lambda arn: iter(history)
    happen("TaskStateEntered", "look")
    happen("TaskStateExited", "look")
    assert ex._steps("toypoll", "arn")["look"]["done"] == 0  # its Choice has not decided yet
    happen("ChoiceStateEntered", "look-ready")
    happen("ChoiceStateExited", "look-ready")
    happen("WaitStateEntered", "look-wait")
    assert ex._steps("toypoll", "arn")["look"]["done"] == 0
    for kind, name in [
        ("WaitStateExited", "look-wait"),
        ("TaskStateEntered", "look"),
        ("TaskStateExited", "look"),
    ]:
        happen(kind, name)
    assert ex._steps("toypoll", "arn")["look"]["done"] == 0
    happen("ChoiceStateEntered", "look-ready")
    happen("ChoiceStateExited", "look-ready")
    happen("TaskStateEntered", "stamp")
    assert ex._steps("toypoll", "arn") == {"look": {"done": 1, "total": 1}, "stamp": {"done": 0, "total": 1}}
