"""Inputs pinned at plan: a read given a pin refuses an object that changed since (S3 ``If-Match`` on the
GET, ``fstat`` of the opened file locally), in one request, with :class:`InputChanged` naming the object.

Store level here (local, S3 through boto3 under ``mock_aws``, S3 through awscrt against a moto server);
the kinds' jobs (fedavg, getbatch, inference) further down: plan, change an input, the job fails naming it.
"""

from __future__ import annotations

import os

import boto3
import pytest

from shardfold.functions import store
from shardfold.functions.errors import BatchItemError, InputChanged
from shardfold.functions.store.pinning import Pin
from shardfold.functions.store.uri import join, local_path


@pytest.fixture
def crt_root(moto_server, aws_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_server)
    monkeypatch.delenv("SHARDFOLD_S3_TRANSPORT", raising=False)  # the default: awscrt
    boto3.client("s3", endpoint_url=moto_server).create_bucket(Bucket="sf-pin-crt")
    return "s3://sf-pin-crt"


@pytest.fixture(params=["local", "s3", pytest.param("crt", marks=pytest.mark.slow)])
def root(request):
    return request.getfixturevalue(f"{request.param}_root")


def replace(uri: str, data: bytes) -> None:
    """Put new content at ``uri`` the way a user would: a new object (locally: a new file renamed over it)."""
    store.put(uri, data)


def test_a_pin_records_size_and_etag_or_mtime_and_inode(root):
    uri = join(root, "in", "a.bin")
    store.put(uri, b"x" * 10)
    p = store.pin(uri)
    assert p.size == 10
    if root.startswith("s3://"):
        assert p.etag and p.mtime_ns is None
    else:
        st = os.stat(local_path(uri))
        assert (p.mtime_ns, p.inode, p.etag) == (st.st_mtime_ns, st.st_ino, None)
    assert Pin.from_doc(p.to_doc()) == p
    assert store.pins([uri, join(root, "in", "nope")]) == {uri: p, join(root, "in", "nope"): None}


def test_unchanged_input_reads_with_its_pin(root):
    uri = join(root, "in", "a.bin")
    store.put(uri, bytes(range(100)))
    p = store.pin(uri)
    assert store.get(uri, pin=p) == bytes(range(100))
    assert store.get(uri, 10, 5, pin=p) == bytes(range(10, 15))
    items = [{"uri": uri, "start": 0, "length": 4}, {"uri": uri, "start": 96}]
    assert [e.data for e in store.get_batch(items, pins={uri: p})] == [bytes(range(4)), bytes(range(96, 100))]
    store.verify(uri, p)


def test_input_replaced_with_same_size_content_is_refused(root):
    uri = join(root, "in", "a.bin")
    store.put(uri, b"a" * 64)
    p = store.pin(uri)
    replace(uri, b"b" * 64)  # same size: only the ETag, or the inode and mtime, tell
    with pytest.raises(InputChanged, match=f"{uri} changed since the job was planned") as info:
        store.get(uri, 8, 8, pin=p)
    assert info.value.uri == uri
    with pytest.raises(BatchItemError) as batch:
        list(store.get_batch([{"uri": uri, "start": 0, "length": 8}], pins={uri: p}))
    assert isinstance(batch.value.__cause__, InputChanged) and uri in str(batch.value)
    # continue_on_error does not soften it: a changed input is never a placeholder
    with pytest.raises(BatchItemError, match="changed since the job was planned"):
        list(store.get_batch([uri], pins={uri: p}, continue_on_error=True))
    with pytest.raises(InputChanged, match=uri):
        store.verify(uri, p)
    assert store.get(uri, 0, 2) == b"bb"  # without a pin: the new object, as before


def test_local_file_rewritten_in_place_is_refused(local_root):
    uri = join(local_root, "in", "a.bin")
    store.put(uri, b"a" * 64)
    p = store.pin(uri)
    path = local_path(uri)
    with open(path, "r+b") as f:  # same inode, same size, new bytes
        f.write(b"z" * 64)
    os.utime(path, ns=(p.mtime_ns + 1_000_000, p.mtime_ns + 1_000_000))  # coarse clocks: force a new mtime
    assert os.stat(path).st_ino == p.inode
    with pytest.raises(InputChanged, match="mtime_ns"):
        store.get(uri, 0, 8, pin=p)


def test_pinned_tar_member_read_refuses_a_changed_shard(local_root):
    import io
    import tarfile

    def shard(body: bytes) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            info = tarfile.TarInfo("m.txt")
            info.size = len(body)
            tf.addfile(info, io.BytesIO(body))
        return buf.getvalue()

    uri = join(local_root, "in", "s.tar")
    store.put(uri, shard(b"one"))
    p = store.pin(uri)
    item = {"uri": uri, "archpath": "m.txt"}
    assert [e.data for e in store.get_batch([item], pins={uri: p})] == [b"one"]
    store.put(uri, shard(b"two"))
    with pytest.raises(BatchItemError, match="changed since the job was planned"):
        list(store.get_batch([item], pins={uri: p}))


def test_a_refused_head_on_crt_is_reported_by_uri_and_nothing_is_asked_twice(monkeypatch, aws_env):
    # the CRT client's HEADs answer per URI: a tolerant lookup reports the refused one and keeps the others'
    # pins, and the thread pool is asked only for what CRT did not look up (local files here)
    from shardfold.functions.errors import StoreError
    from shardfold.functions.store import crt

    monkeypatch.delenv("SHARDFOLD_S3_TRANSPORT", raising=False)  # the default: awscrt
    good, refused = "s3://bkt/a", "s3://bkt/denied"
    pin = Pin(size=3, etag='"e"')

    def head_pins(uris, errors, timeout_s=120.0):
        errors[refused] = StoreError(f"{refused}: AccessDenied")
        return {good: pin}

    pooled = []
    monkeypatch.setattr(crt, "head_pins", head_pins)
    monkeypatch.setattr(store, "_pin", lambda uri: pooled.append(uri) or None)
    failed: dict = {}
    found = store.pins([good, refused, "file:///no/such/file"], failed=failed)
    assert found == {good: pin, "file:///no/such/file": None} and list(failed) == [refused]
    assert pooled == ["file:///no/such/file"]
    with pytest.raises(StoreError, match="AccessDenied"):
        store.pins([good, refused])
