"""The emulator tier: the stack deployed to MiniStack (an AWS emulator we did not write) from the definitions
the Pulumi program uses (``infra.emulator``), its compiled ASL run by MiniStack's Step Functions and its real
Lambda packages by MiniStack's Lambda, with IAM enforced (``AUTH=true``: every function signs with its own
role's session). Each kind runs end to end, its output checked as ``shardfold demo`` checks it, and compared
with the local executor's run of the same job byte for byte (a dpquery release's noisy answers excepted).

``make test-emulator`` builds ``.venv-emulator`` (MiniStack alone, from ``requirements/emulator.txt``) and
runs this module with ``SHARDFOLD_EMULATOR_PYTHON`` naming its interpreter; without it every test skips.
MiniStack's gaps are filled in ``tests/emulator/ministack_server.py`` and listed in docs/deploy.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from shardfold.client import Client
from shardfold.client.demo import DEMOS
from shardfold.functions import store
from shardfold.functions.store.uri import join

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
EMULATOR_PYTHON = os.environ.get("SHARDFOLD_EMULATOR_PYTHON")
WAIT_S = 900  # a deadline, not a timing assumption
REGION = "us-east-1"
KEY = "test"  # MiniStack's account root (AUTH=true): what `pulumi up`'s deployer and the SDK sign as

if not EMULATOR_PYTHON:
    pytest.skip(
        "the emulator tier runs with `make test-emulator` (SHARDFOLD_EMULATOR_PYTHON: MiniStack's venv)",
        allow_module_level=True,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 (our own loopback server)
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """MiniStack on a loopback port, its gaps filled, IAM on; the endpoint URL. Its log and the Batch
    containers' logs are under the test's tmp folder."""
    folder = tmp_path_factory.mktemp("ministack")
    (folder / "containers").mkdir()
    # MiniStack unpacks each Lambda worker's code (about 160 MB) into the temp folder and never removes it
    scratch = folder / "tmp"
    scratch.mkdir()
    port = _free_port()
    env = {  # only what it needs: the Lambda workers inherit MiniStack's environment
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(folder),
        "TMPDIR": str(scratch),
        "BIND_HOST": "127.0.0.1",
        "GATEWAY_PORT": str(port),
        "IOT_MTLS_ENABLED": "0",
        "SFTP_ENABLED": "0",
        "AUTH": "true",
        "LOG_LEVEL": "WARNING",
        "AWS_DEFAULT_REGION": REGION,
        "OMP_NUM_THREADS": "1",
        "SHARDFOLD_CONTAINER_PYTHON": sys.executable,  # the Batch containers: the worker image's packages
        "SHARDFOLD_CONTAINER_LOGS": str(folder / "containers"),
    }
    log = (folder / "ministack.log").open("wb")
    proc = subprocess.Popen(
        [EMULATOR_PYTHON, str(HERE / "ministack_server.py")], env=env, cwd=folder, stdout=log, stderr=log
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not _answers(f"{endpoint}/_ministack/health"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"MiniStack did not start: {(folder / 'ministack.log').read_text()[-2000:]}")
        time.sleep(0.2)
    yield endpoint
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()
    shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture(scope="module")
def deployed(emulator, tmp_path_factory):
    """The stack deployed to the emulator; its outputs (saved beside the package, to read when debugging)."""
    from shardfold.infra import emulator as deploy
    from shardfold.infra import package
    from shardfold.infra.config import StackConfig

    folder = tmp_path_factory.mktemp("stack")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"  # MiniStack runs the functions on its own
    zip_path = package.build_lambda_package("x86_64", folder, python_version=version, glibc=34)
    packages = deploy.Packages(zip_path=zip_path, image_root=deploy.image_root())
    cfg = StackConfig(
        stage="emu", region=REGION, lambda_architecture="x86_64", bucket_name="shardfold-emu-jobs"
    )
    outputs = deploy.deploy(emulator, packages, cfg, key=KEY)
    (folder / "outputs.json").write_text(json.dumps(outputs, indent=2))
    return outputs


@pytest.fixture(scope="module")
def on_emulator(deployed, emulator, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        for var, value in {
            "AWS_ENDPOINT_URL": emulator,
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
        }.items():
            mp.setenv(var, value)
        mp.delenv("AWS_SESSION_TOKEN", raising=False)
        mp.delenv("AWS_PROFILE", raising=False)
        with Client(backend="aws", stack=deployed) as client:
            yield client


@pytest.fixture(scope="module")
def on_local(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDFOLD_HOME", str(tmp_path_factory.mktemp("local-home")))
        with Client() as client:
            yield client


def _wait(job):
    return job.wait(progress=False, timeout_s=WAIT_S)


# Fields of a result that hold its timing.
VOLATILE = {"seconds", "started_at", "ended_at", "compute_s"}


def _comparable(client, result: dict) -> dict:
    """``result`` without its timing, its store root and job id written as placeholders."""
    text = json.dumps({k: v for k, v in result.items() if k not in VOLATILE})
    return json.loads(text.replace(client.store_root, "<root>").replace(result["job_id"], "<job>"))


# S3 names its error code where the local store says the same without one ("no object at ... (NoSuchKey)").
S3_CODE = re.compile(rb" \((NoSuchKey|NotFound|404)\)")


def _without_workers(doc):
    """A lineage manifest without which process computed each shard and how long it took."""
    if isinstance(doc, dict):
        return {k: _without_workers(v) for k, v in doc.items() if k != "worker" and not k.endswith("_s")}
    if isinstance(doc, list):
        return [_without_workers(v) for v in doc]
    return doc


def _outputs(client, result: dict) -> dict[str, bytes]:
    """Every object under the job's output folder, by its path below it, where it ran left out: the store
    root and the job id as placeholders, S3's error codes dropped, a manifest's worker processes too."""
    folder = join(client.store_root, "jobs", result["job_id"], "output") + "/"
    root, job = client.store_root.encode(), result["job_id"].encode()
    out = {}
    for uri in store.list_uris(folder):
        data = S3_CODE.sub(b"", store.get(uri).replace(root, b"<root>").replace(job, b"<job>"))
        if uri.endswith(".manifest.json"):
            data = json.dumps(_without_workers(json.loads(data)), sort_keys=True).encode()
        out[uri[len(folder) :]] = data
    return out


@pytest.mark.parametrize("kind", sorted(DEMOS))
def test_each_kind_runs_on_the_emulator_as_it_runs_locally(kind, on_emulator, on_local):
    emulated = DEMOS[kind](on_emulator, wait=_wait)
    local = DEMOS[kind](on_local, wait=_wait)
    assert emulated.verified and local.verified
    got = on_emulator.job(emulated.job_id).result()
    want = on_local.job(local.job_id).result()
    assert sorted(got) == sorted(want)
    if kind != "dpquery":  # a release's answers are noisy: each run draws its own noise
        assert _comparable(on_emulator, got) == _comparable(on_local, want)
        assert _outputs(on_emulator, got) == _outputs(on_local, want)


def test_a_spec_dropped_in_the_bucket_runs_through_the_trigger(on_emulator):
    """S3's event reaches the dispatch function through the EventBridge rule the stack deploys; the
    function (under its role: it reads the spec, claims the output, starts the job) writes its report."""
    store.put(on_emulator.uri("drop/a.bin"), b"alpha")
    spec = {"kind": "getbatch", "items": [{"uri": "drop/a.bin"}], "output": "results/dropped.tar"}
    store.put(on_emulator.uri("jobs/dropped.json"), json.dumps(spec).encode())
    report_uri = on_emulator.uri("jobs/dropped.status.json")
    deadline = time.monotonic() + 120
    while not store.exists(report_uri):
        error_uri = on_emulator.uri("jobs/dropped.error.json")
        assert not store.exists(error_uri), store.get_json(error_uri)
        assert time.monotonic() < deadline, "the trigger never reported on the dropped spec"
        time.sleep(0.5)
    job = on_emulator.job(store.get_json(report_uri)["job_id"])
    assert _wait(job).state == "SUCCEEDED"
    assert store.exists(on_emulator.uri("results/dropped.tar"))


def test_a_failed_task_names_its_error_as_locally(on_emulator, on_local):
    """A task's exception reaches the workflow under its own name (AWS's errorType), which Retry and Catch
    match; the job fails with the same error on both."""
    # listed in a manifest: submit stats inline local items, and the point is the task's error
    spec = {"kind": "getbatch", "manifest": "nowhere/items.jsonl"}
    errors = []
    for client in (on_emulator, on_local):
        store.put(client.uri("nowhere/items.jsonl"), b'{"uri": "nowhere/missing.bin"}\n')
        status = _wait(client.submit(spec))
        assert status.state == "FAILED"
        errors.append(status.error.split(":", 2)[1].strip())
    assert errors[0] == errors[1] and errors[0] != "Runtime.HandlerError", errors


def test_the_emulators_iam_refuses_a_dp_round_whose_ledger_grant_is_removed(on_emulator, deployed):
    """MiniStack's own IAM evaluator (not moto's) over the policies infra builds: without its ledger grant
    the DP-FedAvg round fails naming the denied write; with it, the same round succeeds."""
    import boto3

    roles = boto3.client("iam")
    name = f"{deployed['function_names']['fedavg.prepare']}-role"
    policy = roles.get_role_policy(RoleName=name, PolicyName=f"{name}-policy")["PolicyDocument"]
    if isinstance(policy, str):
        policy = json.loads(policy)
    without = json.loads(json.dumps(policy))
    for st in without["Statement"]:
        if st.get("Sid") == "WriteObjects":
            st["Resource"] = [r for r in st["Resource"] if not r.endswith("/ledger/*")]
    dp = {"clip_norm": 0.5, "noise_multiplier": 1.0, "dataset_budget_rho": 5.0}
    updates = [{"w": np.full((4, 8), float(i), dtype=np.float32)} for i in range(3)]
    keys = [
        on_emulator.fedavg.save_update(u, f"rounds/iam/client-{i}.safetensors") for i, u in enumerate(updates)
    ]
    base = on_emulator.fedavg.save_update(updates[0], "rounds/iam/global.safetensors")
    roles.put_role_policy(RoleName=name, PolicyName=f"{name}-policy", PolicyDocument=json.dumps(without))
    try:
        job = on_emulator.fedavg.submit(keys, dp={**dp, "dataset_id": "fed-denied", "base": base})
        denied = _wait(job)
    finally:
        roles.put_role_policy(RoleName=name, PolicyName=f"{name}-policy", PolicyDocument=json.dumps(policy))
    assert denied.state == "FAILED" and "AccessDenied" in denied.error and "ledger/fed-denied" in denied.error
    granted = _wait(on_emulator.fedavg.submit(keys, dp={**dp, "dataset_id": "fed-granted", "base": base}))
    assert granted.state == "SUCCEEDED", granted.error
