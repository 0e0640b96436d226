"""``shardfold deploy`` / ``destroy``: a fake ``pulumi`` on PATH records its arguments and prints canned
stack outputs; moto answers STS. Nothing here needs the Pulumi CLI or an AWS account."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from moto import mock_aws

from client import stack as st
from client.cli import cli
from functions.errors import ShardfoldError

pytestmark = pytest.mark.slow

OUTPUTS = {
    "backend": "aws",
    "account": "123456789012",
    "region": "eu-west-1",
    "stage": "prod",
    "bucket": "shardfold-prod-jobs-1a2b3c",
    "state_machine_arns": {
        "getbatch": "arn:aws:states:eu-west-1:123456789012:stateMachine:shardfold-prod-getbatch",
        "fedavg": "arn:aws:states:eu-west-1:123456789012:stateMachine:shardfold-prod-fedavg",
    },
    "functions": {
        "getbatch.prepare": "arn:aws:lambda:eu-west-1:123456789012:function:shardfold-prod-getbatch-prepare"
    },
    "function_names": {"getbatch.prepare": "shardfold-prod-getbatch-prepare"},
    "batch_job_queue": "arn:aws:batch:eu-west-1:123456789012:job-queue/shardfold-prod-gpu",
    "batch_job_definitions": {},
    "dispatch_function": "shardfold-prod-dispatch",
    "sizes": {
        "functions": {
            "getbatch.prepare": {
                "memory_mb": 2048,
                "ephemeral_mb": 512,
                "timeout_s": 300,
                "config": {
                    "memory_mb": 'shardfold:functionMemory["getbatch.prepare"]',
                    "ephemeral_mb": 'shardfold:functionEphemeralStorage["getbatch.prepare"]',
                    "timeout_s": 'shardfold:functionTimeout["getbatch.prepare"]',
                },
            }
        },
        "batch": {
            "inference.worker": {
                "vcpus": 4,
                "memory_mb": 15000,
                "gpus": 1,
                "timeout_s": 14400,
                "config": {
                    "vcpus": 'shardfold:batchVcpus["inference.worker"]',
                    "memory_mb": 'shardfold:batchMemory["inference.worker"]',
                    "gpus": 'shardfold:batchGpus["inference.worker"]',
                    "timeout_s": 'shardfold:batchTimeout["inference.worker"]',
                },
            }
        },
    },
}

FAKE_PULUMI = """#!{python}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_PULUMI_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
if args and args[0] == os.environ.get("FAKE_PULUMI_FAIL"):
    print("error: the fake pulumi was told to fail", file=sys.stderr)
    sys.exit(255)
if args[:2] == ["stack", "output"]:
    sys.stdout.write(open(os.environ["FAKE_PULUMI_OUTPUTS"]).read())
"""


@pytest.fixture
def fake_pulumi(tmp_path, monkeypatch, aws_env):
    """A fake ``pulumi`` first on PATH; returns the list of argument lists it was called with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "pulumi"
    exe.write_text(FAKE_PULUMI.format(python=sys.executable))
    exe.chmod(0o755)
    log = tmp_path / "pulumi.log"
    canned = tmp_path / "outputs.json"
    canned.write_text(json.dumps(OUTPUTS))
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FAKE_PULUMI_LOG", str(log))
    monkeypatch.setenv("FAKE_PULUMI_OUTPUTS", str(canned))
    monkeypatch.setenv("SHARDFOLD_STACK", str(tmp_path / "saved" / "stack.json"))
    monkeypatch.delenv("SHARDFOLD_PULUMI_STACK", raising=False)
    monkeypatch.setenv("COLUMNS", "200")

    class Calls:
        canned_path = canned
        saved = tmp_path / "saved" / "stack.json"

        @property
        def args(self) -> list[list[str]]:
            return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return Calls()


def invoke(*args: str, input: str | None = None):
    return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)


def test_deploy_runs_pulumi_up_and_saves_exactly_the_outputs(fake_pulumi):
    with mock_aws():
        res = invoke("deploy", "--stack", "prod", "--yes")
    assert res.exit_code == 0, res.output
    infra = str(st.INFRA_DIR)
    assert fake_pulumi.args == [
        ["stack", "select", "--create", "prod", "--cwd", infra],
        ["up", "--yes", "--stack", "prod", "--cwd", infra],
        ["stack", "output", "--json", "--stack", "prod", "--cwd", infra],
    ]
    assert json.loads(fake_pulumi.saved.read_text()) == OUTPUTS
    assert st.load_stack_outputs() == OUTPUTS  # where Client(backend="aws") looks ($SHARDFOLD_STACK)
    assert "123456789012" in res.output and "shardfold-prod-jobs-1a2b3c" in res.output


def test_deploy_without_yes_lets_pulumi_ask_and_outputs_goes_where_told(fake_pulumi, tmp_path):
    with mock_aws():
        res = invoke("deploy", "--outputs", str(tmp_path / "elsewhere.json"))
    assert res.exit_code == 0, res.output
    assert ["up", "--stack", "dev", "--cwd", str(st.INFRA_DIR)] in fake_pulumi.args  # default stack "dev"
    assert json.loads((tmp_path / "elsewhere.json").read_text()) == OUTPUTS
    assert not fake_pulumi.saved.exists()


@pytest.mark.parametrize("verb", ["deploy", "destroy"])
def test_missing_pulumi_cli_is_one_clear_line(fake_pulumi, monkeypatch, tmp_path, verb):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with mock_aws():
        res = invoke(verb, "--yes")
    assert res.exit_code == 1
    assert "error: the Pulumi CLI (`pulumi`) is not installed" in res.output
    assert "https://www.pulumi.com/docs/install/" in res.output and "Traceback" not in res.output
    assert fake_pulumi.args == []


@pytest.mark.parametrize("verb", ["deploy", "destroy"])
def test_missing_aws_credentials_is_one_clear_line(fake_pulumi, monkeypatch, tmp_path, verb):
    for var in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    res = invoke(verb, "--yes")
    assert res.exit_code == 1
    assert "error: no AWS credentials found" in res.output and "Traceback" not in res.output
    assert fake_pulumi.args == []  # nothing ran


def test_a_failing_pulumi_up_saves_nothing(fake_pulumi, monkeypatch):
    monkeypatch.setenv("FAKE_PULUMI_FAIL", "up")
    with mock_aws():
        res = invoke("deploy", "--yes")
    assert res.exit_code == 1
    assert "error: `pulumi up --yes --stack dev" in res.output and "failed (exit 255)" in res.output
    assert not fake_pulumi.saved.exists()


def test_outputs_without_what_the_aws_backend_needs_are_refused(fake_pulumi):
    fake_pulumi.canned_path.write_text(json.dumps({"region": "eu-west-1"}))
    with mock_aws():
        res = invoke("deploy", "--yes")
    assert res.exit_code == 1 and "lack ['bucket', 'state_machine_arns']" in res.output
    assert not fake_pulumi.saved.exists()


def test_no_pulumi_program_is_a_clear_error(fake_pulumi, monkeypatch, tmp_path):
    monkeypatch.setattr(st, "INFRA_DIR", tmp_path / "nowhere")
    with mock_aws():
        res = invoke("deploy", "--yes")
    assert res.exit_code == 1 and "no Pulumi program at" in res.output
    assert fake_pulumi.args == []


def test_destroy_removes_the_saved_outputs(fake_pulumi):
    fake_pulumi.saved.parent.mkdir(parents=True)
    fake_pulumi.saved.write_text(json.dumps(OUTPUTS))
    with mock_aws():
        res = invoke("destroy", "--stack", "prod", "--yes")
    assert res.exit_code == 0, res.output
    assert fake_pulumi.args == [["destroy", "--yes", "--stack", "prod", "--cwd", str(st.INFRA_DIR)]]
    assert not fake_pulumi.saved.exists()


def test_destroy_asks_first(fake_pulumi):
    fake_pulumi.saved.parent.mkdir(parents=True)
    fake_pulumi.saved.write_text(json.dumps(OUTPUTS))
    with mock_aws():
        declined = invoke("destroy", input="n\n")
    assert declined.exit_code == 1 and "Destroy every resource" in declined.output
    assert fake_pulumi.args == [] and fake_pulumi.saved.exists()
    with mock_aws():
        accepted = invoke("destroy", input="y\n")
    assert accepted.exit_code == 0, accepted.output
    assert fake_pulumi.args[0][0] == "destroy" and not fake_pulumi.saved.exists()


def test_a_failing_destroy_keeps_the_outputs(fake_pulumi, monkeypatch):
    fake_pulumi.saved.parent.mkdir(parents=True)
    fake_pulumi.saved.write_text(json.dumps(OUTPUTS))
    monkeypatch.setenv("FAKE_PULUMI_FAIL", "destroy")
    with mock_aws():
        res = invoke("destroy", "--yes")
    assert res.exit_code == 1 and "failed (exit 255)" in res.output
    assert fake_pulumi.saved.exists()


def test_save_and_remove_round_trip(tmp_path):
    path = st.save_stack_outputs(OUTPUTS, tmp_path / "s" / "stack.json")
    assert st.load_stack_outputs(path) == OUTPUTS
    assert st.remove_stack_outputs(path) == path and st.remove_stack_outputs(path) is None
    assert Path(path).parent.is_dir()


def test_deployed_sizes_of_the_saved_outputs(fake_pulumi):
    with mock_aws():
        assert invoke("deploy", "--yes").exit_code == 0
    sizes = st.deployed_sizes(st.load_stack_outputs())
    plan = sizes.functions["getbatch.prepare"]
    assert (plan.memory_mb, plan.ephemeral_mb, plan.timeout_s) == (2048, 512, 300)
    assert plan.config["memory_mb"] == 'shardfold:functionMemory["getbatch.prepare"]'
    worker = sizes.of("inference.worker")
    assert isinstance(worker, st.BatchSize) and (worker.vcpus, worker.memory_mb, worker.gpus) == (4, 15000, 1)
    assert (
        worker.timeout_s == 14400
        and worker.config["memory_mb"] == 'shardfold:batchMemory["inference.worker"]'
    )
    with pytest.raises(
        st.SizesMissing, match="no function or Batch job definition 'fedavg.reduce'.*shardfold deploy"
    ):
        sizes.of("fedavg.reduce")


def test_a_stack_deployed_before_sizes_were_exported_is_told_to_redeploy():
    old = {k: v for k, v in OUTPUTS.items() if k != "sizes"}
    st.load_stack_outputs(old)  # still a usable stack for running jobs
    with pytest.raises(st.SizesMissing, match=r"redeploy with `shardfold deploy`") as err:
        st.deployed_sizes(old)
    assert isinstance(err.value, ShardfoldError)
    broken = {**OUTPUTS, "sizes": {"functions": {"getbatch.prepare": {"memory_mb": "big"}}, "batch": {}}}
    with pytest.raises(st.SizesMissing, match="sizes are malformed.*redeploy"):
        st.deployed_sizes(broken)


def test_sizes_read_as_pulumi_numbers():
    # Pulumi's numbers are doubles; an integral one is a size all the same.
    entry = dict(OUTPUTS["sizes"]["functions"]["getbatch.prepare"], memory_mb=2048.0)
    sizes = st.deployed_sizes({"sizes": {"functions": {"getbatch.prepare": entry}, "batch": {}}})
    assert sizes.functions["getbatch.prepare"].memory_mb == 2048 and sizes.batch == {}
