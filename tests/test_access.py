"""What a job may read and write (functions.access), at submit and again in the tasks."""

from __future__ import annotations

import json
import os

import boto3
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from moto import mock_aws
from tiers import examples

from shardfold.functions import access, store
from shardfold.functions.errors import ShardfoldError, SpecError, UnsafeKey
from shardfold.functions.getbatch import core as getbatch
from shardfold.functions.getbatch.spec import GetBatchSpec
from shardfold.functions.specs import parse_spec
from shardfold.functions.submit import check_policy

S3_ROOT = "s3://jobs-bucket"
LOCAL_ROOT = "file:///srv/store"


@pytest.mark.parametrize("root", [S3_ROOT, LOCAL_ROOT])
@pytest.mark.parametrize(
    "output",
    ["ledger/survey/entries/00000001.json", "ledger", "jobs/other-job/result.json", "jobs/x.json"],
)
def test_outputs_never_target_system_prefixes(root, output):
    with pytest.raises(UnsafeKey, match="system prefix"):
        access.output_uri(output, root, "output")
    full = store.join(root, output)  # the same place named by its full URI
    with pytest.raises(UnsafeKey, match="system prefix"):
        access.output_uri(full, root, "output")


def test_a_job_writes_its_own_output_folder_and_anywhere_else():
    assert access.output_uri("results/a.tar", S3_ROOT) == f"{S3_ROOT}/results/a.tar"
    assert access.output_uri("s3://other-bucket/ledger/x", S3_ROOT)  # another bucket's ledger/ is not ours
    own = "jobs/getbatch-20260101T000000-abcdef/output/batch.tar"
    assert access.output_uri(own, S3_ROOT, job_id="getbatch-20260101T000000-abcdef")
    with pytest.raises(UnsafeKey):  # before the job has an id (submit), jobs/ is closed
        access.output_uri(own, S3_ROOT)
    # a local path that walks back into the store's ledger is the ledger
    with pytest.raises(UnsafeKey, match="ledger/"):
        access.output_uri("file:///srv/store/data/./x/../../ledger/d/e.json".replace("/../", "/"), LOCAL_ROOT)
    assert access.store_key("file:///srv/store//ledger/d", LOCAL_ROOT) == "ledger/d"
    assert access.store_key("file:///srv/storefront/x", LOCAL_ROOT) is None


def test_local_files_only_on_the_local_store():
    for uri in ("file:///proc/self/environ", "file:///tmp/out.tar"):
        with pytest.raises(UnsafeKey, match="local file"):
            access.input_uri(uri, S3_ROOT, "items.0.uri")
        with pytest.raises(UnsafeKey, match="local file"):
            access.output_uri(uri, S3_ROOT, "output")
    assert access.input_uri("file:///proc/self/environ", LOCAL_ROOT) == "file:///proc/self/environ"


def test_no_symbolic_link_leads_out_of_the_local_store(tmp_path):
    root = tmp_path / "store"
    (root / "data").mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    (root / "data" / "a.bin").write_bytes(b"a")
    (root / "results").symlink_to(outside)  # a link planted in the store
    (root / "data" / "alias.bin").symlink_to(root / "data" / "a.bin")  # a link inside the store
    store_root = f"file://{root}"
    for rel in ("results/secret", "results/new.tar"):
        with pytest.raises(UnsafeKey, match="symbolic link") as err:
            access.output_uri(rel, store_root, "output")
        assert str(err.value).startswith("output: ")
    with pytest.raises(UnsafeKey, match="symbolic link"):
        access.input_uri("results/secret", store_root, "items.0.uri")
    # named by its own file:// URI, data outside the store is the user's to read; links inside are fine
    assert access.input_uri(f"file://{outside}/secret", store_root) == f"file://{outside}/secret"
    assert access.input_uri("data/alias.bin", store_root).endswith("data/alias.bin")
    # an output that reaches an input through a link is that input
    with pytest.raises(UnsafeKey, match="may not overwrite"):
        access.not_an_input(
            access.output_uri("data/alias.bin", store_root), [("items.0.uri", f"{store_root}/data/a.bin")]
        )


def test_a_request_checks_each_folder_once_and_still_finds_a_link_out(tmp_path, monkeypatch):
    """Thousands of items in a few folders cost one lstat per folder, not one per path component per item;
    a link out of the store among them is still refused, naming its item."""
    import os

    root = tmp_path / "store"
    (root / "data" / "a" / "b").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "secret").write_bytes(b"s")
    (root / "data" / "out").symlink_to(tmp_path / "elsewhere")
    for k in range(200):
        (root / "data" / "a" / "b" / f"{k}.bin").write_bytes(b"x")
    store_root = f"file://{root}"
    items = [{"uri": f"data/a/b/{k}.bin"} for k in range(200)]
    calls = []
    real_lstat = os.lstat
    monkeypatch.setattr(os, "lstat", lambda path, *a, **kw: calls.append(path) or real_lstat(path, *a, **kw))
    assert len(getbatch.load_items(GetBatchSpec(kind="getbatch", items=items), store_root)) == 200
    assert len(calls) == 200 + 3  # each file, and data/, data/a/, data/a/b/ once
    with pytest.raises(SpecError, match="symbolic link") as err:
        linked = GetBatchSpec(kind="getbatch", items=[*items, {"uri": "data/out/secret"}])
        getbatch.load_items(linked, store_root)
    assert [e["field"] for e in err.value.errors] == ["items.200.uri"]


def test_an_output_is_checked_against_each_distinct_input_once(tmp_path, monkeypatch):
    calls = []
    real = access._RealPaths.__call__
    monkeypatch.setattr(access._RealPaths, "__call__", lambda self, uri: calls.append(uri) or real(self, uri))
    store_root = f"file://{tmp_path}"
    inputs = [(f"items.{k}.uri", f"{store_root}/data/x.bin") for k in range(1000)]
    access.not_an_input(f"{store_root}/out/x.bin", inputs, "output")  # the same file name, elsewhere
    assert len(calls) == 2  # the output and the one object
    with pytest.raises(UnsafeKey, match="output: .* is the job's input items.0.uri"):
        access.not_an_input(f"{store_root}/data/x.bin", inputs, "output")
    with pytest.raises(UnsafeKey, match="holds the job's input items.0.uri"):
        access.not_an_input(f"{store_root}/data/", inputs, "output", prefix=True)
    with pytest.raises(UnsafeKey, match="holds"):
        access.not_an_input("s3://b/data", [("inputs.0", "s3://b/data/x.bin")], "output", prefix=True)
    access.not_an_input("s3://b/dat", [("inputs.0", "s3://b/data/x.bin")], "output", prefix=True)


def test_an_input_link_to_an_output_written_after_every_read_is_followed_once_it_exists(
    tmp_path, monkeypatch
):
    """An output that a later step writes once every read is done (a getbatch request of several parts):
    while it is not written, an input that is a link costs no lstat (a plan of 50,000 files made one each)
    and a link to where it will be reads nothing; once it exists, a link to it is that input. Otherwise (the
    default, and a request of one part, whose gather writes the archive) every input link is followed."""
    data = tmp_path / "data"
    data.mkdir()
    for k in range(50):
        (data / f"{k}.bin").write_bytes(b"x")
    out = tmp_path / "out.tar"
    (data / "to-out").symlink_to(out)
    inputs = [(f"items.{k}.uri", f"file://{data}/{k}.bin") for k in range(50)]
    inputs.append(("items.50.uri", f"file://{data}/to-out"))
    with pytest.raises(UnsafeKey, match="is the job's input items.50.uri"):
        access.not_an_input(f"file://{out}", inputs, "output")
    calls = []
    real_lstat = os.lstat
    monkeypatch.setattr(os, "lstat", lambda path, *a, **kw: calls.append(path) or real_lstat(path, *a, **kw))
    access.not_an_input(f"file://{out}", inputs, "output", after_reads=True)
    assert not [c for c in map(str, calls) if c.startswith(f"{data}/")], calls  # the folders' only
    with pytest.raises(UnsafeKey, match="output: .* is the job's input items.0.uri"):  # named literally
        access.not_an_input(f"file://{data}/0.bin", inputs, "output", after_reads=True)
    (tmp_path / "alias").symlink_to(data)  # through a linked folder, to an output not yet written
    with pytest.raises(UnsafeKey, match="is the job's input via-alias"):
        via = [*inputs, ("via-alias", f"file://{tmp_path}/alias/new.tar")]
        access.not_an_input(f"file://{data}/new.tar", via, after_reads=True)
    out.write_bytes(b"an earlier archive")
    with pytest.raises(UnsafeKey, match="is the job's input items.50.uri"):
        access.not_an_input(f"file://{out}", inputs, "output", after_reads=True)
    monkeypatch.undo()
    out.unlink()
    # a spec written behind submit's back (submit refuses this one): the job's steps, as they run
    root, job_id = f"file://{tmp_path}/store", "getbatch-20260101T000000-abcdef"
    items = [{"uri": u} for _, u in inputs]
    one_part = GetBatchSpec(items=items, output=f"file://{out}", continue_on_error=True)
    with pytest.raises(UnsafeKey, match="is the job's input items.50.uri"):
        getbatch.prepare(one_part, job_id, root)
    spec = one_part.model_copy(update={"items_per_part": 10})
    parts = getbatch.prepare(spec, job_id, root)["parts"]
    for p in range(parts):
        getbatch.gather(spec, job_id, root, p, parts, inline=True)  # its own items, none pinned
    rows = [
        json.loads(line)
        for line in store.get(getbatch.assemble(spec, job_id, root, parts)["status"]).splitlines()
    ]
    assert [r["index"] for r in rows if r["error"]] == [50] and "no object" in rows[50]["error"]


def test_keys_with_nul_or_dotdot_are_refused():
    for bad in ("a/\x00b", "a/../b", "../b"):
        with pytest.raises(UnsafeKey):
            access.input_uri(bad, S3_ROOT)


@pytest.mark.parametrize(
    "spec",
    [
        {"kind": "getbatch", "items": [{"uri": "data/a.bin"}, {"uri": "out/a.tar"}], "output": "out/a.tar"},
        {"kind": "fedavg", "clients": [{"uri": "u/1.safetensors"}], "output": "u/1.safetensors"},
        {"kind": "inference", "inputs": ["t/x.jsonl"], "field": "text", "output": "t/x.jsonl"},
        {
            "kind": "dpquery",
            "dataset": "d/people.csv",
            "schema": [{"name": "sex", "categories": ["f", "m"]}],
            "workload": [{"attributes": ["sex"]}],
            "budget": {"rho": 0.1},
            "dataset_id": "people",
            "dataset_budget_rho": 1,
            "output": "d",  # a prefix holding the dataset: the tables would land beside (and over) it
        },
    ],
    ids=["getbatch", "fedavg", "inference", "dpquery"],
)
def test_an_output_is_never_one_of_the_inputs(spec):
    with pytest.raises(SpecError, match="may not overwrite what it reads") as refused:
        check_policy(parse_spec(spec), LOCAL_ROOT)
    assert refused.value.errors[0]["field"] == "output"


def test_submit_names_every_bad_uri():
    spec = parse_spec(
        {"kind": "getbatch", "items": [{"uri": "file:///etc/passwd"}], "output": "ledger/x/entries/1.json"}
    )
    with pytest.raises(SpecError) as refused:
        check_policy(spec, S3_ROOT)
    assert [e["field"] for e in refused.value.errors] == ["items.0.uri", "output"]


@pytest.mark.parametrize("name", ["../../x", "/etc/evil", "a/../../../y", "a\x00b"])
@pytest.mark.parametrize("field", ["name", "archpath"])
def test_archive_names_stay_inside_the_archive(name, field):
    with pytest.raises(SpecError, match=rf"items\.0\.{field}"):
        parse_spec({"kind": "getbatch", "items": [{"uri": "data/a.bin", field: name}]})


def test_the_prepare_task_checks_a_manifests_items_again(aws_env):
    # submit cannot see inside a manifest: the task that reads it holds its items to the same rules
    with mock_aws():
        boto3.client("s3").create_bucket(Bucket="jobs-bucket")
        items = [{"uri": "s3://jobs-bucket/data/a.bin"}, {"uri": "file:///proc/self/environ"}]
        store.put(f"{S3_ROOT}/requests/m.json", json.dumps(items).encode())
        spec = GetBatchSpec(manifest="requests/m.json")
        check_policy(spec, S3_ROOT)  # the spec itself is fine
        with pytest.raises(ShardfoldError, match=r"items\.1\.uri.*local file"):
            getbatch.prepare(spec, "getbatch-20260101T000000-abcdef", S3_ROOT)
        bad_name = [{"uri": "s3://jobs-bucket/data/a.bin", "name": "../../etc/cron.d/x"}]
        store.put(f"{S3_ROOT}/requests/n.json", json.dumps(bad_name).encode())
        with pytest.raises(SpecError, match=r"items\.0.*'\.\.' component"):
            getbatch.prepare(
                GetBatchSpec(manifest="requests/n.json"), "getbatch-20260101T000000-abcdef", S3_ROOT
            )
        # an output equal to an item named only in the manifest is refused by the task too
        store.put(f"{S3_ROOT}/requests/o.json", json.dumps([{"uri": "results/x.tar"}]).encode())
        with pytest.raises(UnsafeKey, match="may not overwrite"):
            getbatch.prepare(
                GetBatchSpec(manifest="requests/o.json", output="results/x.tar"),
                "getbatch-20260101T000000-abcdef",
                S3_ROOT,
            )


def test_real_paths_resolve_as_realpath_does(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "f.bin").write_bytes(b"x")
    (tmp_path / "linkdir").symlink_to(tmp_path / "d")
    (tmp_path / "d" / "linkfile").symlink_to(tmp_path / "d" / "e" / "f.bin")
    paths = ["d/e/f.bin", "linkdir/e/f.bin", "d/linkfile", "linkdir/linkfile", "linkdir/e/missing", "nope/x"]
    real = access._RealPaths()
    for rel in paths * 2:  # the second round from the folder cache
        assert real(f"file://{tmp_path}/{rel}") == os.path.realpath(tmp_path / rel), rel


SEGMENTS = ["a", "b", ".", "..", "", "jobs", "store", "x.y", ".z"]


def _outcome(fn, *args):
    try:
        return fn(*args)
    except UnsafeKey:
        return UnsafeKey


@given(
    st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=6),
    st.sampled_from(["file:///tmp/store", "file:///tmp/store/", "s3://bkt", "s3://bkt/pre"]),
)
@settings(max_examples=examples(300))
def test_a_tasks_fast_key_is_the_store_key(parts, root):
    scope = access.TaskScope(root, "j", "getbatch", frozenset())
    for base in ("file:///tmp/store/", "file:///tmp/", "s3://bkt/", "s3://bkt/pre/"):
        uri = base + "/".join(parts)
        assert _outcome(scope._key, uri) == _outcome(access.store_key, uri, root), uri


@pytest.mark.parametrize("root", [S3_ROOT, LOCAL_ROOT])
@pytest.mark.parametrize("key", ["ledger/survey/entries/00000001.json", "claims/ab/1.json", "ledger"])
def test_the_ledgers_and_claims_are_no_input(root, key):
    with pytest.raises(UnsafeKey, match=r"items\.0\.uri: .*system prefix"):
        access.input_uri(key, root, "items.0.uri")
    assert access.input_uri("jobs/other/output/batch.tar", root).endswith("jobs/other/output/batch.tar")


_SEGMENTS = ["a", "b.bin", "", ".", "..", ".hidden", "ledger", "claims", "store", "jobs", "x\x00y", "link"]


@pytest.fixture(scope="module")
def linked_root(tmp_path_factory) -> str:
    """A store root holding a symbolic link that leads out of it."""
    top = tmp_path_factory.mktemp("plain")
    (top / "store").mkdir()
    (top / "outside").mkdir()
    (top / "store" / "link").symlink_to(top / "outside")
    return str(top)


@settings(max_examples=examples(400), deadline=None)
@given(
    segments=st.lists(st.sampled_from(_SEGMENTS), min_size=1, max_size=5),
    root=st.sampled_from(["{top}/store", "{top}/store/", "{top}/./store", "/", "{top}"]),
    local_files=st.booleans(),
    start=st.sampled_from(["file:///", "file://{top}/store/", "file://{top}/", ""]),
)
# through a link under the root, out of it; under the root's ledger; a file beside the root
@example(segments=["link", "a"], root="{top}/store", local_files=True, start="file://{top}/store/")
@example(segments=["ledger", "a"], root="{top}/store/", local_files=True, start="file://{top}/store/")
@example(segments=["store2", "a"], root="{top}/store", local_files=True, start="file://{top}/")
def test_the_plain_path_of_input_uri_answers_as_every_rule_does(
    linked_root, segments, root, local_files, start
):
    # input_uri lets a plain local file through on its string alone; wherever it does, the rules one by one
    # must allow the same URI unchanged (a hole here would be a policy hole on every path)
    uri = start.format(top=linked_root) + "/".join(segments)
    store_root = "file://" + root.format(top=linked_root)

    class Spec:
        pass

    spec = Spec()
    spec.local_files = local_files
    with access.policy(spec):
        plain = access._plainly_allowed(uri, store_root)
        try:
            full = access._checked_input(uri, store_root, "f", None, None)
        except (ValueError, OSError, access.UnsafeKey, store.StoreError) as exc:
            full = exc
    if plain:
        assert full == uri, (uri, store_root, full)
