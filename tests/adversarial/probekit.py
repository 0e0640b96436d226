"""The adversarial suite's kit: one client per backend (the local store and executor; the moto stack,
i.e. the compiled ASL on moto's Step Functions interpreter with the S3 store), seeded with the example data,
and a snapshot of every committed object, so a probe can prove it changed or lost nothing."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from shardfold.client import Client
from shardfold.functions import store
from shardfold.functions.store.uri import join

EXAMPLES = Path(__file__).resolve().parents[2] / "events" / "data"


@dataclass
class Env:
    backend: str
    client: Client
    root: str  # the store root: s3://bucket on moto, file:///... locally
    home: Path  # a local folder outside the store, for files a probe plants

    def uri(self, key: str) -> str:
        return join(self.root, key)

    def put(self, key: str, data: bytes) -> str:
        uri = self.uri(key)
        store.put(uri, data)
        return uri


def seed(env: Env) -> None:
    """The example inputs of every kind under ``data/``, a results/ object and a dpquery ledger entry."""
    for path in sorted(EXAMPLES.rglob("*")):
        if path.is_file():
            env.put(f"data/{path.relative_to(EXAMPLES).as_posix()}", path.read_bytes())
    env.put("results/kept.bin", b"a committed result another job must never overwrite\n")
    env.put("ledger/example-people/entries/00000001.json", b'{"rho": 0.5, "job": "earlier"}')


def snapshot(root: str) -> dict[str, str]:
    """A fingerprint of every object in the store, ``{uri: ...}``: on S3 its ETag (the MD5 of what a single
    PUT wrote), size and last-modified time, from the listing (a GET per object made every probe slower than
    the last, as the store filled); locally the sha256 of its bytes."""
    if root.startswith("s3://"):
        import boto3

        bucket, _, prefix = root[len("s3://") :].partition("/")
        pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return {
            f"s3://{bucket}/{o['Key']}": f"{o['ETag']}:{o['Size']}:{o['LastModified'].isoformat()}"
            for page in pages
            for o in page.get("Contents", [])
        }
    return {u: hashlib.sha256(store.get(u)).hexdigest() for u in store.list_uris(root + "/")}
