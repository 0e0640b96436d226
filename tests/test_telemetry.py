"""Per-task telemetry (functions/telemetry.py) and the job report (functions/report.py): the records every
task writes on the local and moto backends, a failing task's error and log, a retry as a second attempt,
private steps withheld, and the report's cost equal to its formula over the job's own records."""

from __future__ import annotations

import json
import math
import threading

import pytest
from click.testing import CliRunner
from records import ESTIMATE, record

from shardfold.client import Client, telemetry_table
from shardfold.client.cli import cli
from shardfold.functions import pricing, store, telemetry
from shardfold.functions.report import actual_cost, billed_s, build, requests_by_class, tables
from shardfold.functions.store.retry import TransientError
from shardfold.functions.workflow import BatchJob

FIELDS = {
    "job_id", "kind", "step", "function", "task", "attempt", "outcome", "error", "started_at", "ended_at",
    "duration_s", "peak_memory_mib", "memory_scope", "bytes_read", "bytes_written", "requests",
    "store_retries", "log", "host", "pid",
}  # fmt: skip
WAIT_S = 300  # a deadline, not a timing assumption


# --- the pure parts -----------------------------------------------------------------------------------------


def test_a_meter_counts_for_its_own_task_across_handed_over_threads():
    from concurrent.futures import ThreadPoolExecutor

    assert telemetry.current() is None
    telemetry.count("GET", read=10)  # no task: nothing to count for, nothing raised
    mine, other = telemetry.Meter(), telemetry.Meter()

    def work(meter: telemetry.Meter, n: int) -> None:
        token = telemetry._meter.set(meter)
        try:
            with ThreadPoolExecutor(4) as pool:
                for f in [pool.submit(telemetry.carried(telemetry.count), "GET", read=5) for _ in range(n)]:
                    f.result()
                pool.submit(telemetry.count, "PUT").result()  # not handed over: counts for no task
        finally:
            telemetry._meter.reset(token)

    threads = [threading.Thread(target=work, args=(m, n)) for m, n in ((mine, 7), (other, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (mine.requests, mine.bytes_read) == ({"GET": 7}, 35)
    assert (other.requests, other.bytes_read) == ({"GET": 3}, 15)


def test_a_call_is_named_by_its_workflow_step():
    assert telemetry.step_of("getbatch", "getbatch.gather", "gather") == "gather_part"
    # one function, two steps: the Map (or the Batch step) a call comes from says which
    assert telemetry.step_of("inference", "inference.preprocess", "preprocess") == "preprocess_shard"
    assert (
        telemetry.step_of("inference", "inference.preprocess", "repair_preprocess")
        == "repair_preprocess_shard"
    )
    assert telemetry.step_of("inference", "inference.worker", None, "repair_infer") == "repair_infer"
    assert telemetry.step_of("inference", "inference.worker", "infer_workers") == "infer"
    assert telemetry.step_of("nosuchkind", "nosuchkind.x", None) == "nosuchkind.x"


def test_requests_are_priced_by_s3_class_and_lambda_bills_whole_milliseconds():
    assert requests_by_class({"GET": 3, "HEAD": 2, "PUT": 1, "LIST": 1, "DELETE": 9, "UploadPart": 2}) == (
        5,
        4,
    )
    assert billed_s(0.0) == pricing.LAMBDA_MIN_BILLED_S and billed_s(0.0121) == pytest.approx(0.013)
    assert billed_s(0.013) == pytest.approx(0.013)


def test_the_report_sets_each_step_against_its_plan():
    estimate = ESTIMATE
    records = [
        record("prep", None, 0, 101.0, 0.2),
        record("work", 0, 0, 101.5, 1.0),
        record("work", 0, 1, 102.6, 1.0, peak_memory_mib=80.0),  # a retry
        record("work", 1, 0, 101.5, 2.0, outcome="failed", error={"type": "ValueError", "message": "bad"}),
    ]
    doc = build(estimate, records, {"job_id": "j", "kind": "k", "state": "FAILED"}, batch_steps=set(),
                allowed={"work": 2}, deadline_s=3.0, submitted_at=100.0)  # fmt: skip
    prep, work = doc["steps"]
    assert (
        work["actual"].items()
        >= {"tasks": 2, "attempts": 3, "failed": 1, "peak_mb": 80.0, "worst_task": 0}.items()
    )
    assert work["actual"]["max_duration_s"] == 2.0 and work["actual"]["slowest_task"] == 1
    assert (work["actual"]["gets"], work["actual"]["puts"]) == (6, 3)
    assert doc["sla"] == {"deadline_s": 3.0, "elapsed_s": pytest.approx(3.6), "met": False}
    assert doc["responsiveness"] == {"first_task_s": 1.0, "first_result_s": pytest.approx(2.5)}
    assert doc["scaling"]["peak_running"] == 2 and doc["scaling"]["allowed"] == {"work": 2}
    # task 0's retry waited 0.1 s after its first attempt while only task 1 ran: one idle slot for 0.1 s
    work_scaling = doc["scaling"]["steps"]["work"]
    assert work_scaling["allowed"] == 2 and work_scaling["peak"] == 2
    assert work_scaling["task_s"] == pytest.approx(0.1) and work_scaling["mean"] == pytest.approx(0.1 / 2.1)
    # transitions: the plan's 6, one Map child fewer (2 of 3 tasks ran), one retry
    assert doc["cost"]["transitions"] == 6 - 1 + 1
    assert "work: one part" in doc["interpretability"] and "a note" in doc["interpretability"]
    plan_t, actual_t, cost_t = tables(doc)
    assert plan_t.columns == actual_t.columns  # `shardfold plan` and `shardfold report` share one layout
    assert actual_t.rows[1][:3] == ["work", "2", "80/1,024"]


# --- on the executors ---------------------------------------------------------------------------------------


@pytest.fixture
def local_client(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    with Client() as c:
        yield c


def getbatch_job(client: Client, n: int = 6, per_part: int = 2, **spec):
    for i in range(n):
        store.put(client.uri(f"d/o{i}"), bytes([65 + i]) * (100 * (i + 1)))
    items = [{"uri": f"d/o{i}"} for i in range(n)]
    return client.submit({"kind": "getbatch", "items": items, "items_per_part": per_part, **spec})


def check_records(client: Client, job, steps: dict[str, int]) -> list[dict]:
    """Every field present in every record; one succeeded attempt per task; log lines readable."""
    records = telemetry.read_records(client.store_root, job.job_id)
    assert {s: sum(1 for r in records if r["step"] == s) for s in steps} == steps, records
    for r in records:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["job_id"] == job.job_id and r["outcome"] == "succeeded" and r["attempt"] == 0
        assert r["ended_at"] >= r["started_at"] and r["duration_s"] >= 0 and r["peak_memory_mib"] > 10
        assert r["memory_scope"] in ("task", "shared")
        assert r["bytes_read"] >= 0 and r["bytes_written"] > 0 and sum(r["requests"].values()) > 0
    table = job.telemetry()
    assert table.num_rows == len(records) and set(telemetry_table.COLUMNS) <= set(table.column_names)
    return records


def test_every_task_of_a_local_job_records_itself_and_the_report_prices_its_records(local_client):
    job = getbatch_job(local_client, deadline_s=600)
    assert job.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
    records = check_records(local_client, job, {"prepare": 1, "gather_part": 3, "assemble": 1})
    gather = sorted((r for r in records if r["step"] == "gather_part"), key=lambda r: r["task"])
    assert [r["task"] for r in gather] == [0, 1, 2]
    # part k reads objects 2k and 2k+1 (100(i+1) bytes each) with their pins: at least those bytes
    assert [r["bytes_read"] >= 100 * (4 * k + 3) for k, r in enumerate(gather)] == [True] * 3
    prepare = next(r for r in records if r["step"] == "prepare")
    assert prepare["log"]["lines"] >= 1
    assert any("planned getbatch" in line for _, line in job.logs(step="prepare"))

    doc = job.report()
    assert doc["tasks"] == 5 and doc["attempts"] == 5 and doc["sla"]["met"] is True
    from shardfold.functions.getbatch.workflow import WORKFLOW

    memory = {s.name: s.memory_mb for s in WORKFLOW.walk() if hasattr(s, "memory_mb")}
    batch = {s.name for s in WORKFLOW.walk() if isinstance(s, BatchJob)}
    # the actual cost is the formula over the job's own records, term by term
    want = actual_cost(records, memory, batch, doc["cost"]["transitions"], "arm64")
    assert doc["cost"]["actual"] == pytest.approx(want)
    gb_s = sum(memory[r["step"]] / 1024 * math.ceil(r["duration_s"] * 1000 - 1e-9) / 1000 for r in records)
    assert doc["cost"]["actual"]["lambda_compute"] == pytest.approx(gb_s * pricing.LAMBDA_USD_PER_GB_S)
    gets = sum(requests_by_class(r["requests"])[0] for r in records)
    assert doc["cost"]["actual"]["s3_get"] == pytest.approx(gets * pricing.S3_USD_PER_GET)
    assert [s["name"] for s in doc["steps"]] == ["prepare", "gather_part", "assemble"]
    assert all(s["plan"] is not None for s in doc["steps"])

    # the merged table is written once the job has ended, and read back the same
    again = job.telemetry()
    assert store.exists(telemetry_table.table_uri(local_client.store_root, job.job_id))
    assert again.to_pylist() == job.telemetry().to_pylist()


def said(job, step: str | None = None) -> dict[tuple[str, int | None], list[dict]]:
    """The JSON log lines of each task of ``job`` (by step and task), as ``Job.logs()`` gives them."""
    out: dict[tuple[str, int | None], list[dict]] = {}
    for rec, line in job.logs(step=step):
        out.setdefault((rec["step"], rec.get("task")), []).append(json.loads(line))
    return out


def test_every_task_logs_its_start_what_it_read_and_wrote_and_its_end(local_client):
    job = getbatch_job(local_client, n=6, per_part=2)
    assert job.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
    result = job.result()
    logs = said(job)
    assert sorted(logs, key=str) == sorted(
        [("prepare", None), ("gather_part", 0), ("gather_part", 1), ("gather_part", 2), ("assemble", None)],
        key=str,
    )
    for (step, task), lines in logs.items():  # every kind's tasks: framed by the task runner
        first, last = lines[0], lines[-1]
        assert first["message"] == "task started" and first["attempt"] == 0, (step, task, lines)
        assert last["message"] == "task ended" and last["outcome"] == "succeeded", (step, task, lines)
        assert last["duration_s"] >= 0 and last["bytes_written"] > 0 and last["requests"] > 0, last
        assert all(line.get("task") == task for line in lines), lines
        assert len(lines) == 3, lines  # one summary line per task, never one per item

    planned = logs[("prepare", None)][1]
    assert planned["message"] == "planned getbatch" and (planned["items"], planned["parts"]) == (6, 3)
    assert planned["worklist"] == local_client.uri(f"jobs/{job.job_id}/getbatch/worklist.json")

    def member(i: int) -> int:  # a TAR member: a 512-byte header, then its 100(i+1) bytes padded to 512
        return 512 + -(-100 * (i + 1) // 512) * 512

    for k in range(3):  # part k holds objects 2k and 2k+1
        gathered = logs[("gather_part", k)][1]
        assert gathered["message"] == "gathered part", gathered
        assert (gathered["part"], gathered["parts"], gathered["items"], gathered["failed"]) == (k, 3, 2, 0)
        assert gathered["item_bytes"] == 100 * (2 * k + 1) + 100 * (2 * k + 2)
        assert gathered["fragment"] == local_client.uri(f"jobs/{job.job_id}/getbatch/fragments/{k:05d}.tar")
        assert gathered["fragment_bytes"] == member(2 * k) + member(2 * k + 1)
    assembled = logs[("assemble", None)][1]
    assert assembled["message"] == "assembled getbatch", assembled
    assert (assembled["archive"], assembled["status"]) == (result["archive"], result["status"])
    assert (assembled["items"], assembled["failed"], assembled["item_bytes"]) == (6, 0, 2100)
    assert assembled["archive_bytes"] == sum(map(member, range(6))) + 1024 == store.size(result["archive"])
    # no object's bytes in any log (the objects hold runs of one letter)
    assert not any(chr(65 + i) * 100 in json.dumps(list(logs.values())) for i in range(6))
    # cheap: logs this small live in their records, so writing them took no request of its own
    records = telemetry.read_records(local_client.store_root, job.job_id)
    assert all(len(r["log"]["inline"]) == r["log"]["lines"] == 3 for r in records), records
    assert not [u for u in store.list_uris(telemetry.prefix(local_client.store_root, job.job_id) + "/")
                if u.endswith(".log")]  # fmt: skip
    assert "inline" not in job.telemetry().column("log")[0].as_py()  # the table says where, not what


def test_a_private_steps_end_says_only_its_outcome(tmp_path):
    root = (tmp_path / "store").as_uri()
    with telemetry.recording(store_root=root, job_id="j", kind="dpquery", function="dpquery.prepare",
                             task=None, map_name=None, context=None):  # fmt: skip
        store.put(f"{root}/jobs/j/x", b"some bytes")
    (r,) = telemetry.read_records(root, "j")
    assert r["withheld"] is True and r["step"] == "prepare"
    lines = [json.loads(line) for line in telemetry.log_lines(r, root, "j")]
    assert [line["message"] for line in lines] == ["task started", "task ended"]
    assert all("timestamp" not in line for line in lines), lines
    assert {"attempt", "outcome"} <= set(lines[-1]) and not {"duration_s", "bytes_written"} & set(lines[-1])


def test_a_failing_task_shows_its_error_and_its_log(local_client):
    store.put(local_client.uri("d/there"), b"x")
    # listed in a manifest, which submit does not stat item by item: the job runs and its task fails
    store.put(local_client.uri("d/items.jsonl"), b'{"uri": "d/there"}\n{"uri": "d/gone"}\n')
    job = local_client.submit({"kind": "getbatch", "manifest": "d/items.jsonl"})
    assert job.wait(progress=False, timeout_s=WAIT_S).state == "FAILED"
    failed = [
        r for r in telemetry.read_records(local_client.store_root, job.job_id) if r["outcome"] == "failed"
    ]
    assert failed and "gone" in failed[0]["error"]["message"] and failed[0]["error"]["type"]
    lines = [line for rec, line in job.logs() if rec["outcome"] == "failed"]
    assert any("task failed" in line and "gone" in line for line in lines), lines
    ended = json.loads(lines[-1])  # a failed attempt ends as any other, with its outcome
    assert ended["message"] == "task ended" and ended["outcome"] == "failed" and ended["error_type"], ended
    doc = job.report()
    assert doc["state"] == "FAILED" and sum(s["actual"]["failed"] for s in doc["steps"]) == 1


def test_an_injected_retry_is_a_second_attempt(local_client, monkeypatch):
    from shardfold.functions.getbatch import core

    local_client.executor.retry_delay_scale = 0
    real, raised = core.gather, []

    def flaky(*args, **kwargs):
        if not raised:
            raised.append(1)
            raise TransientError("injected: the store dropped the connection")
        return real(*args, **kwargs)

    monkeypatch.setattr(core, "gather", flaky)
    job = getbatch_job(local_client, n=2, per_part=2)
    assert job.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
    gather = [
        r for r in telemetry.read_records(local_client.store_root, job.job_id) if r["step"] == "gather_part"
    ]
    assert [(r["attempt"], r["outcome"]) for r in gather] == [(0, "failed"), (1, "succeeded")]
    assert gather[0]["error"]["type"] == "TransientError"
    doc = job.report()
    part = next(s for s in doc["steps"] if s["name"] == "gather_part")
    assert part["actual"].items() >= {"tasks": 1, "attempts": 2, "failed": 0}.items()


@pytest.mark.slow
def test_records_on_moto_match_the_local_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "moto-home"))
    with Client(backend="moto") as client:
        job = getbatch_job(client)
        assert job.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
        records = check_records(client, job, {"prepare": 1, "gather_part": 3, "assemble": 1})
        assert all(r["requests"].get("GET", 0) + r["requests"].get("PUT", 0) > 0 for r in records)
        doc = job.report()
        assert doc["tasks"] == 5 and doc["cost"]["actual"]["total"] > 0
        # a Lambda task's log is in CloudWatch Logs (as the harness writes it, as Lambda would): its lines by
        # request id, framed by START, END and the REPORT line
        prepare = next(r for r in records if r["step"] == "prepare")
        assert prepare["log"]["group"] == "/aws/lambda/" + prepare["log"]["group"].rsplit("/", 1)[1]
        lines = [line for _, line in job.logs(step="prepare")]
        assert any("planned getbatch" in line for line in lines), lines
        assert lines[0].startswith("START RequestId: " + prepare["log"]["request_id"])
        assert lines[-1].startswith("REPORT RequestId: ") and "Max Memory Used:" in lines[-1]
        # the report takes Lambda's billed duration and memory size from each invocation's REPORT line
        enriched = telemetry.with_lambda_reports(records)
        assert all(r["billed_duration_s"] * 1000 >= r["duration_s"] * 1000 - 1 for r in enriched)
        from shardfold.functions.getbatch.workflow import WORKFLOW

        memory = {s.name: s.memory_mb for s in WORKFLOW.walk() if hasattr(s, "memory_mb")}
        assert [r["memory_size_mb"] for r in enriched] == [memory[r["step"]] for r in enriched]
        gb_s = sum(r["memory_size_mb"] / 1024 * r["billed_duration_s"] for r in enriched)
        assert doc["cost"]["actual"]["lambda_compute"] == pytest.approx(gb_s * pricing.LAMBDA_USD_PER_GB_S)


def test_cli_report_and_logs(local_client):
    job = getbatch_job(local_client)
    assert job.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
    out = CliRunner().invoke(cli, ["report", job.job_id], catch_exceptions=False, env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "plan (at submit)" in out.output and "actual" in out.output and "5 (5 attempts)" in out.output
    doc = json.loads(CliRunner().invoke(cli, ["report", job.job_id, "--json"]).output)
    assert doc["tasks"] == 5
    logs = CliRunner().invoke(cli, ["logs", job.job_id, "--step", "prepare"], env={"COLUMNS": "400"})
    assert logs.exit_code == 0 and "prepare[-]#0" in logs.output and "planned getbatch" in logs.output
    # --follow on an ended job prints each line once and returns
    follow = CliRunner().invoke(cli, ["logs", job.job_id, "--step", "prepare", "-f"], env={"COLUMNS": "400"})
    assert follow.exit_code == 0 and follow.output == logs.output
    none = CliRunner().invoke(cli, ["logs", job.job_id, "--step", "assemble", "--task", "7"])
    assert none.exit_code == 0 and none.output == ""


@pytest.mark.slow  # end to end: every kind, an inference container among them
@pytest.mark.parametrize("backend", ["local", "moto"])
def test_every_kind_records_every_task_and_dpquery_withholds_its_private_steps(
    backend, tmp_path, monkeypatch
):
    """Every demo job's records. On the local backend the demos run as ``shardfold demo`` does for a new
    user, through the CLI, whose summary is checked too (one run of the four jobs for both checks); on moto
    through the SDK's demo functions."""
    from shardfold.client import demo

    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    if backend == "local":
        monkeypatch.setenv("COLUMNS", "200")
        monkeypatch.delenv("SHARDFOLD_BACKEND", raising=False)
        res = CliRunner().invoke(cli, ["demo", "--items", "24", "--no-progress"], catch_exceptions=False)
        out = res.output
        assert res.exit_code == 0, out
        assert "getbatch" in out and "yes" in out and "SUCCEEDED" in out
        assert "8 clients" in out and "2 shards" in out and "fedavg: 10 tensors" in out
        # dpquery: the expected vs observed error of a release of every <=2-way marginal of 100,000 rows
        assert "100,000 rows" in out and "22 marginals" in out and "workload RMSE predicted" in out
        assert "dpquery: standardised errors" in out and "(exact Gaussian)" in out
        with Client(backend=backend) as client:
            jobs = sorted((s.kind, s.job_id) for s in client.jobs())
            assert [k for k, _ in jobs] == sorted(demo.DEMOS), jobs
            for kind, job_id in jobs:
                check_every_field(client, kind, job_id)
        return
    # smaller than the shipped demo: what is checked is each task's record, not the demo's size
    monkeypatch.setattr(demo, "DEMO_DP_ROWS", 20_000)
    monkeypatch.setattr(demo, "DEMO_INFERENCE_ROWS", 2 * demo.DEMO_INFERENCE_SHARD_ROWS)
    with Client(backend=backend) as client:
        for run in (demo.demo_getbatch, demo.demo_fedavg, demo.demo_dpquery, demo.demo_inference):
            shown = run(client, 24) if run is demo.demo_getbatch else run(client)
            check_every_field(client, shown.kind, shown.job_id)


def check_every_field(client: Client, kind_name: str, job_id: str) -> None:
    """Every field in every record of a demo job; dpquery's private steps withheld (records, estimate)."""
    from shardfold.functions import kinds

    job = client.job(job_id)
    records = telemetry.read_records(client.store_root, job.job_id)
    kind = kinds.find(kind_name)
    ran = {r["step"] for r in records}
    steps = {s.name for s in kind.workflow.walk() if isinstance(s, BatchJob) or hasattr(s, "function")}
    assert ran <= steps and len(ran) >= 3, (kind_name, ran)
    for r in records:
        assert FIELDS <= set(r) and r["outcome"] == "succeeded", (kind_name, r)
        if r["step"] in kind.private_steps:  # nothing measured leaves: a proxy of the row count
            assert r["withheld"] is True and r["duration_s"] is None and r["bytes_read"] is None
            assert r["requests"] is None and r["peak_memory_mib"] is None and r["started_at"] is None
            if r["log"].get("uri"):  # its log keeps what it said, not when (docs/observability.md)
                lines = list(telemetry.log_lines(r, client.store_root, job.job_id, log_groups(client)))
                assert all("timestamp" not in json.loads(line) for line in lines), lines
        else:
            assert r["duration_s"] is not None and r["peak_memory_mib"] > 10, (kind_name, r)
    doc = job.report()
    assert doc["tasks"] == len({(r["step"], r["task"]) for r in records})
    if kind_name == "dpquery":
        assert kind.private_steps <= ran
        private_lines = [
            ln
            for r in records
            if r["step"] in kind.private_steps
            for ln in telemetry.log_lines(r, client.store_root, job.job_id, log_groups(client))
        ]
        assert any("measured" in line for line in private_lines), private_lines  # there were lines to check
        estimate = store.get_json(client.uri(f"jobs/{job.job_id}/estimate.json"))
        private = [s for s in estimate["steps"] if s["name"] in kind.private_steps]
        assert private and all(s["duration_s"] is None and s["gets"] is None for s in private)
        assert estimate["cost_usd"] == {}
    if kind_name == "inference":  # the Batch container's attempt is named by its step
        assert "infer" in ran and "repair_infer" not in ran  # a clean run starts no repair job
        if client.backend == "local":  # a container process of its own
            assert all(r["memory_scope"] == "task" for r in records if r["step"] == "infer")


def test_a_quiet_console_still_leaves_info_lines_in_the_task_logs(local_client, capsys):
    import logging

    shardfold = logging.getLogger("shardfold")
    before = shardfold.level
    shardfold.setLevel(logging.ERROR)  # as the CLI quietens it without -v
    try:
        job = getbatch_job(local_client)
        assert job.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
    finally:
        shardfold.setLevel(before)
    assert any("planned getbatch" in line for _, line in job.logs(step="prepare"))
    assert "planned getbatch" not in capsys.readouterr().out  # the console stayed quiet


def test_records_written_by_hand_cannot_crash_the_report_or_redirect_logs(local_client):
    job = getbatch_job(local_client, n=2, per_part=2)
    assert job.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
    root = local_client.store_root
    secret = local_client.uri("private/secret.txt")
    store.put(secret, b"not a log")
    forged = telemetry.record_uri(root, job.job_id, "prepare", None, 5)
    store.put_json(forged, {"step": "prepare", "task": None, "attempt": 5, "outcome": "succeeded",
                            "log": {"uri": secret, "lines": 1}})  # fmt: skip
    for junk in ([1, 2], {"step": 3}, {"step": "x", "duration_s": "long"}, {"step": "x", "requests": []}):
        store.put_json(telemetry.record_uri(root, job.job_id, "junk", None, len(str(junk))), junk)
    store.put(telemetry.record_uri(root, job.job_id, "junk", None, 99), b"{not json")
    records = telemetry.read_records(root, job.job_id)
    assert {r["step"] for r in records} == {"prepare", "gather_part", "assemble"}  # the junk is skipped
    lines = [line for rec, line in job.logs(step="prepare") if rec["attempt"] == 5]
    assert "not a log" not in "".join(lines)  # the forged record's log is its own sibling, which is absent
    assert job.report()["tasks"] == 3


def log_groups(client) -> frozenset[str]:
    """The stack's log groups (the moto stack's too), where `shardfold logs` follows a record."""
    outputs = getattr(client.executor, "outputs", None) or {}
    return frozenset((outputs.get("log_groups") or {}).values())
