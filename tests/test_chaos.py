"""The kill -9 campaign: each kind's job run by ``shardfold run``, killed outright at points spread
over its run, then ``shardfold resume``d. The output must be byte-identical to an uninterrupted run's; a
dpquery release draws its noise once per measurement, so it is held to what must hold instead: every table
released, one reservation on the ledger for the job.

**Opt-in** (``SHARDFOLD_CHAOS=1``, or ``make test-chaos``; a few minutes): the kill points are fractions of
the uninterrupted run's own duration (``POINTS``), so a run is repeatable on a given machine, and land in
different steps on a faster or slower one. Each kill is checked to leave no process of the run behind.
``-s`` prints the table."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("SHARDFOLD_CHAOS") != "1", reason="opt-in: SHARDFOLD_CHAOS=1"),
]

REPO = Path(__file__).resolve().parent.parent
EVENTS = REPO / "events"
POINTS = (0.1, 0.25, 0.4, 0.55, 0.7, 0.85)  # fractions of the uninterrupted run's duration
WAIT_S = 600
ROWS: list[list[str]] = []


def _shardfold(home: Path, *args: str, timeout: float = WAIT_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "SHARDFOLD_HOME": str(home / "store")}
    cmd = [sys.executable, "-m", "shardfold.client.cli", *args]
    return subprocess.run(cmd, env=env, cwd=home, capture_output=True, text=True, timeout=timeout)


def _inputs(kind: str, home: Path) -> dict:
    """A spec of ``kind`` over inputs generated into ``home``'s store, large enough that a job takes a few
    seconds here (the demo's generators: deterministic)."""
    from shardfold.client import Client
    from shardfold.client.demo import (
        DEMO_MODEL,
        fedavg_updates,
        inference_corpus,
        people_csv,
        seed_getbatch,
        synthetic_people,
    )

    os.environ["SHARDFOLD_HOME"] = str(home / "store")
    with Client() as client:
        if kind == "getbatch":
            spec, _ = seed_getbatch(client, 3000)
            spec["items_per_part"] = 100  # 31 parts
            return spec
        if kind == "fedavg":
            model = {n: ((s[0] * 16, *s[1:]) if s else s, dt) for n, (s, dt) in DEMO_MODEL.items()}
            keys = []
            for i, (tensors, n) in enumerate(fedavg_updates(model, 8, seed=3)):
                keys.append(client.fedavg.save_update(tensors, f"chaos/fedavg/c{i}.safetensors", n))
            return {"kind": "fedavg", "clients": [{"uri": k} for k in keys], "shards": 16}
        if kind == "dpquery":
            columns = synthetic_people(200_000, seed=1)
            names = list(columns)
            client_store = client.uri("chaos/people.csv")
            from shardfold.functions import store

            store.put(client_store, people_csv(columns, names))
            spec = json.loads((EVENTS / "dpquery.json").read_text())
            spec["dataset"] = "chaos/people.csv"
            return spec
        rows = inference_corpus(600, seed=2, max_words=40)
        from shardfold.functions import store

        store.put(client.uri("chaos/corpus.jsonl"), "".join(json.dumps(r) + "\n" for r in rows).encode())
        return {"kind": "inference", "inputs": ["chaos/corpus.jsonl"], "field": "text", "id_field": "id",
                "shard_rows": 50}  # fmt: skip


def _spec(kind: str, home: Path, n: int, base: dict) -> Path:
    """The campaign's spec file for run ``n``: dpquery's under a fresh dataset id each run (its ledger is
    bound to the dataset's content: a copy per run)."""
    spec = dict(base)
    if kind == "dpquery":
        from shardfold.functions import store

        root = f"file://{home}/store"
        # n blank lines more: the same rows (blank lines are skipped), another file to the ledger
        store.put(f"{root}/chaos/people-{n}.csv", store.get(f"{root}/chaos/people.csv") + b"\n" * n)
        spec.update(dataset=f"chaos/people-{n}.csv", dataset_id=f"chaos-{n}")
    path = home / f"chaos-{kind}-{n}.json"
    path.write_text(json.dumps(spec))
    return path


def _digest(home: Path, result: dict, kind: str) -> str:
    """What must be identical across runs: the output's bytes (dpquery: the tables released, by name)."""
    from shardfold.functions import store

    os.environ["SHARDFOLD_HOME"] = str(home / "store")
    if kind == "dpquery":
        return json.dumps(sorted(",".join(t["attributes"]) for t in result["tables"]))
    uri = result.get("archive") or result["output"]
    return hashlib.sha256(store.get(uri)).hexdigest()


def _kill_at(home: Path, spec: Path, delay: float) -> tuple[str, bool]:
    """``shardfold run`` killed with SIGKILL ``delay`` seconds in; the job id, and whether the job was still
    running then. Every process of the run must end with it."""
    env = {**os.environ, "SHARDFOLD_HOME": str(home / "store")}
    cmd = [sys.executable, "-m", "shardfold.client.cli", "run", "-q", str(spec)]
    proc = subprocess.Popen(
        cmd, env=env, cwd=home, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    job_id = proc.stdout.readline().strip()  # printed at submit
    time.sleep(delay)
    family = psutil.Process(proc.pid).children(recursive=True)
    running = proc.poll() is None
    proc.kill()
    proc.wait(WAIT_S)
    _, alive = psutil.wait_procs(family, timeout=60)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    return job_id, running


@pytest.mark.parametrize("kind", ["getbatch", "fedavg", "dpquery", "inference"])
def test_kill_9_at_every_point_resumes_to_the_same_output(kind, tmp_path):
    base = _inputs(kind, tmp_path)
    t0 = time.monotonic()
    ref = _shardfold(tmp_path, "run", "--json", str(_spec(kind, tmp_path, 0, base)))
    duration = time.monotonic() - t0
    assert ref.returncode == 0, ref.stderr[-2000:]
    want = _digest(tmp_path, json.loads(ref.stdout), kind)
    killed = identical = 0
    for n, point in enumerate(POINTS, 1):
        job_id, running = _kill_at(tmp_path, _spec(kind, tmp_path, n, base), point * duration)
        killed += running
        resumed = _shardfold(tmp_path, "resume", job_id)
        assert resumed.returncode == 0 or "nothing to resume" in resumed.stdout, resumed.stderr[-2000:]
        result = json.loads(_shardfold(tmp_path, "result", job_id, "--json").stdout)
        got = _digest(tmp_path, result, kind)
        identical += got == want
        if kind == "dpquery":  # charged once, every measurement drawn once
            from shardfold.functions import store

            entries = store.list_uris(f"file://{tmp_path}/store/ledger/chaos-{n}/entries/")
            kinds = [store.get_json(e)["type"] for e in entries]
            assert kinds.count("reserve") == 1 and kinds.count("spend") <= 1, kinds
    ROWS.append([kind, f"{duration:.1f}", str(len(POINTS)), str(killed), str(identical)])
    print(f"\n{kind}: run {duration:.1f} s; {len(POINTS)} kills ({killed} mid-run), {identical} identical")
    assert identical == len(POINTS)


def teardown_module() -> None:
    if ROWS:
        print("\nkind       | run s | kills | mid-run | resumed identical")
        for row in ROWS:
            print(" | ".join(c.ljust(w) for c, w in zip(row, (10, 5, 5, 7, 17), strict=True)))
