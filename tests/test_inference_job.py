"""The inference job from the user's side: end to end on the local and moto executors (equal embeddings, same
ids in the same order), ``client.inference.run``/``load``, the plan estimator, the shipped example spec on
the CLI, and bad input through the job (a missing field fails naming the file and line; ``skip`` reports it).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from outsider import outside_the_task

from shardfold.client import Client, inference
from shardfold.client.cli import cli
from shardfold.client.demo import inference_corpus
from shardfold.client.errors import JobFailed
from shardfold.functions import telemetry
from shardfold.functions.estimate import estimate
from shardfold.functions.specs import parse_spec

REPO = Path(__file__).resolve().parent.parent
EVENTS = REPO / "events"
WAIT_S = 300  # a deadline, not a timing assumption
ROWS = 48
SHARD_ROWS = 16
# Rows of at most this many words wherever a corpus is embedded twice (on local and on moto; a job with a
# killed worker, then a clean run): 2.6x less CPU than the default of 60 words, and a shard of 16 rows still
# takes ~0.1 s, so a kill after two commits leaves 18 shards to do.
SHORT = 20


def corpus_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture(scope="module")
def moto_client(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDFOLD_HOME", str(tmp_path_factory.mktemp("moto-home")))
        with Client(backend="moto") as c:
            yield c


def put_corpus(client: Client, key: str, rows: list[dict]) -> str:
    from shardfold.functions import store

    uri = client.uri(key)
    store.put(uri, corpus_bytes(rows))
    return key


# --- the job end to end -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_local_and_moto_executors_give_equal_embeddings(moto_client, tmp_path, monkeypatch):
    rows = inference_corpus(ROWS, seed=3, max_words=SHORT)
    key = put_corpus(moto_client, "corpora/a.jsonl", rows)  # relative key: under the moto bucket
    on_moto = inference.run(
        key, field="text", id_field="id", shard_rows=SHARD_ROWS, gpu_workers=2, client=moto_client
    )
    moto_ids, moto_emb = inference.load(on_moto)

    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "local-home"))
    with Client() as local:  # local store and executor; the corpus still lives in the moto bucket
        spec_uri = moto_client.uri(key)
        on_local = inference.run(spec_uri, field="text", id_field="id", shard_rows=SHARD_ROWS, client=local)
        local_ids, local_emb = inference.load(on_local)

    assert on_moto["output"].startswith("s3://") and on_local["output"].startswith("file://")
    assert on_moto["rows"] == on_local["rows"] == ROWS
    assert on_moto["shards"] == on_local["shards"] == ROWS // SHARD_ROWS
    assert on_moto["workers"] == 2 and on_local["workers"] == 1  # a Map of two Batch jobs on moto
    assert on_moto["config_hash"] == on_local["config_hash"]
    want = [r["id"] for r in rows]
    assert [str(i) for i in moto_ids] == want and [str(i) for i in local_ids] == want
    assert moto_emb.shape == local_emb.shape == (ROWS, 384) and moto_emb.dtype == np.float32
    assert np.allclose(moto_emb, local_emb, atol=1e-5)
    assert np.allclose(np.linalg.norm(local_emb, axis=1), 1.0, atol=1e-4)

    # each GPU worker's task record points at its Batch job, whose log stream holds the worker's lines
    job = moto_client.job(on_moto["job_id"])
    infer = [r for r in telemetry.read_records(moto_client.store_root, job.job_id) if r["step"] == "infer"]
    assert len(infer) == 2 and all(r["log"].get("batch_job") for r in infer), infer
    lines = [line for _, line in job.logs(step="infer", task=0)]
    assert any("inference worker done" in line for line in lines), lines


def _worker_container(timeout_s: float = WAIT_S):
    """The running local Batch container under this process: forked by the container server, or
    ``python -m functions.container`` where there is none."""
    import time

    import psutil

    from shardfold.orchestrator.container_server import NAME

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in psutil.Process().children(recursive=True):
            try:
                if p.name() == NAME or "shardfold.functions.container" in " ".join(p.cmdline()):
                    return p
            except psutil.Error:
                continue
        time.sleep(0.02)
    raise AssertionError("no worker container started")


@pytest.mark.slow
def test_kill_9_the_worker_then_resume_recomputes_only_uncommitted_shards(local_client, monkeypatch):
    import time

    from shardfold.functions import store
    from shardfold.functions.inference import shards as layout
    from shardfold.functions.inference.pipeline import worker_reports

    monkeypatch.setattr(store, "delete_prefix", lambda prefix: 0)  # keep the scratch to see who did what

    rows = inference_corpus(320, seed=5, max_words=SHORT)
    key = put_corpus(local_client, "corpora/kill.jsonl", rows)
    spec = {"kind": "inference", "inputs": [key], "field": "text", "id_field": "id", "shard_rows": 16}
    job = local_client.submit(spec)
    root = local_client.store_root
    worker = _worker_container()
    markers = []
    deadline = time.monotonic() + WAIT_S
    while len(markers) < 2 and time.monotonic() < deadline:  # kill once two shards are committed
        markers = [u for u in store.list_uris(layout.job_root(root, job.job_id) + "/") if u.endswith(".done")]
        time.sleep(0.01)
    worker.kill()
    status = job.wait(progress=False, timeout_s=WAIT_S)
    assert status.state == "FAILED" and "killed by SIGKILL" in status.error, (status.error, markers)
    h = layout.load_plan(root, job.job_id)["config_hash"]
    committed = {layout.shard_of(u) for u in store.list_uris(layout.out_prefix(root, job.job_id, h) + "/")}
    committed = {k for k in committed if store.exists(layout.done_uri(root, job.job_id, h, k))}
    assert 2 <= len(committed) < 20, "the worker finished before the kill; the test needs a slower shard"
    before = {k: store.get(layout.out_uri(root, job.job_id, h, k)) for k in committed}
    assert job.status().steps["embedded_shards"] == {"done": len(committed), "total": 20}

    finished = job.resume().wait(progress=False, timeout_s=WAIT_S)
    assert finished.state == "SUCCEEDED" and finished.steps["embedded_shards"] == {"done": 20, "total": 20}
    result = job.result()
    (report,) = worker_reports(root, job.job_id)  # only the resumed worker reports; the killed one never did
    assert sorted(report["computed"]) == sorted(set(range(20)) - committed)
    assert {k: store.get(layout.out_uri(root, job.job_id, h, k)) for k in committed} == before
    assert result["workers"] == 1
    assert not store.list_uris(layout.job_root(root, job.job_id) + "/claims/1/")  # no repair round needed

    clean = local_client.inference.run(key, field="text", id_field="id", shard_rows=16)  # the bound helpers
    ids, emb = local_client.inference.load(result)
    clean_ids, clean_emb = local_client.inference.load(clean)
    assert list(ids) == list(clean_ids) == [r["id"] for r in rows]
    np.testing.assert_allclose(emb, clean_emb, atol=1e-6)


@pytest.mark.slow
def test_two_workers_share_the_shards_and_survive_one_killed(local_client, monkeypatch):
    import time

    from shardfold.functions import store
    from shardfold.functions.inference import shards as layout
    from shardfold.functions.inference.pipeline import worker_reports

    monkeypatch.setattr(store, "delete_prefix", lambda prefix: 0)  # keep the scratch to see who did what

    rows = inference_corpus(320, seed=6, max_words=SHORT)
    key = put_corpus(local_client, "corpora/two.jsonl", rows)
    spec = {"kind": "inference", "inputs": [key], "field": "text", "id_field": "id", "shard_rows": 16}
    job = local_client.submit({**spec, "gpu_workers": 2})
    root = local_client.store_root
    first = _worker_container()
    deadline = time.monotonic() + WAIT_S
    while not any(u.endswith(".done") for u in store.list_uris(layout.job_root(root, job.job_id) + "/")):
        assert time.monotonic() < deadline, "no shard was committed"
        time.sleep(0.01)
    first.kill()  # the other worker carries on; the repair round takes what the killed one held
    assert job.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED", job.status().error
    result = job.result()
    reports = worker_reports(root, job.job_id)
    assert first.pid not in {r["worker"]["pid"] for r in reports}  # the killed worker never reported
    h = layout.load_plan(root, job.job_id)["config_hash"]
    by = {k: store.get_json(layout.done_uri(root, job.job_id, h, k))["pid"] for k in range(20)}
    for r in reports:  # every shard committed once, by the worker whose report lists it
        assert sorted(r["computed"]) == sorted(k for k, pid in by.items() if pid == r["worker"]["pid"])
    assert set(by.values()) <= {first.pid} | {r["worker"]["pid"] for r in reports}
    assert result["rows"] == 320 and result["workers"] == len(reports)

    clean = inference.run(key, field="text", id_field="id", shard_rows=16, client=local_client)
    ids, emb = inference.load(result)
    clean_ids, clean_emb = inference.load(clean)
    assert list(ids) == list(clean_ids) == [r["id"] for r in rows]
    np.testing.assert_allclose(emb, clean_emb, atol=1e-6)


@pytest.mark.slow
def test_run_default_ids_are_row_numbers_across_inputs(local_client):
    a = put_corpus(local_client, "in/a.jsonl", inference_corpus(5, seed=1))
    b = put_corpus(local_client, "in/b.jsonl", inference_corpus(4, seed=2))
    result = inference.run([a, b], field="text", shard_rows=3, client=local_client)
    ids, emb = inference.load(result)
    assert list(ids) == list(range(9)) and emb.shape == (9, 384)
    # the same text embeds the same wherever it sits: row 0 of b.jsonl is global row 5
    again = inference.run(b, field="text", shard_rows=2, client=local_client)
    _, emb_b = inference.load(again)
    assert np.allclose(emb[5:], emb_b, atol=1e-5)


def test_plan_estimate_counts_shards_and_cpu_tasks(local_client):
    key = put_corpus(local_client, "in/p.jsonl", inference_corpus(50, seed=4))
    spec = parse_spec({"kind": "inference", "inputs": [key], "field": "text", "shard_rows": 20})
    report = estimate(spec, local_client.store_root).check()
    assert report.items == 50
    steps = {s.name: s for s in report.steps}
    assert steps["preprocess_shard"].tasks == 3
    assert steps["infer"].tasks == 1
    # Batch steps are priced as GPU instance time, not as Lambda GB-s, and are not Lambda invocations
    from shardfold.functions import pricing

    assert steps["infer"].gb_s == 0 and steps["infer"].instance_s >= pricing.BATCH_STARTUP_S
    # the repair round's GPU job runs only when shards are missing: a clean run's plan prices none
    assert steps["repair_infer"].tasks == 0 and steps["repair_infer"].instance_s == 0
    assert any(n.startswith("repair round (not priced)") for n in report.notes)
    gpu_s = steps["infer"].instance_s
    assert report.cost_usd["batch_gpu_instances"] == pytest.approx(
        gpu_s / 3600 * pricing.BATCH_GPU_USD_PER_HOUR
    )
    assert report.cost_usd["total"] == pytest.approx(
        sum(v for k, v in report.cost_usd.items() if k != "total")
    )
    (table,) = report.details
    assert table.rows[0][:3] == [50, 3, 3]
    # an unreadable input is a note, not a crash
    missing = parse_spec({"kind": "inference", "inputs": ["in/nope.jsonl"], "field": "text"})
    notes = estimate(missing, local_client.store_root).notes
    assert any("nope.jsonl" in n for n in notes)


# --- the shipped example and the CLI ------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_plan_and_run_the_shipped_example(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("SHARDFOLD_BACKEND", raising=False)
    spec = str(EVENTS / "inference.json")
    corpus = (EVENTS / "data" / "inference" / "corpus.jsonl").read_text().splitlines()
    assert len(corpus) == 300

    plan = CliRunner().invoke(cli, ["plan", spec], catch_exceptions=False)
    assert plan.exit_code == 0, plan.output
    assert "inference" in plan.output and "preprocess" in plan.output

    out = CliRunner().invoke(cli, ["run", spec], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert "SUCCEEDED" in out.output
    job_id = next(w for w in out.output.split() if w.startswith("inference-"))
    ids, emb = inference.load(Client().job(job_id).result())
    assert [str(i) for i in ids] == [json.loads(line)["id"] for line in corpus]
    assert emb.shape == (300, 384)
    status = CliRunner().invoke(cli, ["status", job_id], catch_exceptions=False)
    assert status.exit_code == 0 and "embedded_shards 3/3" in status.output, status.output


# --- bad input through the job ------------------------------------------------------------------------------


@pytest.mark.slow
def test_missing_field_fails_naming_file_and_line(local_client):
    # the failing CPU task leaves cpu_failed.json, so the GPU worker stops at once instead of waiting
    rows = inference_corpus(6, seed=8)
    rows[3] = {"id": rows[3]["id"], "body": "no text field here"}
    key = put_corpus(local_client, "bad/missing.jsonl", rows)
    with pytest.raises(JobFailed) as err:
        inference.run(key, field="text", id_field="id", shard_rows=4, client=local_client)
    msg = str(err.value)
    assert "missing.jsonl" in msg and "line 4" in msg and "'text'" in msg


@pytest.mark.slow
def test_skip_policy_drops_bad_rows_and_reports_them(local_client):
    rows = inference_corpus(6, seed=8)
    rows[3] = {"id": rows[3]["id"], "body": "no text field here"}
    key = put_corpus(local_client, "bad/skip.jsonl", rows)
    result = inference.run(
        key, field="text", id_field="id", shard_rows=4, on_bad_row="skip", client=local_client
    )
    ids, emb = inference.load(result)
    assert [str(i) for i in ids] == [r["id"] for i, r in enumerate(rows) if i != 3]
    assert result["skipped"] == 1 and emb.shape == (5, 384)


def test_unknown_option_is_a_spec_error():
    from shardfold.functions.errors import SpecError

    with pytest.raises((SpecError, ValueError)):
        inference.spec(["a.jsonl"], field="text", shard_rowz=3)


def test_the_client_bound_helpers_submit_the_module_functions_spec(monkeypatch):
    """``client.inference`` is the module's helpers bound to one client, as ``client.fedavg`` is."""
    from shardfold.functions.errors import SpecError

    with Client() as client:
        submitted = []
        monkeypatch.setattr(client, "submit", lambda doc: submitted.append(doc) or "job")
        assert client.inference.submit(["a.jsonl"], field="text", shard_rows=7) == "job"
        want = inference.spec(["a.jsonl"], field="text", shard_rows=7).model_dump(
            mode="json", exclude_none=True
        )
        assert submitted == [want]
        with pytest.raises(SpecError, match="shard_rows"):
            client.inference.submit(["a.jsonl"], field="text", shard_rows=0)
        assert client.inference is client.inference


@pytest.mark.parametrize("workers", [0, -1, 257, "two"])
def test_bad_gpu_workers_is_a_spec_error_naming_the_field(workers):
    from shardfold.functions.errors import SpecError

    with pytest.raises(SpecError, match="gpu_workers"):
        parse_spec({"kind": "inference", "inputs": ["a.jsonl"], "field": "text", "gpu_workers": workers})


# --- inputs pinned at plan ----------------------------------------------------------------------------------


def change_after_prepare(monkeypatch, uri: str, data: bytes) -> None:
    """Let the job plan its shards (byte ranges), then put ``data`` at ``uri`` before any shard is read."""
    from shardfold.functions import store
    from shardfold.functions.inference import pipeline

    real = pipeline.prepare

    def prepare_then_change(*args, **kwargs):
        out = real(*args, **kwargs)
        with outside_the_task():
            store.put(uri, data)
        return out

    monkeypatch.setattr(pipeline, "prepare", prepare_then_change)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "moto"])
def test_an_input_replaced_after_the_plan_fails_the_job_naming_it(backend, request, monkeypatch):
    """A JSONL input replaced by one of the same size (a row's text reversed) after the plan: the shards'
    byte ranges still parse, so without the pin the job would embed the new text and succeed."""
    client = request.getfixturevalue(f"{backend}_client")
    rows = inference_corpus(8, seed=9)
    key = put_corpus(client, f"pin/{backend}.jsonl", rows)
    changed = [dict(r) for r in rows]
    changed[5]["text"] = changed[5]["text"][::-1]
    new = corpus_bytes(changed)
    assert len(new) == len(corpus_bytes(rows)) and new != corpus_bytes(rows)
    change_after_prepare(monkeypatch, client.uri(key), new)
    spec = {"kind": "inference", "inputs": [key], "field": "text", "id_field": "id", "shard_rows": 4}
    job = client.submit(spec)
    status = job.wait(progress=False, timeout_s=WAIT_S)
    assert status.state == "FAILED", status.error
    if backend == "moto":
        # moto's interpreter reports the workers' Map (each worker stops on the CPU stage's failure) with its
        # own error; the CPU stage's error, which the workers saw, is in cpu_failed.json
        from shardfold.functions import store
        from shardfold.functions.inference.shards import cpu_failed_uri

        msg = store.get_json(cpu_failed_uri(client.store_root, job.job_id))["error"]
    else:
        msg = status.error
    assert "changed since the job was planned" in msg and client.uri(key) in msg, msg


@pytest.mark.slow
def test_a_parquet_input_replaced_after_the_plan_fails_the_job_naming_it(local_client, monkeypatch):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardfold.functions import store

    def parquet(rows: list[dict]) -> bytes:
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), buf, row_group_size=4)
        return buf.getvalue()

    rows = inference_corpus(8, seed=10)
    uri = local_client.uri("pin/in.parquet")
    store.put(uri, parquet(rows))
    change_after_prepare(monkeypatch, uri, parquet(list(reversed(rows))))
    with pytest.raises(JobFailed) as err:
        inference.run("pin/in.parquet", field="text", id_field="id", shard_rows=4, client=local_client)
    assert "changed since the job was planned" in str(err.value) and uri in str(err.value), str(err.value)
