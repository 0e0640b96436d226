"""IAM enforced on the moto backend: each handler and Batch container signs its requests with its own role's
session, the roles carry the policies ``infra`` deploys (``orchestrator.iam``, from each kind's declared
rights), and what a role lacks is refused, as AWS would refuse it.

A test kind, ``reacher``, touches whatever its spec names, so a test can aim a real task at a place its kind
does not declare: the task's own check refuses it on every backend, and on moto the role refuses it even when
the task skips its check.
"""

from __future__ import annotations

import json
import sys
import textwrap

import boto3
import numpy as np
import pytest
from botocore.exceptions import ClientError

from shardfold import dryrun
from shardfold.client import Client
from shardfold.functions import kinds, store
from shardfold.functions.access import Grants, Right
from shardfold.functions.credentials import Credentials
from shardfold.orchestrator import iam

pytestmark = pytest.mark.slow

WAIT_S = 300  # a deadline, not a timing assumption

REACHER = {
    "__init__.py": '"""A test kind whose one task touches what its spec names."""\n',
    "kind.py": """
        from typing import Literal

        from shardfold.functions.access import Right
        from shardfold.functions.kinds import JobKind
        from shardfold.functions.specs import StrictModel
        from shardfold.functions.workflow import Task, Workflow

        class ReacherJob(StrictModel):
            kind: Literal["reacher"] = "reacher"
            target: str  # a key under the store root, or a full URI, written by the task
            skip_check: bool = False  # write around the task's own check: only the role stands in the way

        TOUCH = Task("touch", "reacher.touch", memory_mb=256)
        WORKFLOW = Workflow(kind="reacher", steps=(TOUCH,))

        KIND = JobKind(
            name="reacher",
            package=__package__,
            spec=ReacherJob,
            workflow=WORKFLOW,
            sizing="reacher.sizing",
            rights=frozenset({Right.INPUTS, Right.OUTPUTS}),  # no ledger
        )
    """,
    "handlers.py": """
        from shardfold.functions import store
        from shardfold.functions.runtime import JobEvent, task
        from shardfold.functions.store.uri import join

        @task(JobEvent, kind="reacher")
        def touch(e, spec):
            target = spec.target if "://" in spec.target else join(e.store_root, spec.target)
            if spec.skip_check:
                with store.scoped(lambda uri, write, prefix: None):
                    store.put(target, b"reached")
            else:
                store.put(target, b"reached")
            store.put_json(join(e.store_root, "jobs", e.job_id, "result.json"), {"kind": "reacher"})
            return {}
    """,
    "sizing.py": """
        from shardfold.functions.estimate import MiB, Loads, Probe, TaskLoad
        from reacher.kind import TOUCH

        def probe(spec, store_root, budget):
            return Probe(facts={})

        def loads(spec, probed):
            return Loads(items=1, tasks={TOUCH: TaskLoad(64 * MiB, puts=2)})
    """,
}


@pytest.fixture(scope="module")
def reacher(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plugins")
    (folder / "reacher").mkdir()
    for name, text in REACHER.items():
        (folder / "reacher" / name).write_text(textwrap.dedent(text))
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(folder))
        mp.setenv(kinds.EXTRA_PACKAGES_ENV, "reacher")
        yield
    for name in [m for m in sys.modules if m == "reacher" or m.startswith("reacher.")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def client(reacher, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDFOLD_HOME", str(tmp_path_factory.mktemp("moto-home")))
        with Client(backend="moto") as c:
            yield c


@pytest.fixture
def stack(client) -> dryrun.MotoStack:
    found = dryrun.running()
    assert found is not None
    return found


def signed_as(creds: Credentials, service: str):
    return boto3.session.Session(
        aws_access_key_id=creds.access_key_id,
        aws_secret_access_key=creds.secret_access_key,
        aws_session_token=creds.session_token,
    ).client(service)


def allowed(call) -> bool:
    try:
        call()
    except ClientError as exc:
        assert exc.response["ResponseMetadata"]["HTTPStatusCode"] == 403, exc
        return False
    return True


def test_every_function_signs_as_its_own_role(stack):
    for function, name in stack.outputs["function_names"].items():
        who = signed_as(stack.credentials(function), "sts").get_caller_identity()["Arn"]
        assert f":assumed-role/{name}-role/" in who, (function, who)
    batch = signed_as(stack.credentials("batch"), "sts").get_caller_identity()["Arn"]
    assert ":assumed-role/shardfold-moto-batch-job-role/" in batch


def test_credentials_no_role_holds_are_refused(stack):
    stranger = boto3.session.Session(aws_access_key_id="AKIAEXAMPLE", aws_secret_access_key="x").client("s3")
    with pytest.raises(ClientError) as info:
        stranger.list_objects_v2(Bucket=stack.bucket)
    assert info.value.response["Error"]["Code"] == "InvalidAccessKeyId"


def test_each_role_reaches_what_its_kind_declares_and_nothing_else(stack):
    bucket = stack.bucket
    boto3.client("s3").put_object(Bucket=bucket, Key="data/probe.bin", Body=b"user data")
    boto3.client("s3").put_object(Bucket=bucket, Key="ledger/probe/read", Body=b"{}")
    grants = Grants()
    assert grants.output_prefixes == ("results/",)
    seen_ledger = set()
    for function in stack.outputs["function_names"]:
        rights = iam.function_rights(function)
        s3 = signed_as(stack.credentials(function), "s3")

        def put(key: str, s3=s3) -> bool:
            return allowed(lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"x"))

        assert put("jobs/some-job/x"), function  # a role serves every job: the task checks which
        assert put("ledger/probe/x") == (Right.LEDGER in rights), function
        assert put("results/probe/x") == (Right.OUTPUTS in rights), function
        assert not put("claims/x") and not put("elsewhere/x") and not put("tmp/x"), function
        read = allowed(lambda s3=s3: s3.get_object(Bucket=bucket, Key="data/probe.bin"))
        assert read == (Right.INPUTS in rights), function
        ledger = allowed(lambda s3=s3: s3.get_object(Bucket=bucket, Key="ledger/probe/read"))
        assert ledger == (Right.LEDGER in rights), function
        if Right.LEDGER in rights:
            seen_ledger.add(function.split(".")[0])
    assert {"dpquery", "fedavg"} <= seen_ledger  # DP-FedAvg reserves and spends its budget too


def test_the_dispatch_role_claims_outputs_and_starts_only_the_stacks_jobs(stack):
    bucket = stack.bucket
    dispatch = stack.credentials("dispatch")
    s3, sfn = signed_as(dispatch, "s3"), signed_as(dispatch, "stepfunctions")
    assert allowed(lambda: s3.put_object(Bucket=bucket, Key="claims/probe.json", Body=b"{}"))
    assert not allowed(lambda: s3.put_object(Bucket=bucket, Key="ledger/x", Body=b"{}"))
    assert not allowed(lambda: s3.put_object(Bucket=bucket, Key="results/x", Body=b"{}"))
    other = "arn:aws:states:us-east-1:123456789012:stateMachine:someone-elses"
    assert not allowed(lambda: sfn.start_execution(stateMachineArn=other, input="{}"))


def test_a_state_machine_role_invokes_its_own_functions_only(stack):
    roles = boto3.client("iam")
    for kind, arn in stack.outputs["state_machine_arns"].items():
        role = roles.get_role(RoleName=f"{arn.rsplit(':', 1)[1]}-role")["Role"]["Arn"]
        for function, function_arn in stack.outputs["functions"].items():
            own = function.split(".")[0] == kind
            assert dryrun._permitted(role, "lambda:InvokeFunction", function_arn) == own, (
                kind,
                function,
            )


def test_a_state_machine_whose_role_may_not_invoke_its_function_fails_the_job(client, stack):
    roles = boto3.client("iam")
    name = f"{stack.outputs['state_machine_arns']['getbatch'].rsplit(':', 1)[1]}-role"
    policy = roles.get_role_policy(RoleName=name, PolicyName=f"{name}-policy")["PolicyDocument"]
    kept = [st for st in policy["Statement"] if st.get("Sid") != "InvokeFunctions"]
    without = {**policy, "Statement": kept}
    store.put(client.uri("data/one.bin"), b"one")
    roles.put_role_policy(RoleName=name, PolicyName=f"{name}-policy", PolicyDocument=json.dumps(without))
    try:
        job = client.submit({"kind": "getbatch", "items": [{"uri": "data/one.bin"}]})
        status = job.wait(progress=False, timeout_s=WAIT_S)
    finally:
        roles.put_role_policy(RoleName=name, PolicyName=f"{name}-policy", PolicyDocument=json.dumps(policy))
    assert status.state == "FAILED", status.error
    assert "getbatch-role is not authorized to perform: lambda:InvokeFunction" in status.error


@pytest.fixture(scope="module")
def local(reacher, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDFOLD_HOME", str(tmp_path_factory.mktemp("local-home")))
        with Client() as c:
            yield c


@pytest.mark.parametrize("backend", ["local", "moto"])
@pytest.mark.parametrize(
    "target, refusal",
    [
        ("ledger/stolen/x", "does not declare the 'ledger' right"),
        ("jobs/another-job/x", "another job's folder"),
    ],
)
def test_a_task_is_refused_what_its_kind_does_not_declare(backend, target, refusal, request):
    client = request.getfixturevalue("client" if backend == "moto" else "local")
    job = client.submit({"kind": "reacher", "target": target})
    status = job.wait(progress=False, timeout_s=WAIT_S)
    assert status.state == "FAILED" and "AccessDenied" in status.error and refusal in status.error, (
        status.error
    )
    assert not store.exists(client.uri(target))


def test_the_role_refuses_it_even_when_the_task_skips_its_check(client):
    job = client.submit({"kind": "reacher", "target": "ledger/stolen/x", "skip_check": True})
    status = job.wait(progress=False, timeout_s=WAIT_S)
    assert status.state == "FAILED" and "AccessDenied" in status.error, status.error
    assert "ledger/stolen/x: access denied" in status.error
    assert not store.exists(client.uri("ledger/stolen/x"))
    ok = client.submit({"kind": "reacher", "target": "results/reached.bin"}).wait(
        progress=False, timeout_s=WAIT_S
    )
    assert ok.state == "SUCCEEDED", ok.error


def _dp_round(client, tag: str) -> dict:
    rng = np.random.default_rng(3)
    base = {"w": rng.standard_normal((4, 8)).astype(np.float32)}
    keys = [f"rounds/{tag}/client-{i}.safetensors" for i in range(3)]
    for i, key in enumerate(keys):
        client.fedavg.save_update({"w": base["w"] + 0.01 * i}, key)
    client.fedavg.save_update(base, f"rounds/{tag}/global.safetensors")
    dp = {
        "clip_norm": 0.5,
        "noise_multiplier": 1.0,
        "dataset_id": f"fed-{tag}",
        "dataset_budget_rho": 5.0,
        "base": f"rounds/{tag}/global.safetensors",
    }
    job = client.fedavg.submit(keys, dp=dp)
    return {"status": job.wait(progress=False, timeout_s=WAIT_S), "job": job}


def test_a_removed_ledger_grant_fails_a_dp_round_with_access_denied(client, stack):
    """The grant DP-FedAvg's prepare needs to reserve its budget: taken away, the round fails naming the
    denied ledger write; given back (the policy infra builds), the same round succeeds."""
    roles = boto3.client("iam")
    name = f"{stack.outputs['function_names']['fedavg.prepare']}-role"
    policy = roles.get_role_policy(RoleName=name, PolicyName=f"{name}-policy")["PolicyDocument"]
    without = json.loads(json.dumps(policy))
    for st in without["Statement"]:
        if st.get("Sid") == "WriteObjects":
            st["Resource"] = [r for r in st["Resource"] if not r.endswith("/ledger/*")]
    assert without != policy
    roles.put_role_policy(RoleName=name, PolicyName=f"{name}-policy", PolicyDocument=json.dumps(without))
    try:
        denied = _dp_round(client, "denied")["status"]
        assert denied.state == "FAILED", denied.error
        assert "step prepare failed: AccessDenied" in denied.error and "/ledger/fed-denied" in denied.error
    finally:
        roles.put_role_policy(RoleName=name, PolicyName=f"{name}-policy", PolicyDocument=json.dumps(policy))
    granted = _dp_round(client, "granted")
    assert granted["status"].state == "SUCCEEDED", granted["status"].error
    assert granted["job"].result()["privacy"]["ledger"]["jobs"] == 1
