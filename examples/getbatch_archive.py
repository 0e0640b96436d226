"""Fetch many objects as one ordered TAR with a `getbatch` job, then the same reads in-process.

Run from anywhere: python examples/getbatch_archive.py
Uses events/getbatch.json and the files it names in events/data/ (whole files, a byte range, TAR members).
"""

from __future__ import annotations

import json
import os
import tarfile
import tempfile
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "events" / "data"

# A throwaway store unless you chose one: jobs write their spec, journal and output under the store root
# (default ./.shardfold in the working directory). Set before the Client is made: it reads it once.
if not os.environ.get("SHARDFOLD_HOME"):
    os.environ["SHARDFOLD_HOME"] = tempfile.mkdtemp(prefix="shardfold-example-")

from shardfold.client import Client  # noqa: E402  (after SHARDFOLD_HOME is settled)


def local_path(uri: str) -> Path:
    """The filesystem path of a local store's file:// URI (on AWS the archive would be s3://)."""
    return Path(url2pathname(urlparse(uri).path))


def main() -> None:
    with Client() as client:
        print(f"store: {client.store_root}")

        # A Path (not a dict) so that the spec's "./data/..." URIs resolve relative to the spec file.
        job = client.submit(REPO / "events" / "getbatch.json")
        status = job.wait(progress=False)
        print(f"job {job.job_id}: {status.state}")
        result = job.result()
        print(f"{result['items']} items, {result['errors']} errors, {result['bytes']} bytes")
        print(f"archive: {result['archive']}")

        # The archive holds the items in request order (duplicates included), named as the spec says.
        with tarfile.open(local_path(result["archive"])) as tar:
            for member in tar.getmembers():
                print(f"  tar member {member.name:45} {member.size:5d} bytes")
        # status.jsonl: one row per item, the place to look for errors with continue_on_error.
        first = local_path(result["status"]).read_text().splitlines()[0]
        print(f"status.jsonl row 0: {json.loads(first)}")

        # The same engine without a job: entries come back in request order, as each (and all before it)
        # arrives, so a consumer can start on item 0 while later reads are still in flight.
        items = [
            {"uri": (DATA / "hello.txt").as_uri(), "name": "hello.txt"},
            {"uri": (DATA / "scores.csv").as_uri(), "start": 14, "length": 30, "name": "scores-rows.csv"},
            {
                "uri": (DATA / "shard-000.tar").as_uri(),
                "archpath": "sample-001.txt",
                "name": "sample-001.txt",
            },
            {"uri": (DATA / "missing.txt").as_uri(), "name": "missing.txt"},
        ]
        # continue_on_error: the missing file becomes an entry with .error set instead of failing the batch.
        for entry in client.get_batch(items, continue_on_error=True, stream=True):
            if entry.error:
                print(f"  stream {entry.index}: {entry.name} -> error: {entry.error}")
            else:
                first_line = entry.data.decode().splitlines()[0]
                print(f"  stream {entry.index}: {entry.name} ({entry.size} bytes) {first_line!r}")


if __name__ == "__main__":
    main()
