"""The adversarial suite's kit: one client per backend (the local store and executor; the moto stack,
i.e. the compiled ASL on moto's Step Functions interpreter with the S3 store), seeded with the example data,
and a snapshot of every committed object, so a probe can prove it changed or lost nothing."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


# --- what a probe expects, and how an outcome is judged -----------------------------------------------------


@dataclass
class Refused:
    """Refused at submit, naming ``field``, with a message matching ``pattern``."""

    field: str
    pattern: str


@dataclass
class Fails:
    """Accepted (submit cannot see inside a manifest or a file); the job ends FAILED, matching ``pattern``."""

    pattern: str


@dataclass
class Clear:
    """Either of the two."""

    pattern: str


@dataclass
class Safe:
    """The job succeeds and ``check(env, result)`` holds."""

    check: Callable[[Env, dict[str, Any]], None]


@dataclass
class Probe:
    name: str
    spec: Callable[[Env], dict[str, Any]]
    expect: Refused | Fails | Clear | Safe
    backends: tuple[str, ...] = ("local", "moto")
    notes: list[str] = field(default_factory=list)
    as_text: Refused | None = None  # where the spec as JSON text (the trigger's) is refused otherwise
    escape: bool = False  # accepting it would read or write outside what the job may touch


# The categories of the campaign's table, in its order. The last four must stay empty.
OUTCOMES = ("clear error", "safe result", "unclear", "wrongly accepted", "data lost", "crash", "escape")


def classify(
    probe: Probe,
    expect: Refused | Fails | Clear | Safe,
    state: str,
    message: str,
    fields: list[str | None],
    changed: list[str],
    check: Callable[[], None] | None = None,
) -> str:
    """One outcome (:data:`OUTCOMES`) of a probe on one path: ``state`` is ``refused``, ``crash`` (an
    exception that is no user error, a traceback, no answer) or the job's final state; ``fields`` the fields
    a refusal named; ``changed`` the committed objects that changed or went; ``check`` the Safe check."""
    if changed:
        return "data lost"
    if state == "crash" or "Traceback" in message:
        return "crash"
    if isinstance(expect, Safe):
        if state != "SUCCEEDED":
            return "unclear"
        try:
            if check is not None:
                check()
        except AssertionError:
            return "escape" if probe.escape else "wrongly accepted"
        return "safe result"
    if state == "SUCCEEDED":
        return "escape" if probe.escape else "wrongly accepted"
    if not re.search(expect.pattern, message):
        return "unclear"
    if isinstance(expect, Refused):
        # "<spec>" is the document as a whole: any refusal of it names it
        whole = expect.field == "<spec>"
        named = whole or any(expect.field == f or expect.field in (f or "") for f in fields)
        return "clear error" if state == "refused" and named else "unclear"
    if isinstance(expect, Fails) and state != "FAILED":
        return "unclear"
    return "clear error"


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
