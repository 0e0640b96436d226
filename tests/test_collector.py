"""The collector is made to wait while the platform's work runs, and set back after it."""

import gc

import pytest

from shardfold.functions import collector
from shardfold.functions.runtime import JobEvent, task


@pytest.mark.parametrize("users", [1, 3])
def test_the_threshold_is_raised_while_any_work_runs_and_restored(users):
    before = gc.get_threshold()
    holds = [collector.relaxed() for _ in range(users)]
    for hold in holds:
        hold.__enter__()
    assert gc.get_threshold()[0] >= collector.THRESHOLD_WHILE_BUSY
    for hold in holds[:-1]:
        hold.__exit__(None, None, None)
    assert gc.get_threshold()[0] >= collector.THRESHOLD_WHILE_BUSY  # one still runs
    holds[-1].__exit__(None, None, None)
    assert gc.get_threshold() == before


def test_a_task_runs_with_the_threshold_raised_and_leaves_it_as_it_was(tmp_path, monkeypatch):
    from shardfold.functions import runtime, store

    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path))
    root = store.uri.store_root()
    job_id = "getbatch-20260101T000000-0000cc"
    spec_uri = store.uri.join(root, "jobs", job_id, "spec.json")
    store.put_json(spec_uri, {"kind": "getbatch", "items": [{"uri": "data/x"}]})
    seen = []

    @task(JobEvent, kind="getbatch", step="getbatch.look")
    def look(e: JobEvent, spec) -> dict:
        seen.append(gc.get_threshold()[0])
        return {}

    before = gc.get_threshold()
    look({"job_id": job_id, "spec_uri": spec_uri, "store_root": root})
    runtime.clear_spec_cache()
    assert seen[0] >= collector.THRESHOLD_WHILE_BUSY and gc.get_threshold() == before
