"""LocalExecutor on the toy workflow: results, retries, failures, resume, cancel, progress, payload size."""

from __future__ import annotations

import json
import os
import uuid

import pytest
import toyflow
from toyflow import calls, fail_switch, parts_workflow, toy_workflow, write_spec

from shardfold.functions import store
from shardfold.functions.errors import JobNotFound, PlanError, ShardfoldError
from shardfold.functions.jobs import new_job_id
from shardfold.functions.store.uri import join
from shardfold.functions.workflow import Map, Retry, Task, Workflow
from shardfold.functions.worklist import MAX_MAP_ITEMS
from shardfold.orchestrator.invoke import MAX_STATE_BYTES, HandlerFailed, call
from shardfold.orchestrator.local import LocalExecutor, map_result_bytes
from shardfold.orchestrator.registry import register
from shardfold.orchestrator.status import JobStatus

pytestmark = pytest.mark.slow

WAIT_S = 60  # a deadline for the job, not a timing assumption


def squares(n: int) -> int:
    return sum(i * i for i in range(n))


@pytest.fixture
def root(tmp_path) -> str:
    return f"file://{tmp_path}/store"


@pytest.fixture(autouse=True)
def _gate():
    toyflow.GATE.clear()
    toyflow.STARTED.clear()
    yield
    toyflow.GATE.set()  # never leave a handler blocked


def make(root: str, workflow: Workflow | None = None, **kw) -> LocalExecutor:
    wf = workflow or toy_workflow()
    return LocalExecutor(store_root=root, workflows={wf.kind: wf}, retry_delay_scale=0.0, **kw)


def run(ex: LocalExecutor, root: str, kind: str = "toy", **spec) -> tuple[str, JobStatus]:
    job_id = new_job_id(kind)
    ex.start(job_id, kind, write_spec(root, job_id, **spec))
    return job_id, ex.wait(job_id, timeout_s=WAIT_S)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_toy_end_to_end(root, mode):
    seen: list[JobStatus] = []
    with make(root, toy_workflow(mode=mode)) as ex:
        job_id = new_job_id("toy")
        ex.start(job_id, "toy", write_spec(root, job_id, n=20))
        status = ex.wait(job_id, on_progress=seen.append, timeout_s=WAIT_S)
    assert status.state == "SUCCEEDED", status.error
    assert status.steps == {
        "plan": {"done": 1, "total": 1},
        "square": {"done": 20, "total": 20},  # a Map of one task shows under its task's name
        "total": {"done": 1, "total": 1},
    }
    result = store.get_json(join(root, "jobs", job_id, "result.json"))
    assert result == {"sum": squares(20), "outputs": 20, "n": 20}
    assert calls(root, job_id) == {i: 1 for i in range(20)}
    assert seen and seen[-1].state == "SUCCEEDED"
    done = [s.steps["square"]["done"] for s in seen]
    assert done == sorted(done)  # progress only moves forward
    # the record on disk tells another process the same
    assert LocalExecutor(store_root=root).status(job_id).state == "SUCCEEDED"


def test_a_process_task_runs_in_the_jobs_current_environment_and_import_path(root, tmp_path, monkeypatch):
    """Pool workers are forked from a fork server started with an earlier environment; each task still sees
    the environment and ``sys.path`` the job's process has when it runs the task (as a spawned worker did)."""
    import sys

    wf = Workflow(kind="toy", steps=(Task("where", "toy.whereabouts", mode="process"),))

    def seen(**spec) -> dict:
        with make(root, wf) as ex:
            job_id, status = run(ex, root, **spec)
        assert status.state == "SUCCEEDED", status.error
        return store.get_json(join(root, "jobs", job_id, "toy", "whereabouts.json"))

    monkeypatch.setenv("TOY_MARK", "first")
    first = seen()
    assert first["mark"] == "first" and first["pid"] != os.getpid()
    monkeypatch.setenv("TOY_MARK", "second")
    (tmp_path / "later_mod").mkdir()
    (tmp_path / "later_mod" / "toy_later.py").write_text("VALUE = 42\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "later_mod"), *sys.path])
    again = seen(module="toy_later")
    assert (again["mark"], again["value"]) == ("second", 42)


@pytest.mark.parametrize(
    "said, where", [({"mode": "process"}, "worker"), ({"mode": "thread"}, "here"), ({}, "here")]
)
def test_a_task_runs_in_the_mode_its_input_names_at_mode_from(root, said, where):
    # the step says thread; the data (an earlier step's result here, a Map item in getbatch) may say process
    where_to = Task("where", "toy.whereabouts", mode="thread", mode_from="$.echo.mode")
    wf = Workflow(kind="toy", steps=(Task("echo", "toy.echo"), where_to))
    with make(root, wf) as ex:
        job_id, status = run(ex, root, echo=said)
    assert status.state == "SUCCEEDED", status.error
    pid = store.get_json(join(root, "jobs", job_id, "toy", "whereabouts.json"))["pid"]
    assert (pid == os.getpid()) == (where == "here")


def test_mode_from_must_be_a_path():
    with pytest.raises(PlanError, match="mode_from 'item.mode' must be a JSONPath"):
        Workflow(kind="toy", steps=(Task("where", "toy.whereabouts", mode_from="item.mode"),))


def test_transient_errors_are_retried(root):
    with make(root) as ex:
        job_id, status = run(ex, root, n=5, transient={"2": 2})
    assert status.state == "SUCCEEDED", status.error
    assert calls(root, job_id)[2] == 3  # failed twice, then succeeded
    assert store.get_json(join(root, "jobs", job_id, "result.json"))["sum"] == squares(5)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_task_past_its_timeout_fails_as_on_lambda(root, mode):
    """Lambda ends an invocation at the function's timeout and Step Functions reports Sandbox.Timedout;
    the local executor does the same for a task past its timeout_s (a process-mode worker is killed)."""
    wf = Workflow(kind="toy", steps=(Task("nap", "toy.nap", mode=mode, timeout_s=1),))
    with make(root, wf) as ex:
        job_id, status = run(ex, root, nap_s=30)
    assert status.state == "FAILED"
    assert (
        status.error
        == "step nap failed: Sandbox.Timedout: toy.nap ran past its timeout of 1 s (the step's timeout_s)"
    )
    with make(root, wf) as ex:
        job_id, status = run(ex, root, nap_s=0)
    assert status.state == "SUCCEEDED", status.error


def test_retries_run_out(root):
    with make(root) as ex:
        job_id, status = run(ex, root, n=5, transient={"2": 9})
    assert status.state == "FAILED"
    assert status.error == "step square (item 2) failed: ConnectionError: item 2: transient failure 4"
    assert calls(root, job_id)[2] == 4  # the first try and TOY_RETRY's 3 attempts


def test_failure_names_step_item_and_message_and_keeps_outputs(root):
    with make(root) as ex:
        job_id = new_job_id("toy")
        spec_uri = write_spec(root, job_id, n=8, fail=[3])
        fail_switch(root, job_id, True)
        ex.start(job_id, "toy", spec_uri)
        status = ex.wait(job_id, timeout_s=WAIT_S)
    assert status.state == "FAILED"
    assert status.error == "step square (item 3) failed: ValueError: item 3 is bad"
    assert calls(root, job_id)[3] == 1  # a ValueError is not transient: no retry
    assert not store.exists(join(root, "jobs", job_id, "result.json"))  # no partial result
    outs = store.list_uris(join(root, "jobs", job_id, "toy", "out") + "/")
    assert outs and all(store.get_json(u)["i"] != 3 for u in outs)  # committed outputs stay
    assert store.get_json(join(root, "jobs", job_id, "status.json"))["state"] == "FAILED"


def test_resume_reruns_only_unfinished_items(root):
    with make(root) as ex:
        job_id = new_job_id("toy")
        spec_uri = write_spec(root, job_id, n=12, fail=[3])
        fail_switch(root, job_id, True)
        ex.start(job_id, "toy", spec_uri)
        assert ex.wait(job_id, timeout_s=WAIT_S).state == "FAILED"
        before = calls(root, job_id)
        fail_switch(root, job_id, False)
        ex.resume(job_id)
        status = ex.wait(job_id, timeout_s=WAIT_S)
    assert status.state == "SUCCEEDED", status.error
    after = calls(root, job_id)
    assert after[3] == 2  # the failed item ran again
    assert all(after[i] == 1 for i in range(12) if i != 3)  # every other item ran exactly once
    assert sum(before.values()) < sum(after.values())
    assert store.get_json(join(root, "jobs", job_id, "result.json"))["sum"] == squares(12)
    # a resumed job's plan task was not re-run: its journal marker was reused
    assert status.steps["plan"] == {"done": 1, "total": 1}


def test_resume_from_another_executor(root):
    with make(root) as ex:
        job_id = new_job_id("toy")
        spec_uri = write_spec(root, job_id, n=6, fail=[1])
        fail_switch(root, job_id, True)
        ex.start(job_id, "toy", spec_uri)
        assert ex.wait(job_id, timeout_s=WAIT_S).state == "FAILED"
    fail_switch(root, job_id, False)
    with make(root) as other:  # e.g. `shardfold resume` in a new process
        other.resume(job_id)
        assert other.wait(job_id, timeout_s=WAIT_S).state == "SUCCEEDED"
    assert calls(root, job_id)[1] == 2 and calls(root, job_id)[0] == 1


def test_cancel(root):
    with make(root, toy_workflow(max_concurrency=2)) as ex:
        job_id = new_job_id("toy")
        ex.start(job_id, "toy", write_spec(root, job_id, n=10, gate=True))
        assert toyflow.STARTED.wait(timeout=WAIT_S)
        ex.cancel(job_id)
        toyflow.GATE.set()
        status = ex.wait(job_id, timeout_s=WAIT_S)
        assert status.state == "CANCELLED"
        assert len(calls(root, job_id)) < 10  # no new item started after the cancel
        assert not store.exists(join(root, "jobs", job_id, "result.json"))
        assert store.get_json(join(root, "jobs", job_id, "status.json"))["state"] == "CANCELLED"
        # the Map did not finish: no journal marker claims it did
        assert not store.exists(join(root, "jobs", job_id, "journal", "squares.json"))
        ex.resume(job_id)  # a cancelled job can be resumed to completion
        assert ex.wait(job_id, timeout_s=WAIT_S).state == "SUCCEEDED"
    assert calls(root, job_id) == {i: 1 for i in range(10)}
    assert store.get_json(join(root, "jobs", job_id, "result.json"))["sum"] == squares(10)


def test_cancel_marker_from_another_process(root):
    with make(root, toy_workflow(max_concurrency=1)) as ex:
        job_id = new_job_id("toy")
        ex.start(job_id, "toy", write_spec(root, job_id, n=5, gate=True))
        assert toyflow.STARTED.wait(timeout=WAIT_S)
        LocalExecutor(store_root=root, workflows=ex.workflows).cancel(job_id)  # only writes the marker
        toyflow.GATE.set()
        assert ex.wait(job_id, timeout_s=WAIT_S).state == "CANCELLED"


def test_batch_job_step_runs_in_a_process(root):
    with make(root, toy_workflow(batch=True)) as ex:
        job_id, status = run(ex, root, n=4)
    assert status.state == "SUCCEEDED", status.error
    assert store.get_json(join(root, "jobs", job_id, "toy", "batch.json")) == {"double": 2 * squares(4)}
    assert status.steps["double"] == {"done": 1, "total": 1}


def test_state_stays_small_for_100k_items(root):
    """100,000 items live in the store; the state handed to every task stays tiny."""
    wf = parts_workflow()
    with make(root, wf) as ex:
        job_id, status = run(ex, root, kind="toyparts", n=100_000, parts=1000)
        assert status.state == "SUCCEEDED", status.error
        assert ex.max_state_bytes(job_id) < 2048
    assert store.get_json(join(root, "jobs", job_id, "result.json"))["sum"] == squares(100_000)
    assert status.steps["part"] == {"done": 100, "total": 100}
    fan = store.get_json(join(root, "jobs", job_id, "journal", "fan.json"))["result"]
    assert fan == {"stamp": {"job": job_id}}  # Parallel: $.fan holds the branches' task results


def test_plan_result_for_a_big_worklist_is_small(root):
    job_id = new_job_id("toy")
    event = {"job_id": job_id, "spec_uri": write_spec(root, job_id, n=MAX_MAP_ITEMS), "store_root": root}
    result = call(toyflow.__name__ + ":plan", event, function_name="toy.plan")
    assert len(store.get_json(result["worklist"]["uri"])) == MAX_MAP_ITEMS
    state = {**event, "plan": result}
    assert len(json.dumps(state)) < 1024


def test_a_worklist_over_the_map_limit_is_refused(root):
    """A Distributed Map gathers every child's output ({} each) into 256 KiB even under ResultPath null,
    so a plan may not fan out over more than MAX_MAP_ITEMS children; nothing is written."""
    job_id = new_job_id("toy")
    event = {"job_id": job_id, "spec_uri": write_spec(root, job_id, n=MAX_MAP_ITEMS + 1), "store_root": root}
    with pytest.raises(HandlerFailed) as info:
        call(toyflow.__name__ + ":plan", event, function_name="toy.plan")
    assert info.value.error == "PlanError" and "at most 50,000" in str(info.value)
    assert not store.exists(join(root, "jobs", job_id, "toy", "worklist.json"))
    assert map_result_bytes(MAX_MAP_ITEMS + 5_000) < MAX_STATE_BYTES  # the allowance covers failed children


def test_a_map_whose_gathered_result_is_too_big_fails(root):
    """The local executor fails a Map whose children would gather more than 256 KiB, as AWS does, even for a
    work list written without worklist_ref."""
    too_many = next(n for n in range(87_000, 90_000) if map_result_bytes(n) > MAX_STATE_BYTES)
    assert too_many == 87_382  # [{},{},...]: 3 bytes a child
    register("toy.raw_plan", __name__ + ":_raw_plan")
    wf = Workflow(
        "raw",
        (Task("plan", "toy.raw_plan"), Map("m", items="$.plan.worklist", body=(Task("t", "toy.stamp"),))),
    )
    with make(root, wf) as ex:
        _, status = run(ex, root, kind="raw", n=too_many)
    assert status.state == "FAILED"
    assert status.error.startswith("step m failed: States.DataLimitExceeded: 87,382 children gather a result")


def _raw_plan(event, context):
    uri = join(event["store_root"], "jobs", event["job_id"], "raw.json")
    n = int(store.get_json(event["spec_uri"])["n"])
    store.put_json(uri, [{"i": i} for i in range(n)])
    return {"worklist": {"uri": uri, "bucket": "", "key": "", "count": n}}


def test_map_over_something_that_is_not_a_worklist_ref(root):
    register("toy.bad_plan", toyflow.__name__ + ":stamp")
    wf = Workflow(
        "bad", (Task("plan", "toy.bad_plan"), Map("m", items="$.plan.job", body=(Task("t", "toy.stamp"),)))
    )
    with make(root, wf) as ex:
        _, status = run(ex, root, kind="bad", n=1)
    assert status.state == "FAILED"
    assert status.error.startswith("step m failed: States.Runtime: $.plan.job is ")
    assert "worklist_ref" in status.error


def test_user_errors_are_never_retried(root):
    register("toy.user_error", __name__ + ":_user_error")
    retry = (Retry(errors=("SpecError", "ShardfoldError"), interval_s=1, max_attempts=5),)
    wf = Workflow("usererr", (Task("check", "toy.user_error", retry=retry),))
    with make(root, wf) as ex:
        job_id, status = run(ex, root, kind="usererr")
    assert status.state == "FAILED"
    assert status.error == "step check failed: SpecError: field x is wrong"
    assert len(store.list_uris(join(root, "jobs", job_id, "usererr") + "/")) == 1


def _user_error(event, context):
    from shardfold.functions.errors import SpecError

    store.put(join(event["store_root"], "jobs", event["job_id"], "usererr", uuid.uuid4().hex), b"")
    raise SpecError("field x is wrong")


def test_interface_errors(root):
    with make(root) as ex:
        with pytest.raises(PlanError, match="unknown job kind 'nope'"):
            ex.start(new_job_id("nope"), "nope", "x")
        with pytest.raises(JobNotFound):
            ex.status("toy-20260101T000000-abcdef")
        job_id, status = run(ex, root, n=2)
        with pytest.raises(ShardfoldError, match="already exists"):
            ex.start(job_id, "toy", "x")
        assert [j.job_id for j in ex.jobs()] == [job_id]
        ex.resume(job_id)  # nothing to do for a finished job
        assert ex.status(job_id).state == "SUCCEEDED"


def _big(event, context):
    return {"blob": "x" * 300_000}


def _not_json(event, context):
    return {"when": object()}


@pytest.mark.parametrize(
    ("handler", "error"),
    [("_big", "States.DataLimitExceeded: toy.big returned"), ("_not_json", "States.Runtime: Object of type")],
)
def test_results_must_be_small_json(root, handler, error):
    name = f"toy.{handler.strip('_')}"
    register(name, f"{__name__}:{handler}")
    wf = Workflow("res", (Task("t", name),))
    with make(root, wf) as ex:
        _, status = run(ex, root, kind="res")
    assert status.state == "FAILED"
    assert status.error.startswith(f"step t failed: {error}")


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_on_failure_runs_once_when_a_step_fails_and_not_on_success(root, mode):
    from toyflow import scrubbed, toy_scrubbed

    wf = toy_scrubbed(mode)
    with make(root, wf) as ex:
        ok_id, ok = run(ex, root, kind="toyscrub", n=3)
        job_id = new_job_id("toyscrub")
        fail_switch(root, job_id, True)
        ex.start(job_id, "toyscrub", write_spec(root, job_id, n=3, fail=[1]))
        failed = ex.wait(job_id, timeout_s=WAIT_S)
    assert ok.state == "SUCCEEDED" and scrubbed(root, ok_id) is None
    assert failed.state == "FAILED" and "item 1 is bad" in failed.error  # its own failure, as before
    assert scrubbed(root, job_id) is not None
