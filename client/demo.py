"""``shardfold demo``: every job kind end to end on generated data, with its output verified.

Library code: it returns :class:`DemoResult` rows and never prints; the CLI draws the table.
"""

from __future__ import annotations

import io
import json
import random
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aws_lambda_powertools import Logger

from functions import store
from functions.errors import ShardfoldError

logger = Logger(service="shardfold")

DEMO_PREFIX = "demo"


@dataclass
class DemoResult:
    kind: str
    job_id: str
    state: str
    items: int
    parts: int
    bytes: int
    errors: int
    seconds: float
    verified: bool
    checks: list[str] = field(default_factory=list)


class DemoFailed(ShardfoldError):
    """The demo's job ran but its output did not match what was generated."""


def _tar_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def seed_getbatch(client: Any, n: int, seed: int = 0) -> tuple[dict, list[bytes | None]]:
    """Write ``n`` objects (plus a TAR shard) under ``demo/getbatch/`` and build a request over them.

    The request mixes whole objects, a byte range, two TAR members and one missing object, with
    ``continue_on_error`` so the missing one becomes a ``__404__`` placeholder. Returns the spec and the
    bytes each entry must hold (None for the placeholder).
    """
    rng = random.Random(seed)
    prefix = f"{DEMO_PREFIX}/getbatch"
    items: list[dict] = []
    expected: list[bytes | None] = []
    for i in range(n):
        data = rng.randbytes(rng.randint(64, 4096))
        key = f"{prefix}/obj-{i:05d}.bin"
        store.put(client.uri(key), data)
        items.append({"uri": key})
        expected.append(data)
    members = {f"sample-{k}.txt": f"member {k} of the demo shard\n".encode() * (k + 1) for k in range(4)}
    store.put(client.uri(f"{prefix}/shard-0000.tar"), _tar_bytes(members))
    # a byte range, two TAR members (one ranged), and one object that does not exist
    extras: list[tuple[int, dict, bytes | None]] = [
        (n // 3, {"uri": items[0]["uri"], "start": 10, "length": 32}, expected[0][10:42]),
        (n // 2, {"uri": f"{prefix}/shard-0000.tar", "archpath": "sample-2.txt"}, members["sample-2.txt"]),
        (
            2 * n // 3,
            {"uri": f"{prefix}/shard-0000.tar", "archpath": "sample-3.txt", "start": 7, "length": 9},
            members["sample-3.txt"][7:16],
        ),
        (n - n // 4, {"uri": f"{prefix}/missing-object.bin"}, None),
    ]
    for pos, item, data in sorted(extras, key=lambda e: e[0], reverse=True):
        items.insert(pos, item)
        expected.insert(pos, data)
    spec = {
        "kind": "getbatch",
        "items": items,
        "continue_on_error": True,
        "items_per_part": max(1, len(items) // 4 + 1),  # a few parts, so the Map really fans out
    }
    return spec, expected


def verify_getbatch(result: dict, expected: list[bytes | None]) -> list[str]:
    """Check the archive entry by entry against what was generated; returns the checks passed."""
    archive = store.get(result["archive"])
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
        members = tar.getmembers()
        if len(members) != len(expected):
            raise DemoFailed(f"archive has {len(members)} entries, expected {len(expected)}")
        for i, (member, want) in enumerate(zip(members, expected, strict=True)):
            got = tar.extractfile(member).read() if member.isfile() else b""
            if want is None:
                if not member.name.startswith("__404__/") or got:
                    raise DemoFailed(f"entry {i} ({member.name}) should be a zero-byte __404__ placeholder")
            elif got != want:
                raise DemoFailed(f"entry {i} ({member.name}) does not hold the bytes that were written")
    checks = [f"{len(expected)} entries in request order, bytes identical"]
    rows = [json.loads(line) for line in store.get(result["status"]).decode().splitlines() if line.strip()]
    failed = [r for r in rows if r.get("error")]
    if len(rows) != len(expected) or len(failed) != 1:
        raise DemoFailed(f"status manifest has {len(rows)} rows and {len(failed)} errors; expected 1 error")
    checks.append("missing object reported once, as a __404__ placeholder")
    return checks


def demo_getbatch(client: Any, items: int = 300, wait: Callable[[Any], Any] | None = None) -> DemoResult:
    """Seed, run and verify one getbatch job on ``client``'s backend."""
    spec, expected = seed_getbatch(client, items)
    t0 = time.perf_counter()
    job = client.submit(spec)
    status = wait(job) if wait else job.wait(progress=False)
    seconds = time.perf_counter() - t0
    if status.state != "SUCCEEDED":
        raise DemoFailed(f"demo job {job.job_id} ended {status.state}: {status.error}")
    result = job.result()
    checks = verify_getbatch(result, expected)
    return DemoResult(
        kind="getbatch",
        job_id=job.job_id,
        state=status.state,
        items=result.get("items", len(expected)),
        parts=result.get("parts", 0),
        bytes=result.get("bytes", 0),
        errors=result.get("errors", 0),
        seconds=seconds,
        verified=True,
        checks=checks,
    )


# Every job kind's demo; a new kind registers here.
DEMOS: dict[str, Callable[..., DemoResult]] = {"getbatch": demo_getbatch}
