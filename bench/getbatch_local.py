"""GetBatch on local files: the getbatch job against GNU tar and a plain Python read loop, in one run.

N files of SIZE bytes in a fresh temporary folder (the page cache warm after the first round). Each round,
in alternating order, times:

  tar   GNU tar archiving the same files into one TAR (``tar cf OUT -C DIR NAMES...``): the limit a user
        compares with (C, one process, the files' data and 512-byte headers written sequentially)
  loop  ``open``/``read`` of every file in a Python loop (no archive): what the interpreter costs per file
  job   the ``getbatch`` job on the local backend, from submit to SUCCEEDED, in a warm SDK process (one
        small job first): validation, plan, gather of every part, the archive committed

It prints a table (median of the rounds, with min and max) and the job's ratio to tar, and writes JSON to
``bench/results/getbatch_local.json`` with every round and the load before and after
(``benchutil.LoadWatch``). It never asserts on timing: the target (job within 3x of tar) is a PASS/FAIL
line.

    .venv/bin/python bench/getbatch_local.py                        # 50,000 x 1 KiB, 3 rounds
    .venv/bin/python bench/getbatch_local.py --files 10000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchutil import LoadWatch, load_end_line, load_start_line, table  # noqa: E402

TARGET_RATIO = 3.0


def make_files(folder: Path, n: int, size: int) -> list[str]:
    blob = os.urandom(size)
    names = [f"f{i:06d}.bin" for i in range(n)]
    for name in names:
        (folder / name).write_bytes(blob)
    return names


def time_tar(folder: Path, names: list[str], out: Path) -> float:
    started = time.perf_counter()
    subprocess.run(["tar", "cf", str(out), "-C", str(folder), *names], check=True)
    return time.perf_counter() - started


def time_loop(folder: Path, names: list[str]) -> float:
    started = time.perf_counter()
    total = 0
    for name in names:
        with open(folder / name, "rb") as f:
            total += len(f.read())
    return time.perf_counter() - started


def time_job(client, items: list[dict]) -> tuple[float, str]:
    started = time.perf_counter()
    job = client.submit({"kind": "getbatch", "items": items})
    status = job.wait(progress=False)
    return time.perf_counter() - started, status.state


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=50_000)
    ap.add_argument("--size", type=int, default=1024, help="bytes per file (1024)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "getbatch_local.json"))
    args = ap.parse_args(argv)

    watch = LoadWatch("getbatch_local")
    print(load_start_line(watch))
    with tempfile.TemporaryDirectory(prefix="sf-gbl-") as tmp:
        root = Path(tmp)
        folder = root / "files"
        folder.mkdir()
        names = make_files(folder, args.files, args.size)
        os.environ["SHARDFOLD_HOME"] = str(root / "store")
        from shardfold.client import Client

        items = [{"uri": (folder / name).as_uri()} for name in names]
        runs: dict[str, list[float]] = {"tar": [], "loop": [], "job": []}
        with Client() as client:
            time_job(client, items[:100])  # warm: imports, the pools, the first job's bookkeeping
            for r in range(args.rounds):
                order = ["tar", "loop", "job"] if r % 2 == 0 else ["job", "loop", "tar"]
                for what in order:
                    if what == "tar":
                        runs["tar"].append(time_tar(folder, names, root / "out.tar"))
                    elif what == "loop":
                        runs["loop"].append(time_loop(folder, names))
                    else:
                        seconds, state = time_job(client, items)
                        if state != "SUCCEEDED":
                            raise SystemExit(f"the job ended {state}")
                        runs["job"].append(seconds)
    load = watch.stop()
    tar = statistics.median(runs["tar"])
    rows = []
    for what, label in (("tar", "GNU tar"), ("loop", "Python open/read loop"), ("job", "getbatch job")):
        med = statistics.median(runs[what])
        rows.append(
            [
                label,
                f"{med:.3f}",
                f"{min(runs[what]):.3f}",
                f"{max(runs[what]):.3f}",
                f"{args.files / med:,.0f}",
                f"{med / tar:.1f}x",
            ]
        )
    print(f"\n{args.files:,} files of {args.size:,} bytes, {args.rounds} rounds (median, min, max)")
    print(table(["what", "s", "min", "max", "files/s", "vs tar"], rows, right={1, 2, 3, 4, 5}))
    ratio = statistics.median(runs["job"]) / tar
    verdict = "PASS" if ratio <= TARGET_RATIO else "FAIL"
    line = f"TARGET job within {TARGET_RATIO:g}x of GNU tar: {ratio:.1f}x: {verdict}"
    print(line)
    print(load_end_line(watch))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "files": args.files,
        "size": args.size,
        "rounds": runs,
        "ratio_job_to_tar": ratio,
        "target": {"ratio": TARGET_RATIO, "pass": ratio <= TARGET_RATIO, "line": line},
        "load": load,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
