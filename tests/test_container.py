"""The Batch container entry point: exit codes drive the job definition's retry table."""

import json

import pytest

from shardfold.functions import container
from shardfold.functions.store.retry import TransientError


def ok(event, context):
    return {"seen": event["x"]}


def flaky(event, context):
    raise TransientError("S3 answered 503", 503)


def broken(event, context):
    raise ValueError("bad input")


@pytest.mark.parametrize(("handler", "code"), [("ok", 0), ("flaky", container.EXIT_TRANSIENT), ("broken", 1)])
def test_exit_codes(monkeypatch, handler, code):
    monkeypatch.setenv("SHARDFOLD_HANDLER", f"{__name__}:{handler}")
    monkeypatch.setenv("SHARDFOLD_EVENT", json.dumps({"x": 1}))
    assert container.main() == code


def test_run_returns_the_result_and_names_a_bad_handler_setting():
    env = {"SHARDFOLD_HANDLER": f"{__name__}:ok", "SHARDFOLD_EVENT": '{"x": 3}'}
    assert container.run(env) == {"seen": 3}
    with pytest.raises(RuntimeError, match="module:function"):
        container.run({"SHARDFOLD_HANDLER": "nonsense"})
