"""The store interface on both schemes: local files and S3 (moto)."""

import errno
import io
import os
import threading
from pathlib import Path

import boto3
import botocore.exceptions
import numpy as np
import pytest

from shardfold.functions import store
from shardfold.functions.errors import InvalidRange, ObjectExists, ObjectNotFound, StoreError, UnsafeKey
from shardfold.functions.store import local
from shardfold.functions.store import s3 as s3mod
from shardfold.functions.store import uri as urimod
from shardfold.functions.store.uri import local_path

MiB = 1024 * 1024


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])
def root(request):
    return request.getfixturevalue(f"{request.param}_root")


# --- URIs ------------------------------------------------------------------------------------------------


def test_store_root_is_an_absolute_file_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SHARDFOLD_HOME", raising=False)
    assert store.store_root() == f"file://{tmp_path}/.shardfold"
    monkeypatch.setenv("SHARDFOLD_HOME", "rel/home")
    assert store.store_root() == f"file://{tmp_path}/rel/home"


def test_resolve_keeps_uris_and_confines_keys(local_root):
    assert store.resolve("a/b") == local_root + "/a/b"
    assert store.resolve("s3://bkt/k/x") == "s3://bkt/k/x"
    assert store.resolve("file:///data/x") == "file:///data/x"  # the user's own path: allowed
    for bad in ("../x", "a/../../x", "/etc/passwd", "file:///data/../etc/passwd", "s3://bkt/a/../b", ""):
        with pytest.raises(UnsafeKey):
            store.resolve(bad)
    with pytest.raises(StoreError, match="scheme"):
        store.resolve("gs://bucket/key")


def test_normalise_gives_one_spelling_per_object():
    for given, want in [
        ("c", "c"),
        ("./c", "c"),
        (".//c", "c"),
        ("a//b/./c/", "a/b/c/"),
        ("a/../c", "c"),
        ("x//y/../../c", "c"),
        ("file:///d//e/./f", "file:///d/e/f"),
        ("file:///d/", "file:///d/"),
        # left as given, for resolve() to refuse or to name literally
        ("file:///d/x/../f", "file:///d/x/../f"),
        ("file:///d/./x/../f", "file:///d/x/../f"),
        ("../c", "../c"),
        ("a/../../c", "a/../../c"),
        ("/etc/passwd", "/etc/passwd"),
        (".", "."),
        ("", ""),
        ("s3://b/a//./c", "s3://b/a//./c"),  # S3 keys are literal: a//c and a/c are two objects
    ]:
        assert urimod.normalise(given) == want, given
        assert urimod.normalise(want) == want, want
    with pytest.raises(UnsafeKey):
        store.resolve(urimod.normalise("a/../../c"))


def test_join_split_and_names(local_root):
    assert store.join("s3://b/x/", "/y/", "z") == "s3://b/x/y/z"
    with pytest.raises(UnsafeKey):
        store.join(local_root, "a/../..")
    assert store.split_s3("s3://bucket/a/b") == ("bucket", "a/b")
    assert store.split_s3("s3://bucket") == ("bucket", "")
    with pytest.raises(StoreError):
        store.split_s3("s3:///key")
    assert store.is_s3("s3://b/k") and not store.is_s3(local_root)
    assert urimod.default_name("s3://bkt/dir/obj.bin") == "dir/obj.bin"
    assert urimod.default_name(local_root + "/data/x.bin") == "data/x.bin"
    assert urimod.default_name("file:///elsewhere/x.bin") == "elsewhere/x.bin"


# --- objects on both schemes -----------------------------------------------------------------------------


def test_put_get_size_exists_delete(root):
    u = store.join(root, "dir", "obj.bin")
    assert not store.exists(u)
    store.put(u, b"0123456789")
    assert store.exists(u) and store.size(u) == 10
    assert store.get(u) == b"0123456789"
    store.put(u, b"new")  # overwrite
    assert store.get(u) == b"new"
    store.delete(u)
    assert not store.exists(u)
    store.delete(u)  # deleting a missing object is fine
    with pytest.raises(ObjectNotFound, match="obj.bin"):
        store.get(u)
    with pytest.raises(ObjectNotFound):
        store.size(u)


@pytest.mark.parametrize(
    ("start", "length", "want"),
    [(0, None, b"0123456789"), (3, None, b"3456789"), (2, 3, b"234"), (0, 10, b"0123456789"), (9, 1, b"9")],
)
def test_ranged_get(root, start, length, want):
    u = store.join(root, "r.bin")
    store.put(u, b"0123456789")
    assert store.get(u, start, length) == want


@pytest.mark.parametrize(("start", "length"), [(10, None), (11, None), (8, 3), (0, 11), (20, 1)])
def test_ranged_get_outside_the_object_is_invalid(root, start, length):
    u = store.join(root, "r.bin")
    store.put(u, b"0123456789")
    with pytest.raises(InvalidRange, match="r.bin"):
        store.get(u, start, length)


def test_empty_objects_and_zero_length_reads(root):
    u = store.join(root, "empty")
    store.put(u, b"")
    assert store.get(u) == b"" and store.size(u) == 0
    assert store.get(u, 0, 0) == b""
    with pytest.raises(InvalidRange):
        store.get(u, 0, 1)
    with pytest.raises(ObjectNotFound):
        store.get(store.join(root, "nope"), 0, 0)


def test_put_if_absent(root):
    u = store.join(root, "once")
    assert store.put_if_absent(u, b"first")
    assert not store.put_if_absent(u, b"second")
    assert store.get(u) == b"first"


def test_put_if_absent_has_exactly_one_winner_under_contention(local_root):
    u = store.join(local_root, "race")
    barrier = threading.Barrier(8)
    wins: list[bool] = []

    def writer(i: int) -> None:
        barrier.wait()
        wins.append(store.put_if_absent(u, f"writer-{i}".encode() * 1000))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wins.count(True) == 1
    data = store.get(u)
    assert data == data[: len(data) // 1000] * 1000  # one writer's complete content


def test_put_file_and_json(root):
    u = store.join(root, "f.bin")
    store.put_file(u, io.BytesIO(b"x" * 100_000))
    assert store.get(u) == b"x" * 100_000
    j = store.join(root, "doc.json")
    store.put_json(j, {"a": [1, 2], "b": None})
    assert store.get_json(j) == {"a": [1, 2], "b": None}
    store.put(j, b"{not json")
    with pytest.raises(StoreError, match="not valid JSON"):
        store.get_json(j)


def test_list_and_delete_prefix(root):
    keys = ["jobs/a/1", "jobs/a/2/x", "jobs/ab", "jobs/b/1", "other"]
    for k in keys:
        store.put(store.join(root, k), k.encode())
    assert store.list_uris(store.join(root, "jobs/a") + "/") == [store.join(root, k) for k in keys[:2]]
    assert store.list_uris(store.join(root, "jobs/a")) == [store.join(root, k) for k in keys[:3]]
    assert store.list_uris(store.join(root, "nothing") + "/") == []
    assert store.delete_prefix(store.join(root, "jobs/a") + "/") == 2
    assert store.list_uris(store.join(root, "jobs")) == [store.join(root, k) for k in keys[2:4]]
    assert store.exists(store.join(root, "other"))


def test_list_starts_after_a_key_as_s3_does(root):
    keys = ["p/00001.npz", "p/00002.done", "p/00002.npz", "p/00010.npz", "p/100000.npz"]
    for k in keys:
        store.put(store.join(root, k), b"x")
    listed = store.list_uris(store.join(root, "p") + "/", store.join(root, "p/00002"))
    assert listed == [store.join(root, k) for k in keys[1:]]  # exclusive; the stem sorts before its files
    assert store.list_uris(store.join(root, "p/"), store.join(root, "p/00010.npz")) == [
        store.join(root, "p/100000.npz")
    ]
    assert store.list_uris(store.join(root, "p/"), store.join(root, "p/2")) == []


def test_local_delete_prefix_prunes_emptied_directories(local_root):
    base = local_root.removeprefix("file://")
    store.put(store.join(local_root, "jobs/j1/a/b/c"), b"1")
    store.put(store.join(local_root, "jobs/j2/x"), b"2")
    store.delete_prefix(store.join(local_root, "jobs/j1") + "/")
    assert not os.path.exists(base + "/jobs/j1") and os.path.isfile(base + "/jobs/j2/x")


def test_relative_keys_use_the_store_root(local_root):
    store.put("k/v.txt", b"v")
    assert store.get(local_root + "/k/v.txt") == b"v"
    assert os.path.isfile(local_root.removeprefix("file://") + "/k/v.txt")
    with pytest.raises(UnsafeKey):
        store.put("../escape.txt", b"x")


def test_local_temporaries_are_invisible(local_root):
    store.put(store.join(local_root, "d/x"), b"1")
    leftovers = [n for n in os.listdir(local_root.removeprefix("file://") + "/d") if n != "x"]
    assert leftovers == []
    open(local_root.removeprefix("file://") + "/d/.sf-tmp-x.123", "wb").close()  # a crashed writer's
    assert store.list_uris(store.join(local_root, "d") + "/") == [store.join(local_root, "d/x")]


# --- assemble --------------------------------------------------------------------------------------------


def test_assemble_small_parts(root):
    parts = [store.join(root, f"p{i}") for i in range(4)]
    for i, p in enumerate(parts):
        store.put(p, bytes([65 + i]) * (i * 10))
    dest = store.join(root, "out")
    store.assemble(parts, dest)
    assert store.get(dest) == b"".join(store.get(p) for p in parts)
    with pytest.raises(ObjectNotFound, match="p9"):
        store.assemble([parts[0], store.join(root, "p9")], store.join(root, "out2"))
    assert not store.exists(store.join(root, "out2"))


def _multipart_calls(monkeypatch) -> dict[str, int]:
    calls = {"upload_part_copy": 0, "upload_part": 0}
    client = s3mod.s3_client()
    for name in calls:
        real = getattr(client, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(client, name, counted)
    return calls


@pytest.mark.slow
def test_assemble_on_s3_copies_big_parts_server_side(s3_root, monkeypatch):
    sizes = [5 * MiB, 5 * MiB + 7, 1000]
    parts = [store.join(s3_root, f"big{i}") for i in range(len(sizes))]
    for i, (p, n) in enumerate(zip(parts, sizes, strict=True)):
        store.put(p, bytes([i + 1]) * n)
    calls = _multipart_calls(monkeypatch)
    dest = store.join(s3_root, "assembled")
    store.assemble(parts, dest)
    assert store.get(dest) == b"".join(bytes([i + 1]) * n for i, n in enumerate(sizes))
    assert calls == {"upload_part_copy": 3, "upload_part": 0}


@pytest.mark.slow
@pytest.mark.parametrize(
    "sizes",
    [
        [1000, 5 * MiB, 2000],  # a small part before a big one: coalesced through memory
        [3 * MiB, 3 * MiB, 1, 0, 2 * MiB],  # only small parts, summing past 5 MiB
        [6 * MiB, 100, 6 * MiB],  # small part between big ones
    ],
)
def test_assemble_on_s3_handles_small_parts(s3_root, sizes):
    parts = [store.join(s3_root, f"mix{i}") for i in range(len(sizes))]
    for i, (p, n) in enumerate(zip(parts, sizes, strict=True)):
        store.put(p, bytes([i + 1]) * n)
    dest = store.join(s3_root, "assembled")
    store.assemble(parts, dest)
    assert store.get(dest) == b"".join(bytes([i + 1]) * n for i, n in enumerate(sizes))


@pytest.mark.parametrize("how", ["EXDEV", "absent"])
def test_local_assemble_copies_by_reading_where_the_kernel_cannot(local_root, monkeypatch, how):
    if how == "absent":  # not Linux
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    else:  # e.g. parts and output on different filesystems with an older kernel

        def refuse(*a, **kw):
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", refuse)
    parts = [store.join(local_root, f"p{i}") for i in range(3)]
    for i, p in enumerate(parts):
        store.put(p, bytes([65 + i]) * (100_000 * i + 7))
    store.assemble(parts, store.join(local_root, "out"))
    assert store.get(store.join(local_root, "out")) == b"".join(store.get(p) for p in parts)


def _big_parts(root: str, n: int) -> list[str]:
    """``n`` parts of S3's smallest multipart size; part i is byte i + 1 repeated."""
    parts = [store.join(root, f"big{i}") for i in range(n)]
    for i, p in enumerate(parts):
        store.put(p, bytes([i + 1]) * (5 * MiB))
    return parts


def _before_each_copy(monkeypatch, hook) -> None:
    """Call ``hook(**request)`` before each UploadPartCopy the store's S3 client sends."""
    client = s3mod.s3_client()
    real = client.upload_part_copy

    def copy(*a, **kw):
        hook(**kw)
        return real(*a, **kw)

    monkeypatch.setattr(client, "upload_part_copy", copy)


@pytest.mark.slow
def test_assemble_on_s3_copies_parts_at_once(s3_root, monkeypatch):
    parts = _big_parts(s3_root, 2)
    both = threading.Barrier(2, timeout=20)  # broken (the test fails) unless the two copies overlap
    _before_each_copy(monkeypatch, lambda **kw: both.wait())
    store.assemble(parts, store.join(s3_root, "out"))
    assert store.get(store.join(s3_root, "out")) == bytes([1]) * (5 * MiB) + bytes([2]) * (5 * MiB)


@pytest.mark.slow
def test_assemble_on_s3_aborts_when_a_copy_fails(s3_root, monkeypatch):
    parts = _big_parts(s3_root, 3)

    def fail_part_2(**kw):
        if kw["PartNumber"] == 2:
            raise botocore.exceptions.ClientError({"Error": {"Code": "InternalError"}}, "UploadPartCopy")

    _before_each_copy(monkeypatch, fail_part_2)
    with pytest.raises(botocore.exceptions.ClientError):
        store.assemble(parts, store.join(s3_root, "out"))
    assert not store.exists(store.join(s3_root, "out"))
    client = s3mod.s3_client()
    bucket, _ = s3mod.split_s3(s3_root + "/x")
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_assemble_refuses_mixed_schemes(local_root):
    with pytest.raises(StoreError, match="all"):
        store.assemble(["s3://bkt/a"], store.join(local_root, "x"))


# --- S3 specifics ----------------------------------------------------------------------------------------


def test_s3_client_is_cached_per_process_and_endpoint(aws_env, monkeypatch):
    a = s3mod.s3_client()
    assert s3mod.s3_client() is a
    assert s3mod.s3_client(retries=False) is not a
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    b = s3mod.s3_client()
    assert b is not a and b.meta.endpoint_url == "http://127.0.0.1:9"
    assert a.meta.config.max_pool_connections >= 64


@pytest.mark.slow
def test_s3_errors_are_translated(s3_root):
    with pytest.raises(ObjectNotFound, match="bucket"):
        store.get("s3://no-such-bucket/x")
    from botocore.exceptions import ClientError

    from shardfold.functions.store.retry import TransientError

    def err(code: str, status: int) -> ClientError:
        return ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
        )

    assert isinstance(s3mod.translate(err("SlowDown", 503), "s3://b/k", "GET"), TransientError)
    assert isinstance(s3mod.translate(err("InternalError", 500), "s3://b/k", "GET"), TransientError)
    assert isinstance(s3mod.translate(err("InvalidRange", 416), "s3://b/k", "GET"), InvalidRange)
    denied = s3mod.translate(err("AccessDenied", 403), "s3://b/k", "GET")
    assert isinstance(denied, StoreError) and "access denied" in str(denied)


def test_network_errors_are_transient_in_tasks_and_one_named_line_at_submit(aws_env, monkeypatch):
    import socket

    from shardfold.functions.errors import StoreUnreachable
    from shardfold.functions.store.retry import TransientError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    assert s3mod.s3_client().meta.config.retries["total_max_attempts"] == 1
    for call in (
        lambda: store.exists("s3://sf-bucket/k"),
        lambda: store.list_uris("s3://sf-bucket/p/"),
        lambda: store.delete("s3://sf-bucket/k"),
    ):
        with pytest.raises(TransientError):  # a task retries it (its class name is in the retry policy)
            call()
    with pytest.raises(StoreUnreachable) as info, store.endpoint_errors():
        store.size("s3://sf-bucket/k")
    assert str(info.value).startswith(
        f"cannot reach the S3 endpoint http://127.0.0.1:{port} (AWS_ENDPOINT_URL_S3)"
    )
    assert "\n" not in str(info.value) and str(info.value).endswith("an S3 service is running there")
    # an error with an HTTP status (throttling) is not "unreachable": it stays as it was
    with pytest.raises(TransientError), store.endpoint_errors():
        raise TransientError("GET s3://sf-bucket/k: SlowDown", 503)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    assert s3mod.endpoint() == ("https://s3.eu-west-1.amazonaws.com", "AWS's endpoint for AWS_REGION")
    assert "AWS_REGION" in str(s3mod.unreachable(TransientError("HEAD s3://sf-bucket/k: refused")))


def test_writer_commits_whole_or_not_at_all(root, monkeypatch):
    dest = store.join(root, "streamed/obj")
    if store.is_s3(root):
        monkeypatch.setattr(s3mod, "WRITE_PART", 5 * MiB)  # S3's smallest part: three parts and a tail
    data = bytes(range(256)) * (64 * 1024 + 3)  # 16 MiB + 768 bytes, written in odd-sized pieces
    with store.writer(dest) as f:
        for i in range(0, len(data), 1_000_003):
            f.write(data[i : i + 1_000_003])
        assert not store.exists(dest)  # nothing is visible before the block ends
    assert store.get(dest) == data
    with pytest.raises(RuntimeError, match="boom"), store.writer(store.join(root, "streamed/broken")) as f:
        f.write(data)
        raise RuntimeError("boom")
    assert not store.exists(store.join(root, "streamed/broken"))
    assert store.list_uris(store.join(root, "streamed")) == [dest]
    assert _files_under(root, "streamed") in ([], ["obj"])  # no temporaries left behind
    if store.is_s3(root):
        assert not boto3.client("s3").list_multipart_uploads(Bucket="sf-test").get("Uploads")
    with store.writer(store.join(root, "streamed/small")) as f:
        f.write(b"tiny")
    assert store.get(store.join(root, "streamed/small")) == b"tiny"


def test_spooled_writer_sends_one_object_whole_or_not_at_all(root, monkeypatch):
    puts: list[str] = []
    if store.is_s3(root):
        real = s3mod.put_file

        def counted(uri, fileobj):
            puts.append(uri)
            return real(uri, fileobj)

        monkeypatch.setattr(s3mod, "put_file", counted)
    dest = store.join(root, "spooled/part")
    data = bytes(range(256)) * 20_000  # past the spool's memory: rolls over to a temporary file
    with store.spooled_writer(dest, spool_bytes=1 << 16) as f:
        for i in range(0, len(data), 70_001):
            f.write(np.frombuffer(data[i : i + 70_001], np.uint8))  # buffers, as the aggregate writes
        assert not store.exists(dest)
    assert store.get(dest) == data
    assert puts == ([dest] if store.is_s3(root) else [])  # S3: one PUT
    with pytest.raises(RuntimeError, match="boom"):
        with store.spooled_writer(store.join(root, "spooled/broken"), spool_bytes=1 << 16) as f:
            f.write(data)
            raise RuntimeError("boom")
    assert store.list_uris(store.join(root, "spooled")) == [dest]
    assert _files_under(root, "spooled") in ([], ["part"])  # no temporaries left behind


def _files_under(root: str, prefix: str) -> list[str]:
    """Every file under ``prefix`` on the local store, temporaries too (listings hide those); [] on S3."""
    if store.is_s3(root):
        return []
    top = local_path(store.join(root, prefix))
    return sorted(str(Path(d, f).relative_to(top)) for d, _, fs in os.walk(top) for f in fs)


def test_local_delete_prefix_removes_what_killed_writers_left(local_root):
    store.put(store.join(local_root, "jobs/j/parts/1.bin"), b"done")
    left = local_path(store.join(local_root, "jobs/j/parts")) / f"{local.TMP_PREFIX}0.bin.dead"
    left.write_bytes(b"half a part")  # a task killed while writing its part in place
    assert store.delete_prefix(store.join(local_root, "jobs/j/")) == 1  # one object
    assert not local_path(store.join(local_root, "jobs/j")).exists()  # temporary and directories gone


@pytest.mark.slow
def test_assemble_on_s3_sends_no_copy_after_its_abort(s3_root, monkeypatch):
    monkeypatch.setattr(s3mod, "COPY_CONCURRENCY", 1)  # copies queue behind the failing one
    parts = _big_parts(s3_root, 4)
    aborted: list[bool] = []
    late: list[int] = []
    client = s3mod.s3_client()
    real_abort = client.abort_multipart_upload

    def abort(**kw):
        aborted.append(True)
        return real_abort(**kw)

    def copy(**kw):
        if aborted:
            late.append(kw["PartNumber"])
        if kw["PartNumber"] == 2:
            raise botocore.exceptions.ClientError({"Error": {"Code": "InternalError"}}, "UploadPartCopy")

    monkeypatch.setattr(client, "abort_multipart_upload", abort)
    _before_each_copy(monkeypatch, copy)
    with pytest.raises(botocore.exceptions.ClientError):
        store.assemble(parts, store.join(s3_root, "out"))
    assert aborted and late == []


def test_spooled_writer_if_absent_writes_once(root):
    dest = store.join(root, "once/part")
    with store.spooled_writer(dest, spool_bytes=1 << 10, if_absent=True) as f:
        f.write(b"first" * 1000)
    with pytest.raises(ObjectExists), store.spooled_writer(dest, spool_bytes=1 << 10, if_absent=True) as f:
        f.write(b"second" * 1000)
    assert store.get(dest) == b"first" * 1000  # the object stands
    assert _files_under(root, "once") in ([], ["part"])  # no temporaries left behind
