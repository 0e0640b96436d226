"""The local stand-in for an AWS Batch container: the entry point as a child process, Batch's retry table."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from shardfold.functions.errors import ShardfoldError
from shardfold.functions.store.retry import TransientError
from shardfold.functions.workflow import BATCH_ATTEMPTS
from shardfold.orchestrator.invoke import HandlerFailed
from shardfold.orchestrator.local_batch import Cancelled, run_container

HERE = f"{__name__}"


@pytest.fixture(autouse=True, params=["forked", "fresh"])
def container_start(request, monkeypatch):
    """Every behaviour holds both for a container forked by the container server and for a fresh
    ``python -m functions.container`` (elsewhere than Linux, or ``SHARDFOLD_CONTAINER_SERVER=0``)."""
    monkeypatch.setenv("SHARDFOLD_CONTAINER_SERVER", "1" if request.param == "forked" else "0")
    return request.param


def _log(event, what):
    with open(event["log"], "a") as fh:
        fh.write(json.dumps({"pid": os.getpid(), "what": what}) + "\n")


def ok(event, context):
    _log(event, "ok")
    Path(event["out"]).write_text(json.dumps(event["value"] * 2))


def flaky(event, context):
    """Transient until it has been called ``event["fail_times"]`` times."""
    _log(event, "flaky")
    calls = len(Path(event["log"]).read_text().splitlines())
    if calls <= event["fail_times"]:
        raise TransientError(f"throttled (call {calls})")


def user_error(event, context):
    raise ShardfoldError("field 'text' is missing in data/x.jsonl line 3")


def crash(event, context):
    _log(event, "crash")
    os.kill(os.getpid(), signal.SIGKILL)


def sleepy(event, context):
    _log(event, "sleepy")
    time.sleep(60)


def _calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _run(fn, tmp_path, cancel=None, timeout_s=60, **event):
    event = {"log": str(tmp_path / "log.jsonl"), **event}
    run_container(
        f"{HERE}:{fn}", f"test.{fn}", event, timeout_s=timeout_s, cancel=cancel or threading.Event()
    )


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_runs_the_entry_point_in_a_child_process(tmp_path):
    _run("ok", tmp_path, out=str(tmp_path / "out.json"), value=21)
    assert json.loads((tmp_path / "out.json").read_text()) == 42
    (call,) = _calls(tmp_path / "log.jsonl")
    assert call["pid"] != os.getpid()


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_exit_75_is_retried_like_the_job_definition(tmp_path):
    _run("flaky", tmp_path, fail_times=BATCH_ATTEMPTS - 1)
    calls = _calls(tmp_path / "log.jsonl")
    assert len(calls) == BATCH_ATTEMPTS
    assert len({c["pid"] for c in calls}) == BATCH_ATTEMPTS  # a fresh container each attempt


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_attempts_are_bounded(tmp_path):
    with pytest.raises(HandlerFailed) as info:
        _run("flaky", tmp_path, fail_times=BATCH_ATTEMPTS)
    assert info.value.error == "TransientError"
    assert f"call {BATCH_ATTEMPTS}" in info.value.message
    assert len(_calls(tmp_path / "log.jsonl")) == BATCH_ATTEMPTS


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_a_user_error_fails_at_once_with_its_message(tmp_path):
    with pytest.raises(HandlerFailed) as info:
        _run("user_error", tmp_path)
    assert info.value.error == "ShardfoldError" and info.value.user_error
    assert "data/x.jsonl line 3" in info.value.message


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_a_killed_container_fails_naming_the_signal_and_is_not_retried(tmp_path):
    with pytest.raises(HandlerFailed) as info:
        _run("crash", tmp_path)
    assert info.value.error == "Batch.JobFailed"
    assert "SIGKILL" in info.value.message
    assert len(_calls(tmp_path / "log.jsonl")) == 1  # exit 137 matches the table's EXIT row


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_attempt_duration_is_enforced(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(HandlerFailed) as info:
        _run("sleepy", tmp_path, timeout_s=1)
    assert info.value.error == "States.Timeout"
    assert time.monotonic() - t0 < 30


@pytest.mark.slow  # end to end: a job, a model or child processes
def test_cancel_terminates_the_container(tmp_path):
    cancel = threading.Event()
    log = tmp_path / "log.jsonl"
    threading.Thread(target=lambda: (_wait_for(log), cancel.set()), daemon=True).start()
    with pytest.raises(Cancelled):
        _run("sleepy", tmp_path, cancel=cancel)
    (call,) = _calls(log)
    with pytest.raises(ProcessLookupError):
        os.kill(call["pid"], 0)


def _wait_for(path: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
