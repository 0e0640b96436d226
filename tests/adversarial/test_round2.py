"""The second adversarial round (issue 33): forged records, output claims, data-dependent behaviour under DP,
hostile nesting, hostile drop folders and logs. Each test failed on the code before its fix; each names the
defect class it closes. (The first round's spec probes are in ``test_probes.py``.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from shardfold.client import Client
from shardfold.client.cli import cli
from shardfold.functions import store
from shardfold.functions.errors import SpecError

pytestmark = pytest.mark.slow


@pytest.fixture
def local(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    with Client() as client:
        yield client


def _getbatch(client: Client, tmp_path: Path, name: str = "a.bin", **extra) -> object:
    path = tmp_path / name
    if not path.exists():
        path.write_bytes(name.encode() * 50)
    return client.submit({"kind": "getbatch", "items": [{"uri": path.as_uri()}], **extra})


# -- 1. a job's identity comes from where it lives -----------------------------------------------------------


def test_clean_ignores_forged_status_records_claiming_other_jobs(local, tmp_path):
    victim = _getbatch(local, tmp_path)
    assert victim.wait(progress=False).state == "SUCCEEDED"
    jobs = tmp_path / "store" / "jobs"
    output = jobs / victim.job_id / "output"
    assert output.is_dir() and any(output.iterdir())
    forged = {"kind": "output", "state": "SUCCEEDED", "ended_at": "2020-01-01T00:00:01+00:00", "steps": {}}
    for folder, job_id in (("evil", victim.job_id), ("evil-empty", ""), (victim.job_id + "x", victim.job_id)):
        (jobs / folder).mkdir(exist_ok=True)
        (jobs / folder / "status.json").write_text(json.dumps({**forged, "job_id": job_id}))
    # and a record in the victim's own folder that names another kind: its scratch is still its kind's
    before = sorted(p.relative_to(jobs).as_posix() for p in jobs.rglob("*") if p.is_file())
    listed = {st.job_id for st in local.jobs()}
    assert listed == {victim.job_id}  # folders not named as jobs are no jobs
    cleaned = local.clean(failed=True)
    assert cleaned == [victim.job_id]
    after = {p.relative_to(jobs).as_posix() for p in jobs.rglob("*") if p.is_file()}
    kept = [p for p in before if not p.startswith(f"{victim.job_id}/journal/")]
    assert set(kept) <= after, set(kept) - after  # only the victim's own journal went
    assert victim.result()["items"] == 1 and store.exists(victim.result()["archive"])


def test_a_forged_record_in_a_jobs_own_folder_changes_only_how_that_job_reads(local, tmp_path):
    job = _getbatch(local, tmp_path)
    assert job.wait(progress=False).state == "SUCCEEDED"
    status = tmp_path / "store" / "jobs" / job.job_id / "status.json"
    status.write_text(
        json.dumps({"job_id": "other", "kind": "output", "state": 7, "steps": "x", "error": []})
    )
    with Client() as reader:  # another process's view: the record, not this one's run
        st = reader.job(job.job_id).status()
    assert (st.job_id, st.kind, st.state) == (job.job_id, "getbatch", "FAILED")  # identity from the place
    assert "names no state" in st.error
    assert CliRunner().invoke(cli, ["jobs"]).exit_code == 0  # one bad record does not break the listing
    status.write_text("[1, 2, 3]")
    with Client() as reader:
        assert reader.job(job.job_id).status().state == "FAILED"


@pytest.mark.parametrize("days", ["nan", "inf", "-1e308", "-1"])
def test_clean_refuses_an_age_that_is_no_number_of_days(local, days):
    run = CliRunner().invoke(cli, ["clean", "--older-than", days])
    assert run.exit_code == 2 and "--older-than" in run.output, run.output
    with pytest.raises(Exception, match="finite number of seconds"):
        local.clean(older_than_s=float(days))


# -- 2. an output belongs to one job; what is there is replaced only on request ------------------------------


def _wait(job) -> str:
    return job.wait(progress=False, timeout_s=300).state


def test_a_second_job_writing_the_same_output_is_refused_naming_the_first(env):
    out = f"results/same-{env.backend}.tar"
    first = env.client.submit({"kind": "getbatch", "items": [{"uri": "data/hello.txt"}], "output": out})
    assert _wait(first) == "SUCCEEDED"
    held = store.get(env.uri(out))
    with pytest.raises(SpecError, match=rf"job {first.job_id}'s output\); set \"overwrite\": true") as err:
        env.client.submit({"kind": "getbatch", "items": [{"uri": "data/about.txt"}], "output": out})
    assert err.value.errors[0]["field"] == "output"
    assert store.get(env.uri(out)) == held
    again = env.client.submit(
        {"kind": "getbatch", "items": [{"uri": "data/about.txt"}], "output": out, "overwrite": True}
    )
    assert _wait(again) == "SUCCEEDED" and store.get(env.uri(out)) != held


def test_an_object_no_job_wrote_is_never_replaced_without_overwrite(env):
    kept = store.get(env.uri("results/kept.bin"))
    for spec in (
        {"kind": "getbatch", "items": [{"uri": "data/hello.txt"}], "output": "results/kept.bin"},
        {
            "kind": "fedavg",
            "clients": [{"uri": "data/fedavg/client-0.safetensors"}],
            "output": "results/kept.bin",
        },
    ):
        with pytest.raises(SpecError, match=r"an object no job of this store wrote.*overwrite"):
            env.client.submit(spec)
    assert store.get(env.uri("results/kept.bin")) == kept


def test_an_output_whose_job_has_not_ended_is_never_taken_even_with_overwrite(env):
    from shardfold.functions.submit import submit

    out = f"results/busy-{env.backend}.safetensors"
    spec = {"kind": "fedavg", "clients": [{"uri": "data/fedavg/client-0.safetensors"}], "output": out}
    parked = submit(
        spec, store_root=env.root, start=lambda *a: None
    )  # recorded, not started: it has not ended
    with pytest.raises(SpecError, match=rf"output of job {parked.job_id}, which has not ended"):
        env.client.submit({**spec, "overwrite": True})


def test_of_two_jobs_claiming_one_output_at_once_exactly_one_wins(env):
    import threading

    from shardfold.functions.submit import submit

    out = f"results/race-{env.backend}.tar"
    spec = {"kind": "getbatch", "items": [{"uri": "data/hello.txt"}], "output": out}
    won, lost, barrier = [], [], threading.Barrier(4)

    def one() -> None:
        barrier.wait()
        try:
            won.append(submit(spec, store_root=env.root, start=lambda *a: None).job_id)
        except SpecError as exc:
            lost.append(str(exc))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == 3, (won, lost)
    from shardfold.functions import claims

    assert claims.latest(env.root, env.uri(out)).job_id == won[0]  # the one job that went on holds it
    assert all(re.search(r"job getbatch-\d{8}T\d{6}-[0-9a-f]{6}", why) for why in lost), (
        lost
    )  # names a holder


def test_a_task_never_writes_an_output_another_job_now_holds(local, tmp_path):
    from shardfold.functions import claims
    from shardfold.functions.submit import submit

    (tmp_path / "a.bin").write_bytes(b"a" * 64)
    spec = {"kind": "getbatch", "items": [{"uri": (tmp_path / "a.bin").as_uri()}], "output": "results/x.tar"}
    parked = submit(spec, store_root=local.store_root, start=lambda *a: None)
    held = claims.latest(local.store_root, local.uri("results/x.tar"))
    # a claim taken over behind its back (as a racing submit could, had it found the job unrecorded)
    store.put(
        claims._folder(local.store_root, held.uri) + f"{held.n + 1:08d}.json",
        json.dumps({"uri": held.uri, "job_id": "getbatch-20990101T000000-000000"}).encode(),
    )
    local.start(parked.job_id, "getbatch", parked.spec_uri)
    final = local.job(parked.job_id).wait(progress=False, timeout_s=300)
    assert final.state == "FAILED" and "no longer holds it" in final.error
    assert not store.exists(local.uri("results/x.tar"))


# -- 7, 11. one parser for untrusted JSON: depth, duplicate keys, NaN and Infinity ---------------------------

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ('{"kind": "getbatch", "items": ' + DEEP + "}", "nests deeper than 64"),
        ('{"kind": "getbatch", "items": [{"uri": "a"}], "items": []}', "duplicate key 'items'"),
        (
            '{"kind": "getbatch", "items": [{"uri": "a"}], "deadline_s": Infinity}',
            "Infinity is not a JSON value",
        ),
        ('{"kind": "getbatch", "items": [{"uri": "a"}], "deadline_s": NaN}', "NaN is not a JSON value"),
    ],
)
def test_hostile_json_is_a_spec_error_on_every_path(local, tmp_path, text, pattern):
    from shardfold.functions.trigger import dispatch

    spec = tmp_path / "hostile.json"
    spec.write_text(text)
    for verb in ("run", "plan"):
        run = CliRunner().invoke(cli, [verb, str(spec)])
        assert run.exit_code == 1 and pattern in run.output and "Traceback" not in run.output, run.output
    with pytest.raises(SpecError, match=pattern):
        local.submit(text)
    drop = tmp_path / "drop"
    drop.mkdir(exist_ok=True)
    (drop / "hostile.json").write_text(text)
    (drop / "good.json").write_text(json.dumps({"kind": "getbatch", "items": [{"uri": "data/g.bin"}]}))
    store.put(local.uri("data/g.bin"), b"good")
    watched = CliRunner().invoke(cli, ["watch", str(drop), "--once"])
    assert watched.exit_code == 0, watched.output  # the bad spec is reported; the good one beside it runs
    assert pattern in json.loads((drop / "hostile.error.json").read_text())["error"]
    assert json.loads((drop / "good.status.json").read_text())["state"] == "SUCCEEDED"
    # the bucket trigger's dispatch: an error report, and no claim left to swallow the next upload
    store.put(local.uri("jobs/hostile.json"), text.encode())
    report = dispatch(local.uri("jobs/hostile.json"), local.start, root=local.store_root)
    assert pattern in report["error"]
    # its claim holds the report, and swallows nothing: the fixed spec uploaded to the same key starts a job
    store.put(
        local.uri("jobs/hostile.json"),
        json.dumps({"kind": "getbatch", "items": [{"uri": "data/g.bin"}]}).encode(),
    )
    fixed = dispatch(local.uri("jobs/hostile.json"), local.start, root=local.store_root)
    assert "job_id" in fixed, fixed


def test_a_dict_spec_from_the_sdk_is_held_to_the_same_rules(local):
    nested: list = []
    for _ in range(200):
        nested = [nested]
    with pytest.raises(SpecError, match="nests deeper than 64"):
        local.submit({"kind": "getbatch", "items": nested})
    with pytest.raises(SpecError, match="deadline_s"):
        local.submit({"kind": "getbatch", "items": [{"uri": "a"}], "deadline_s": float("inf")})


def test_a_manifest_and_stored_records_too(local, tmp_path):
    store.put(local.uri("requests/deep.jsonl"), ('{"uri": ' + DEEP + "}\n").encode())
    with pytest.raises(SpecError, match=r"line 1: .*nests deeper"):
        local.submit({"kind": "getbatch", "manifest": "requests/deep.jsonl"})
    job = _getbatch(local, tmp_path)
    assert job.wait(progress=False).state == "SUCCEEDED"
    (tmp_path / "store" / "jobs" / job.job_id / "status.json").write_text(DEEP)
    assert CliRunner().invoke(cli, ["jobs"]).exit_code == 0


# -- 15. stack outputs are checked when saved and when read --------------------------------------------------

GOOD_OUTPUTS = {
    "bucket": "shardfold-dev-jobs",
    "region": "us-east-1",
    "state_machine_arns": {
        "getbatch": "arn:aws:states:us-east-1:123456789012:stateMachine:shardfold-getbatch"
    },
    "output_prefixes": ["results/"],
}


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"bucket": {"name": "b"}}, "bucket"),
        ({"state_machine_arns": "arn:aws:states:x"}, "state_machine_arns"),
        ({"output_prefixes": [""]}, "output_prefixes"),
        ({"output_prefixes": ["jobs/"]}, "output_prefixes"),
        ({"output_prefixes": ["ledger"]}, "output_prefixes"),
        ({"region": "us-east-1\nx"}, "region"),
        ({"write_buckets": ["*"]}, "write_buckets"),
    ],
)
def test_stack_import_refuses_malformed_outputs_naming_the_key(tmp_path, change, key):
    path = tmp_path / "outputs.json"
    path.write_text(json.dumps({**GOOD_OUTPUTS, **change}))
    run = CliRunner().invoke(cli, ["stack", "import", "dev", str(path)])
    assert run.exit_code == 1 and "malformed" in run.output and key in run.output, run.output
    path.write_text(json.dumps(GOOD_OUTPUTS))
    assert CliRunner().invoke(cli, ["stack", "import", "dev", str(path)]).exit_code == 0


# -- 12. a spec dropped into a watched folder is untrusted, as one dropped into the bucket -------------------


def test_watch_refuses_a_dropped_spec_reaching_this_machines_files(local, tmp_path):
    drop = tmp_path / "drop"
    drop.mkdir()
    (tmp_path / "mine.txt").write_text("the user's own file, beside the drop folder\n")
    escapes = {
        "dotdot.json": "../../../../../../../../etc/hostname",
        "abs.json": "file:///etc/passwd",
        "beside.json": "../mine.txt",
    }
    for name, uri in escapes.items():
        (drop / name).write_text(json.dumps({"kind": "getbatch", "items": [{"uri": uri}]}))
    (drop / "manifest.json").write_text(json.dumps({"kind": "getbatch", "manifest": "requests/m.jsonl"}))
    store.put(local.uri("requests/m.jsonl"), b'{"uri": "file:///etc/passwd"}\n')  # planted in the store
    (drop / "out.json").write_text(
        json.dumps(
            {"kind": "getbatch", "items": [{"uri": "data/g.bin"}], "output": (tmp_path / "x.tar").as_uri()}
        )
    )
    store.put(local.uri("data/g.bin"), b"good")
    watched = CliRunner().invoke(cli, ["watch", str(drop), "--once"])
    assert watched.exit_code == 0, watched.output
    for name in [*escapes, "manifest.json", "out.json"]:
        report = json.loads((drop / name.replace(".json", ".error.json")).read_text())
        assert "outside the store" in report["error"], (name, report)
    assert not (tmp_path / "x.tar").exists()
    assert not list((tmp_path / "store" / "jobs").glob("getbatch-*/output/*"))  # nothing archived
    # the user's own spec, submitted by the user, still names the user's files
    job = local.submit({"kind": "getbatch", "items": [{"uri": (tmp_path / "mine.txt").as_uri()}]})
    assert job.wait(progress=False).state == "SUCCEEDED"


def test_a_claim_whose_job_never_came_to_be_is_taken_over_once_it_is_stale(local, tmp_path):
    from shardfold.functions import claims

    out = local.uri("results/orphan.tar")
    folder = claims._folder(local.store_root, out)
    ghost = {"uri": out, "job_id": "getbatch-20260101T000000-000000", "overwrite": False}
    store.put(folder + "00000001.json", json.dumps({**ghost, "at": __import__("time").time()}).encode())
    spec = {"kind": "getbatch", "items": [{"uri": "data/g.bin"}], "output": "results/orphan.tar"}
    store.put(local.uri("data/g.bin"), b"g")
    with pytest.raises(SpecError, match=r"has not ended \(SUBMITTING\)"):  # it may still be submitting
        local.submit(spec)
    store.put(folder + "00000001.json", json.dumps({**ghost, "at": 0}).encode())  # long ago: it failed
    job = local.submit(spec)
    assert job.wait(progress=False).state == "SUCCEEDED"
    assert claims.latest(local.store_root, out).job_id == job.job_id


# -- 18. the library never writes to the program's standard output ------------------------------------------


def test_a_failing_job_writes_no_log_line_to_stdout(tmp_path):
    import subprocess
    import sys

    env = {**__import__("os").environ, "SHARDFOLD_HOME": str(tmp_path / "store")}
    env.pop("POWERTOOLS_LOG_LEVEL", None)
    # a missing file in a manifest: submit stats inline items only, so the job runs and fails in its task
    missing = (tmp_path / "missing.bin").as_uri()
    manifest = tmp_path / "items.jsonl"
    manifest.write_text(json.dumps({"uri": missing}) + "\n")
    script = (
        "from shardfold import Client\n"
        "with Client() as c:\n"
        f"    job = c.submit({{'kind': 'getbatch', 'manifest': {manifest.as_uri()!r}}})\n"
        "    print('STATE', job.wait(progress=False).state)\n"
    )
    sdk = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert sdk.returncode == 0 and sdk.stdout == "STATE FAILED\n", (sdk.stdout, sdk.stderr[-2000:])
    spec = tmp_path / "missing.json"
    spec.write_text(json.dumps({"kind": "getbatch", "manifest": manifest.as_uri()}))
    for args in (["run", "--json", str(spec)], ["-v", "run", "--json", str(spec)]):
        cli_run = subprocess.run(
            [sys.executable, "-m", "shardfold.client.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert cli_run.returncode == 1 and '"level"' not in cli_run.stdout, (args, cli_run.stdout)


# -- 10. a store failing at submit leaves no half-recorded job ---------------------------------------------


def test_a_full_disk_at_submit_is_one_line_and_leaves_nothing_behind(local, tmp_path, monkeypatch):
    import errno

    from shardfold.functions import claims

    store.put(local.uri("data/g.bin"), b"g")
    real_put = store.put

    def full_disk(uri, data):
        if uri.endswith("/spec.json"):
            raise OSError(errno.ENOSPC, "No space left on device", uri)
        return real_put(uri, data)

    monkeypatch.setattr(store, "put", full_disk)
    spec = {"kind": "getbatch", "items": [{"uri": "data/g.bin"}], "output": "results/full.tar"}
    with pytest.raises(Exception, match=r"could not record the job in the store \(No space left on device\)"):
        local.submit(spec)
    (tmp_path / "s.json").write_text(json.dumps(spec))
    run = CliRunner().invoke(cli, ["run", str(tmp_path / "s.json")])
    assert run.exit_code == 1 and "No space left on device" in run.output and "Traceback" not in run.output
    assert not list((tmp_path / "store" / "jobs").glob("getbatch-*"))  # no orphan folder
    assert claims.latest(local.store_root, local.uri("results/full.tar")) is None  # claims withdrawn
    monkeypatch.setattr(store, "put", real_put)
    assert local.submit(spec).wait(progress=False).state == "SUCCEEDED"  # and the output is free


# -- 16. archive entry names stay inside the folder and read as what they are; an object output names one ----


@pytest.mark.parametrize(
    "name",
    ["..\\\\..\\\\evil.sh", ".", "a/", "x\nforged line", "\u202etxt.exe", "C:evil", "/etc/x", "a/../b"],
)
def test_an_archive_name_that_escapes_or_misleads_is_refused(local, name):
    with pytest.raises(SpecError, match=r"items\.0\.name") as err:
        local.submit({"kind": "getbatch", "items": [{"uri": "data/g.bin", "name": name}]})
    assert err.value.errors[0]["field"] == "items.0.name"


def test_a_default_name_from_a_hostile_object_key_is_made_safe(local, tmp_path):
    import io
    import tarfile

    for key in ("data/x\nforged", "data/\u202etxt.exe"):
        store.put(local.uri(key), b"k")
    job = local.submit(
        {"kind": "getbatch", "items": [{"uri": "data/x\nforged"}, {"uri": "data/\u202etxt.exe"}]}
    )
    assert job.wait(progress=False).state == "SUCCEEDED"
    with tarfile.open(fileobj=io.BytesIO(store.get(job.result()["archive"]))) as tf:
        assert tf.getnames() == ["data/x%0Aforged", "data/%u202Etxt.exe"]


@pytest.mark.parametrize("output", ["results/", "results/.", "results/..", "results/x/"])
def test_an_object_output_naming_a_folder_is_refused(local, output):
    for spec in (
        {"kind": "getbatch", "items": [{"uri": "data/g.bin"}], "output": output},
        {"kind": "fedavg", "clients": [{"uri": "data/g.safetensors"}], "output": output},
    ):
        with pytest.raises(SpecError, match="names a folder, not an object") as err:
            local.submit(spec)
        assert err.value.errors[0]["field"] == "output"


# -- 13. logs come from the job's own places only, streamed, and reach the terminal escaped ------------------


def test_logs_follow_only_the_jobs_own_places_and_print_controls_escaped(local, tmp_path):
    from shardfold.functions import telemetry

    job = _getbatch(local, tmp_path)
    assert job.wait(progress=False).state == "SUCCEEDED"
    records = telemetry.read_records(local.store_root, job.job_id)
    rec_uri = next(u for u in store.list_uris(telemetry.prefix(local.store_root, job.job_id) + "/"))
    forged = dict(records[0])
    (tmp_path / "elsewhere.log").write_text("a secret of another folder\n")
    for log in (
        {"uri": (tmp_path / "elsewhere.log").as_uri(), "lines": 1},
        {"uri": f"{local.store_root}/jobs/{job.job_id}/../other/x.log", "lines": 1},
        {"group": "/aws/lambda/someone-elses", "stream": "s"},
    ):
        store.put(rec_uri, json.dumps({**forged, "log": log}).encode())
        lines = [line for _, line in local.job(job.job_id).logs()]
        assert not any("secret" in line for line in lines), lines  # a log object is the record's sibling
        assert "group" not in log or any("not followed" in line for line in lines), lines
    # a log line holding a terminal escape sequence prints as text
    own = rec_uri[: -len(".json")] + ".log"
    store.put(own, b"\x1b]0;pwned\x07\x1b[2Jclear screen\n")
    store.put(rec_uri, json.dumps({**forged, "log": {"uri": own, "lines": 1}}).encode())
    shown = CliRunner().invoke(cli, ["logs", job.job_id])
    assert shown.exit_code == 0 and "\x1b" not in shown.output and "\\x1b]0;pwned" in shown.output


def test_a_huge_log_is_streamed_not_read_whole(local, tmp_path, monkeypatch):
    from shardfold.functions import telemetry

    job = _getbatch(local, tmp_path)
    assert job.wait(progress=False).state == "SUCCEEDED"
    own = local.uri(f"jobs/{job.job_id}/big.log")
    store.put(own, b"x" * 100 + b"\n" + b"y" * (5 * telemetry.LOG_READ_BYTES))
    reads = []
    real_get = store.get
    monkeypatch.setattr(store, "get", lambda uri, *a, **k: reads.append(a) or real_get(uri, *a, **k))
    lines = telemetry.log_lines({"log": {"uri": own, "lines": 2}}, local.store_root, job.job_id)
    assert next(lines) == "x" * 100 and len(reads) == 1 and reads[0][1] == telemetry.LOG_READ_BYTES


# -- 4. a DP round's tensors are the public model's, never a majority of the clients' ------------------------


def test_one_clients_presence_does_not_decide_a_dp_rounds_tensors(local):
    import numpy as np

    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(8,)).astype(np.float32), rng.normal(size=(4,)).astype(np.float32)
    fa = local.fedavg
    base = fa.save_update({"a": a, "b": b}, "round/base.safetensors")
    full = [fa.save_update({"a": a + i, "b": b - i}, f"round/c{i}.safetensors") for i in range(2)]
    partial = [fa.save_update({"a": a * i}, f"round/c{i}.safetensors") for i in (2, 3)]
    dp = {
        "clip_norm": 1.0,
        "noise_multiplier": 1.0,
        "dataset_id": "fed-r2",
        "dataset_budget_rho": 50.0,
        "base": base,
    }
    outcomes = []
    for clients in (full + partial, full[1:] + partial):  # with c0, then without it
        spec = {"kind": "fedavg", "clients": [{"uri": u} for u in clients], "min_clients": 1, "dp": dp}
        job = local.submit(spec)
        outcomes.append((job.wait(progress=False).state, job))
    assert [state for state, _ in outcomes] == ["SUCCEEDED", "SUCCEEDED"], [
        j.status().error for _, j in outcomes
    ]
    for _, job in outcomes:
        out = fa.load(job.result()["output"])
        assert sorted(out) == ["a", "b"]  # the base's tensors, whoever took part
        left = {e["uri"].rsplit("/", 1)[-1] for e in job.result()["excluded"]}
        assert left == {"c2.safetensors", "c3.safetensors"}, job.result()["excluded"]


def test_a_dp_round_without_a_public_model_is_refused(local):
    spec = {"kind": "fedavg", "clients": [{"uri": "round/c0.safetensors"}],
            "dp": {"clip_norm": 1.0, "noise_multiplier": 1.0, "dataset_id": "fed-r2"}}  # fmt: skip
    with pytest.raises(SpecError, match="takes its tensors from a public model") as err:
        local.submit(spec)
    assert err.value.errors[0]["field"] == "dp.structure"


# -- 5. a client masks only for the round's roster, every peer's key present ---------------------------------


def test_mask_update_refuses_to_mask_for_too_few_or_forged_peers(local):
    import numpy as np

    from shardfold.client.fedavg import UpdateError

    fa, update = local.fedavg, {"w": np.arange(6, dtype=np.float32)}
    me = fa.secure_keys("rounds/r5", "alice")
    kw = {"round_prefix": "rounds/r5", "client_id": "alice", "private_key": me}
    # no peer has published: masking "for zero peers" would upload the update in the clear
    with pytest.raises(UpdateError, match=r"no key published for \['bob'\]"):
        fa.mask_update(update, "rounds/r5/alice.safetensors", roster=["alice", "bob"], **kw)
    with pytest.raises(UpdateError, match="at least two distinct clients"):
        fa.mask_update(update, "rounds/r5/alice.safetensors", roster=["alice"], **kw)
    # a writer adds keys of its own: they are not the roster's, so not used
    for cid in ("mallory1", "mallory2"):
        fa.secure_keys("rounds/r5", cid)
    bob = fa.secure_keys("rounds/r5", "bob")
    from shardfold.client import secagg

    pinned = {"alice": secagg.public_key(me), "bob": secagg.public_key(bob)}
    # a writer replaces bob's key: a roster with pinned keys refuses
    store.put(local.uri("rounds/r5/keys/bob.pub"), secagg.public_key(secagg.new_private_key()))
    with pytest.raises(UpdateError, match=r"keys published for \['bob'\] .* someone replaced them"):
        fa.mask_update(update, "rounds/r5/alice.safetensors", roster=pinned, **kw)
    store.put(local.uri("rounds/r5/keys/bob.pub"), pinned["bob"])
    uri = fa.mask_update(update, "rounds/r5/alice.safetensors", roster=pinned, **kw)
    meta = fa.metadata(uri)
    assert json.loads(meta["shardfold_secagg"])["clients"] == 2  # the roster's two, not the four keys listed


# -- 8. what would fail after the budget is reserved is refused at submit, naming the field ------------------


def _dpquery_doc() -> tuple[dict, str]:
    from shardfold.client.sdk import load_spec_document

    raw, base = load_spec_document(Path(__file__).resolve().parents[2] / "events" / "dpquery.json")
    return json.loads(raw), base


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"schema.0": {"name": "age", "range": [-(2**63), 2**63], "bin_width": 2**62}}, "schema.0"),
        ({"budget": {"rho": 5e-324}}, "budget.rho"),
        ({"budget": {"epsilon": 1e-300, "delta": 1e-9}}, "budget.epsilon"),
    ],
)
def test_a_dpquery_that_would_fail_after_reserving_is_refused_at_submit(local, change, field):
    from shardfold.functions.submit import check

    doc, base = _dpquery_doc()
    for key, value in change.items():
        if key.startswith("schema."):
            doc["schema"][int(key.split(".")[1])] = value
        else:
            doc[key] = value
    with pytest.raises(SpecError) as err:
        check(doc, store_root=local.store_root, base_uri=base)
    assert any(e["field"].startswith(field) for e in err.value.errors), err.value.errors
    assert not (Path(local.store_root.removeprefix("file://")) / "ledger").exists()  # nothing reserved


def test_dp_fedavg_expected_clients_beyond_any_round_is_refused(local):
    spec = {"kind": "fedavg", "clients": [{"uri": "round/c0.safetensors"}],
            "dp": {"clip_norm": 1.0, "noise_multiplier": 1.0, "dataset_id": "f", "expected_clients": 10**400,
                   "structure": "round/c0.safetensors"}}  # fmt: skip
    with pytest.raises(SpecError) as err:
        local.submit(spec)
    assert err.value.errors[0]["field"] == "dp.expected_clients"


# -- 17. a cancel reaches a round that waits; workers end with their owner (test_container_server.py) -------


def test_cancel_stops_a_fedavg_round_waiting_for_late_updates(local):
    import numpy as np

    fa = local.fedavg
    here = [fa.save_update({"w": np.ones(4, np.float32) * i}, f"late/c{i}.safetensors") for i in range(2)]
    spec = {"kind": "fedavg", "clients": [{"uri": u} for u in [*here, local.uri("late/never.safetensors")]],
            "min_clients": 2, "wait_s": 600}  # fmt: skip
    import time

    from shardfold.functions import telemetry

    job = local.submit(spec)
    deadline = time.monotonic() + 120
    while not any(r["step"] == "await_updates" for r in telemetry.read_records(local.store_root, job.job_id)):
        assert time.monotonic() < deadline, "the round never looked for its updates"
        time.sleep(0.05)
    job.cancel()  # while the round waits up to 600 s for the late client
    final = job.wait(progress=False, timeout_s=120)
    assert final.state == "CANCELLED", (final.state, final.error)
    steps = {r["step"] for r in telemetry.read_records(local.store_root, job.job_id)}
    assert steps == {"await_updates"}, steps  # the wait between looks ended; prepare never ran


# -- 6. a failed DP round keeps no client's norm ------------------------------------------------------------
# (that every executor runs a workflow's on_failure task when a step fails: test_local_executor.py and
# test_moto_harness.py; that the scrub task deletes the clip factors: test_fedavg_dp.py)


def test_fedavg_scrubs_a_failed_round_with_its_on_failure_task():
    from shardfold.functions.fedavg.workflow import SCRUB, WORKFLOW

    assert WORKFLOW.on_failure is SCRUB and SCRUB.function == "fedavg.scrub"


# -- 10 (inference). a store fault reading an input is the store's, retried, not a bad input -----------------


def test_a_store_fault_while_sharding_an_inference_input_is_not_blamed_on_the_input(local, monkeypatch):
    from shardfold.functions.errors import BadInputError
    from shardfold.functions.inference import shards
    from shardfold.functions.specs import parse_spec
    from shardfold.functions.store.retry import TransientError

    store.put(local.uri("data/rows.jsonl"), b'{"text": "a"}\n{"text": "b"}\n')
    spec = parse_spec({"kind": "inference", "inputs": ["data/rows.jsonl"], "field": "text"})

    def flaky(*a, **k):
        raise TransientError("GET data/rows.jsonl: connection reset")

    monkeypatch.setattr(shards, "jsonl_lines", flaky)
    with pytest.raises(TransientError):  # the workflow's retry policy retries it
        shards.make_shards(spec, local.store_root)
    monkeypatch.setattr(shards, "jsonl_lines", lambda *a, **k: (_ for _ in ()).throw(ValueError("junk")))
    with pytest.raises(BadInputError, match="inputs.0 data/rows.jsonl: cannot read it"):
        shards.make_shards(spec, local.store_root)


# -- 9. a user model's size is in the plan -------------------------------------------------------------------


def test_a_user_models_size_enters_the_workers_planned_memory(local, tmp_path):
    from shardfold.functions.errors import PlanError

    store.put(local.uri("data/rows.jsonl"), b'{"text": "a"}\n')
    model = tmp_path / "store" / "models" / "big.pt"
    model.parent.mkdir(parents=True, exist_ok=True)
    spec = {"kind": "inference", "inputs": ["data/rows.jsonl"], "field": "text",
            "model": {"torchscript": "models/big.pt"}}  # fmt: skip
    with open(model, "wb") as f:  # a sparse 64 MiB file: its size is what the plan reads
        f.truncate(64 * 2**20)
    small = local.plan(spec)
    worker = next(s for s in small.steps if s.name == "infer")
    with open(model, "wb") as f:
        f.truncate(3 * 2**30)
    try:
        big = local.plan(spec)
    except PlanError as exc:  # refused: it cannot fit the worker, the message names the setting
        assert "infer" in str(exc) and "memory" in str(exc), exc
    else:
        grown = next(s for s in big.steps if s.name == "infer")
        assert grown.peak_mb - worker.peak_mb >= 2 * (3 * 1024 - 64)  # the file twice over while it loads
        assert "twice over as it loads" in grown.why


def test_json_output_never_holds_non_standard_numbers(local, tmp_path, monkeypatch):
    from shardfold.client import cli as cli_module

    doc = {"ratio": float("inf"), "rows": [float("nan"), 1.5], "ok": 2}
    printed = []
    monkeypatch.setattr(cli_module.out, "print_json", printed.append)
    cli_module._print_json(doc)
    assert json.loads(printed[0]) == {"ratio": None, "rows": [None, 1.5], "ok": 2}
    assert "Infinity" not in printed[0] and "NaN" not in printed[0]
