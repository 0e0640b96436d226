"""FedAvg commit: the time spent copying the shards' parts into the output (``store.assemble``).

A fedavg round's aggregate tasks each write one part; commit concatenates them into the output object. This
measures that copy, the commit's only cost that grows with the model, on both stores, against the way it
was done before:

  local  parts of the given sizes on this machine's disk, flushed first (``sync``), then assembled:
         ``copy_file_range`` (the kernel copies; Shardfold now) against a read/write loop of 8 MiB blocks
         through Python (Shardfold before; what ``shutil.copyfileobj`` does). Best of ``--repeats``.
  s3     the same parts on the benchmark S3 server (``bench/s3server.py``: SeaweedFS on loopback, every
         answer delayed by an injected time to first byte), assembled with ``UploadPartCopy``: one copy
         request at a time (before) against :data:`functions.store.s3.COPY_CONCURRENCY` at once (now).
         SeaweedFS copies on this machine's disk, so this measures the request pattern (parts x latency
         against about one latency) plus a local copy, not AWS's copy rate.

Prints a table, writes ``bench/results/fedavg_commit.json`` (``--out``). Nothing asserts on time.

    .venv/bin/python bench/fedavg_commit.py                  # 256 MiB in 4 parts and 1 GiB in 16 parts
    .venv/bin/python bench/fedavg_commit.py --quick          # 64 MiB in 4 parts
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import load_end_line, table, watched  # noqa: E402

MiB = 1 << 20
HERE = Path(__file__).resolve().parent


def read_write_assemble(paths: list[Path], dest: Path) -> None:
    """The peer: what ``local.assemble`` did before, 8 MiB blocks read and written through Python."""
    from shardfold.functions.store import local

    with local.writer(dest) as out:
        for path in paths:
            with open(path, "rb") as f:
                shutil.copyfileobj(f, out, 8 * MiB)


def write_parts(directory: Path, total: int, parts: int) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    size = total // parts
    block = os.urandom(MiB)
    paths = []
    for k in range(parts):
        p = directory / f"part-{k:04d}.bin"
        with open(p, "wb") as f:
            for _ in range(size // MiB):
                f.write(block)
        paths.append(p)
    os.sync()
    return paths


def best_of(repeats: int, fn: Any, fresh: Path | None = None) -> float:
    """Best time of ``fn``; ``fresh``: a file removed before each (renaming over an existing file makes
    ext4 start writing the new one out at once, which a commit, whose output is new, does not pay)."""
    best = float("inf")
    for _ in range(repeats):
        if fresh is not None:
            fresh.unlink(missing_ok=True)
        os.sync()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def local_case(work: Path, total: int, parts: int, repeats: int) -> dict:
    from shardfold.functions.store import local

    paths = write_parts(work / f"local-{total}-{parts}", total, parts)
    dest = work / "out.bin"
    uris = [p.as_uri() for p in paths]
    new = best_of(repeats, lambda: local.assemble(paths, uris, dest), dest)
    with open(dest, "rb") as f, open(paths[0], "rb") as g:  # the output starts with part 0
        assert f.read(MiB) == g.read(MiB)
    old = best_of(repeats, lambda: read_write_assemble(paths, dest), dest)
    dest.unlink()
    for p in paths:
        p.unlink()
    return {"store": "local", "bytes": total, "parts": parts, "before_s": old, "now_s": new}


def s3_case(total: int, parts: int, repeats: int, concurrency: int) -> dict:
    from shardfold.functions import store
    from shardfold.functions.store import s3

    bucket = "sf-commit-bench"
    block = os.urandom(MiB)
    uris = [f"s3://{bucket}/parts/{k:04d}.bin" for k in range(parts)]
    for u in uris:
        store.put(u, block * (total // parts // MiB))
    dest = f"s3://{bucket}/out.bin"

    def with_concurrency(n: int) -> float:
        old = s3.COPY_CONCURRENCY
        s3.COPY_CONCURRENCY = n
        try:
            return best_of(repeats, lambda: store.assemble(uris, dest))
        finally:
            s3.COPY_CONCURRENCY = old

    before = with_concurrency(1)
    now = with_concurrency(concurrency)
    assert store.size(dest) == total
    store.delete_prefix(f"s3://{bucket}/")
    return {"store": "s3 (bench server)", "bytes": total, "parts": parts, "before_s": before, "now_s": now}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="256:4,1024:16", help="output MiB:parts, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ttfb-ms", type=float, default=16.0, help="the S3 server's time to first byte (16)")
    ap.add_argument("--quick", action="store_true", help="64 MiB in 4 parts, 2 repeats")
    ap.add_argument("--out", default=str(HERE / "results" / "fedavg_commit.json"))
    args = ap.parse_args()
    if args.quick:
        args.cases, args.repeats = "64:4", 2
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]

    from getbatch import set_client_env
    from s3server import ServerHandle

    from shardfold.functions.store import s3

    rows: list[dict] = []
    report: dict[str, Any] = {}
    tmp = tempfile.TemporaryDirectory(prefix="shardfold-bench-commit-")
    with tmp, watched("fedavg_commit", report) as w:
        work = Path(tmp.name)
        for mib, parts in cases:
            rows.append(local_case(work, mib * MiB, parts, args.repeats))
        with ServerHandle(ttfb_median_s=args.ttfb_ms / 1000) as server:
            set_client_env(server.endpoint, str(work / "home"))
            server.make_bucket("sf-commit-bench")
            for mib, parts in cases:
                rows.append(s3_case(mib * MiB, parts, args.repeats, s3.COPY_CONCURRENCY))

    print(f"\nCommit: the parts copied into the output, best of {args.repeats} (S3 TTFB {args.ttfb_ms:g} ms)")
    lines = []
    for r in rows:
        before, now = r["before_s"], r["now_s"]
        how = (
            ("read/write 8 MiB", "copy_file_range")
            if r["store"] == "local"
            else ("1 UploadPartCopy at a time", f"{s3.COPY_CONCURRENCY} at once")
        )
        lines.append(
            [
                r["store"],
                f"{r['bytes'] / MiB:,.0f} MiB / {r['parts']}",
                f"{how[0]}: {before:.3f} s",
                f"{how[1]}: {now:.3f} s",
                f"{r['bytes'] / now / 1e6:,.0f}",
                f"{before / now:.1f}x",
            ]
        )
    print(table(["store", "output / parts", "before", "now", "now MB/s", "speed-up"], lines, right={4, 5}))
    print(load_end_line(w))
    out = {"args": vars(args), "rows": rows, **report}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
