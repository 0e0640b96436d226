"""The moto backend (harness stack + the unchanged AwsExecutor) against the local executor, on toy kinds."""

from __future__ import annotations

import json

import pytest
import toyflow
from toyflow import calls, fail_switch, parts_workflow, toy_workflow, write_spec

from shardfold.dryrun import MotoStack
from shardfold.functions import store
from shardfold.functions.errors import JobNotFound, PlanError, ShardfoldError
from shardfold.functions.jobs import new_job_id
from shardfold.functions.store.uri import join
from shardfold.orchestrator.aws import AwsExecutor
from shardfold.orchestrator.local import LocalExecutor
from shardfold.orchestrator.status import JobStatus

pytestmark = pytest.mark.slow

WAIT_S = 120  # a deadline, not a timing assumption
FLOWS = {"toy": toy_workflow(batch=True), "toyparts": parts_workflow()}


@pytest.fixture(scope="module")
def stack():
    with MotoStack(FLOWS) as s:
        yield s


@pytest.fixture
def aws(stack) -> AwsExecutor:
    return AwsExecutor(stack.outputs, FLOWS)


@pytest.fixture(autouse=True)
def _gate():
    toyflow.GATE.clear()
    toyflow.STARTED.clear()
    yield
    toyflow.GATE.set()


def start(ex, root: str, kind: str = "toy", **spec) -> str:
    job_id = new_job_id(kind)
    spec_uri = write_spec(root, job_id, **spec)
    if spec.pop("fail", None):
        fail_switch(root, job_id, True)
    ex.start(job_id, kind, spec_uri)
    return job_id


def run_both(
    tmp_path, aws: AwsExecutor, kind: str = "toy", **spec
) -> tuple[tuple[str, JobStatus], tuple[str, JobStatus]]:
    local_root = f"file://{tmp_path}/store"
    local = LocalExecutor(store_root=local_root, workflows=FLOWS, retry_delay_scale=0.0)
    with local:
        lid = start(local, local_root, kind, **spec)
        aid = start(aws, aws.store_root, kind, **spec)
        return (lid, local.wait(lid, timeout_s=WAIT_S)), (aid, aws.wait(aid, timeout_s=WAIT_S))


def result(root: str, job_id: str) -> dict:
    return store.get_json(join(root, "jobs", job_id, "result.json"))


def test_same_result_as_local(tmp_path, aws):
    (lid, lstat), (aid, astat) = run_both(tmp_path, aws, n=12)
    assert lstat.state == astat.state == "SUCCEEDED", (lstat.error, astat.error)
    assert result(f"file://{tmp_path}/store", lid) == result(aws.store_root, aid)
    assert lstat.steps == astat.steps
    assert store.get_json(join(aws.store_root, "jobs", aid, "toy", "batch.json")) == {"double": 2 * 506}
    record = store.get_json(join(aws.store_root, "jobs", aid, "status.json"))
    assert record["state"] == "SUCCEEDED" and record["backend"] == "moto" and record["execution_arn"]


def test_same_error_as_local(tmp_path, aws):
    (lid, lstat), (aid, astat) = run_both(tmp_path, aws, n=6, fail=[4])
    assert lstat.state == astat.state == "FAILED"
    assert lstat.error == astat.error == "step square (item 4) failed: ValueError: item 4 is bad"
    assert not store.exists(join(aws.store_root, "jobs", aid, "result.json"))
    outs = store.list_uris(join(aws.store_root, "jobs", aid, "toy", "out") + "/")
    assert len(outs) == 5  # committed outputs stay readable


def test_parallel_and_state_size_for_100k_items(tmp_path, aws):
    (lid, lstat), (aid, astat) = run_both(tmp_path, aws, kind="toyparts", n=100_000, parts=5000)
    assert lstat.state == astat.state == "SUCCEEDED", (lstat.error, astat.error)
    assert result(f"file://{tmp_path}/store", lid) == result(aws.store_root, aid)
    assert astat.steps["part"] == {"done": 20, "total": 20}
    desc = aws._sfn.describe_execution(executionArn=astat.execution_arn)
    assert json.loads(desc["output"])["fan"] == {"stamp": {"job": aid}}
    # every state input/output in the history stays tiny: the 100,000 items never enter the state
    sizes = []
    for event in aws._sfn.get_execution_history(executionArn=astat.execution_arn, maxResults=1000)["events"]:
        for details in event.values():
            if isinstance(details, dict):
                sizes += [len(details[k]) for k in ("input", "output") if isinstance(details.get(k), str)]
    assert sizes and max(sizes) < 2048


def test_transient_errors_are_retried(aws):
    job_id = start(aws, aws.store_root, n=4, transient={"1": 1})
    status = aws.wait(job_id, timeout_s=WAIT_S)
    assert status.state == "SUCCEEDED", status.error
    assert calls(aws.store_root, job_id)[1] == 2


def test_resume_after_failure(aws):
    root = aws.store_root
    job_id = start(aws, root, n=6, fail=[2])
    assert aws.wait(job_id, timeout_s=WAIT_S).state == "FAILED"
    fail_switch(root, job_id, False)
    aws.resume(job_id)  # a new execution, <job_id>-r1 (a redrive would re-run the Fail state)
    status = aws.wait(job_id, timeout_s=WAIT_S)
    assert status.state == "SUCCEEDED", status.error
    assert status.execution_arn.endswith(f"{job_id}-r1")
    assert result(root, job_id)["sum"] == sum(i * i for i in range(6))
    # idempotent outputs: every item's output was written once, whatever ran twice
    assert len(store.list_uris(join(root, "jobs", job_id, "toy", "out") + "/")) == 6
    assert [j.job_id for j in aws.jobs()].count(job_id) == 1


def test_cancel(aws):
    root = aws.store_root
    job_id = start(aws, root, n=10, gate=True)
    assert toyflow.STARTED.wait(timeout=WAIT_S)
    aws.cancel(job_id)
    assert aws.status(job_id).state == "CANCELLED"
    toyflow.GATE.set()
    assert aws.wait(job_id, timeout_s=WAIT_S).state == "CANCELLED"
    desc = aws._sfn.describe_execution(executionArn=aws.status(job_id).execution_arn)
    assert desc["status"] in ("ABORTED", "RUNNING")  # moto ends it once the in-flight call returns
    assert len(calls(root, job_id)) <= 4  # MaxConcurrency: nothing started after the cancel
    assert not store.exists(join(root, "jobs", job_id, "result.json"))


def test_progress_callbacks_and_interface_errors(aws):
    seen: list[JobStatus] = []
    job_id = start(aws, aws.store_root, n=3)
    status = aws.wait(job_id, on_progress=seen.append, timeout_s=WAIT_S)
    assert status.state == "SUCCEEDED" and seen[-1] == status
    assert status.steps["square"] == {"done": 3, "total": 3}
    with pytest.raises(ShardfoldError, match="already exists"):
        aws.start(job_id, "toy", "s3://x/y")
    with pytest.raises(PlanError, match="not deployed"):
        aws.start(new_job_id("nope"), "nope", "s3://x/y")
    with pytest.raises(JobNotFound):
        aws.status("toy-20260101T000000-abcdef")


def test_cancel_terminates_the_jobs_batch_jobs():
    """moto's Batch finishes jobs at submit, so the terminate path is checked against botocore's Stubber."""
    from botocore.stub import Stubber

    outputs = {
        "bucket": "b-unused",
        "region": "us-east-1",
        "state_machine_arns": {"toy": "arn:aws:states:us-east-1:123456789012:stateMachine:x"},
        "batch_job_queue": "arn:aws:batch:us-east-1:123456789012:job-queue/q",
    }
    ex = AwsExecutor(outputs, FLOWS)
    job_id = "toy-20260101T000000-abcdef"
    with Stubber(ex._batch) as stub:
        stub.add_response(
            "list_jobs",
            {
                "jobSummaryList": [
                    {"jobId": "j1", "jobName": f"{job_id}-double", "status": "RUNNING"},
                    {"jobId": "j2", "jobName": f"{job_id}-double", "status": "SUCCEEDED"},
                ]
            },
            {
                "jobQueue": outputs["batch_job_queue"],
                "filters": [{"name": "JOB_NAME", "values": [f"{job_id}*"]}],
            },
        )
        stub.add_response("terminate_job", {}, {"jobId": "j1", "reason": f"shardfold job {job_id} cancelled"})
        ex._terminate_batch_jobs(job_id)
        stub.assert_no_pending_responses()
