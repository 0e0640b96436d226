"""The bucket trigger: dispatch core on the local store, and the Lambda handler on S3 via moto."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

from shardfold.functions import store
from shardfold.functions import trigger as trigger_mod
from shardfold.functions.errors import SpecError, StoreUnreachable
from shardfold.functions.specs import parse_spec
from shardfold.functions.store.uri import join, store_root
from shardfold.functions.trigger import dispatch, handler, ignore_reason

EVENTS = Path(__file__).resolve().parent.parent / "events"
GOOD = {"kind": "getbatch", "items": [{"uri": "data/a.bin"}, {"uri": "data/b.bin", "start": 2, "length": 3}]}
# four independent mistakes: every one must be reported, not just the first
BAD = {
    "kind": "getbatch",
    "items": [{"uri": "", "start": -1}],
    "items_per_part": 0,
    "colour": "blue",
}


class Starter:
    """Records start() calls instead of running anything."""

    def __init__(self, result: str | None = "exec-1"):
        self.calls: list[tuple[str, str, str]] = []
        self.result = result

    def __call__(self, job_id: str, kind: str, spec_uri: str) -> str | None:
        self.calls.append((job_id, kind, spec_uri))
        return self.result


@pytest.fixture
def root(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    root = store_root()
    # the objects the specs name (submit refuses a local file that is not there)
    for key in ("data/a.bin", "data/b.bin", "jobs/data/a.bin"):
        store.put(join(root, key), b"0123456789")
    return root


def put_spec(root: str, name: str, doc: dict | bytes) -> str:
    uri = join(root, "jobs", name)
    store.put(uri, doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    return uri


# --- core on the local store --------------------------------------------------------------------------------


def test_valid_spec_starts_job_and_writes_status(root):
    start = Starter()
    uri = put_spec(root, "nightly.json", GOOD)
    report = dispatch(uri, start)
    assert report["kind"] == "getbatch" and report["state"] == "RUNNING" and report["execution"] == "exec-1"
    job_id = report["job_id"]
    assert start.calls == [(job_id, "getbatch", join(root, "jobs", job_id, "spec.json"))]
    assert store.get_json(join(root, "jobs", "nightly.status.json")) == report
    assert not store.exists(join(root, "jobs", "nightly.error.json"))
    # the canonical spec is the validated document (a dropped spec names only the store's objects), and it
    # round-trips
    assert parse_spec(store.get_json(report["spec_uri"])) == parse_spec({**GOOD, "local_files": False})


def test_duplicate_delivery_does_not_start_twice(root):
    start = Starter()
    uri = put_spec(root, "once.json", GOOD)
    first = dispatch(uri, start)
    again = dispatch(uri, start)
    assert again["job_id"] == first["job_id"] and len(start.calls) == 1
    # new bytes at the same key are a new job
    put_spec(root, "once.json", {**GOOD, "items_per_part": 1})
    third = dispatch(uri, start)
    assert third["job_id"] != first["job_id"] and len(start.calls) == 2


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_concurrent_deliveries_of_one_event_start_one_job(root):
    # two copies of one bucket event, both past the "already dispatched?" check before either reports
    import threading

    gate = threading.Barrier(2)
    calls: list[str] = []

    def slow_start(job_id: str, kind: str, spec_uri: str) -> str:
        calls.append(job_id)
        return "exec"

    real_exists = store.exists
    looks: list[str] = []

    def exists(uri: str) -> bool:
        if uri.endswith("twice.status.json"):
            looks.append(uri)
            if len(looks) <= 2:  # both deliveries' first look, at the same moment; later looks pass
                gate.wait(timeout=10)
        return real_exists(uri)

    uri = put_spec(root, "twice.json", GOOD)
    reports: list[dict] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(store, "exists", exists)
        threads = [
            threading.Thread(target=lambda: reports.append(dispatch(uri, slow_start))) for _ in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert len(calls) == 1, reports
    assert len(reports) == 2, reports  # neither delivery raised
    assert sorted("job_id" in r for r in reports) == [False, True] or all(
        r.get("job_id") == calls[0] for r in reports
    )


def test_a_claim_left_by_a_dead_delivery_expires(root, monkeypatch):
    start = Starter()
    uri = put_spec(root, "retry.json", GOOD)
    raw = store.get(uri)
    import hashlib

    claim = trigger_mod.claim_uri(uri, f"sha256:{hashlib.sha256(raw).hexdigest()}")
    store.put(claim, json.dumps({"claimed_at": 0}).encode())  # a delivery that died long ago
    report = dispatch(uri, start)
    assert report["state"] == "RUNNING" and len(start.calls) == 1
    store.put(claim, json.dumps({"claimed_at": __import__("time").time()}).encode())
    store.delete(join(root, "jobs", "retry.status.json"))
    assert "duplicate" in dispatch(uri, start) and len(start.calls) == 1  # a live claim: someone else has it


def test_oversized_inline_spec_is_refused_unread(root, monkeypatch):
    monkeypatch.setattr(trigger_mod, "MAX_SPEC_BYTES", 1000)
    read = []
    monkeypatch.setattr(store, "get", lambda *a, **k: read.append(a) or b"")
    start = Starter()
    uri = put_spec(root, "huge.json", {**GOOD, "items": [{"uri": f"data/{i}.bin"} for i in range(100)]})
    report = dispatch(uri, start)
    assert "manifest" in report["error"] and not read and not start.calls


def test_invalid_spec_reports_every_error_and_starts_nothing(root):
    start = Starter()
    uri = put_spec(root, "bad.json", BAD)
    report = dispatch(uri, start)
    assert start.calls == []
    assert store.get_json(join(root, "jobs", "bad.error.json")) == report
    assert not store.exists(join(root, "jobs", "bad.status.json"))
    fields = {e["field"] for e in report["errors"]}
    assert {"items.0.uri", "items.0.start", "items_per_part", "colour"} <= fields
    assert all(e["error"] for e in report["errors"])
    assert not store.list_uris(join(root, "jobs") + "/") or all(
        "/spec.json" not in u for u in store.list_uris(join(root, "jobs") + "/")
    )


def test_a_hostile_dpquery_matrix_is_reported_naming_its_row(root):
    """A dpquery spec dropped in the bucket with an explicit query matrix whose weight is 10^400, or whose row
    is short: refused by the same spec model as every other entry path, the error naming its field."""
    start = Starter()
    for name, queries, field, words in [
        ("huge.json", [[10**400, 0, 0, 0, 0, 0, 0, 1]], "workload.0.queries", "row 0, entry 0 is not 0"),
        ("short.json", [[1, 0, 0, 0, 0, 0, 0, 1], [1, 1]], "workload.0.queries.1", "2 entries; the marginal"),
    ]:
        doc = {
            "kind": "dpquery",
            "dataset": "data/people.csv",
            "schema": [{"name": "sex", "categories": ["f", "m"]}, {"name": "age", "range": [0, 3]}],
            "workload": [{"attributes": ["sex", "age"], "queries": queries}],
            "budget": {"rho": 0.1},
            "dataset_id": "people",
            "dataset_budget_rho": 1.0,
        }
        report = dispatch(put_spec(root, name, doc), start)
        assert [e["field"] for e in report["errors"]] == [field] and words in report["error"], report
    assert start.calls == []


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"min_clients": 0}, "min_clients"),
        ({"wait_s": 10**9}, "wait_s"),
        ({"secure": True, "min_clients": 1}, "min_clients"),
        ({"dp": {"clip_norm": -1, "noise_multiplier": 1, "dataset_id": "fed"}}, "dp.clip_norm"),
        ({"dp": {"clip_norm": 1, "noise_multiplier": 1, "dataset_id": "../../ledger"}}, "dp.dataset_id"),
    ],
)
def test_a_hostile_fedavg_round_is_reported_naming_the_field(root, extra, field):
    """A fedavg spec dropped in the bucket with bad dropout, DP or secure options is refused naming the
    field, as on every other entry path, and starts nothing (a local base model on the S3 store: below)."""
    start = Starter()
    doc = {
        "kind": "fedavg",
        "clients": [{"uri": "rounds/1/a.safetensors"}, {"uri": "rounds/1/b.safetensors"}],
    }
    report = dispatch(put_spec(root, "round.json", {**doc, **extra}), start)
    assert field in [e["field"] for e in report["errors"]], report
    assert start.calls == []


def test_unknown_kind_is_reported(root):
    report = dispatch(put_spec(root, "what.json", {"kind": "teleport"}), Starter())
    assert report["errors"][0]["field"] == "kind" and "teleport" in report["error"]


@pytest.mark.parametrize("payload", [b"{not json", b"\xff\xfe\x00garbage", b"[1, 2, 3]"])
def test_non_json_or_non_object_spec_is_reported(root, payload):
    start = Starter()
    report = dispatch(put_spec(root, "junk.json", payload), start)
    assert start.calls == [] and report["errors"] and report["error"]
    assert store.exists(join(root, "jobs", "junk.error.json"))


def test_fixed_spec_replaces_error_report(root):
    uri = put_spec(root, "fixme.json", BAD)
    dispatch(uri, Starter())
    assert store.exists(join(root, "jobs", "fixme.error.json"))
    put_spec(root, "fixme.json", GOOD)
    report = dispatch(uri, Starter())
    assert report["state"] == "RUNNING"
    assert not store.exists(join(root, "jobs", "fixme.error.json"))


def test_start_refusal_is_reported(root):
    def refuse(job_id, kind, spec_uri):
        raise trigger_mod.ShardfoldError(f"job kind {kind!r} is not deployed here")

    report = dispatch(put_spec(root, "nodeploy.json", GOOD), refuse)
    assert "not deployed" in report["error"]


def test_unreachable_store_is_raised_for_a_retry_not_reported(root, monkeypatch):
    # not the spec's fault: Lambda's async retry (or watch's next save) tries again; no error report
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    start = Starter()
    uri = put_spec(root, "s3.json", {"kind": "getbatch", "items": [{"uri": "s3://inputs/a.bin"}]})
    with pytest.raises(StoreUnreachable, match=f"cannot reach the S3 endpoint http://127.0.0.1:{port}"):
        dispatch(uri, start)
    assert start.calls == [] and not store.exists(join(root, "jobs", "s3.error.json"))


@pytest.mark.parametrize(
    "key",
    [
        "jobs/x.status.json",
        "jobs/x.error.json",
        "jobs/getbatch-20260101T000000-abcdef/spec.json",
        "jobs/sub/x.json",
        "data/x.json",
        "x.json",
        "jobs/readme.txt",
    ],
)
def test_ignored_keys_local(root, key):
    start = Starter()
    uri = join(root, key)
    store.put(uri, json.dumps(GOOD).encode())
    before = set(store.list_uris(root + "/"))
    report = dispatch(uri, start)
    assert set(report) == {"ignored"} and report["ignored"]
    assert start.calls == [] and set(store.list_uris(root + "/")) == before


def test_relative_data_paths_resolve_beside_the_spec_inside_the_store_only(root, tmp_path):
    # a spec dropped under jobs/ names its data relative to itself, inside the store
    report = dispatch(
        put_spec(root, "rel.json", {"kind": "getbatch", "items": [{"uri": "./data/a.bin"}]}), Starter()
    )
    assert store.get_json(report["spec_uri"])["items"][0]["uri"] == join(root, "jobs", "data", "a.bin")
    # one dropped into a `watch` directory outside the store may not reach the files beside it (nor, through
    # ../, anything else of this machine): whoever may write the folder is not the machine's user
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    for rel in ("./data/a.bin", "../../../../../../etc/hostname"):
        (inbox / "s.json").write_text(json.dumps({"kind": "getbatch", "items": [{"uri": rel}]}))
        report = dispatch((inbox / "s.json").as_uri(), Starter(), root=root)
        assert report["errors"][0]["field"] == "items.0.uri" and "outside the store" in report["error"], (
            report
        )
    assert ignore_reason((inbox / "s.json").as_uri()) is None


# --- the Lambda handler on S3 (moto) ----------------------------------------------------------------------

BUCKET = "shardfold-jobs-test"


@pytest.fixture
def aws(aws_env, monkeypatch):
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setattr(trigger_mod, "_sfn_clients", {})
    with mock_aws():
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        sfn = boto3.client("stepfunctions")
        arn = sfn.create_state_machine(
            name="shardfold-getbatch",
            definition=json.dumps({"StartAt": "Done", "States": {"Done": {"Type": "Succeed"}}}),
            roleArn="arn:aws:iam::123456789012:role/sfn",
        )["stateMachineArn"]
        monkeypatch.setenv("SHARDFOLD_STATE_MACHINES", json.dumps({"getbatch": arn}))
        yield {"s3": boto3.client("s3"), "sfn": sfn, "arn": arn}


def event_for(key: str, bucket: str = BUCKET) -> dict:
    event = json.loads((EVENTS / "dispatch_object_created.json").read_text())
    event["detail"]["bucket"]["name"] = bucket
    event["detail"]["object"]["key"] = key
    return event


def s3_json(aws, key: str) -> dict:
    return json.loads(aws["s3"].get_object(Bucket=BUCKET, Key=key)["Body"].read())


@pytest.mark.slow
def test_handler_starts_state_machine(aws):
    aws["s3"].put_object(Bucket=BUCKET, Key="jobs/nightly.json", Body=json.dumps(GOOD).encode())
    report = handler(event_for("jobs/nightly.json"), None)
    job_id = report["job_id"]
    assert s3_json(aws, "jobs/nightly.status.json") == report
    execution = aws["sfn"].describe_execution(executionArn=report["execution"])
    assert execution["name"] == job_id and execution["stateMachineArn"] == aws["arn"]
    assert json.loads(execution["input"]) == {
        "job_id": job_id,
        "spec_uri": f"s3://{BUCKET}/jobs/{job_id}/spec.json",
        "store_root": f"s3://{BUCKET}",
    }
    assert parse_spec(s3_json(aws, f"jobs/{job_id}/spec.json")) == parse_spec({**GOOD, "local_files": False})
    status = s3_json(aws, f"jobs/{job_id}/status.json")
    assert status["execution_arn"] == report["execution"] and status["backend"] == "aws"


@pytest.mark.slow
def test_handler_refuses_a_dp_round_whose_base_model_is_a_local_file(aws):
    """dp.base is an input like any other: on the S3 store a local file is refused, naming the field."""
    doc = {
        "kind": "fedavg",
        "clients": [{"uri": "rounds/1/a.safetensors"}, {"uri": "rounds/1/b.safetensors"}],
        "dp": {"clip_norm": 1, "noise_multiplier": 1, "dataset_id": "fed", "base": "file:///etc/passwd"},
    }
    aws["s3"].put_object(Bucket=BUCKET, Key="jobs/round.json", Body=json.dumps(doc).encode())
    report = handler(event_for("jobs/round.json"), None)
    assert [e["field"] for e in report["errors"]] == ["dp.base"], report
    assert aws["sfn"].list_executions(stateMachineArn=aws["arn"])["executions"] == []


@pytest.mark.slow
def test_handler_url_decodes_keys(aws):
    aws["s3"].put_object(Bucket=BUCKET, Key="jobs/my spec.json", Body=json.dumps(GOOD).encode())
    report = handler(event_for("jobs/my+spec.json"), None)
    assert report["state"] == "RUNNING"
    assert s3_json(aws, "jobs/my spec.status.json")["job_id"] == report["job_id"]


@pytest.mark.slow
def test_handler_reports_invalid_spec_on_s3(aws):
    aws["s3"].put_object(Bucket=BUCKET, Key="jobs/bad.json", Body=json.dumps(BAD).encode())
    report = handler(event_for("jobs/bad.json"), None)
    assert s3_json(aws, "jobs/bad.error.json") == report
    assert {"items.0.uri", "items.0.start", "items_per_part", "colour"} <= {
        e["field"] for e in report["errors"]
    }
    assert aws["sfn"].list_executions(stateMachineArn=aws["arn"])["executions"] == []


@pytest.mark.slow
def test_handler_reports_non_json_on_s3(aws):
    aws["s3"].put_object(Bucket=BUCKET, Key="jobs/junk.json", Body=b"kind: getbatch")
    report = handler(event_for("jobs/junk.json"), None)
    assert "not valid JSON" in report["error"]
    assert "error" in s3_json(aws, "jobs/junk.error.json")


@pytest.mark.slow
def test_handler_kind_not_deployed(aws, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_STATE_MACHINES", "{}")
    aws["s3"].put_object(Bucket=BUCKET, Key="jobs/n.json", Body=json.dumps(GOOD).encode())
    report = handler(event_for("jobs/n.json"), None)
    assert "not deployed" in report["error"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "key",
    [
        "jobs/x.status.json",
        "jobs/x.error.json",
        "jobs/getbatch-20260101T000000-abcdef/spec.json",
        "in/x.json",
    ],
)
def test_handler_ignores_non_spec_keys_on_s3(aws, key):
    aws["s3"].put_object(Bucket=BUCKET, Key=key, Body=json.dumps(GOOD).encode())
    report = handler(event_for(key), None)
    assert set(report) == {"ignored"}
    keys = [o["Key"] for o in aws["s3"].list_objects_v2(Bucket=BUCKET).get("Contents", [])]
    assert keys == [key]
    assert aws["sfn"].list_executions(stateMachineArn=aws["arn"])["executions"] == []


def test_sample_events():
    # the shipped not-a-job event is ignored without touching AWS; a malformed envelope is a SpecError
    assert "ignored" in handler(json.loads((EVENTS / "dispatch_not_a_job.json").read_text()), None)
    assert "ignored" in handler({"detail-type": "Object Deleted"}, None)
    with pytest.raises(SpecError) as exc:
        handler({"detail-type": "Object Created", "detail": {"bucket": {}}}, None)
    assert exc.value.errors


@pytest.mark.slow
def test_dispatch_to_a_real_workflow_on_moto(tmp_path, monkeypatch):
    # end to end: a spec dropped in the bucket runs the compiled getbatch state machine (moto harness),
    # and the AWS executor reads the job the trigger started like one it started itself
    from shardfold.dryrun import MotoStack
    from shardfold.orchestrator.aws import AwsExecutor

    monkeypatch.setattr(trigger_mod, "_sfn_clients", {})
    with MotoStack() as stack:
        outputs = stack.outputs
        bucket = outputs["bucket"]
        store.put(f"s3://{bucket}/data/a.bin", b"alpha")
        store.put(f"s3://{bucket}/data/b.bin", b"bravo")
        dropped = {**GOOD, "output": "results/dropped.tar"}  # an output: submit claims it
        store.put(f"s3://{bucket}/jobs/drop.json", json.dumps(dropped).encode())
        # under the dispatch role, as deployed: it reads the spec, claims the outputs, starts the job
        report = stack.dispatch(event_for("jobs/drop.json", bucket=bucket))
        status = AwsExecutor(outputs).wait(report["job_id"])
        assert status.state == "SUCCEEDED", status.error
        result = store.get_json(f"s3://{bucket}/jobs/{report['job_id']}/result.json")
        assert result["items"] == 2 and result["bytes"] == len(b"alpha") + len(b"avo")


@pytest.mark.slow
def test_a_reupload_of_earlier_bytes_is_a_new_job_and_a_repeated_delivery_is_not(aws):
    """v1, v2, then v1 again of one key: three uploads, three jobs, even within the claim's lifetime; each
    event delivered twice (EventBridge delivers at least once) still starts one job."""
    versions = [GOOD, {**GOOD, "items_per_part": 1}, GOOD]
    jobs = []
    for n, spec in enumerate(versions):
        put = aws["s3"].put_object(Bucket=BUCKET, Key="jobs/nightly.json", Body=json.dumps(spec).encode())
        event = event_for("jobs/nightly.json")
        event["detail"]["object"].update(sequencer=f"00617F0829932{n:05d}", etag=put["ETag"].strip('"'))
        first, again = handler(event, None), handler(event, None)
        assert "job_id" in first and again == first, (first, again)
        jobs.append(first["job_id"])
    assert len(set(jobs)) == 3
    names = {e["name"] for e in aws["sfn"].list_executions(stateMachineArn=aws["arn"])["executions"]}
    assert names == set(jobs)  # one execution per upload, none for the repeated deliveries
