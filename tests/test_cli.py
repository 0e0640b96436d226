"""Smoke tests of every ``shardfold`` verb through click's CliRunner, on the local backend."""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from shardfold.client import Client
from shardfold.client.cli import SAMPLE_EVENTS, cli
from shardfold.functions import store
from shardfold.functions.errors import ShardfoldError
from shardfold.functions.store.uri import join, store_root

REPO = Path(__file__).resolve().parent.parent
EVENTS = REPO / "events"


@pytest.fixture
def home(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "200")  # rich tables wide enough to keep ids on one line
    monkeypatch.delenv("SHARDFOLD_BACKEND", raising=False)
    r = store_root()
    for i in range(6):
        store.put(join(r, "data", f"obj-{i}.bin"), f"object {i}".encode())
    return r


def invoke(*args: str, ok: bool = True):
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def spec_file(tmp_path: Path, n: int = 6, **kw) -> Path:
    path = tmp_path / "spec.json"
    path.write_text(
        json.dumps({"kind": "getbatch", "items": [{"uri": f"data/obj-{i}.bin"} for i in range(n)], **kw})
    )
    return path


def job_id_in(output: str) -> str:
    return next(w for w in output.split() if w.startswith("getbatch-"))


@pytest.mark.slow
def test_run_sample_spec_from_events(home):
    # the shipped example runs on a fresh checkout: its data lives in events/data/
    out = invoke("run", str(EVENTS / "getbatch.json")).output
    assert "SUCCEEDED" in out
    job = Client().job(job_id_in(out))
    result = job.result()
    with tarfile.open(fileobj=io.BytesIO(store.get(result["archive"]))) as tf:
        datas = [tf.extractfile(m).read() for m in tf.getmembers()]
    hello = (EVENTS / "data" / "hello.txt").read_bytes()
    assert datas[0] == hello and datas[-1] == hello
    assert datas[1] == (EVENTS / "data" / "scores.csv").read_bytes()[14:44]
    assert datas[2] == b"second sample of the shard\n"


@pytest.mark.slow
def test_run_no_wait_then_status_jobs_result_cancel_resume(home, tmp_path):
    out = invoke("run", str(spec_file(tmp_path)), "--no-wait").output
    job_id = job_id_in(out)
    Client().job(job_id).wait(progress=False)
    assert "SUCCEEDED" in invoke("status", job_id).output
    assert job_id in invoke("jobs").output
    res = invoke("result", job_id, "--json").output
    assert json.loads(res)["items"] == 6
    assert "items" in invoke("result", job_id).output
    assert "cancelled" in invoke("cancel", job_id).output
    assert job_id in invoke("resume", job_id, "--no-wait").output


def test_plan_table_and_json(home, tmp_path):
    path = spec_file(tmp_path, items_per_part=2)
    out = invoke("plan", str(path)).output
    for word in ("gather", "assemble", "total", "transitions"):
        assert word in out
    data = json.loads(invoke("plan", str(path), "--json").output)
    assert data["items"] == 6 and any(s["tasks"] == 3 for s in data["steps"])


def test_asl(home):
    asl = json.loads(invoke("asl", "getbatch").output)
    assert asl["StartAt"] in asl["States"]
    assert any(s.get("Type") == "Map" for s in asl["States"].values())


def test_invoke_handler_with_sample_event(home):
    out = invoke("invoke", "dispatch", "dispatch_not_a_job").output
    assert "ignored" in json.loads(out)
    # the getbatch samples step through a job by hand: plan writes the parts, gather fetches one
    planned = json.loads(invoke("invoke", "getbatch.prepare", "getbatch_prepare").output)
    assert planned["parts"] == 3 and planned["items"] == 6
    gathered = json.loads(invoke("invoke", "getbatch.gather", str(EVENTS / "getbatch_gather.json")).output)
    assert gathered["part"] == 1 and gathered["items"] == 2 and gathered["errors"] == 0
    # a registered workflow function fails like Lambda would on a bad event: errorType/errorMessage, exit 1
    bad = invoke("invoke", "getbatch.prepare", str(EVENTS / "dispatch_not_a_job.json"), ok=False)
    assert bad.exit_code == 1 and "errorType" in json.loads(bad.output)


def test_invoke_dispatch_runs_the_trigger_on_the_local_store_without_credentials(home, tmp_path, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # the sample event names s3://shardfold-jobs-example/jobs/nightly-batch.json: read here in the local store
    missing = invoke("invoke", "dispatch", "dispatch_object_created", ok=False)
    assert missing.exit_code == 1 and "Traceback" not in missing.output
    assert f"there is no {join(home, 'jobs', 'nightly-batch.json')}" in missing.output.replace("\n", "")
    spec = {"kind": "getbatch", "items": [{"uri": f"data/obj-{i}.bin"} for i in range(3)]}
    store.put_json(join(home, "jobs", "nightly-batch.json"), spec)
    out = invoke("invoke", "dispatch", "dispatch_object_created").output
    report = json.loads(out[out.index("{") : out.index("}\n") + 1])
    assert report["submitted_spec"] == join(home, "jobs", "nightly-batch.json")
    assert any(line.split()[:2] == ["state", "SUCCEEDED"] for line in out.splitlines()), out
    # the trigger's own report beside the spec, as in the bucket
    assert store.get_json(join(home, "jobs", "nightly-batch.status.json"))["job_id"] == report["job_id"]
    # a key that climbs out of the store is refused, naming it, before anything is read or written
    event = json.loads((EVENTS / "dispatch_object_created.json").read_text())
    event["detail"]["object"]["key"] = "jobs/../../etc/passwd.json"
    (tmp_path / "evil.json").write_text(json.dumps(event))
    evil = invoke("invoke", "dispatch", str(tmp_path / "evil.json"), ok=False)
    assert evil.exit_code == 1 and "contains a '..' segment" in evil.output and "Traceback" not in evil.output


def probe(event, context):
    """A handler for ``invoke``: reports the context it got, or returns more than a state may hold."""
    if event.get("big"):
        return "x" * (300 * 1024)
    return {"context": type(context).__name__, "function": context.function_name, "n": event["n"]}


def test_invoke_calls_the_handler_as_the_executors_do(home, tmp_path):
    from shardfold.orchestrator.invoke import LocalContext

    path = tmp_path / "event.json"
    path.write_text(json.dumps({"n": 1}))
    got = json.loads(invoke("invoke", f"{__name__}:probe", str(path)).output)
    assert got == {"context": LocalContext.__name__, "function": f"{__name__}:probe", "n": 1}
    # the 256 KiB state limit applies as on the executors; not a user error, so the trace is kept
    path.write_text(json.dumps({"big": True}))
    res = invoke("invoke", f"{__name__}:probe", str(path), ok=False)
    failure = json.loads(res.output)
    assert res.exit_code == 1 and failure["errorType"] == "States.DataLimitExceeded" and failure["stackTrace"]


@pytest.mark.slow
def test_watch_once(home, tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "good.json").write_text(
        json.dumps({"kind": "getbatch", "items": [{"uri": "data/obj-1.bin"}, {"uri": "data/obj-2.bin"}]})
    )
    (inbox / "bad.json").write_text(
        json.dumps(
            {"kind": "getbatch", "items": [{"uri": "data/obj-1.bin", "start": -1}], "items_per_part": 0}
        )
    )
    (inbox / "junk.json").write_text("{nope")
    (inbox / "notes.txt").write_text("not a spec")
    invoke("watch", str(inbox), "--once")
    status = json.loads((inbox / "good.status.json").read_text())
    assert status["state"] == "SUCCEEDED" and status["kind"] == "getbatch"
    assert Client().job(status["job_id"]).result()["items"] == 2
    errors = json.loads((inbox / "bad.error.json").read_text())["errors"]
    assert {"items.0.start", "items_per_part"} <= {e["field"] for e in errors}
    assert "JSON" in json.loads((inbox / "junk.error.json").read_text())["error"]
    assert not (inbox / "bad.status.json").exists() and not (inbox / "notes.status.json").exists()
    # a second pass starts nothing new: the same spec bytes map to the same job
    invoke("watch", str(inbox), "--once")
    assert json.loads((inbox / "good.status.json").read_text())["job_id"] == status["job_id"]


# `shardfold demo` runs in tests/test_telemetry.py, which checks its summary and every record of its jobs.


def test_user_errors_are_one_red_line(home, tmp_path):
    res = invoke("status", "getbatch-20000101T000000-000000", ok=False)
    assert res.exit_code == 1 and "error:" in res.output and "Traceback" not in res.output
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "getbatch", "items": [{"uri": ""}], "items_per_part": 0}))
    res = invoke("run", str(bad), ok=False)
    assert res.exit_code == 1 and "items_per_part" in res.output and "Traceback" not in res.output
    res = invoke("asl", "nosuchkind", ok=False)
    assert res.exit_code == 1 and "nosuchkind" in res.output


@pytest.mark.slow
def test_failed_job_exits_nonzero(home, tmp_path):
    path = tmp_path / "missing.json"
    path.write_text(json.dumps({"kind": "getbatch", "items": [{"uri": "data/not-there.bin"}]}))
    res = invoke("run", str(path), ok=False)  # a local file that is not there: refused at submit
    assert res.exit_code == 1 and "items.0.uri: no file at" in res.output and "not-there.bin" in res.output
    # in a manifest (inline items are what submit stats) the job runs, fails, and says how to go on
    store.put(join(home, "m.jsonl"), b'{"uri": "data/not-there.bin"}\n')
    path.write_text(json.dumps({"kind": "getbatch", "manifest": "m.jsonl"}))
    res = invoke("run", str(path), ok=False)
    assert res.exit_code == 1 and "not-there.bin" in res.output and "shardfold resume" in res.output


# --- user text prints as written (rich markup is escaped) ---------------------------------------------------

# Each would be markup to rich: a closing tag with nothing open (MarkupError), a hyperlink, a style.
MARKUP = ("[/]", "[link=http://x]y[/link]", "[bold]")


def shows_literally(output: str) -> None:
    for text in MARKUP:
        assert text in output, f"{text!r} not printed as written in:\n{output}"


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no cell wraps a marker across lines


@pytest.mark.parametrize("verb", ["run", "plan"])
def test_spec_fields_named_with_markup_print_literally(home, tmp_path, wide, verb):
    path = tmp_path / "fields.json"
    path.write_text(
        json.dumps({"kind": "getbatch", "items": [{"uri": "data/obj-1.bin"}], **{m: 1 for m in MARKUP}})
    )
    res = invoke(verb, str(path), ok=False)
    assert res.exit_code == 1 and "Traceback" not in res.output and "MarkupError" not in res.output
    assert "Extra inputs are not permitted" in res.output
    shows_literally(res.output)


def test_job_errors_with_markup_print_literally_in_run_status_and_jobs(home, tmp_path, wide):
    member = "".join(MARKUP)
    path = tmp_path / "member.json"
    tar = EVENTS / "data" / "shard-000.tar"
    path.write_text(json.dumps({"kind": "getbatch", "items": [{"uri": tar.as_uri(), "archpath": member}]}))
    res = invoke("run", str(path), ok=False)
    assert res.exit_code == 1 and "FAILED" in res.output and "Traceback" not in res.output
    shows_literally(res.output)
    job_id = job_id_in(res.output)
    shows_literally(invoke("status", job_id).output)
    shows_literally(invoke("jobs").output)


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_dpquery_names_with_markup_print_literally_in_plan_run_and_result(home, tmp_path, wide):
    # attribute names are the dataset's column names: they head the plan's tables and name each marginal
    rows = [",".join(MARKUP)] + [",".join("ab"[(i >> k) & 1] for k in range(3)) for i in range(64)]
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    spec = {
        "kind": "dpquery",
        "dataset": "./d.csv",
        "schema": [{"name": m, "categories": ["a", "b"]} for m in MARKUP],
        "workload": {"all_marginals_up_to": 1},
        "budget": {"rho": 0.5},
        "dataset_id": "markup",
        "dataset_budget_rho": 1.0,
    }
    path = tmp_path / "dp.json"
    path.write_text(json.dumps(spec))
    shows_literally(invoke("plan", str(path)).output)
    out = invoke("run", str(path)).output
    shows_literally(out.split("SUCCEEDED", 1)[1])  # the result, not the echo of the submission
    job_id = next(w for w in out.split() if w.startswith("dpquery-"))
    shows_literally(invoke("result", job_id).output)


def test_watch_prints_markup_in_errors_literally_and_keeps_going(home, tmp_path, wide):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "a-bad.json").write_text(
        json.dumps({"kind": "getbatch", "items": [{"uri": "data/obj-1.bin"}], **{m: 1 for m in MARKUP}})
    )
    (inbox / "b-good.json").write_text(json.dumps({"kind": "getbatch", "items": [{"uri": "data/obj-2.bin"}]}))
    res = invoke("watch", str(inbox), "--once")
    shows_literally(res.output)
    assert json.loads((inbox / "b-good.status.json").read_text())["state"] == "SUCCEEDED"
    errors = json.loads((inbox / "a-bad.error.json").read_text())["errors"]
    assert {e["field"] for e in errors} == set(MARKUP)


def test_watch_loop_survives_a_spec_with_markup(home, tmp_path, monkeypatch):
    # without --once: the bad spec is reported on the first poll, a spec dropped later still starts a job,
    # and a restart (which sees the bad spec again) does not crash either
    import shardfold.client.cli as cli_module

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "bad.json").write_text(json.dumps({"kind": "getbatch", "[/]": 1, "[bold]": 2}))
    polls = []

    class Clock:
        @staticmethod
        def sleep(seconds: float) -> None:
            polls.append(seconds)
            if len(polls) == 1:
                (inbox / "good.json").write_text(
                    json.dumps({"kind": "getbatch", "items": [{"uri": "data/obj-3.bin"}]})
                )
            elif len(polls) == 3:
                raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "time", Clock)
    out = invoke("watch", str(inbox), "--interval", "0").output
    assert "[/]" in out and "[bold]" in out and "good.json: job" in out and "stopped" in out
    assert (inbox / "good.status.json").exists()
    polls.clear()
    out = invoke("watch", str(inbox), "--interval", "0").output  # restarted: reports bad.json again
    assert "[/]" in out and "stopped" in out


def test_progress_bars_print_step_names_literally():
    from types import SimpleNamespace

    from rich.console import Console

    from shardfold.client.progress import ProgressView

    buf = io.StringIO()
    console = Console(file=buf, width=200, force_terminal=False)
    with ProgressView("job", console=console) as view:
        view.update(SimpleNamespace(steps={m: {"done": 1, "total": 2} for m in MARKUP}))
    shows_literally(buf.getvalue())


@pytest.mark.parametrize(
    ("state", "want"),
    [
        ("SUCCEEDED", ["✓", "skipped"]),
        ("FAILED", ["✓", "skipped", "✗"]),
        ("CANCELLED", ["✓", "skipped", "cancelled"]),
    ],
)
def test_progress_ends_without_spinners(state, want):
    # a step with nothing to do (total 0: a clean inference run's repair) reads "skipped", never "0/?"
    # spinning; once a job failed or was cancelled, its unfinished steps say so instead of spinning on
    from types import SimpleNamespace

    from rich.console import Console

    from shardfold.client.progress import ProgressView

    buf = io.StringIO()
    console = Console(file=buf, width=200, force_terminal=False)
    steps = {"prepare": {"done": 1, "total": 1}, "repair": {"done": 0, "total": 0}}
    if state != "SUCCEEDED":
        steps["work"] = {"done": 1, "total": 3}
    with ProgressView("job", console=console) as view:
        view.update(SimpleNamespace(steps=steps, state=state, finished=True))
    shown = buf.getvalue().splitlines()[-len(steps) :]
    assert "0/?" not in buf.getvalue() and not any(c in buf.getvalue() for c in "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏")
    assert [next((w for w in want if w in line), None) for line in shown] == want, shown


# --- an S3 endpoint that does not answer --------------------------------------------------------------------


@pytest.fixture
def closed_port() -> int:
    import socket

    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("transport", ["crt", "boto3"])
@pytest.mark.parametrize("home_on_s3", [False, True], ids=["local-store", "s3-store"])
@pytest.mark.parametrize("verb", ["run", "plan"])
def test_unreachable_s3_endpoint_is_one_line_naming_it(
    home, tmp_path, monkeypatch, closed_port, transport, home_on_s3, verb
):
    endpoint = f"http://127.0.0.1:{closed_port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("SHARDFOLD_S3_TRANSPORT", transport)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # boto3 fails at the first refusal, not after 5 backoffs
    for var, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    if home_on_s3:
        monkeypatch.setenv("SHARDFOLD_HOME", "s3://shardfold-jobs")
    path = tmp_path / "s3.json"
    path.write_text(json.dumps({"kind": "getbatch", "items": [{"uri": "s3://inputs/a.bin"}]}))
    res = invoke(verb, str(path), ok=False)
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1, res.output
    assert lines[0].startswith(f"error: cannot reach the S3 endpoint {endpoint} (AWS_ENDPOINT_URL_S3)")
    assert "s3://inputs/a.bin" in lines[0] and "check that AWS_ENDPOINT_URL_S3" in lines[0]


def test_help_and_version_import_no_sdk_boto3_or_planner():
    # `shardfold --help` and `--version` stay fast by importing neither the SDK nor boto3 nor a kind
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from shardfold.client.cli import cli\n"
        "for args in (['--help'], ['--version'], ['report', '--help']):\n"
        "    r = CliRunner().invoke(cli, args, prog_name='shardfold')\n"
        "    assert r.exit_code == 0, r.output\n"
        "    print(r.output.splitlines()[0])\n"
        "names = ('boto3', 'botocore', 'shardfold.client.sdk', 'shardfold.functions.kinds', 'pyarrow',\n"
        "         'numpy')\n"
        "heavy = sorted(m for m in names if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    import subprocess
    import sys
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert f"shardfold {version('shardfold')}" in out.stdout.splitlines()


def test_jobs_newest_first_whole_and_filtered_and_json_everywhere(home, tmp_path, monkeypatch):
    from shardfold.functions import jobs as job_ids

    stamps = iter(["20260101T000001", "20260101T000003", "20260101T000002"])  # submitted out of order
    real = job_ids.new_job_id
    monkeypatch.setattr(
        job_ids,
        "new_job_id",
        lambda kind, now=None: real(kind).replace(real(kind).split("-")[1], next(stamps)),
    )
    monkeypatch.setattr("shardfold.functions.submit.new_job_id", job_ids.new_job_id)
    spec = str(spec_file(tmp_path, n=2))
    first = invoke("run", "-q", spec).output.strip()  # --quiet: the id alone
    second = json.loads(invoke("run", "--json", spec).stdout)[
        "job_id"
    ]  # the result as JSON; the id on stderr
    third = invoke("run", "--quiet", "--no-wait", spec).output.strip()
    assert [first, second, third] == [w for w in (first, second, third) if w.startswith("getbatch-20260101T")]

    lines = invoke("jobs").output.splitlines()[
        1:
    ]  # piped: a title, then one whole line per job, newest first
    assert lines[0].split() == ["job", "id", "kind", "state", "submitted", "steps", "error"]
    assert [line.split()[0] for line in lines[1:]] == [second, third, first]
    assert "2026-01-01 00:00:03" in lines[1]
    assert [d["job_id"] for d in json.loads(invoke("jobs", "--json", "--limit", "2").output)] == [
        second,
        third,
    ]
    succeeded = json.loads(invoke("jobs", "--json", "--state", "succeeded").output)
    assert {d["job_id"] for d in succeeded} >= {first, second} and all(
        d["state"] == "SUCCEEDED" for d in succeeded
    )
    assert json.loads(invoke("jobs", "--json", "--kind", "dpquery").output) == []
    assert json.loads(invoke("status", first, "--json").output)["state"] == "SUCCEEDED"
    assert json.loads(invoke("result", first, "--json").output)["job_id"] == first
    assert "SUCCEEDED" in invoke("wait", third).output  # --no-wait: it ran on in a process of its own
    # at a terminal of 100 columns: whole ids, then kind, state and age; the steps summed up
    from rich.console import Console

    from shardfold.client import cli as cli_module

    monkeypatch.setattr(cli_module, "out", Console(force_terminal=True, width=100, highlight=False))
    shown = invoke("jobs").output
    for job_id in (first, second, third):
        line = next(line for line in shown.splitlines() if job_id in line)
        assert "getbatch" in line and "SUCCEEDED" in line and "steps" in line, line


def test_a_moto_result_says_its_objects_vanish_with_the_process(capsys):
    from types import SimpleNamespace

    from shardfold.client import cli as cli_module

    status = SimpleNamespace(state="SUCCEEDED", error=None)
    result = {"kind": "getbatch", "job_id": "j", "archive": "s3://shardfold-moto/jobs/j/output/batch.tar"}
    job = SimpleNamespace(
        job_id="j", client=SimpleNamespace(backend="moto"), wait=lambda **kw: status, result=lambda: result
    )
    cli_module._wait_and_report(job)
    shown = capsys.readouterr()
    assert "s3://shardfold-moto" in shown.out and "gone" in shown.err and "--backend local" in shown.err
    job.client.backend = "local"
    cli_module._wait_and_report(job)
    assert "gone" not in capsys.readouterr().err


@pytest.mark.slow  # two jobs
def test_the_shipped_getbatch_example_gives_one_archive_from_any_folder(home, tmp_path):
    import shutil
    import tarfile

    archives = []
    for where in ("a", "b/deeper"):
        events = tmp_path / where / "events"
        shutil.copytree(SAMPLE_EVENTS, events)
        result = json.loads(invoke("run", "--json", str(events / "getbatch.json")).stdout)
        archives.append(store.get(result["archive"]))
    assert archives[0] == archives[1]  # byte-identical: nothing of the folder it ran from
    with tarfile.open(fileobj=io.BytesIO(archives[0])) as tf:
        names = tf.getnames()
    assert names[0] == "data/hello.txt" and str(tmp_path).lstrip("/") not in "".join(names)


@pytest.mark.parametrize("kind", ["getbatch", "fedavg", "dpquery", "inference"])
def test_schema_validates_the_shipped_example_and_refuses_a_typo(kind):
    import jsonschema

    schema = json.loads(invoke("schema", kind).output)
    example = json.loads((SAMPLE_EVENTS / f"{kind}.json").read_text())
    jsonschema.validate(example, schema)  # what an editor checks a spec file against
    with pytest.raises(jsonschema.ValidationError, match="itemz|Additional properties"):
        jsonschema.validate({**example, "itemz": []}, schema)


def test_shell_completion_script_is_generated():
    import os
    import subprocess
    import sys

    env = {**os.environ, "_SHARDFOLD_COMPLETE": "bash_source"}
    code = "from shardfold.client.cli import main; main()"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert "_shardfold_completion" in out.stdout and "complete " in out.stdout, out.stderr


def test_piped_results_keep_uris_whole_whatever_the_width(home, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")  # a narrow terminal size must not matter when piped
    out = invoke("run", str(spec_file(tmp_path, n=2))).output
    job_id = job_id_in(out)
    archive = json.loads(invoke("result", job_id, "--json").output)["archive"]
    assert len(archive) > 40 and any(line.split()[-1] == archive for line in out.splitlines() if line.strip())
    status = invoke("status", job_id).output
    assert any(line.split()[:2] == ["state", "SUCCEEDED"] for line in status.splitlines())


def test_s3_uris_without_aws_credentials_are_one_line_at_plan_run_and_submit(home, tmp_path, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to look for here
    path = tmp_path / "s3.json"
    path.write_text(json.dumps({"kind": "getbatch", "items": [{"uri": "s3://some-bucket/a.bin"}]}))
    for verb in ("plan", "run"):
        res = invoke(verb, str(path), ok=False)
        assert res.exit_code == 1 and "Traceback" not in res.output, res.output
        assert res.output.startswith("error: no AWS credentials found") and "AWS_PROFILE" in res.output
        assert len(res.output.strip().splitlines()) == 1
    from shardfold.client import Client
    from shardfold.functions.errors import NoCredentials

    with Client() as client, pytest.raises(NoCredentials, match="s3://some-bucket/a.bin"):
        client.submit(path)
    assert invoke("jobs").output.startswith("no jobs")  # nothing was submitted


@pytest.mark.slow  # a detached process runs the job
def test_run_no_wait_runs_the_job_detached_and_wait_follows_it(home, tmp_path):
    job_id = invoke("run", "--no-wait", "-q", str(spec_file(tmp_path, n=3))).output.strip()
    # this process holds nothing of the job: its own process runs it, in a session of its own
    from shardfold.client import Client

    with Client() as client:
        owner = store.get_json(client.uri(f"jobs/{job_id}/owner.json"))
        assert owner["pid"] != os.getpid()
    waited = invoke("wait", job_id).output
    assert f"job {job_id} SUCCEEDED" in waited and "items" in waited
    assert json.loads(invoke("status", job_id, "--json").output)["state"] == "SUCCEEDED"
    assert json.loads(invoke("result", job_id, "--json").output)["items"] == 3


@pytest.mark.slow  # a moto stack
def test_run_upload_puts_a_specs_local_inputs_in_the_bucket_and_names_them_there(home):
    """The shipped example spec, written for this machine, runs on the cloud path's dry run: its files are
    copied into the emulated bucket (content-addressed keys) and the job reads them there."""
    spec = Path(__file__).resolve().parent.parent / "events" / "getbatch.json"
    refused = invoke("run", str(spec), "--backend", "moto", ok=False)
    assert refused.exit_code != 0 and "--upload" in refused.output and "is a local file" in refused.output
    result = json.loads(invoke("run", str(spec), "--backend", "moto", "--upload", "--json").stdout)
    assert result["items"] == len(json.loads(spec.read_text())["items"]) and result["errors"] == 0


def test_the_moto_backend_without_moto_is_one_line_naming_the_dev_extra(home, monkeypatch):
    monkeypatch.setitem(sys.modules, "moto", None)  # `import moto` fails, as where it is not installed
    spec = Path(__file__).resolve().parent.parent / "events" / "getbatch.json"
    res = invoke("run", str(spec), "--backend", "moto", "--upload", ok=False)
    assert res.exit_code != 0
    (line,) = [x for x in res.output.splitlines() if x.strip()]
    assert line.startswith("error: the moto backend needs the dev extra ('shardfold[dev]')"), res.output


def test_one_name_per_step_and_json_on_every_verb_that_prints_data(home, tmp_path):
    """Status, progress, logs and report name a getbatch part task gather_part; a Map's own name still
    selects its logs; an unknown step is refused naming the job's steps; a unique start of an id names the
    job; every verb that prints data takes --json; report --html prints one line."""
    spec = str(spec_file(tmp_path, n=4))
    job_id = json.loads(invoke("run", "--json", spec).stdout)["job_id"]
    status = json.loads(invoke("status", job_id, "--json").output)
    assert {"prepare", "gather_part", "assemble"} <= set(status["steps"]) and "gather" not in status["steps"]
    assert (
        invoke("logs", job_id, "--step", "gather").output
        == invoke("logs", job_id, "--step", "gather_part").output
    )
    bad = invoke("logs", job_id, "--step", "nosuch", ok=False)
    assert bad.exit_code != 0 and "prepare, gather_part, assemble" in bad.output
    lines = [json.loads(line) for line in invoke("logs", job_id, "--json").output.splitlines()]
    assert lines and all({"step", "task", "attempt", "line"} <= set(d) for d in lines)
    # a start of the id that names one job only
    assert json.loads(invoke("status", job_id[:-3], "--json").output)["job_id"] == job_id
    other = json.loads(invoke("run", "--json", spec).stdout)["job_id"]
    common = os.path.commonprefix([job_id, other])
    ambiguous = invoke("status", common, ok=False)
    assert ambiguous.exit_code != 0 and job_id in ambiguous.output and other in ambiguous.output
    assert json.loads(invoke("wait", job_id, "--json").output)["job_id"] == job_id
    assert json.loads(invoke("cancel", job_id, "--json").output) == {"job_id": job_id, "state": "SUCCEEDED"}
    assert sorted(json.loads(invoke("clean", "--json").output)["cleaned"]) == sorted([job_id, other])
    html = tmp_path / "r.html"
    shown = invoke("report", other, "--html", str(html)).output
    assert shown.strip() == f"wrote the HTML report of {other} to {html}" and html.read_text().startswith("<")


def test_a_spec_failure_is_not_sent_to_resume():
    from shardfold.client.errors import ended_badly

    spec = str(ended_badly("j", "FAILED", "DatasetError: dataset x has no column 'age'"))
    assert "submit it again" in spec and "shardfold resume" not in spec
    transient = str(ended_badly("j", "FAILED", "ObjectNotFound: s3://b/in.bin"))
    assert "shardfold resume j" in transient
    assert "resume" not in str(ended_badly("j", "CANCELLED", None))


def test_delete_removes_an_ended_jobs_folder_and_refuses_a_running_one(home, tmp_path, monkeypatch):
    spec = str(spec_file(tmp_path, n=2))
    first = json.loads(invoke("run", "--json", spec).stdout)["job_id"]
    second = json.loads(invoke("run", "--json", spec).stdout)["job_id"]
    assert f"store {home.removeprefix('file://')}" in invoke("jobs").output  # the store it listed
    refused = invoke("delete", first, ok=False)  # not a terminal, no --yes: nothing deleted
    assert (
        refused.exit_code != 0
        and "--yes" in refused.output
        and store.exists(join(home, "jobs", first, "spec.json"))
    )
    assert json.loads(invoke("delete", first, "--yes", "--json").output) == {"deleted": [first]}
    assert store.list_uris(join(home, "jobs", first) + "/") == []
    assert "no job" in invoke("status", first, ok=False).output
    assert store.exists(join(home, "data", "obj-0.bin"))  # its inputs stay
    from types import SimpleNamespace

    from shardfold.client import Client
    from shardfold.client.sdk import Job

    running = SimpleNamespace(finished=False, state="RUNNING")
    monkeypatch.setattr(Job, "status", lambda self: running)
    with Client() as client, pytest.raises(ShardfoldError, match="is RUNNING: cancel it first"):
        client.delete(second)


def test_shell_completion_offers_job_ids_and_kinds(home, tmp_path):
    import subprocess
    import sys

    job_id = json.loads(invoke("run", "--json", str(spec_file(tmp_path, n=1))).stdout)["job_id"]

    def complete(words: str) -> list[str]:
        env = {**os.environ, "_SHARDFOLD_COMPLETE": "bash_complete", "COMP_WORDS": words}
        env["COMP_CWORD"] = str(len(words.split()) - (0 if words.endswith(" ") else 1))
        code = "from shardfold.client.cli import main; main()"
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
        )
        return [line.split(",", 1)[1] for line in out.stdout.splitlines() if "," in line]

    assert complete("shardfold status getb") == [job_id]
    assert complete("shardfold status dpq") == []
    assert complete("shardfold schema f") == ["fedavg"]
    assert "inference" in complete("shardfold jobs --kind ")
