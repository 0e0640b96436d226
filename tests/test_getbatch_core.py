"""The getbatch job's pure core on the local store: plan → gather → assemble."""

import io
import json
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from shardfold.functions import store
from shardfold.functions.errors import BatchItemError, SpecError, StoreError, TooManySoftErrors
from shardfold.functions.getbatch import core
from shardfold.functions.getbatch.spec import GetBatchSpec
from shardfold.functions.store.tar import write_tar


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    r = store.uri.store_root()
    for i in range(23):
        store.put(store.uri.join(r, "data", f"obj-{i:03d}.bin"), bytes([i]) * (100 + i))
    return r


def run_job(
    spec: GetBatchSpec, root: str, job_id: str = "getbatch-20260101T000000-abcdef", say_parts: bool = True
) -> dict:
    planned = core.prepare(spec, job_id, root)
    for part in store.get_json(planned["worklist"]["uri"]):
        # told it is the only part, gather writes the whole archive; not told, a fragment for assemble
        core.gather(
            spec, job_id, root, part["part"], part["of"] if say_parts else 0, part.get("inline", False)
        )
    return core.assemble(spec, job_id, root, planned["parts"])


def members(uri: str) -> list[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(store.get(uri))) as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf.getmembers()]


@pytest.mark.parametrize(
    "items_per_part,say_parts", [(1, True), (4, True), (7, True), (23, True), (100, False)]
)
def test_archive_equals_single_tar_of_whole_request(root, items_per_part, say_parts):
    uris = [f"data/obj-{i:03d}.bin" for i in (5, 0, 22, 5, 9, 3, 17, 1, 1, 12)]
    spec = GetBatchSpec(items=[{"uri": u} for u in uris], items_per_part=items_per_part)
    result = run_job(spec, root, say_parts=say_parts)
    assert result["items"] == len(uris) and result["errors"] == 0
    got = members(result["archive"])
    assert [data for _, data in got] == [store.get(store.uri.join(root, u)) for u in uris]
    # byte-identical to one deterministic TAR of the whole request, whatever the part size
    whole = io.BytesIO()
    write_tar(store.get_batch([{"uri": store.uri.join(root, u)} for u in uris]), whole)
    assert store.get(result["archive"]) == whole.getvalue()
    # temporaries removed, status file complete and in order
    assert not store.list_uris(core.job_uri(root, "getbatch-20260101T000000-abcdef", "getbatch", "fragments"))
    rows = [json.loads(line) for line in store.get(result["status"]).decode().splitlines()]
    assert [r["index"] for r in rows] == list(range(len(uris)))


def test_missing_item_with_continue_on_error_keeps_neighbours(root):
    spec = GetBatchSpec(
        items=[{"uri": "data/obj-001.bin"}, {"uri": "data/nope.bin"}, {"uri": "data/obj-002.bin"}],
        continue_on_error=True,
        items_per_part=2,
    )
    result = run_job(spec, root)
    got = members(result["archive"])
    assert got[0][1] == bytes([1]) * 101 and got[2][1] == bytes([2]) * 102
    assert got[1][0].startswith("__404__/") and got[1][1] == b""
    assert result["errors"] == 1
    rows = [json.loads(line) for line in store.get(result["status"]).decode().splitlines()]
    assert rows[1]["error"] and "nope.bin" in rows[1]["name"]


def test_missing_item_strict_fails_and_writes_no_archive(root):
    items = [{"uri": "data/obj-001.bin"}] * 3 + [{"uri": "data/nope.bin"}]
    spec = GetBatchSpec(items=items, items_per_part=2)
    job_id = "getbatch-20260101T000000-000001"
    planned = core.prepare(spec, job_id, root)
    core.gather(spec, job_id, root, 0)
    with pytest.raises(BatchItemError, match=r"item 3 \(.*nope.bin") as exc:
        core.gather(spec, job_id, root, 1)
    assert exc.value.index == 3  # its place in the request, not in its part
    assert planned["parts"] == 2
    assert not store.exists(core.output_uri(spec, root, job_id))
    assert not store.exists(core.job_uri(root, job_id, "result.json"))


def test_soft_error_budget_is_enforced_across_parts(root):
    items = [{"uri": f"data/missing-{i}.bin"} for i in range(3)] + [{"uri": "data/obj-001.bin"}]
    spec = GetBatchSpec(items=items, continue_on_error=True, max_soft_errors=2, items_per_part=1)
    with pytest.raises(TooManySoftErrors, match="max_soft_errors=2"):
        run_job(spec, root)


@pytest.mark.parametrize("least, modes", [(5, ["process", "thread", "process"]), (6, ["thread"] * 3)])
def test_parts_of_local_files_are_marked_to_run_in_worker_processes(root, monkeypatch, least, modes):
    # reading local files keeps an interpreter busy, so the local executor runs those parts in processes
    # once the request is large enough to repay starting them; a part with an S3 object waits on the
    # network and stays on a thread (workflow.GATHER_PART.mode_from)
    monkeypatch.setattr(core, "PROCESS_MIN_ITEMS", least)
    items = [{"uri": "data/obj-001.bin"}, {"uri": "data/obj-002.bin"}, {"uri": "s3://bkt/x"}]
    items += [{"uri": "data/obj-003.bin"}, {"uri": "data/obj-004.bin"}]
    spec = GetBatchSpec(items=items, items_per_part=2)
    planned = core.prepare(spec, "getbatch-20260101T000000-00000b", root)
    refs = store.get_json(planned["worklist"]["uri"])
    assert [ref.get("mode", "thread") for ref in refs] == modes


def test_a_request_of_one_part_stays_on_a_thread(root, monkeypatch):
    monkeypatch.setattr(core, "PROCESS_MIN_ITEMS", 1)
    spec = GetBatchSpec(items=[{"uri": "data/obj-001.bin"}, {"uri": "data/obj-002.bin"}], items_per_part=2)
    planned = core.prepare(spec, "getbatch-20260101T000000-00000c", root)
    assert "mode" not in store.get_json(planned["worklist"]["uri"])[0]


def test_soft_error_budget_names_the_first_failed_item_of_the_request(root):
    # parts 0 and 1 hold no failure; the first failure is item 5 of part 2
    uris = ["data/obj-001.bin"] * 5 + ["data/missing-a.bin", "data/obj-002.bin", "data/missing-b.bin"]
    uris += ["data/missing-c.bin"]
    items = [{"uri": u} for u in uris]
    spec = GetBatchSpec(items=items, continue_on_error=True, max_soft_errors=2, items_per_part=2)
    with pytest.raises(TooManySoftErrors, match=r"^3 items failed, .*; first: item 5 \(.*missing-a\.bin"):
        run_job(spec, root)


def test_assemble_reads_the_parts_tallies_not_their_rows(root, monkeypatch):
    uris = [f"data/obj-{i % 23:03d}.bin" for i in range(30)]
    uris[3] = "data/missing.bin"
    spec = GetBatchSpec(items=[{"uri": u} for u in uris], continue_on_error=True, items_per_part=10)
    job_id = "getbatch-20260101T000000-00000a"
    planned = core.prepare(spec, job_id, root)
    for part in store.get_json(planned["worklist"]["uri"]):
        core.gather(spec, job_id, root, part["part"], 0, part.get("inline", False))
    read = []
    real_get = store.get

    def get(uri, *args, **kwargs):
        data = real_get(uri, *args, **kwargs)
        read.append(len(data))
        return data

    monkeypatch.setattr(store, "get", get)
    result = core.assemble(spec, job_id, root, planned["parts"])
    # a few numbers per part (each part's 10 rows are ~700 bytes): the rows are joined by the store
    assert len(read) == 3 and max(read) < 300
    sizes = [0 if i == 3 else 100 + i % 23 for i in range(30)]
    assert (result["items"], result["errors"], result["parts"], result["bytes"]) == (30, 1, 3, sum(sizes))
    rows = [json.loads(line) for line in store.get(result["status"]).decode().splitlines()]
    assert [r["index"] for r in rows] == list(range(30)) and [r["size"] for r in rows] == sizes
    assert [i for i, r in enumerate(rows) if r["error"]] == [3]


def test_manifest_jsonl_and_bare_uris(root):
    manifest = store.uri.join(root, "requests", "r.jsonl")
    store.put(manifest, b'"data/obj-004.bin"\n{"uri": "data/obj-006.bin", "start": 2, "length": 3}\n')
    result = run_job(GetBatchSpec(manifest="requests/r.jsonl"), root)
    got = members(result["archive"])
    assert [d for _, d in got] == [bytes([4]) * 104, bytes([6]) * 3]


def test_bad_manifest_item_is_named(root):
    manifest = store.uri.join(root, "requests", "bad.json")
    store.put(manifest, json.dumps([{"uri": "data/obj-001.bin"}, {"uri": "x", "start": -1}]).encode())
    with pytest.raises(SpecError, match=r"items\.1"):
        core.prepare(GetBatchSpec(manifest="requests/bad.json"), "getbatch-20260101T000000-000002", root)


def test_manifest_that_is_not_utf8_names_the_manifest_and_line(root):
    manifest = store.uri.join(root, "requests", "latin1.jsonl")
    store.put(manifest, b'"data/obj-001.bin"\n"data/caf\xe9.bin"\n')
    with pytest.raises(SpecError, match=r"manifest requests/latin1\.jsonl, line 2: not UTF-8") as info:
        core.load_items(GetBatchSpec(manifest="requests/latin1.jsonl"), root)
    assert info.value.errors[0]["field"] == "manifest"


def test_manifest_line_that_is_not_json_is_named(root):
    manifest = store.uri.join(root, "requests", "r.jsonl")
    store.put(manifest, b'"data/obj-001.bin"\n\n{"uri": "data/obj-002.bin",\n')
    with pytest.raises(SpecError, match=r"r\.jsonl, line 3: not a JSON value"):
        core.load_items(GetBatchSpec(manifest="requests/r.jsonl"), root)


@pytest.mark.parametrize(
    "bad, field, says",
    [
        (7, "items.1", "an item is a URI string or an object"),
        (["data/obj-002.bin"], "items.1", "got a list"),
        ({"uri": 5}, "items.1.uri", "valid string (got an integer 5)"),
        ({"uri": "data/obj-002.bin", "start": "2"}, "items.1.start", 'valid integer (got a string "2")'),
        ({"uri": "data/obj-002.bin", "length": 1.5}, "items.1.length", "valid integer"),
    ],
)
@pytest.mark.parametrize("form", ["array", "jsonl"])
def test_manifest_item_of_the_wrong_type_is_named(root, bad, field, says, form):
    docs = ["data/obj-001.bin", bad]
    text = json.dumps(docs) if form == "array" else "".join(json.dumps(d) + "\n" for d in docs)
    store.put(store.uri.join(root, "requests", "m"), text.encode())
    with pytest.raises(SpecError) as info:
        core.load_items(GetBatchSpec(manifest="requests/m"), root)
    (err,) = info.value.errors
    assert err["field"] == field and says in err["error"]
    assert "pydantic" not in str(info.value) and "BatchItem" not in str(info.value)
    assert str(info.value).startswith("manifest requests/m: 1 invalid item(s)")
    if form == "jsonl":
        assert "(manifest line 2)" in err["error"]


def test_assemble_is_idempotent(root):
    spec = GetBatchSpec(items=[{"uri": "data/obj-001.bin"}, {"uri": "data/obj-002.bin"}], items_per_part=1)
    job_id = "getbatch-20260101T000000-000003"
    first = run_job(spec, root, job_id)
    again = core.assemble(spec, job_id, root, 2)
    assert again == first


def test_assemble_removes_the_scratch_and_a_retried_assemble_too(root):
    job_id = "getbatch-20260101T000000-0000aa"
    spec = GetBatchSpec(items=[{"uri": f"data/obj-{i:03d}.bin"} for i in range(6)], items_per_part=2)
    result = run_job(spec, root, job_id)
    scratch = core.job_uri(root, job_id, "getbatch") + "/"
    assert not store.list_uris(scratch)  # part lists, fragments, status rows
    assert store.get(result["status"]).count(b"\n") == 6  # what the user needs stays
    store.put(scratch + "fragments/00001.tar", b"left over by a crash after the result")
    assert core.assemble(spec, job_id, root, 3) == result and not store.list_uris(scratch)


def test_the_only_part_commits_the_archive_status_and_result_itself(root):
    job_id = "getbatch-20260101T000000-0000bb"
    spec = GetBatchSpec(items=[{"uri": f"data/obj-{i:03d}.bin"} for i in (3, 1, 5)])
    planned = core.prepare(spec, job_id, root)
    (part,) = store.get_json(planned["worklist"]["uri"])
    assert part["inline"]  # nothing pinned: no part list, gather reads the items from the spec
    gathered = core.gather(spec, job_id, root, part["part"], part["of"], part["inline"])
    result = store.get_json(core.job_uri(root, job_id, "result.json"))
    assert gathered == {"part": 0, "items": 3, "errors": 0, "bytes": 103 + 101 + 105}
    assert result["items"] == 3 and result["parts"] == 1 and store.exists(result["archive"])
    assert store.get(result["status"]).count(b"\n") == 3
    assert not store.exists(core.job_uri(root, job_id, "getbatch", "parts", "00000.json"))
    # assemble has only the scratch left to clear, and answers the same result
    assert core.assemble(spec, job_id, root, 1) == result
    assert not store.list_uris(core.job_uri(root, job_id, "getbatch") + "/")


@pytest.mark.parametrize(
    "tally",
    [[{"index": 0, "size": 1, "error": None}], {"items": "3"}, {"items": 2, "errors": 0, "bytes": -1}, "x"],
    ids=["rows", "a string count", "negative", "not an object"],
)
def test_an_altered_tally_fails_assemble_naming_it_and_commits_nothing(root, tally):
    spec = GetBatchSpec(items=[{"uri": f"data/obj-{i:03d}.bin"} for i in range(4)], items_per_part=2)
    job_id = "getbatch-20260101T000000-00000d"
    planned = core.prepare(spec, job_id, root)
    for part in store.get_json(planned["worklist"]["uri"]):
        core.gather(spec, job_id, root, part["part"], 0, part.get("inline", False))
    store.put_json(core._part_tally_uri(root, job_id, 1), tally)
    with pytest.raises(StoreError, match=r"00001\.tally\.json is not a part's tally"):
        core.assemble(spec, job_id, root, planned["parts"])
    assert not store.exists(core.job_uri(root, job_id, "result.json"))
    assert not store.exists(core.output_uri(spec, root, job_id))


ANY_TEXT = st.text(st.characters(exclude_categories=()))  # lone surrogates too


@given(
    st.integers(min_value=0, max_value=10**12),
    ANY_TEXT,
    st.integers(min_value=0, max_value=10**12),
    st.none() | ANY_TEXT,
)
@settings(max_examples=examples(300))
def test_a_status_row_is_written_as_json_dumps_writes_it(index, name, size, error):
    """The status file's rows come from a template: each must be exactly json.dumps(row, sort_keys=True),
    whatever the name or error holds (quotes, controls, non-ASCII, lone surrogates)."""
    row = {"index": index, "name": name, "size": size, "error": error}
    assert core._status_lines([row]) == (json.dumps(row, sort_keys=True) + "\n").encode()
    for odd in ({**row, "extra": True}, {"index": index, "name": name, "size": size, "extra": error}):
        # not a row write_tar makes (a key more; another key for "error"): the encoder writes it
        assert core._status_lines([odd]) == (json.dumps(odd, sort_keys=True) + "\n").encode()
