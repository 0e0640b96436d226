"""One way in: the SDK, the CLI, ``shardfold watch`` and the bucket trigger refuse the same spec alike.

Every path calls :func:`functions.submit.submit`, so a rule holds on all of them: here the plan check (a
task that would not fit its memory) and the S3 store's refusal of local files. On the S3 store the memory is
the deployed size, and the refusal names the stack setting that raises it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from client import Client
from client.cli import cli
from functions import store
from functions import trigger as trigger_mod
from functions.errors import PlanError, SpecError
from functions.trigger import dispatch, handler

EVENTS = Path(__file__).resolve().parent.parent / "events"
# 2 GiB in one range: the gather task would buffer it whole; ranges need no HEAD, so no data is needed
OVER = {"kind": "getbatch", "items": [{"uri": "data/huge.bin", "start": 0, "length": 2 * 1024**3}]}
REFUSAL = "plan refused: step 'gather_part' (getbatch.gather) needs ~2232 MiB per task but gets 1024 MiB"


def started(*_: str) -> str:
    pytest.fail("a refused spec must not start")


@pytest.fixture
def local(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    with Client() as client:
        yield client


def test_sdk_cli_and_watch_refuse_alike(local, tmp_path):
    with pytest.raises(PlanError) as sdk:
        local.submit(OVER)
    message = str(sdk.value)
    assert message.startswith(REFUSAL) and "memory_mb of step 'gather_part'" in message

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
        with pytest.raises(PlanError) as sdk:
            client.submit(OVER)
        message = str(sdk.value)
        assert message.startswith(REFUSAL)
        assert """`pulumi config set --path 'shardfold:functionMemory["getbatch.gather"]' <MB>`""" in message

        monkeypatch.setenv("SHARDFOLD_STATE_MACHINES", json.dumps(outputs["state_machine_arns"]))
        monkeypatch.setenv(trigger_mod.SIZES_ENV, json.dumps(outputs["sizes"]))
        bucket = outputs["bucket"]
        store.put(f"s3://{bucket}/jobs/over.json", json.dumps(OVER).encode())
        event = json.loads((EVENTS / "dispatch_object_created.json").read_text())
        event["detail"]["bucket"]["name"] = bucket
        event["detail"]["object"]["key"] = "jobs/over.json"
        report = handler(event, None)
        assert report["error"] == message

        # a bigger deployed gather function takes the same spec
        sizes = json.loads(json.dumps(outputs["sizes"]))
        sizes["functions"]["getbatch.gather"]["memory_mb"] = 3008
        root = f"s3://{bucket}"
        ok = dispatch(f"{root}/jobs/over.json", lambda *a: "started", root=root, deployed=sizes)
        assert ok["state"] == "RUNNING", ok


def test_local_files_are_refused_on_the_s3_store_on_every_path(monkeypatch):
    # the functions would read their own filesystem (/proc/self/environ holds the role's credentials)
    spec = {"kind": "getbatch", "items": [{"uri": "s3://b/ok"}, {"uri": "file:///proc/self/environ"}]}
    with pytest.raises(SpecError, match=r"items\.1\.uri") as refused:
        trigger_mod.submit(spec, store_root="s3://bucket", start=started)
    assert refused.value.errors == [
        {
            "field": "items.1.uri",
            "error": "file:///proc/self/environ is a local file; the S3 store reads only s3:// objects",
        }
    ]
    monkeypatch.setattr(store, "get", lambda uri: json.dumps(spec).encode())
    monkeypatch.setattr(store, "exists", lambda uri: False)
    written = {}
    monkeypatch.setattr(store, "put_json", lambda uri, doc: written.setdefault(uri, doc))
    report = dispatch("s3://bucket/jobs/x.json", started)
    assert report["errors"] == refused.value.errors and list(written) == ["s3://bucket/jobs/x.error.json"]
