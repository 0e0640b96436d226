"""``shardfold deploy`` / ``destroy`` and the saved stack outputs: a fake ``pulumi`` on PATH records its
arguments and prints canned stack outputs; moto answers STS. Nothing here needs the Pulumi CLI or an AWS
account. Outputs are saved per stack name in ``$SHARDFOLD_STACKS_DIR`` (here under ``tmp_path``), and
``--stack NAME`` picks the same stack in every verb."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from moto import mock_aws

from shardfold.client import stack as st
from shardfold.client.cli import cli
from shardfold.functions.errors import ShardfoldError

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
    monkeypatch.setenv("SHARDFOLD_STACKS_DIR", str(tmp_path / "stacks"))
    monkeypatch.delenv("SHARDFOLD_STACK", raising=False)
    monkeypatch.delenv("SHARDFOLD_PULUMI_STACK", raising=False)
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.chdir(tmp_path)  # no ./.shardfold/stack.json from elsewhere

    class Calls:
        canned_path = canned
        stacks = tmp_path / "stacks"
        saved = stacks / "dev.json"  # the default stack's

        def of(self, name: str) -> Path:
            return self.stacks / f"{name}.json"

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
    assert json.loads(fake_pulumi.of("prod").read_text()) == OUTPUTS  # saved under the stack's name
    assert st.load_stack_outputs("prod") == OUTPUTS  # where Client(backend="aws", stack="prod") looks
    assert not fake_pulumi.saved.exists() and st.known_stacks() == ["prod"]
    assert "123456789012" in res.output and "shardfold-prod-jobs-1a2b3c" in res.output
    assert "--backend aws --stack prod" in res.output


def test_deploy_without_yes_lets_pulumi_ask_and_saves_the_default_stack(fake_pulumi, tmp_path):
    with mock_aws():
        res = invoke("deploy")
    assert res.exit_code == 0, res.output
    assert ["up", "--stack", "dev", "--cwd", str(st.INFRA_DIR)] in fake_pulumi.args  # default stack "dev"
    assert json.loads(fake_pulumi.saved.read_text()) == OUTPUTS
    assert st.load_stack_outputs() == OUTPUTS  # no name: $SHARDFOLD_STACK, else dev
    assert not (tmp_path / ".shardfold").exists()  # nothing in the current directory


def test_outputs_live_in_the_per_user_config_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("SHARDFOLD_STACKS_DIR")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert st.outputs_path("prod") == tmp_path / "xdg" / "shardfold" / "stacks" / "prod.json"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert st.outputs_path() == tmp_path / "home" / ".config" / "shardfold" / "stacks" / "dev.json"
    monkeypatch.setenv("SHARDFOLD_STACK", "staging")
    assert st.outputs_path() == tmp_path / "home" / ".config" / "shardfold" / "stacks" / "staging.json"


def test_two_stacks_coexist_and_destroy_removes_only_its_own(fake_pulumi):
    prod = {**OUTPUTS, "bucket": "shardfold-prod-jobs-1a2b3c"}
    with mock_aws():
        assert invoke("deploy", "--stack", "prod", "--yes").exit_code == 0
        fake_pulumi.canned_path.write_text(json.dumps({**OUTPUTS, "bucket": "shardfold-staging-jobs-9z"}))
        assert invoke("deploy", "--stack", "staging", "--yes").exit_code == 0
    assert st.known_stacks() == ["prod", "staging"]
    assert st.load_stack_outputs("prod") == prod
    assert st.load_stack_outputs("staging")["bucket"] == "shardfold-staging-jobs-9z"
    listed = invoke("stack", "list")
    assert "prod" in listed.output and "shardfold-staging-jobs-9z" in listed.output
    with mock_aws():
        res = invoke("destroy", "--stack", "staging", "--yes")
    assert res.exit_code == 0, res.output
    assert fake_pulumi.args[-1] == ["destroy", "--yes", "--stack", "staging", "--cwd", str(st.INFRA_DIR)]
    assert st.known_stacks() == ["prod"] and st.load_stack_outputs("prod") == prod


class _Picked(ShardfoldError):
    pass


@pytest.fixture
def two_stacks(fake_pulumi, monkeypatch):
    """Stacks ``prod`` and ``staging`` deployed (different buckets); the AWS executor replaced by one that
    stops at once naming the bucket of the outputs it was given, so each verb shows which stack it picked."""
    from shardfold.orchestrator import aws

    with mock_aws():
        assert invoke("deploy", "--stack", "prod", "--yes").exit_code == 0
        fake_pulumi.canned_path.write_text(json.dumps({**OUTPUTS, "bucket": "shardfold-staging-jobs-9z"}))
        assert invoke("deploy", "--stack", "staging", "--yes").exit_code == 0

    def picked(outputs):
        raise _Picked(f"picked bucket {outputs['bucket']}")

    monkeypatch.setattr(aws, "AwsExecutor", picked)
    return fake_pulumi


SPEC = str(Path(__file__).resolve().parent.parent / "events" / "getbatch.json")


@pytest.mark.parametrize(
    "verb",
    [["status", "job-1"], ["jobs"], ["run", SPEC], ["plan", SPEC], ["result", "job-1"], ["cancel", "job-1"]],
    ids=lambda v: v[0],
)
def test_stack_name_selects_the_same_stack_in_every_verb(two_stacks, monkeypatch, verb):
    for name, bucket in (("prod", "shardfold-prod-jobs-1a2b3c"), ("staging", "shardfold-staging-jobs-9z")):
        res = invoke(*verb, "--backend", "aws", "--stack", name)
        assert res.exit_code == 1 and f"picked bucket {bucket}" in res.output, res.output
    monkeypatch.setenv("SHARDFOLD_STACK", "staging")  # the same name from the environment
    res = invoke(*verb, "--backend", "aws")
    assert "picked bucket shardfold-staging-jobs-9z" in res.output, res.output


def test_sdk_client_selects_a_stack_by_name(two_stacks):
    from shardfold.client import Client

    with pytest.raises(_Picked, match="shardfold-staging-jobs-9z"):
        Client(backend="aws", stack="staging")
    with pytest.raises(_Picked, match="shardfold-prod-jobs-1a2b3c"):
        Client(backend="aws", stack="prod")


def test_a_missing_stack_lists_the_known_ones(two_stacks):
    res = invoke("jobs", "--backend", "aws", "--stack", "qa")
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "no outputs saved for stack 'qa'" in res.output
    assert "known stacks: prod, staging" in res.output and "shardfold deploy --stack qa" in res.output
    res = invoke("jobs", "--backend", "aws")  # no name: dev, never deployed here
    assert "no outputs saved for stack 'dev'" in res.output and "known stacks: prod, staging" in res.output


def test_no_stacks_at_all_says_to_deploy(fake_pulumi):
    res = invoke("status", "job-1", "--backend", "aws", "--stack", "prod")
    assert res.exit_code == 1 and "no stacks are saved" in res.output
    assert "shardfold deploy --stack prod" in res.output


def test_an_old_cwd_stack_json_is_named_with_the_command_to_import_it(fake_pulumi, tmp_path):
    legacy = tmp_path / ".shardfold" / "stack.json"
    legacy.parent.mkdir()
    legacy.write_text(json.dumps(OUTPUTS))
    res = invoke("jobs", "--backend", "aws", "--stack", "prod")
    assert res.exit_code == 1
    assert "shardfold stack import prod .shardfold/stack.json" in res.output, res.output
    res = invoke("stack", "import", "prod", ".shardfold/stack.json")
    assert res.exit_code == 0, res.output
    assert st.load_stack_outputs("prod") == OUTPUTS
    assert json.loads(invoke("stack", "show", "prod").output) == OUTPUTS


@pytest.mark.parametrize("value", ["./out/stack.json", "stack.json", "/tmp/prod"])
def test_a_path_given_as_stack_is_refused_with_how_to_import_it(fake_pulumi, monkeypatch, value):
    res = invoke("jobs", "--backend", "aws", "--stack", value)
    assert res.exit_code == 1 and "takes a stack name now" in res.output, res.output
    assert f"shardfold stack import NAME {value}" in res.output
    monkeypatch.setenv("SHARDFOLD_STACK", value)  # an old $SHARDFOLD_STACK held a path
    res = invoke("jobs", "--backend", "aws")
    assert res.exit_code == 1 and "SHARDFOLD_STACK takes a stack name now" in res.output, res.output
    with mock_aws():
        res = invoke("deploy", "--stack", value, "--yes")
    assert res.exit_code == 1 and "takes a stack name now" in res.output and fake_pulumi.args == []


def test_stack_with_a_local_backend_is_refused(fake_pulumi):
    res = invoke("jobs", "--stack", "prod")
    assert res.exit_code == 1 and "only --backend aws uses" in res.output


def test_the_old_pulumi_stack_variable_is_refused(fake_pulumi, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_PULUMI_STACK", "prod")
    with mock_aws():
        res = invoke("deploy", "--yes")
    assert res.exit_code == 1 and "SHARDFOLD_PULUMI_STACK is no longer read" in res.output
    assert fake_pulumi.args == []


def test_import_refuses_what_is_not_stack_outputs(fake_pulumi, tmp_path):
    (tmp_path / "bad.json").write_text("[1, 2]")
    res = invoke("stack", "import", "prod", str(tmp_path / "bad.json"))
    assert res.exit_code == 1 and "not the stack outputs object" in res.output
    (tmp_path / "partial.json").write_text(json.dumps({"region": "eu-west-1"}))
    res = invoke("stack", "import", "prod", str(tmp_path / "partial.json"))
    assert res.exit_code == 1 and "lack ['bucket', 'state_machine_arns']" in res.output
    assert st.known_stacks() == []


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
    st.save_stack_outputs(OUTPUTS, "prod")
    with mock_aws():
        res = invoke("destroy", "--stack", "prod", "--yes")
    assert res.exit_code == 0, res.output
    assert fake_pulumi.args == [["destroy", "--yes", "--stack", "prod", "--cwd", str(st.INFRA_DIR)]]
    assert not fake_pulumi.of("prod").exists() and "removed" in res.output


def test_destroy_asks_first(fake_pulumi):
    st.save_stack_outputs(OUTPUTS)  # stack dev
    with mock_aws():
        declined = invoke("destroy", input="n\n")
    assert declined.exit_code == 1 and "Destroy every resource" in declined.output
    assert fake_pulumi.args == [] and fake_pulumi.saved.exists()
    with mock_aws():
        accepted = invoke("destroy", input="y\n")
    assert accepted.exit_code == 0, accepted.output
    assert fake_pulumi.args[0][0] == "destroy" and not fake_pulumi.saved.exists()


def test_a_failing_destroy_keeps_the_outputs(fake_pulumi, monkeypatch):
    st.save_stack_outputs(OUTPUTS)  # stack dev
    monkeypatch.setenv("FAKE_PULUMI_FAIL", "destroy")
    with mock_aws():
        res = invoke("destroy", "--yes")
    assert res.exit_code == 1 and "failed (exit 255)" in res.output
    assert fake_pulumi.saved.exists()


def test_save_and_remove_round_trip(tmp_path):
    path = st.save_stack_outputs(OUTPUTS, "qa")
    assert path == tmp_path / "stacks" / "qa.json"  # $SHARDFOLD_STACKS_DIR (tests/conftest.py)
    assert st.load_stack_outputs("qa") == OUTPUTS
    assert st.remove_stack_outputs("qa") == path and st.remove_stack_outputs("qa") is None
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
