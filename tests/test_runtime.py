"""The task decorator (functions.runtime.task): event validation, the per-process spec cache, logger keys
bound per call and never leaked, the kind check, and the Lambda signature with and without a context."""

from __future__ import annotations

import json
import logging
import threading

import pytest
from pydantic import BaseModel, Field

from shardfold.functions import runtime, store
from shardfold.functions.access import Grants, Right, TaskScope
from shardfold.functions.errors import AccessDenied, SpecError
from shardfold.functions.getbatch.spec import GetBatchSpec
from shardfold.functions.runtime import JobEvent, logger, task
from shardfold.functions.specs import parse_spec
from shardfold.functions.store.uri import join
from shardfold.orchestrator.invoke import LocalContext, call
from shardfold.orchestrator.registry import import_handler

LAMBDA_KEYS = ("function_name", "function_memory_size", "function_arn", "function_request_id")


class PartRef(BaseModel):
    part: int = Field(ge=0)


class PartEvent(JobEvent):
    item: PartRef


seen: list[dict] = []  # what each call of the handlers below saw


def log_line() -> dict:
    """The fields a log line written now would carry (through the logger's own formatter)."""
    record = logging.LogRecord("shardfold", logging.INFO, __file__, 1, "probe", None, None)
    return json.loads(logger.registered_formatter.format(record))


@task(PartEvent, kind="getbatch")
def gather(e: PartEvent, spec: GetBatchSpec) -> dict:
    seen.append({"spec": spec, "log": log_line()})
    return {"part": e.item.part, "items": len(spec.items or [])}


@task(JobEvent, kind="getbatch", step="getbatch.custom")
def plan(e: JobEvent, spec: GetBatchSpec) -> dict:
    seen.append({"spec": spec, "log": log_line()})
    return {"job": e.job_id}


@pytest.fixture(autouse=True)
def fresh():
    runtime.clear_spec_cache()
    seen.clear()
    yield
    runtime.clear_spec_cache()


@pytest.fixture
def parses(monkeypatch):
    """Counts the spec parses the decorator makes."""
    calls: list[int] = []
    real = runtime.parse_spec

    def counting(doc):
        calls.append(1)
        return real(doc)

    monkeypatch.setattr(runtime, "parse_spec", counting)
    return calls


def write_spec(root: str, job_id: str, doc: dict) -> str:
    uri = join(root, "jobs", job_id, "spec.json")
    store.put_json(uri, doc)
    return uri


def getbatch_doc(n: int = 2) -> dict:
    return {"kind": "getbatch", "items": [{"uri": f"in/{i}.bin"} for i in range(n)]}


@pytest.fixture
def root(tmp_path):
    return (tmp_path / "store").as_uri()


def event(root: str, job_id: str, spec_uri: str, **extra) -> dict:
    return {"job_id": job_id, "spec_uri": spec_uri, "store_root": root, **extra}


def test_a_bad_event_names_every_field_at_fault(root):
    uri = write_spec(root, "j1", getbatch_doc())
    with pytest.raises(SpecError, match=r"invalid PartEvent: item\.part: Input should be greater than or"):
        gather(event(root, "j1", uri, item={"part": -1}))
    with pytest.raises(SpecError, match=r"invalid PartEvent: spec_uri: Field required; item: Field required"):
        gather({"job_id": "j1", "store_root": root})
    with pytest.raises(SpecError, match="invalid PartEvent"):
        gather(["not", "an", "object"])
    assert seen == []


def test_the_spec_is_parsed_once_per_process_for_the_same_spec_uri(root, parses):
    uri = write_spec(root, "j1", getbatch_doc())
    assert gather(event(root, "j1", uri, item={"part": 0})) == {"part": 0, "items": 2}
    assert gather(event(root, "j1", uri, item={"part": 1})) == {"part": 1, "items": 2}
    assert plan(event(root, "j1", uri)) == {"job": "j1"}
    assert len(parses) == 1
    assert seen[0]["spec"] is seen[1]["spec"] is seen[2]["spec"]


def test_another_job_or_a_rewritten_spec_is_parsed_again_never_served_stale(root, parses):
    first = write_spec(root, "j1", getbatch_doc(2))
    second = write_spec(root, "j2", getbatch_doc(2))
    assert gather(event(root, "j1", first, item={"part": 0}))["items"] == 2
    assert gather(event(root, "j2", second, item={"part": 0}))["items"] == 2
    assert len(parses) == 2 and seen[0]["spec"] is not seen[1]["spec"]
    write_spec(root, "j1", getbatch_doc(5))  # specs are written once per job; the cache does not rely on it
    assert gather(event(root, "j1", first, item={"part": 0}))["items"] == 5
    assert len(parses) == 3


def test_the_cache_holds_a_bounded_number_of_specs(root, parses):
    uris = [write_spec(root, f"j{i}", getbatch_doc()) for i in range(runtime.SPEC_CACHE_SIZE + 1)]
    for i, uri in enumerate(uris):
        plan(event(root, f"j{i}", uri))
    plan(event(root, "j0", uris[0]))  # the least recently used, so evicted
    plan(event(root, f"j{len(uris) - 1}", uris[-1]))  # still cached
    assert len(parses) == len(uris) + 1


def test_threads_asking_for_the_same_spec_share_one_parse(root, monkeypatch):
    uri = write_spec(root, "j1", getbatch_doc())
    threads_n = 8
    arrived = threading.Barrier(threads_n)
    parses: list[int] = []
    another_parse = threading.Event()
    real_get, real_parse = store.get, runtime.parse_spec

    def get(u, *a, **k):
        arrived.wait(timeout=30)  # every thread has read the spec before any of them parses it
        return real_get(u, *a, **k)

    def parse(doc):
        parses.append(1)
        if len(parses) > 1:
            another_parse.set()
        # hold the first parse open for a while: a second parse, if any, starts meanwhile
        another_parse.wait(timeout=0.5)
        return real_parse(doc)

    monkeypatch.setattr(store, "get", get)
    monkeypatch.setattr(runtime, "parse_spec", parse)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            gather(event(root, "j1", uri, item={"part": i}))
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(parses) == 1 and len(seen) == threads_n


def test_a_spec_of_another_kind_is_refused(root):
    uri = write_spec(root, "f1", {"kind": "fedavg", "clients": [{"uri": "c0.safetensors"}]})
    with pytest.raises(SpecError, match=r"is a 'fedavg' spec, but this handler runs 'getbatch' jobs"):
        gather(event(root, "f1", uri, item={"part": 0}))
    assert seen == []


def test_a_bad_spec_is_refused_every_time_and_never_cached(root, parses):
    uri = join(root, "jobs", "bad", "spec.json")
    store.put(uri, b"{not json")
    for _ in range(2):
        with pytest.raises(SpecError, match="spec is not valid JSON"):
            plan(event(root, "bad", uri))
    assert len(parses) == 2


def test_job_step_and_task_are_bound_for_the_call_and_cleared_after_it(root):
    uri = write_spec(root, "j1", getbatch_doc())
    gather(event(root, "j1", uri, item={"part": 3}, index=3))
    line = seen[0]["log"]
    assert (line["job_id"], line["step"], line["task"]) == ("j1", "getbatch.gather", 3)
    after = log_line()
    assert not {"job_id", "step", "task"} & set(after)
    # the next task of another step, outside a Map: no key of the one before
    plan(event(root, "j1", uri))
    line = seen[1]["log"]
    assert (line["job_id"], line["step"]) == ("j1", "getbatch.custom") and "task" not in line
    assert not {"job_id", "step", "task"} & set(logger.thread_safe_get_current_keys())


def test_a_failed_call_leaks_no_key_either(root):
    uri = write_spec(root, "j1", {"kind": "fedavg", "clients": [{"uri": "c0.safetensors"}]})
    with pytest.raises(SpecError):
        gather(event(root, "j1", uri, item={"part": 0}, index=0))
    assert not {"job_id", "step", "task"} & set(log_line())


def test_concurrent_tasks_on_threads_each_log_their_own_keys(root):
    uris = {f"j{i}": write_spec(root, f"j{i}", getbatch_doc()) for i in range(4)}
    barrier = threading.Barrier(len(uris))
    lines: dict[str, dict] = {}

    @task(JobEvent, kind="getbatch", step="getbatch.wait")
    def wait_for_all(e: JobEvent, spec: GetBatchSpec) -> None:
        barrier.wait(timeout=30)  # every task is inside its call before any logs
        lines[e.job_id] = log_line()

    threads = [
        threading.Thread(target=wait_for_all, args=(event(root, job_id, uri, index=i), LocalContext(job_id)))
        for i, (job_id, uri) in enumerate(uris.items())
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, job_id in enumerate(uris):
        assert (lines[job_id]["job_id"], lines[job_id]["task"]) == (job_id, i)
        assert lines[job_id]["function_name"] == job_id


def test_context_none_binds_no_lambda_keys(root):
    uri = write_spec(root, "j1", getbatch_doc())
    assert plan(event(root, "j1", uri), None) == {"job": "j1"}
    assert not set(LAMBDA_KEYS) & set(seen[0]["log"])


def test_a_lambda_like_context_off_lambda_is_bound_for_the_call_only(root, monkeypatch):
    monkeypatch.delenv("AWS_LAMBDA_RUNTIME_API", raising=False)
    uri = write_spec(root, "j1", getbatch_doc())
    context = LocalContext(function_name="getbatch.prepare", memory_limit_in_mb=512)
    assert plan(event(root, "j1", uri), context) == {"job": "j1"}
    line = seen[0]["log"]
    assert line["function_name"] == "getbatch.prepare" and line["function_memory_size"] == 512
    assert line["function_request_id"] == context.aws_request_id
    assert not set(LAMBDA_KEYS) & set(log_line())


def test_on_lambda_the_context_goes_through_powertools_inject_lambda_context(root, monkeypatch):
    monkeypatch.setenv("AWS_LAMBDA_RUNTIME_API", "127.0.0.1:9001")
    uri = write_spec(root, "j1", getbatch_doc())
    context = LocalContext(function_name="shardfold-prod-getbatch-prepare")
    try:
        assert plan(event(root, "j1", uri), context) == {"job": "j1"}
        line = seen[0]["log"]
        assert line["function_name"] == "shardfold-prod-getbatch-prepare" and "cold_start" in line
        assert (line["job_id"], line["step"]) == ("j1", "getbatch.custom")
        assert "job_id" not in log_line()  # the task's own keys still end with the call
    finally:
        logger.remove_keys([*LAMBDA_KEYS, "cold_start"])  # Powertools keeps these until the next invocation


def test_handlers_keep_the_lambda_signature_and_their_importable_names(root):
    uri = write_spec(root, "j1", getbatch_doc())
    assert gather.__name__ == "gather" and gather.__module__ == __name__
    assert import_handler(f"{__name__}:gather") is gather
    # through the executors' path: JSON in and out, a LocalContext
    assert call(f"{__name__}:gather", event(root, "j1", uri, item={"part": 0}), function_name="t.g") == {
        "part": 0,
        "items": 2,
    }
    real = import_handler("shardfold.functions.getbatch.handlers:gather")
    assert real.__name__ == "gather" and real.__module__ == "shardfold.functions.getbatch.handlers"


# --- the task's reach: its job's folder, and what its kind's rights add (functions.access.TaskScope) --------


@task(JobEvent, kind="getbatch", step="getbatch.reach")
def reach(e: JobEvent, spec: GetBatchSpec) -> dict:
    """Touches what the event names: ``writes``, ``reads`` and ``pins`` (keys under the store root); returns
    the refusal of each, or None."""
    out: dict[str, str | None] = {}

    def attempt(what: str, fn) -> None:
        try:
            fn()
            out[what] = None
        except AccessDenied as exc:
            out[what] = str(exc)

    for key in e.model_extra.get("writes", []):
        attempt(f"write {key}", lambda key=key: store.put(join(e.store_root, key), b"x"))
    for key in e.model_extra.get("reads", []):
        attempt(f"read {key}", lambda key=key: store.exists(join(e.store_root, key)))
    for key in e.model_extra.get("pins", []):
        attempt(f"pin {key}", lambda key=key: store.pins([join(e.store_root, key)]))
    return out


def test_a_task_writes_its_own_job_folder_and_what_its_kind_declares_nothing_else(root):
    uri = write_spec(root, "j1", getbatch_doc())
    writes = ["jobs/j1/out/a", "results/a", "ledger/survey/entries/1.json", "jobs/j2/result.json", "claims/x"]
    got = reach(
        event(root, "j1", uri, writes=writes, reads=["ledger/survey/entries/1.json", "jobs/j2/spec.json"])
    )
    assert got["write jobs/j1/out/a"] is None and got["write results/a"] is None  # its folder; outputs
    assert "does not declare the 'ledger' right" in got["write ledger/survey/entries/1.json"]
    assert "may not write another job's folder" in got["write jobs/j2/result.json"]
    assert "may not write the output claims" in got["write claims/x"]
    assert "does not declare the 'ledger' right" in got["read ledger/survey/entries/1.json"]
    assert got["read jobs/j2/spec.json"] is None  # an input may be another job's output
    assert not store.exists(join(root, "ledger/survey/entries/1.json"))
    assert not store.exists(join(root, "jobs/j2/result.json"))


def test_the_reach_covers_lookups_too_and_ends_with_the_task(root):
    uri = write_spec(root, "j1", getbatch_doc())
    got = reach(event(root, "j1", uri, pins=["ledger/x", "jobs/j1/x"]))
    assert "'ledger' right" in got["pin ledger/x"] and got["pin jobs/j1/x"] is None
    store.put(join(root, "ledger/x"), b"outside any task: the caller's own reach")


def test_a_kind_without_a_right_is_refused_it(root):
    scope = TaskScope(root, "j1", "getbatch", frozenset())
    with pytest.raises(AccessDenied, match="'outputs' right"):
        scope.check(join(root, "results/a"), True)
    with pytest.raises(AccessDenied, match="'inputs' right"):
        scope.check(join(root, "data/a"), False)
    with pytest.raises(AccessDenied, match="'inputs' right"):
        scope.check("s3://another-bucket/data/a", False)
    scope.check(join(root, "jobs/j1/anything"), True)
    granted = TaskScope(root, "j1", "getbatch", frozenset(Right))
    granted.check(join(root, "ledger/survey/entries/1.json"), True)
    granted.check("file:///home/user/data.bin", False)


def test_a_task_lists_its_own_folder_whatever_its_rights(root):
    scope = TaskScope(root, "j1", "getbatch", frozenset())
    for folder in ("jobs/j1", "jobs/j1/", "jobs/j1/getbatch/parts/"):
        scope.check(join(root, folder), False)
        scope.check(join(root, folder), True)
    with pytest.raises(AccessDenied, match="'ledger' right"):
        scope.check(join(root, "ledger/"), False)
    with pytest.raises(AccessDenied, match="another job's folder"):
        scope.check(join(root, "jobs/"), True)


@pytest.mark.parametrize(
    "prefix, write, refusal",
    [
        ("l", True, "'ledger' right"),  # reaches ledger/
        ("led", False, "'ledger' right"),
        ("job", True, "another job's folder"),  # reaches every job's folder
        ("jobs/j1", True, "another job's folder"),  # and jobs/j10/...
        ("", True, "'ledger' right"),  # the whole store
        ("c", True, "the output claims"),
    ],
)
def test_a_listing_or_prefix_delete_reaches_what_its_string_matches(root, prefix, write, refusal):
    scope = TaskScope(root, "j1", "getbatch", frozenset({Right.INPUTS, Right.OUTPUTS}))
    uri = join(root, prefix) if prefix else root
    with pytest.raises(AccessDenied, match=refusal):
        scope.check(uri, write, prefix=True)
    scope.check(join(root, "jobs/j1") + "/", True, prefix=True)  # its own folder
    scope.check(join(root, "results/run-"), True, prefix=True)  # outputs
    scope.check(join(root, "data/"), False, prefix=True)  # inputs


def test_a_prefix_delete_in_a_task_cannot_reach_the_ledger(root):
    uri = write_spec(root, "j1", getbatch_doc())
    store.put(join(root, "ledger/ds/entries/00000001.json"), b"{}")

    @task(JobEvent, kind="getbatch", step="getbatch.sweep")
    def sweep(e: JobEvent, spec: GetBatchSpec) -> int:
        return store.delete_prefix(join(e.store_root, "l"))

    with pytest.raises(AccessDenied, match="'ledger' right"):
        sweep(event(root, "j1", uri))
    assert store.exists(join(root, "ledger/ds/entries/00000001.json"))


def test_on_a_deployment_a_task_writes_only_under_its_grants():
    scope = TaskScope("s3://bkt", "j1", "getbatch", frozenset(Right), Grants(("results/",), ("in-bkt",), ()))
    scope.check("s3://bkt/results/a", True)
    scope.check("s3://in-bkt/x", False)
    with pytest.raises(AccessDenied, match="outputPrefixes"):
        scope.check("s3://bkt/elsewhere/a", True)
    with pytest.raises(AccessDenied, match="writeBuckets"):
        scope.check("s3://in-bkt/x", True)
    with pytest.raises(AccessDenied, match="readBuckets"):
        scope.check("s3://other/x", False)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["getbatch", "fedavg", "dpquery", "inference"])
def test_submit_hands_its_tasks_the_spec_it_wrote_equal_to_a_fresh_parse(local_client, monkeypatch, kind):
    """Submit caches its parse of the spec it wrote, so the job's tasks in this process parse it no more;
    that parse must equal what a task would make of the stored bytes."""
    from shardfold.client.demo import DEMOS

    remembered, parses = [], []
    real_remember, real_parse = runtime._specs.remember, runtime.parse_spec
    monkeypatch.setattr(runtime._specs, "remember", lambda *a: (remembered.append(a), real_remember(*a)))
    monkeypatch.setattr(runtime, "parse_spec", lambda raw: (parses.append(1), real_parse(raw))[1])
    result = DEMOS[kind](local_client)
    assert result.state == "SUCCEEDED" and result.verified, result
    assert remembered and not parses  # the tasks run on threads here took submit's parse
    for uri, raw, spec in remembered:
        assert store.get(uri) == raw and parse_spec(raw) == spec
