"""The SDK on the local backend: submit/wait/result, validation first, plan, jobs/status/cancel."""

from __future__ import annotations

import io
import json
import math
import tarfile
import threading
from pathlib import Path

import pytest

from shardfold.client import Client, Job
from shardfold.client.errors import JobFailed, JobNotFinished, StackNotFound
from shardfold.client.stack import save_stack_outputs
from shardfold.functions import store
from shardfold.functions.errors import JobNotFound, PlanError, SpecError
from shardfold.functions.estimate import SUBMIT_BUDGET, estimate
from shardfold.functions.getbatch.spec import GetBatchSpec
from shardfold.functions.specs import parse_spec
from shardfold.functions.store.uri import join, store_root

N = 25


@pytest.fixture
def root(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SHARDFOLD_STACK", raising=False)
    monkeypatch.setenv("SHARDFOLD_STACKS_DIR", str(tmp_path / "stacks"))
    r = store_root()
    for i in range(N):
        store.put(join(r, "data", f"obj-{i:03d}.bin"), bytes([i]) * (50 + i))
    return r


@pytest.fixture
def client(root):
    with Client() as c:
        yield c


def spec(n: int = N, **kw) -> dict:
    return {"kind": "getbatch", "items": [{"uri": f"data/obj-{i:03d}.bin"} for i in range(n)], **kw}


def archive_members(uri: str) -> list[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(store.get(uri))) as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]


def job_dirs(root: str) -> list[str]:
    return [u for u in store.list_uris(join(root, "jobs") + "/")] if store.exists(join(root, "jobs")) else []


@pytest.mark.slow
def test_submit_wait_result(client, root):
    job = client.submit(spec(items_per_part=7))
    assert isinstance(job, Job) and job.kind == "getbatch" and job.job_id.startswith("getbatch-")
    assert parse_spec(store.get_json(join(root, "jobs", job.job_id, "spec.json"))) == parse_spec(
        spec(items_per_part=7)
    )
    status = job.wait(progress=False)
    assert status.state == "SUCCEEDED" and status.error is None
    result = job.result()
    assert result["items"] == N and result["errors"] == 0 and result["parts"] == math.ceil(N / 7)
    assert [data for _, data in archive_members(result["archive"])] == [
        bytes([i]) * (50 + i) for i in range(N)
    ]
    assert client.job(job.job_id).result() == result


@pytest.mark.slow
def test_wait_with_progress_bars(client):
    from rich.console import Console

    buf = io.StringIO()
    job = client.submit(spec(items_per_part=5))
    status = job.wait(progress=True, console=Console(file=buf, width=120, force_terminal=False))
    assert status.state == "SUCCEEDED"
    drawn = buf.getvalue()
    for step in status.steps:
        assert step in drawn


@pytest.mark.slow
def test_submit_accepts_model_json_text_and_file(client, tmp_path):
    model = GetBatchSpec.model_validate(spec(3))
    assert client.submit(model).wait(progress=False).state == "SUCCEEDED"
    assert client.submit(json.dumps(spec(2))).wait(progress=False).state == "SUCCEEDED"
    # a spec file names its data relative to itself
    (tmp_path / "pack" / "data").mkdir(parents=True)
    (tmp_path / "pack" / "data" / "x.txt").write_bytes(b"beside the spec")
    (tmp_path / "pack" / "job.json").write_text(
        json.dumps({"kind": "getbatch", "items": [{"uri": "./data/x.txt"}]})
    )
    job = client.submit(tmp_path / "pack" / "job.json")
    assert job.wait(progress=False).state == "SUCCEEDED"
    assert archive_members(job.result()["archive"])[0][1] == b"beside the spec"


@pytest.mark.parametrize(
    "bad, fields",
    [
        (
            {"kind": "getbatch", "items": [{"uri": "", "start": -1}], "items_per_part": 0, "x": 1},
            {"items.0.uri", "items.0.start", "items_per_part", "x"},
        ),
        ({"kind": "nope"}, {"kind"}),
        ("{not json", {"<spec>"}),
    ],
)
def test_spec_errors_before_anything_runs(client, root, monkeypatch, bad, fields):
    def never(*a, **k):
        raise AssertionError("the executor must not be reached")

    monkeypatch.setattr(client.executor, "start", never)
    before = job_dirs(root)
    with pytest.raises(SpecError) as exc:
        client.submit(bad)
    assert fields <= {e["field"] for e in exc.value.errors}
    with pytest.raises(SpecError):
        client.plan(bad)
    assert job_dirs(root) == before


def test_plan_numbers(client):
    report = client.plan(spec(items_per_part=4))
    parts = math.ceil(N / 4)
    by_name = {s.function.rsplit(".", 1)[-1]: s for s in report.steps}
    assert report.kind == "getbatch" and report.items == N
    assert (
        by_name["gather"].tasks == parts and by_name["prepare"].tasks == 1 and by_name["assemble"].tasks == 1
    )
    assert by_name["gather"].gets >= N  # one GET per item at least
    assert report.gets >= N and report.puts >= parts
    assert all(s.fits and 0 < s.peak_mb <= s.memory_mb for s in report.steps)
    assert report.transitions >= 2 + parts  # every child of the Map is billed
    assert report.cost_usd["total"] == pytest.approx(
        sum(v for k, v in report.cost_usd.items() if k != "total")
    )
    assert report.cost_usd["total"] > 0
    assert json.loads(json.dumps(report.to_dict()))["items"] == N
    # more items -> more parts, more GETs, more transitions
    bigger = client.plan(spec(items_per_part=2))
    assert bigger.transitions > report.transitions and bigger.tasks > report.tasks


def test_plan_refuses_task_that_does_not_fit(client, root, monkeypatch):
    monkeypatch.setattr(client.executor, "start", lambda *a: pytest.fail("refused plans must not start"))
    before = job_dirs(root)
    # 300,000 items: the prepare task would hold them all parsed, more than its memory
    store.put(join(root, "requests", "long.jsonl"), b'"a"\n' * 300_000)
    long = {"kind": "getbatch", "manifest": "requests/long.jsonl"}
    with pytest.raises(PlanError, match="step 'prepare'.*split it into several jobs"):
        client.submit(long)
    assert job_dirs(root) == before
    assert estimate(parse_spec(long), store_root=root, budget=SUBMIT_BUDGET).steps  # alone it never refuses
    # a sparse 2 GiB object fits: the engine streams an item larger than its byte budget through in ranges
    path = Path(root.removeprefix("file://")) / "data" / "huge.bin"
    with open(path, "wb") as f:
        f.truncate(2 * 1024**3)
    big = {"kind": "getbatch", "items": [{"uri": "data/huge.bin"}, {"uri": "data/obj-000.bin"}]}
    gather = next(s for s in client.plan(big).steps if s.name == "gather_part")
    assert gather.fits and "byte budget" in gather.why and gather.peak_mb < 512


@pytest.mark.slow
def test_failed_job_result_is_a_clear_error(client, root):
    items = [{"uri": "data/obj-001.bin"}, {"uri": "data/nope.bin"}]
    with pytest.raises(SpecError, match=r"items\.1\.uri: no file at .*nope\.bin"):  # a local file: at submit
        client.submit({"kind": "getbatch", "items": items})
    # in a manifest (submit stats inline items only) the job runs and fails naming it
    store.put(join(root, "m.jsonl"), "".join(json.dumps(i) + "\n" for i in items).encode())
    job = client.submit({"kind": "getbatch", "manifest": "m.jsonl"})
    status = job.wait(progress=False)
    assert status.state == "FAILED" and "nope.bin" in (status.error or "")
    # a missing object: resume once it is there
    with pytest.raises(JobFailed, match=r"nope\.bin.*shardfold resume"):
        job.result()


@pytest.mark.slow
def test_continue_on_error_job(client):
    job = client.submit(
        {
            "kind": "getbatch",
            "items": [{"uri": "data/obj-001.bin"}, {"uri": "data/nope.bin"}, {"uri": "data/obj-002.bin"}],
            "continue_on_error": True,
        }
    )
    assert job.wait(progress=False).state == "SUCCEEDED"
    result = job.result()
    assert result["errors"] == 1
    names = [n for n, _ in archive_members(result["archive"])]
    assert names[1].startswith("__404__/")


@pytest.mark.slow
def test_jobs_status_and_unknown_job(client):
    a = client.submit(spec(3))
    b = client.submit(spec(4))
    a.wait(progress=False)
    b.wait(progress=False)
    listed = {s.job_id: s for s in client.jobs()}
    assert {a.job_id, b.job_id} <= set(listed)
    assert listed[a.job_id].state == "SUCCEEDED" and listed[a.job_id].kind == "getbatch"
    st = client.job(b.job_id).status()
    assert st.state == "SUCCEEDED" and st.steps
    with pytest.raises(JobNotFound, match="shardfold jobs"):
        client.job("getbatch-20000101T000000-000000")


@pytest.mark.slow
def test_result_before_the_end_and_cancel(client, monkeypatch):
    # hold every gather task on an event so the job is provably still running
    from shardfold.functions.getbatch import core

    gate = threading.Event()
    entered = threading.Event()
    real = core.gather

    def held(*args, **kwargs):
        entered.set()
        assert gate.wait(60), "test gate never opened"
        return real(*args, **kwargs)

    monkeypatch.setattr(core, "gather", held)
    job = client.submit(spec(6, items_per_part=2))
    assert entered.wait(60)
    with pytest.raises(JobNotFinished, match="RUNNING|PENDING"):
        job.result()
    job.cancel()
    gate.set()
    status = job.wait(progress=False)
    assert status.state == "CANCELLED"
    with pytest.raises(JobFailed, match="cancelled"):
        job.result()
    # resume finishes what was left
    monkeypatch.setattr(core, "gather", real)
    job.resume()
    assert job.wait(progress=False).state == "SUCCEEDED"
    assert job.result()["items"] == 6


def test_get_batch_in_process(client):
    entries = client.get_batch(["data/obj-003.bin", {"uri": "data/obj-004.bin", "start": 10, "length": 5}])
    assert [e.data for e in entries] == [bytes([3]) * 53, bytes([4]) * 5]
    stream = client.get_batch(["data/obj-001.bin", "data/missing.bin"], continue_on_error=True, stream=True)
    first, second = list(stream)
    assert first.data == bytes([1]) * 51 and second.error and second.name.startswith("__404__/")


def test_aws_backend_needs_stack_outputs(root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StackNotFound, match=r"stack 'dev'.*shardfold deploy --stack dev"):
        Client(backend="aws")
    with pytest.raises(StackNotFound, match=r"stack 'prod'.*shardfold deploy --stack prod"):
        Client(backend="aws", stack="prod")
    monkeypatch.setenv("SHARDFOLD_STACK", "qa")
    with pytest.raises(StackNotFound, match=r"stack 'qa'"):
        Client(backend="aws")
    # a path, as SHARDFOLD_STACK and stack= used to take, says how to save the file under a name
    monkeypatch.setenv("SHARDFOLD_STACK", str(tmp_path / "nowhere.json"))
    with pytest.raises(StackNotFound, match=r"takes a stack name now.*shardfold stack import NAME"):
        Client(backend="aws")
    with pytest.raises(StackNotFound, match=r"stack= takes a stack name or a dict.*shardfold stack import"):
        Client(backend="aws", stack=tmp_path / "stack.json")


# --- the moto backend: the cloud path (compiled ASL, Lambda handlers, S3) inside moto -----------------------


@pytest.fixture
def moto_client(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    with Client(backend="moto") as c:
        yield c


@pytest.mark.slow
def test_moto_backend_submit_wait_result(moto_client):
    c = moto_client
    assert c.store_root.startswith("s3://")
    for i in range(5):
        store.put(c.uri(f"data/obj-{i}.bin"), f"object {i}".encode())
    items = [{"uri": f"data/obj-{i}.bin"} for i in (4, 0, 2)] + [{"uri": "data/gone.bin"}]
    job = c.submit({"kind": "getbatch", "items": items, "items_per_part": 2, "continue_on_error": True})
    status = job.wait(progress=False)
    assert status.state == "SUCCEEDED", status.error
    result = job.result()
    assert result["items"] == 4 and result["errors"] == 1 and result["archive"].startswith("s3://")
    members = archive_members(result["archive"])
    assert [d for _, d in members[:3]] == [b"object 4", b"object 0", b"object 2"]
    assert members[3][0].startswith("__404__/")
    assert job.job_id in {s.job_id for s in c.jobs()}
    assert [e.data for e in c.get_batch(["data/obj-1.bin"])] == [b"object 1"]


def test_aws_backend_refuses_local_files_before_anything_runs(root, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    stack = {
        "bucket": "shardfold-example",
        "region": "us-east-1",
        "state_machine_arns": {"getbatch": "arn:aws:states:us-east-1:123456789012:stateMachine:x"},
    }
    save_stack_outputs(stack, "example")  # as `shardfold deploy --stack example` does
    with Client(backend="aws", stack="example") as c:
        assert c.store_root == "s3://shardfold-example"
        monkeypatch.setattr(c.executor, "start", lambda *a: pytest.fail("must not start"))
        local = {"kind": "getbatch", "items": [{"uri": "s3://bkt/k"}, {"uri": (tmp_path / "x.bin").as_uri()}]}
        with pytest.raises(SpecError, match="local file") as exc:
            c.submit(local)
        assert [e["field"] for e in exc.value.errors] == ["items.1.uri"]


@pytest.mark.slow  # a fresh interpreter runs a job with process-mode tasks
def test_a_script_without_a_main_guard_runs_as_pasted(tmp_path):
    # the README's fedavg snippet in a file, no `if __name__ == "__main__":` — the local executor's worker
    # processes (fedavg's shard tasks run in them) must not re-run the script
    import os
    import subprocess
    import sys

    script = tmp_path / "snippet.py"
    script.write_text(
        "import numpy as np\n"
        "from shardfold.client import Client\n"
        "client = Client()\n"
        "models = [{'w': np.full((4, 4), i, dtype=np.float32)} for i in range(3)]\n"
        "keys = [f'rounds/7/clients/{i}.safetensors' for i in range(3)]\n"
        "for key, model, n in zip(keys, models, [1, 2, 3]):\n"
        "    client.fedavg.save_update(model, key, num_examples=n)\n"
        "result = client.fedavg.run(keys)\n"
        "print('AVERAGE', client.fedavg.load(result['output'])['w'][0, 0])\n"
        "print('RAN', flush=True)\n"
    )
    env = {**os.environ, "SHARDFOLD_HOME": str(tmp_path / "home"), "POWERTOOLS_LOG_LEVEL": "ERROR"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("RAN") == 1 and "AVERAGE 1.333333" in out.stdout, out.stdout


@pytest.mark.slow  # a fresh interpreter, as a user's program
def test_the_sdk_is_quiet_by_default_and_logging_shows_more(tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "program.py"
    script.write_text(
        "import logging\n"
        "from shardfold.client import Client\n"
        "from shardfold.functions import store\n"
        "client = Client()\n"
        "store.put(client.uri('d/a'), b'x')\n"
        "job = client.submit({'kind': 'getbatch', 'items': [{'uri': 'd/a'}]})\n"
        "job.wait(progress=False)\n"
        "print('QUIET DONE', any('planned getbatch' in line for _, line in job.logs()), flush=True)\n"
        "import sys; print('NOW LOUD', file=sys.stderr, flush=True)\n"
        "logging.getLogger('shardfold').setLevel(logging.INFO)  # the standard way to see more\n"
        "client.submit({'kind': 'getbatch', 'items': [{'uri': 'd/a'}]}).wait(progress=False)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("POWERTOOLS_LOG_LEVEL", "LOG_LEVEL")}
    env["SHARDFOLD_HOME"] = str(tmp_path / "home")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "QUIET DONE True\n", (
        out.stdout
    )  # the task log kept its line; stdout is the program's
    quiet, _, loud = out.stderr.partition("NOW LOUD")
    assert '"level"' not in quiet and "planned getbatch" in loud, out.stderr  # when asked for, on stderr


def test_upload_copies_a_specs_local_inputs_into_the_store_once_by_content(tmp_path):
    from shardfold.client.uploads import upload_inputs
    from shardfold.functions.errors import SpecError as Refused

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.bin").write_bytes(b"alpha")
    (data / "b.bin").write_bytes(b"bravo")
    root = (tmp_path / "store").as_uri()
    doc = {"kind": "getbatch", "items": [{"uri": f"./data/{n}.bin"} for n in ("a", "b", "a")]}
    spec_uri = (tmp_path / "spec.json").as_uri()
    out = upload_inputs(doc, spec_uri, root)
    keys = [i["uri"] for i in out["items"]]
    assert keys[0] == keys[2] != keys[1] and all(k.startswith("uploads/") for k in keys)
    assert keys[0].endswith("/a.bin") and store.get(join(root, keys[0])) == b"alpha"
    assert upload_inputs(doc, spec_uri, root) == out  # the same bytes: the same keys, nothing rewritten
    (data / "a.bin").write_bytes(b"ALPHA!")  # a changed file is a new object; the old one stays
    assert upload_inputs(doc, spec_uri, root)["items"][0]["uri"] != keys[0]
    assert store.get(join(root, keys[0])) == b"alpha"
    with pytest.raises(Refused, match=r"items\.0\.uri: .* is a folder"):
        upload_inputs({"kind": "getbatch", "items": [{"uri": "./data"}]}, spec_uri, root)
    with pytest.raises(Refused, match=r"items\.0\.uri: no file at"):
        upload_inputs({"kind": "getbatch", "items": [{"uri": "./data/none.bin"}]}, spec_uri, root)


def test_upload_refuses_other_bytes_planted_at_the_key_it_would_use(tmp_path):
    from shardfold.client.uploads import upload_inputs
    from shardfold.functions.errors import SpecError as Refused

    (tmp_path / "a.bin").write_bytes(b"alpha")
    root = (tmp_path / "store").as_uri()
    doc = {"kind": "getbatch", "items": [{"uri": "./a.bin"}]}
    key = upload_inputs(doc, (tmp_path / "spec.json").as_uri(), root)["items"][0]["uri"]
    store.put(join(root, key), b"ALPHA")  # same size, other bytes, where the next upload would look
    with pytest.raises(Refused, match="holds other bytes"):
        upload_inputs(doc, (tmp_path / "spec.json").as_uri(), root)


def test_the_output_size_is_stated_only_from_sizes_read(client, root):
    """`shardfold plan` looks the objects up and states the archive's size near the truth; the submit-time
    estimate looks none up and states none (an assumed size per object is no estimate: it said ~5 MiB
    for a 7 KiB archive)."""
    spec = parse_spec({"kind": "getbatch", "items": [{"uri": f"data/obj-00{i}.bin"} for i in range(6)]})
    planned = estimate(spec, store_root=root)
    size = sum(len(store.get(join(root, "data", f"obj-00{i}.bin"))) for i in range(6))  # the members' bytes
    assert any(n.startswith("output ~") for n in planned.notes)
    # the members, a 512-byte header each plus padding, and the trailer
    assert size + 6 * 512 <= planned.output_bytes <= size + 6 * 1024 + 1024
    submitted = estimate(spec, store_root=root, budget=SUBMIT_BUDGET)
    assert not any(n.startswith("output ~") for n in submitted.notes)
