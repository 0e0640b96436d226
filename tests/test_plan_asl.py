"""Plan vocabulary, function registry and the ASL compiler/validator."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiers import examples
from toyflow import parts_workflow, polled, toy_workflow

from shardfold.functions.errors import PlanError
from shardfold.functions.kinds import WORKFLOWS
from shardfold.functions.workflow import (
    BATCH_ATTEMPTS,
    DEFAULT_TASK_RETRY,
    LAMBDA_THROTTLED,
    LAMBDA_TRANSIENT,
    BatchJob,
    Map,
    Parallel,
    Retry,
    Task,
    Workflow,
)
from shardfold.orchestrator import asl as asl_mod
from shardfold.orchestrator.asl import (
    BATCH_RUNNABLE_MAX_S,
    BATCH_STARTUP_S,
    BATCH_SYNC,
    LAMBDA_STATE_MARGIN_S,
    S3_GET_OBJECT,
    NamingResolver,
    StackResolver,
    compile_workflow,
    lint,
    moto_check,
    validate,
)
from shardfold.orchestrator.registry import handler_path, lambda_handler, lambda_name, register

TOYS = [toy_workflow(), toy_workflow(mode="process", batch=True), parts_workflow()]


# --- plan ---------------------------------------------------------------------------------------------------


def test_workflow_validation_names_the_problem():
    with pytest.raises(PlanError, match="used twice"):
        Workflow("x", (Task("a", "toy.plan"), Task("a", "toy.total")))
    with pytest.raises(PlanError, match="must be an identifier"):
        Workflow("x", (Task("a-b", "toy.plan"),))
    with pytest.raises(PlanError, match="reserved"):
        Workflow("x", (Task("item", "toy.plan"),))
    with pytest.raises(PlanError, match="must be a JSONPath"):
        Workflow("x", (Map("m", items="plan.worklist", body=(Task("t", "toy.square"),)),))
    with pytest.raises(PlanError, match="no steps"):
        Workflow("x", (Parallel("p", branches=((),)),))
    with pytest.raises(PlanError, match="lower-case"):
        Workflow("Bad", (Task("a", "toy.plan"),))
    with pytest.raises(PlanError, match="AWS Batch's minimum"):
        Workflow("x", (BatchJob("b", "toy.batch_double", timeout_s=10),))
    with pytest.raises(PlanError, match=r"lambda_package 'tar' must be one of \['zip', 'image'\]"):
        Workflow("x", (Task("a", "toy.plan"),), lambda_package="tar")  # type: ignore[arg-type]


def test_lambda_package_is_zip_unless_a_kind_says_image():
    assert Workflow("x", (Task("a", "toy.plan"),)).lambda_package == "zip"
    wf = Workflow("x", (Task("a", "toy.plan"),), lambda_package="image")
    assert wf.lambda_package == "image"
    # packaging is a deployment matter: the state machine is the same either way
    resolver = NamingResolver(region="eu-west-1", account="111122223333", stage="t")
    zipped = compile_workflow(Workflow("x", (Task("a", "toy.plan"),)), resolver)
    assert compile_workflow(wf, resolver) == zipped


def test_retry_never_matches_user_errors():
    with pytest.raises(PlanError, match="user errors must not be retried"):
        Retry(errors=("States.ALL",))
    with pytest.raises(PlanError, match="interval_s >= 1"):
        Retry(errors=("X",), interval_s=0)
    r = Retry(errors=("X",), interval_s=2, backoff=3.0, max_delay_s=10)
    assert [r.delay_s(n) for n in (1, 2, 3)] == [2, 6, 10]


def test_workflow_walk_and_functions():
    wf = parts_workflow()
    assert [s.name for s in wf.walk()] == ["plan", "fan", "parts", "part", "stamp", "total"]
    assert wf.functions() == ["toy.plan", "toy.square_part", "toy.stamp", "toy.total"]
    assert wf.step("stamp").function == "toy.stamp"


# --- registry -----------------------------------------------------------------------------------------------


def test_registry():
    assert handler_path("toy.plan").endswith(":plan")
    assert lambda_handler("toy.plan").endswith(".plan")
    assert lambda_name("getbatch.prepare", "dev") == "shardfold-dev-getbatch-prepare"
    with pytest.raises(PlanError, match="already registered"):
        register("toy.plan", "somewhere.else:plan")
    with pytest.raises(PlanError, match="kind.step"):
        register("Plan", "a:b")
    with pytest.raises(PlanError, match="no handler is registered"):
        handler_path("nobody.home")

    def nested(event, context):  # not importable by name
        return {}

    with pytest.raises(PlanError, match="not a top-level function"):
        register("toy.nested", nested)
    with pytest.raises(PlanError, match="longer than 64"):
        lambda_name("toy.plan", "x" * 60)


# --- compiler -----------------------------------------------------------------------------------------------


def test_task_state_shape():
    asl = compile_workflow(
        toy_workflow(), NamingResolver(region="eu-west-1", account="111122223333", stage="t")
    )
    plan = asl["States"]["plan"]
    assert plan["Type"] == "Task"
    assert plan["Resource"] == "arn:aws:lambda:eu-west-1:111122223333:function:shardfold-t-toy-plan"
    assert plan["ResultPath"] == "$.plan"  # the data-flow rule: the result lands at $.<name>
    assert plan["Next"] == "squares"
    assert plan["Retry"][0]["ErrorEquals"][: len(LAMBDA_TRANSIENT)] == list(LAMBDA_TRANSIENT)
    throttle = plan["Retry"][1]
    assert throttle["ErrorEquals"] == list(LAMBDA_THROTTLED)
    assert throttle["JitterStrategy"] == "FULL" and throttle["MaxDelaySeconds"] == 30
    assert plan["Catch"] == [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.error", "Next": "plan-failed"}]
    # the function's own timeout fires first (Sandbox.Timedout); the state's guards a lost invocation
    assert plan["TimeoutSeconds"] == 900 + LAMBDA_STATE_MARGIN_S
    fail = asl["States"]["plan-failed"]
    # the project's own error name (LocalStack refuses a Fail state passing on a States.* name); the caught
    # error's name starts the cause
    assert fail == {
        "Type": "Fail",
        "Error": "Shardfold.StepFailed",
        "CausePath": "States.Format('step plan failed: {}: {}', $.error.Error, $.error.Cause)",
    }
    assert asl["States"]["total"]["End"] is True


def test_a_polling_task_loops_through_a_choice_and_a_wait_state():
    states = compile_workflow(polled())["States"]
    assert states["look"]["Next"] == "look-ready" and states["look"]["ResultPath"] == "$.look"
    assert states["look-ready"] == {
        "Type": "Choice",
        "Choices": [{"Variable": "$.look.ready", "BooleanEquals": True, "Next": "stamp"}],
        "Default": "look-wait",
    }
    assert states["look-wait"] == {"Type": "Wait", "SecondsPath": "$.look.wait_s", "Next": "look"}
    last = compile_workflow(polled(last=True))["States"]  # ending the workflow: through a Succeed state
    assert "End" not in last["look"] and last["look-ready"]["Choices"][0]["Next"] == "look-done"
    assert last["look-done"] == {"Type": "Succeed"}


def test_map_state_is_a_distributed_map_reading_the_worklist():
    wf = Workflow(
        "m",
        (
            Task("plan", "toy.plan"),
            Map(
                "work",
                items="$.plan.worklist",
                body=(Task("square", "toy.square"),),
                max_concurrency=7,
                tolerated_failure_percentage=5,
            ),
        ),
    )
    state = compile_workflow(wf)["States"]["work"]
    assert state["Type"] == "Map"
    assert state["ItemProcessor"]["ProcessorConfig"] == {"Mode": "DISTRIBUTED", "ExecutionType": "STANDARD"}
    assert state["ItemReader"] == {
        "Resource": S3_GET_OBJECT,
        "ReaderConfig": {"InputType": "JSON"},
        "Parameters": {"Bucket.$": "$.plan.worklist.bucket", "Key.$": "$.plan.worklist.key"},
    }
    assert state["ItemSelector"]["item.$"] == "$$.Map.Item.Value"
    assert state["ItemSelector"]["index.$"] == "$$.Map.Item.Index"
    assert state["ResultPath"] is None  # child outputs never come back into the state
    assert state["MaxConcurrency"] == 7
    assert state["ToleratedFailurePercentage"] == 5.0 and isinstance(
        state["ToleratedFailurePercentage"], float
    )
    child_fail = state["ItemProcessor"]["States"]["square-failed"]
    assert child_fail["CausePath"] == (
        "States.Format('step square (item {}) failed: {}: {}', $.index, $.error.Error, $.error.Cause)"
    )


def test_parallel_selects_branch_task_results():
    state = compile_workflow(parts_workflow())["States"]["fan"]
    assert state["Type"] == "Parallel" and len(state["Branches"]) == 2
    assert state["ResultSelector"] == {"stamp.$": "$[1].stamp"}
    assert state["ResultPath"] == "$.fan"


def test_batch_job_state():
    wf = toy_workflow(batch=True)
    outputs = {
        "functions": {f: f"arn:fn:{f}" for f in wf.functions()},
        "batch_job_queue": "arn:queue",
        "batch_job_definitions": {"toy.batch_double": "arn:jobdef"},
    }
    state = compile_workflow(wf, StackResolver(outputs))["States"]["double"]
    assert state["Resource"] == BATCH_SYNC
    params = state["Parameters"]
    assert params["JobQueue"] == "arn:queue" and params["JobDefinition"] == "arn:jobdef"
    assert params["JobName.$"] == "States.Format('{}-double', $.job_id)"
    env = {e["Name"]: e for e in params["ContainerOverrides"]["Environment"]}
    assert env["SHARDFOLD_EVENT"]["Value.$"] == "States.JsonToString($)"
    assert env["SHARDFOLD_HANDLER"]["Value"] == handler_path("toy.batch_double")
    assert params["Timeout"] == {"AttemptDurationSeconds": 600}
    # the state waits for a place and every attempt, never forever
    assert state["TimeoutSeconds"] == BATCH_RUNNABLE_MAX_S + BATCH_ATTEMPTS * (600 + BATCH_STARTUP_S)
    # Step Functions names the Batch API errors it does not model Batch.AWSBatchException (hyp3#911)
    assert "Batch.AWSBatchException" in state["Retry"][0]["ErrorEquals"]
    assert state["ResultPath"] is None
    with pytest.raises(PlanError, match="no Lambda function"):
        compile_workflow(wf, StackResolver({"functions": {}}))


# --- validation ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(WORKFLOWS))
def test_every_builtin_workflow_validates(kind):
    validate(compile_workflow(WORKFLOWS[kind]))


@pytest.mark.parametrize("wf", [*TOYS, polled(), polled(last=True)], ids=lambda wf: wf.kind)
def test_toy_workflows_validate(wf):
    validate(compile_workflow(wf))


def test_statelint_allowances_cover_only_known_false_reports():
    from statelint.linter import Linter

    asl = compile_workflow(toy_workflow())
    raw = Linter.validate(asl)
    assert sorted(raw) == [
        'Field "InputType" not allowed in State Machine.States.squares.ItemReader.ReaderConfig',
        'Field "Label" not allowed in State Machine.States.squares',
    ]
    assert lint(asl) == []
    tolerant = Workflow(
        "tol",
        (
            Task("plan", "toy.plan"),
            Map("m", "$.plan.worklist", (Task("t", "toy.square"),), tolerated_failure_percentage=5),
        ),
    )
    asl = compile_workflow(tolerant)
    assert (
        len(Linter.validate(asl)) == 3
    )  # InputType, Label, the float tolerance and lint(asl) == []  # InputType, Label, the float
    moto_check(asl)  # the float form is the one moto accepts
    assert len(asl_mod.STATELINT_FALSE_REPORTS) == 3  # the one place allowances live
    # a real problem in the same fields is still reported
    asl["States"]["m"]["ToleratedFailurePercentage"] = "lots"
    asl["States"]["m"]["ItemReader"]["ReaderConfig"]["Bogus"] = 1
    assert len(lint(asl)) == 2


def test_validate_rejects_broken_asl():
    asl = compile_workflow(toy_workflow())
    broken = json.loads(json.dumps(asl))
    broken["States"]["plan"]["Next"] = "nowhere"
    with pytest.raises(PlanError, match="statelint"):
        validate(broken)
    jsonl = json.loads(json.dumps(asl))
    jsonl["States"]["squares"]["ItemReader"]["ReaderConfig"]["InputType"] = "JSONL"  # moto 5.2.5 cannot
    with pytest.raises(PlanError, match="moto rejects"):
        moto_check(jsonl)


# --- property: any plan compiles to ASL that both checkers accept -------------------------------------------

_counter = iter(range(10**9))


def _name() -> str:
    return f"s{next(_counter)}"


def _task() -> st.SearchStrategy:
    return st.builds(
        lambda mode, retry, poll: Task(_name(), "toy.stamp", mode=mode, retry=retry, poll=poll),
        st.sampled_from(["thread", "process"]),
        st.sampled_from([DEFAULT_TASK_RETRY, (), (Retry(errors=("ConnectionError",), interval_s=1),)]),
        st.booleans(),
    )


def _steps(depth: int) -> st.SearchStrategy:
    leaf = st.one_of(
        _task(), st.just(None).map(lambda _: BatchJob(_name(), "toy.batch_double", timeout_s=60))
    )
    if depth == 0:
        return st.lists(leaf, min_size=1, max_size=3).map(tuple)
    inner = _steps(depth - 1)
    compound = st.one_of(
        st.builds(
            lambda body, pct: Map(
                _name(), items="$.plan.worklist", body=body, tolerated_failure_percentage=pct
            ),
            inner,
            st.one_of(st.none(), st.floats(0, 100)),
        ),
        st.builds(
            lambda branches: Parallel(_name(), branches=tuple(branches)),
            st.lists(inner, min_size=1, max_size=3),
        ),
    )
    return st.lists(st.one_of(leaf, compound), min_size=1, max_size=3).map(tuple)


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps(2))
def test_any_plan_compiles_to_valid_asl(steps):
    wf = Workflow("prop", (Task(_name(), "toy.plan"), *steps))
    asl = compile_workflow(wf)
    validate(asl)
    names: list[str] = []

    def collect(states: dict) -> None:
        for name, state in states.items():
            names.append(name)
            if "ItemProcessor" in state:
                collect(state["ItemProcessor"]["States"])
            for branch in state.get("Branches", []):
                collect(branch["States"])

    collect(asl["States"])
    assert len(names) == len(set(names))  # state names are unique across the whole machine
    assert all(len(n) <= 80 for n in names)


def test_no_fail_state_passes_on_a_states_error_name():
    """LocalStack refuses a Fail state whose error starts with States.; every Fail state names the project's
    own error and puts the caught one first in its cause, which the executors read back."""
    from shardfold.orchestrator.status import tidy_cause

    for wf in [*WORKFLOWS.values(), *TOYS]:
        asl = compile_workflow(wf, NamingResolver(region="eu-west-1", account="111122223333", stage="t"))
        fails = [s for s in _all_states(asl) if s["Type"] == "Fail"]
        assert fails and all(s["Error"] == "Shardfold.StepFailed" and "ErrorPath" not in s for s in fails)
    payload = '{"errorType": "ValueError", "errorMessage": "bad"}'
    assert (
        tidy_cause(f"step s (item 3) failed: ValueError: {payload}")
        == "step s (item 3) failed: ValueError: bad"
    )
    assert tidy_cause("step s failed: States.Timeout: ") == "step s failed: States.Timeout"
    assert tidy_cause('step s failed: States.TaskFailed: {"StatusReason": "OOM"}') == (
        "step s failed: States.TaskFailed: OOM"
    )
    assert (
        tidy_cause("step s failed: States.Runtime: no such path")
        == "step s failed: States.Runtime: no such path"
    )


def _all_states(asl: dict) -> list[dict]:
    out = []
    for state in asl["States"].values():
        out.append(state)
        for inner in [state.get("ItemProcessor"), *state.get("Branches", [])]:
            if inner:
                out += _all_states(inner)
    return out


def _map_states(states: dict) -> list[dict]:
    found = []
    for state in states.values():
        if state["Type"] == "Map":
            found.append(state)
            found.extend(_map_states(state["ItemProcessor"]["States"]))
        for branch in state.get("Branches", []):
            found.extend(_map_states(branch["States"]))
    return found


@pytest.mark.parametrize("wf", [*WORKFLOWS.values(), *TOYS], ids=lambda wf: wf.kind)
def test_every_map_child_outputs_nothing_that_grows(wf):
    """A Distributed Map gathers each child's output (its terminal state's) into the Map's result, which must
    fit 256 KiB even under ResultPath null (aws-cdk#24799): every terminal state of a child other than a
    Fail state (which has no output) has OutputPath null, so a child's output is {}."""
    maps = _map_states(compile_workflow(wf)["States"])
    assert maps or wf.kind == "toyparts"
    for state in maps:
        children = state["ItemProcessor"]["States"]
        terminal = [s for s in children.values() if s.get("End") or s["Type"] in ("Succeed", "Pass")]
        assert terminal
        for s in terminal:
            assert "OutputPath" in s and s["OutputPath"] is None, s
        # ...and only the terminal ones: a step before the last still passes its state on
        assert all("OutputPath" not in s for s in children.values() if s.get("Next"))


def test_only_the_map_body_ends_with_output_path_null():
    inner = Parallel("fan", branches=((Task("a", "toy.square"),), (Task("b", "toy.square"),)))
    wf = Workflow("m", (Task("plan", "toy.plan"), Map("work", items="$.plan.worklist", body=(inner,))))
    asl = compile_workflow(wf)
    validate(asl)
    fan = asl["States"]["work"]["ItemProcessor"]["States"]["fan"]
    assert fan["OutputPath"] is None
    # a branch's last state keeps its output: the Parallel's ResultSelector reads it
    assert all("OutputPath" not in s for b in fan["Branches"] for s in b["States"].values())
    assert "OutputPath" not in asl["States"]["plan"]
