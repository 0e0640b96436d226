"""The getbatch job end to end: the local executor and the moto executor (compiled ASL on moto's Step
Functions interpreter) must produce the byte-identical archive; a 100,000-item request keeps every state
payload far below Step Functions' 256 KiB limit."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import pytest
from outsider import outside_the_task

from shardfold.client import Client
from shardfold.functions import store
from shardfold.functions.jobs import new_job_id
from shardfold.functions.store.uri import join
from shardfold.orchestrator.local import LocalExecutor

pytestmark = pytest.mark.slow

WAIT_S = 180  # a deadline, not a timing assumption


@pytest.fixture(scope="module")
def moto_client(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDFOLD_HOME", str(tmp_path_factory.mktemp("moto-home")))
        with Client(backend="moto") as c:
            yield c


def request(bucket_root: str) -> list[dict]:
    """Objects of varied sizes in the (moto) bucket, a TAR shard, ranges, duplicates and a missing key."""
    for i in range(12):
        store.put(join(bucket_root, "data", f"obj-{i:02d}.bin"), bytes([i]) * (97 * i + 1))
    shard = io.BytesIO()
    with tarfile.open(fileobj=shard, mode="w") as tf:
        for name in ("a.txt", "dir/b.txt"):
            info = tarfile.TarInfo(name)
            body = name.encode() * 50
            info.size = len(body)
            tf.addfile(info, io.BytesIO(body))
    store.put(join(bucket_root, "data", "shard.tar"), shard.getvalue())
    d = f"{bucket_root}/data"
    return [
        {"uri": f"{d}/obj-07.bin"},
        {"uri": f"{d}/obj-00.bin"},
        {"uri": f"{d}/shard.tar", "archpath": "dir/b.txt"},
        {"uri": f"{d}/obj-11.bin", "start": 100, "length": 50},
        {"uri": f"{d}/missing.bin"},
        {"uri": f"{d}/obj-07.bin"},
        {"uri": f"{d}/obj-03.bin", "start": 10},
        {"uri": f"{d}/shard.tar", "archpath": "a.txt", "name": "renamed.txt"},
    ] + [{"uri": f"{d}/obj-{i:02d}.bin"} for i in range(12)]


def test_local_and_moto_executors_give_the_identical_archive(moto_client, tmp_path, monkeypatch):
    items = request(moto_client.store_root)
    spec = {"kind": "getbatch", "items": items, "items_per_part": 3, "continue_on_error": True}

    on_moto = moto_client.submit(spec)
    assert on_moto.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
    moto_result = on_moto.result()

    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "local-home"))
    with Client() as local:  # local store and executor; the items still live in the moto bucket
        on_local = local.submit(spec)
        assert on_local.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
        local_result = on_local.result()

    assert moto_result["archive"].startswith("s3://") and local_result["archive"].startswith("file://")
    moto_tar, local_tar = store.get(moto_result["archive"]), store.get(local_result["archive"])
    assert hashlib.sha256(moto_tar).hexdigest() == hashlib.sha256(local_tar).hexdigest()
    assert store.get(moto_result["status"]) == store.get(local_result["status"])
    for key in ("items", "errors", "bytes", "parts"):
        assert moto_result[key] == local_result[key]

    with tarfile.open(fileobj=io.BytesIO(local_tar)) as tf:
        names = tf.getnames()
    assert len(names) == len(items) and names[4].startswith("__404__/") and names[7] == "renamed.txt"


def test_strict_job_fails_naming_the_item_and_writes_no_archive(moto_client):
    items = request(moto_client.store_root)[:6]  # includes the missing object at index 4
    job = moto_client.submit({"kind": "getbatch", "items": items, "items_per_part": 2})
    status = job.wait(progress=False, timeout_s=WAIT_S)
    assert status.state == "FAILED"
    assert "missing.bin" in status.error and "item 4" in status.error
    out = join(moto_client.store_root, "jobs", job.job_id, "output", "batch.tar")
    assert not store.exists(out)


def test_state_payloads_stay_small_for_a_manifest_past_the_payload_limit(tmp_path):
    # 3,000 items of a 100-character key: the manifest (309 KB) alone is past Step Functions' 256 KiB, and
    # the states stay small
    root = f"file://{tmp_path}/store"
    key = "data/" + "k" * 91 + ".bin"
    store.put(join(root, key), b"x")
    job_id = new_job_id("getbatch")
    manifest = join(root, "requests", "big.jsonl")
    store.put(manifest, f'"{key}"\n'.encode() * 3_000)
    assert store.size(manifest) > 256 * 1024
    spec_uri = join(root, "jobs", job_id, "spec.json")
    store.put_json(spec_uri, {"kind": "getbatch", "manifest": manifest, "items_per_part": 500})
    with LocalExecutor(store_root=root) as ex:
        ex.start(job_id, "getbatch", spec_uri)
        status = ex.wait(job_id, timeout_s=WAIT_S)
        assert status.state == "SUCCEEDED", status.error
        assert ex.max_state_bytes(job_id) < 4 * 1024  # Step Functions allows 256 KiB
    result = store.get_json(join(root, "jobs", job_id, "result.json"))
    assert result["items"] == 3_000 and result["parts"] == 6
    assert len(json.dumps(result)) < 1024


# --- inputs pinned at plan ----------------------------------------------------------------------------------


@pytest.fixture
def local_client(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    with Client() as c:
        yield c


def test_parts_gathered_in_worker_processes_give_the_archive_threads_give(local_client, monkeypatch):
    """A large request's parts of local files run in worker processes (prepare marks them): the archive
    and the status file are byte for byte those of the same request gathered on threads."""
    import os

    from shardfold.functions import telemetry
    from shardfold.functions.getbatch import core

    spec = {"kind": "getbatch", "items": request(local_client.store_root), "items_per_part": 3}
    spec["continue_on_error"] = True
    runs = {}
    for least in (10**9, 1):  # the request is never large enough, then always
        monkeypatch.setattr(core, "PROCESS_MIN_ITEMS", least)
        job = local_client.submit(spec)
        assert job.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
        records = telemetry.read_records(local_client.store_root, job.job_id)
        pids = {r["pid"] for r in records if r["step"] == "gather_part"}
        result = job.result()
        runs[least] = (store.get(result["archive"]), store.get(result["status"]), pids)
    (threads_tar, threads_status, here), (procs_tar, procs_status, there) = runs[10**9], runs[1]
    assert here == {os.getpid()} and os.getpid() not in there
    assert procs_tar == threads_tar and procs_status == threads_status


@pytest.mark.parametrize("backend", ["local", "moto"])
@pytest.mark.parametrize("changed", ["obj-03.bin", "shard.tar"])
def test_an_item_replaced_after_the_plan_fails_the_job_naming_it(
    backend, changed, moto_client, local_client, monkeypatch
):
    """An object replaced (same size, new bytes) between plan and gather fails the job naming it, even with
    continue_on_error: a changed input is never a placeholder. A TAR shard's member index is pinned too."""
    from shardfold.functions.getbatch import core

    client = moto_client if backend == "moto" else local_client
    items = request(client.store_root)
    target = join(client.store_root, "data", changed)
    old = store.get(target)
    new = old.replace(b"a.txt" * 50, b"A.TXT" * 50) if changed == "shard.tar" else bytes([99]) * len(old)
    assert len(new) == len(old) and new != old
    real = core.prepare

    def prepare_then_change(*args, **kwargs):
        out = real(*args, **kwargs)
        with outside_the_task():
            store.put(target, new)
        return out

    monkeypatch.setattr(core, "prepare", prepare_then_change)
    spec = {"kind": "getbatch", "items": items, "items_per_part": 4, "continue_on_error": True}
    job = client.submit(spec)
    status = job.wait(progress=False, timeout_s=WAIT_S)
    assert status.state == "FAILED", status.error
    assert "changed since the job was planned" in status.error and target in status.error, status.error
    monkeypatch.setattr(core, "prepare", real)
    assert client.submit(spec).wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"  # a new plan
