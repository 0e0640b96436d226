"""One way in: the SDK, the CLI, ``shardfold watch`` and the bucket trigger refuse the same spec alike.

Every path calls :func:`functions.submit.submit`, so a rule holds on all of them: here the plan check (a
task that would not fit its memory) and the S3 store's refusal of local files. On the S3 store the memory is
the deployed size, and the refusal names the stack setting that raises it.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from shardfold.client import Client
from shardfold.client.cli import cli
from shardfold.functions import access, store
from shardfold.functions import trigger as trigger_mod
from shardfold.functions.access import Grants
from shardfold.functions.errors import PlanError, SpecError, UnsafeKey
from shardfold.functions.trigger import dispatch, handler

EVENTS = Path(__file__).resolve().parent.parent / "events"
# 300,000 items in a manifest (1.2 MB, so submit counts them from its first MiB): the prepare task would
# hold them all parsed. (No object size makes a getbatch task too big: its engine streams a large item.)
LONG_MANIFEST = b'"a"\n' * 300_000
OVER = {"kind": "getbatch", "manifest": "requests/long.jsonl"}
REFUSAL = "plan refused: step 'prepare' (getbatch.prepare) needs ~706 MiB per task but gets 512 MiB"


def started(*_: str) -> str:
    pytest.fail("a refused spec must not start")


@pytest.fixture
def local(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    with Client() as client:
        yield client


def test_sdk_cli_and_watch_refuse_alike(local, tmp_path):
    store.put(local.uri("requests/long.jsonl"), LONG_MANIFEST)
    with pytest.raises(PlanError) as sdk:
        local.submit(OVER)
    message = str(sdk.value)
    assert message.startswith(REFUSAL) and "memory_mb of step 'prepare'" in message

    spec = tmp_path / "over.json"
    spec.write_text(json.dumps(OVER))
    run = CliRunner().invoke(cli, ["run", str(spec)])
    assert run.exit_code == 1 and " ".join(run.output.split()) == f"error: {message}"

    drop = tmp_path / "drop"
    drop.mkdir()
    (drop / "over.json").write_text(json.dumps(OVER))
    watched = CliRunner().invoke(cli, ["watch", str(drop), "--once"])
    assert watched.exit_code == 0, watched.output
    report = json.loads((drop / "over.error.json").read_text())
    assert report["error"] == message
    assert not (tmp_path / "store" / "jobs").exists() or not any((tmp_path / "store" / "jobs").iterdir())


@pytest.mark.slow
def test_sdk_and_bucket_trigger_refuse_alike_against_the_deployed_sizes(monkeypatch):
    monkeypatch.setattr(trigger_mod, "_sfn_clients", {})
    with Client(backend="moto") as client:
        outputs = client.executor.outputs
        store.put(client.uri("requests/long.jsonl"), LONG_MANIFEST)
        with pytest.raises(PlanError) as sdk:
            client.submit(OVER)
        message = str(sdk.value)
        assert message.startswith(REFUSAL)
        assert """`pulumi config set --path 'shardfold:functionMemory["getbatch.prepare"]' <MB>`""" in message

        monkeypatch.setenv("SHARDFOLD_STATE_MACHINES", json.dumps(outputs["state_machine_arns"]))
        monkeypatch.setenv(trigger_mod.SIZES_ENV, json.dumps(outputs["sizes"]))
        bucket = outputs["bucket"]
        store.put(f"s3://{bucket}/jobs/over.json", json.dumps(OVER).encode())
        event = json.loads((EVENTS / "dispatch_object_created.json").read_text())
        event["detail"]["bucket"]["name"] = bucket
        event["detail"]["object"]["key"] = "jobs/over.json"
        report = handler(event, None)
        assert report["error"] == message

        # a bigger deployed prepare function takes the same spec
        sizes = json.loads(json.dumps(outputs["sizes"]))
        sizes["functions"]["getbatch.prepare"]["memory_mb"] = 3008
        root = f"s3://{bucket}"
        ok = dispatch(f"{root}/jobs/over.json", lambda *a: "started", root=root, deployed=sizes)
        assert ok["state"] == "RUNNING", ok


def test_local_files_are_refused_on_the_s3_store_on_every_path(monkeypatch):
    # the functions would read their own filesystem (/proc/self/environ holds the role's credentials)
    spec = {"kind": "getbatch", "items": [{"uri": "s3://bkt/ok"}, {"uri": "file:///proc/self/environ"}]}
    with pytest.raises(SpecError, match=r"items\.1\.uri") as refused:
        trigger_mod.submit(spec, store_root="s3://bucket", start=started)
    ((error,),) = [refused.value.errors]
    assert error["field"] == "items.1.uri"
    assert error["error"].startswith(
        "file:///proc/self/environ is a local file; the S3 store reads only s3:// objects"
    )
    monkeypatch.setattr(store, "get", lambda uri: json.dumps(spec).encode())
    monkeypatch.setattr(store, "size", lambda uri: len(json.dumps(spec)))
    monkeypatch.setattr(store, "exists", lambda uri: False)
    monkeypatch.setattr(store, "put_if_absent", lambda uri, data: True)
    monkeypatch.setattr(store, "delete", lambda uri: None)
    written = {}
    monkeypatch.setattr(store, "put_json", lambda uri, doc: written.setdefault(uri, doc))
    report = dispatch("s3://bucket/jobs/x.json", started)
    assert report["errors"] == refused.value.errors
    assert [u for u in written if not u.endswith(".claim")] == ["s3://bucket/jobs/x.error.json"]


def test_other_buckets_only_where_the_deployment_grants_them(monkeypatch):
    # readBuckets lets jobs read (a prefix of) another bucket; writeBuckets read and write; nothing else
    grants = Grants(("results/",), read_buckets=("datasets/public",), write_buckets=("exports",))

    def refused(spec: dict) -> list[dict]:
        with pytest.raises(SpecError) as err:
            trigger_mod.submit(spec, store_root="s3://bucket", start=started, grants=grants)
        return err.value.errors

    ok = [
        {"kind": "getbatch", "items": [{"uri": "s3://datasets/public/a.bin"}], "output": "results/a.tar"},
        {"kind": "getbatch", "items": [{"uri": "s3://exports/a.bin"}], "output": "s3://exports/out/a.tar"},
        {"kind": "getbatch", "items": [{"uri": "s3://bucket/data/a.bin"}], "output": "results/a.tar"},
    ]
    from shardfold.functions.specs import parse_spec
    from shardfold.functions.submit import check_policy

    for spec in ok:
        check_policy(parse_spec(spec), "s3://bucket", grants)
    read = refused({"kind": "getbatch", "items": [{"uri": "s3://datasets/private/a.bin"}]})
    assert read[0]["field"] == "items.0.uri" and "shardfold:readBuckets" in read[0]["error"]
    wrote = refused(
        {"kind": "getbatch", "items": [{"uri": "data/a"}], "output": "s3://datasets/public/x.tar"}
    )
    assert wrote[0]["field"] == "output" and "shardfold:writeBuckets" in wrote[0]["error"]
    # the tasks hold a spec to the grants in their environment, as deployed
    monkeypatch.setenv("SHARDFOLD_OUTPUT_PREFIXES", "results/")
    monkeypatch.setenv("SHARDFOLD_READ_BUCKETS", "datasets/public")
    assert access.input_uri("s3://datasets/public/a", "s3://bucket") == "s3://datasets/public/a"
    with pytest.raises(UnsafeKey, match="readBuckets"):
        access.input_uri("s3://datasets/other/a", "s3://bucket", "items.0.uri")
    # locally the user's own credentials decide: any bucket
    assert access.input_uri("s3://datasets/other/a", "file:///srv/store") == "s3://datasets/other/a"


def test_outputs_only_where_the_deployment_lets_jobs_write(monkeypatch):
    # the SDK knows the stack's output prefixes; the deployed functions have them in their environment
    spec = {"kind": "getbatch", "items": [{"uri": "data/a.bin"}], "output": "elsewhere/a.tar"}
    with pytest.raises(SpecError, match=r"outputPrefixes") as refused:
        trigger_mod.submit(spec, store_root="s3://bucket", start=started, grants=Grants(("results/",)))
    assert refused.value.errors[0]["field"] == "output"
    monkeypatch.setenv("SHARDFOLD_OUTPUT_PREFIXES", "results/,exports")
    with pytest.raises(SpecError, match=r"results/, exports/"):
        trigger_mod.submit(spec, store_root="s3://bucket", start=started)
    ok = {**spec, "output": "exports/a.tar"}
    from shardfold.functions.specs import parse_spec
    from shardfold.functions.submit import check_policy

    check_policy(parse_spec(ok), "s3://bucket")  # allowed by the environment
    check_policy(parse_spec(spec), "file:///srv/store")  # locally the user's machine: anywhere


def _reads(monkeypatch) -> dict[str, int]:
    """Count what the store is asked for: objects read (GETs) and their bytes, objects sized."""
    seen = {"gets": 0, "bytes": 0, "sized": 0}
    get, sizes, size = store.get, store.sizes, store.size

    def counted_get(uri, start=0, length=None):
        data = get(uri, start, length)
        seen["gets"] += 1
        seen["bytes"] += len(data)
        return data

    def counted_sizes(uris):
        seen["sized"] += len(uris)
        return sizes(uris)

    def counted_size(uri):
        seen["sized"] += 1
        return size(uri)

    monkeypatch.setattr(store, "get", counted_get)
    monkeypatch.setattr(store, "sizes", counted_sizes)
    monkeypatch.setattr(store, "size", counted_size)
    return seen


def test_submit_reads_a_bounded_probe(local, tmp_path, monkeypatch):
    import numpy as np

    from shardfold.functions.estimate import SUBMIT_BUDGET

    # inference: a 3 MiB JSONL is not read in full at submit (the prepare step counts its rows exactly)
    rows = "".join(json.dumps({"text": f"sentence {i} " + "word " * 40}) + "\n" for i in range(15_000))
    (tmp_path / "corpus.jsonl").write_text(rows)
    # fedavg: 40 clients, of which submit reads at most 32 headers
    for i in range(40):
        local.fedavg.save_update({"w": np.full(4, i, np.float32)}, f"u/{i:02d}.safetensors", num_examples=1)
    monkeypatch.setattr(local.executor, "start", lambda *a: None)  # what submit does, not the job

    seen = _reads(monkeypatch)
    local.submit({"kind": "inference", "inputs": [(tmp_path / "corpus.jsonl").as_uri()], "field": "text"})
    assert len(rows) > 3 * SUBMIT_BUDGET.data_bytes and seen["bytes"] <= SUBMIT_BUDGET.data_bytes

    seen = _reads(monkeypatch)
    job = local.submit({"kind": "fedavg", "clients": [{"uri": f"u/{i:02d}.safetensors"} for i in range(40)]})
    assert seen["sized"] <= SUBMIT_BUDGET.objects and seen["gets"] <= 2 * SUBMIT_BUDGET.objects
    # what the probe learned is recorded beside the spec
    assert store.get_json(local.uri(f"jobs/{job.job_id}/probe.json"))["headers_read"] == SUBMIT_BUDGET.objects

    # getbatch: no object is read or even sized at submit (its gather task's memory needs no size)
    seen = _reads(monkeypatch)
    job = local.submit({"kind": "getbatch", "items": [{"uri": f"u/{i:02d}.safetensors"} for i in range(40)]})
    assert seen == {"gets": 0, "bytes": 0, "sized": 0}
    assert store.get_json(local.uri(f"jobs/{job.job_id}/probe.json"))["sizes_probed"] == 0
    # ... but one HEAD shows that an S3 endpoint answers, unless it answered this process just now
    from shardfold.functions.store import s3

    s3_items = {"kind": "getbatch", "items": [{"uri": f"s3://bkt/{i}.bin"} for i in range(40)]}

    def sized(uris):
        seen["sized"] += len(uris)
        return dict.fromkeys(uris, 10)

    monkeypatch.setattr(store, "sizes", sized)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # as a user of S3 has (submit checks there are some)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    for recent, heads in ((False, 1), (True, 0)):
        seen["sized"] = 0
        monkeypatch.setattr(s3, "answered_within", lambda seconds, recent=recent: recent)
        local.submit(s3_items)
        assert seen["sized"] == heads


@pytest.mark.slow
def test_one_big_object_is_one_window_not_256(local, tmp_path):
    # the estimate once multiplied the engine's window (256) by the largest item even for one item
    (tmp_path / "big.bin").write_bytes(b"\x5a" * (5 * 1024 * 1024))
    job = local.submit({"kind": "getbatch", "items": [{"uri": (tmp_path / "big.bin").as_uri()}]})
    assert job.wait(progress=False).state == "SUCCEEDED"
    assert job.result()["bytes"] == 5 * 1024 * 1024
    gather = {
        s.name: s
        for s in local.plan({"kind": "getbatch", "items": [{"uri": (tmp_path / "big.bin").as_uri()}]}).steps
    }
    assert gather["gather_part"].peak_mb < 200


@pytest.mark.slow
def test_clean_removes_scratch_and_journals_of_ended_jobs(local, tmp_path, monkeypatch):
    (tmp_path / "a.bin").write_bytes(b"a" * 100)
    ok = local.submit({"kind": "getbatch", "items": [{"uri": (tmp_path / "a.bin").as_uri()}]})
    listed = tmp_path / "items.jsonl"  # a manifest's items are read by the job, not stat-ed at submit
    listed.write_text(json.dumps({"uri": (tmp_path / "missing.bin").as_uri()}) + "\n")
    bad = local.submit({"kind": "getbatch", "manifest": listed.as_uri()})
    assert ok.wait(progress=False).state == "SUCCEEDED" and bad.wait(progress=False).state == "FAILED"
    folder = tmp_path / "store" / "jobs"
    assert (folder / ok.job_id / "journal").exists() and (folder / bad.job_id / "getbatch").exists()
    assert local.clean(older_than_s=3600) == []  # both ended just now
    assert local.clean() == [ok.job_id]  # a FAILED job keeps what resume needs unless asked
    assert not (folder / ok.job_id / "journal").exists() and ok.result()["items"] == 1
    assert store.exists(ok.result()["archive"])
    run = CliRunner().invoke(cli, ["clean", "--failed"])
    assert run.exit_code == 0 and bad.job_id in run.output
    assert not (folder / bad.job_id / "getbatch").exists() and (folder / bad.job_id / "spec.json").exists()


@pytest.mark.slow
def test_watch_on_the_s3_store_holds_outputs_to_the_deployment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    drop = tmp_path / "drop"
    drop.mkdir()
    spec = {"kind": "getbatch", "items": [{"uri": "data/a.bin"}], "output": "elsewhere/a.tar"}
    (drop / "out.json").write_text(json.dumps(spec))
    watched = CliRunner().invoke(cli, ["watch", str(drop), "--once", "--backend", "moto"])
    assert watched.exit_code == 0, watched.output
    report = json.loads((drop / "out.error.json").read_text())
    assert report["errors"][0]["field"] == "output" and "outputPrefixes" in report["error"]


def test_lambda_is_priced_at_the_deployed_architecture(tmp_path):
    """The stack deploys arm64 unless lambdaArchitecture says x86_64; the plan prices the one deployed."""
    from shardfold.dryrun import stack_sizes
    from shardfold.functions import pricing
    from shardfold.functions.estimate import Limits, estimate
    from shardfold.functions.kinds import WORKFLOWS
    from shardfold.functions.specs import parse_spec

    root = f"file://{tmp_path}"
    store.put(f"{root}/data/a.bin", b"x" * 1000)
    spec = parse_spec({"kind": "getbatch", "items": [{"uri": "data/a.bin"}]})
    deployed = stack_sizes(WORKFLOWS)
    assert deployed["lambda_architecture"] == "arm64"
    arm = estimate(spec, root, limits=Limits(deployed))
    x86 = estimate(spec, root, limits=Limits({**deployed, "lambda_architecture": "x86_64"}))
    local = estimate(spec, root)  # no stack: what `pulumi up` would deploy
    ratio = x86.cost_usd["lambda_compute"] / arm.cost_usd["lambda_compute"]
    assert ratio == pytest.approx(pricing.LAMBDA_USD_PER_GB_S_BY_ARCH["x86_64"] / 0.0000133334)
    assert "Lambda priced at the arm64 rate" in local.notes and "Lambda priced at the arm64 rate" in arm.notes
    assert "Lambda priced at the x86_64 rate" in x86.notes


def test_plan_explain_lists_every_model_number_with_its_source(tmp_path, monkeypatch):
    from shardfold.functions import pricing

    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    spec = tmp_path / "s.json"
    (tmp_path / "home" / "data").mkdir(parents=True)
    (tmp_path / "home" / "data" / "a.bin").write_bytes(b"x")
    spec.write_text(json.dumps({"kind": "getbatch", "items": [{"uri": "data/a.bin"}]}))
    res = CliRunner().invoke(cli, ["plan", str(spec), "--explain"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for name, _value, _unit, source in pricing.MODEL:
        assert name in res.output and source in res.output


def test_a_found_credential_is_looked_up_once_per_environment_and_a_missing_one_every_time(monkeypatch):
    import boto3

    from shardfold.functions import submit as submit_mod
    from shardfold.functions.errors import NoCredentials
    from shardfold.functions.specs import parse_spec

    monkeypatch.setattr(submit_mod, "_FOUND_CREDENTIALS", set())
    found = {"value": object()}
    looks = []

    def get_credentials(self):
        looks.append(1)
        return found["value"]

    monkeypatch.setattr(boto3.session.Session, "get_credentials", get_credentials)
    spec = parse_spec({"kind": "getbatch", "items": [{"uri": "s3://some-bucket/a.bin"}]})
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "one")
    submit_mod.check_credentials(spec, "file:///tmp/store")
    submit_mod.check_credentials(spec, "file:///tmp/store")
    assert len(looks) == 1  # found once: kept for this environment
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "two")  # another environment is looked up again
    found["value"] = None
    for _ in range(2):  # missing: refused, and looked for again next time
        with pytest.raises(NoCredentials, match="s3://some-bucket/a.bin"):
            submit_mod.check_credentials(spec, "file:///tmp/store")
    assert len(looks) == 3


@pytest.mark.slow  # end to end: a job through the local executor
def test_a_one_object_5_mib_getbatch_runs_from_the_cli(local, tmp_path):
    """Issue 10's report: the estimate multiplied the read window by the largest item even for one item,
    and `shardfold run` refused this spec (~1347 MiB against 1024)."""
    body = bytes(range(256)) * (5 * 4096)  # 5 MiB
    store.put(local.uri("data/big.bin"), body)
    spec = tmp_path / "one.json"
    spec.write_text(json.dumps({"kind": "getbatch", "items": [{"uri": "data/big.bin"}]}))
    run = CliRunner().invoke(cli, ["run", str(spec)], catch_exceptions=False)
    assert run.exit_code == 0 and "SUCCEEDED" in run.output, run.output
    (status,) = local.jobs()
    with tarfile.open(fileobj=io.BytesIO(store.get(local.job(status.job_id).result()["archive"]))) as tf:
        (member,) = tf.getmembers()
        assert tf.extractfile(member).read() == body
