"""Progress in the user's units: the kinds' counters (items and bytes, rows, model bytes) and the progress
view that shows them with a rate, an ETA and each step's own duration."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console

from shardfold.client.progress import ProgressView
from shardfold.functions import store
from shardfold.functions.getbatch import core as getbatch
from shardfold.functions.getbatch.progress import progress as getbatch_progress
from shardfold.functions.getbatch.spec import GetBatchSpec


class Clock:
    """A clock the test moves: rich's Progress and the view's step clocks both read it."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def status(steps: dict, state: str = "RUNNING") -> SimpleNamespace:
    return SimpleNamespace(steps=steps, state=state, finished=state != "RUNNING")


def shown(view: ProgressView) -> dict[str, str]:
    """The view's lines as they stand now, by step name."""
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    console.print(view)
    lines = console.file.getvalue().splitlines()
    return {line.split()[1]: " ".join(line.split()) for line in lines if line.strip()}


def steps(prepare=0, infer=(0, None), commit=0, rows=None, size=None) -> dict:
    s = {
        "prepare": {"done": prepare, "total": 1},
        "infer": {"done": infer[0], "total": infer[1]},
        "commit": {"done": commit, "total": 1},
    }
    if rows is not None:
        s["embedded_rows"] = {"done": rows, "total": 3000, "unit": "rows"}
    if size is not None:
        s["written"] = {"done": size[0], "total": size[1], "unit": "bytes"}
    return s


def test_view_shows_units_with_a_rate_an_eta_and_each_steps_own_duration():
    clock, out = Clock(), io.StringIO()
    console = Console(file=out, width=120, force_terminal=False)
    with ProgressView("job", console=console, get_time=clock) as view:
        view.update(status(steps()))
        assert "s" not in shown(view)["commit"].split("0/1", 1)[1]  # waiting its turn: no time yet
        clock.t += 2
        view.update(status(steps(prepare=1, infer=(0, 2), rows=0)))  # the plan: rows known, GPU under way
        clock.t += 4
        view.update(status(steps(prepare=1, infer=(0, 2), rows=1200, size=(0, None))))
        now = shown(view)
        assert "1,200/3,000 rows" in now["embedded_rows"]
        assert "300 rows/s" in now["embedded_rows"] and "ETA 6s" in now["embedded_rows"]
        assert now["prepare"].endswith("2.0s")  # prepare's own time, not the job's 6 s
        assert now["infer"].endswith("4.0s")  # running since the Map's items became known
        clock.t += 3  # nothing new: the rate holds, the ETA counts down
        now = shown(view)
        assert "300 rows/s" in now["embedded_rows"] and "ETA 3s" in now["embedded_rows"]
        view.update(status(steps(prepare=1, infer=(1, 2), rows=2100, size=(3 * 2**20, None))))
        clock.t += 3
        view.update(status(steps(prepare=1, infer=(2, 2), rows=3000, size=(6 * 2**20, 6 * 2**20))))
        now = shown(view)
        assert "3,000/3,000 rows" in now["embedded_rows"] and "300 rows/s" in now["embedded_rows"]
        assert now["embedded_rows"].endswith("10.0s") and "ETA" not in now["embedded_rows"]
        assert "6.0/6.0 MiB" in now["written"] and "1.0 MiB/s" in now["written"]
        assert now["infer"].endswith("10.0s")
        clock.t += 1.5
        view.update(status(steps(prepare=1, infer=(2, 2), commit=1, rows=3000), "SUCCEEDED"))
    final = {line.split()[1]: line for line in out.getvalue().splitlines()[-5:]}
    assert final["prepare"].rstrip().endswith("2.0s") and final["infer"].rstrip().endswith("10.0s")
    assert final["commit"].rstrip().endswith("1.5s")  # from infer's end, not the job's 13.5 s
    assert "✓" in final["embedded_rows"] and "300 rows/s" in final["embedded_rows"]


def test_a_step_of_tasks_reads_as_before_and_bytes_scale_like_the_result_view():
    clock = Clock()
    with ProgressView("job", console=Console(file=io.StringIO()), get_time=clock) as view:
        view.update(status({"gather_part": {"done": 0, "total": None}, "b": {"done": 0, "total": 1000}}))
        clock.t += 1
        view.update(
            status(
                {
                    "gather_part": {"done": 3, "total": 10},
                    "b": {"done": 430, "total": 1000, "unit": "bytes"},
                    "n": {"done": 5, "total": None, "unit": "items"},
                }
            )
        )
        now = shown(view)
    assert " 3/10 " in now["gather_part"] and "/s" not in now["gather_part"]
    assert "430/1,000 B" in now["b"] and "430 B/s" in now["b"]
    assert "5/? items" in now["n"] and "ETA" not in now["n"]


def test_a_failed_job_freezes_its_steps_and_a_skipped_step_shows_no_time():
    clock = Clock()
    out = io.StringIO()
    with ProgressView("job", console=Console(file=out, width=120), get_time=clock) as view:
        view.update(status({"a": {"done": 0, "total": None}, "r": {"done": 0, "total": None}}))
        clock.t += 1
        view.update(status({"a": {"done": 1, "total": 4}, "r": {"done": 0, "total": 0}}))
        assert shown(view)["r"].endswith("0/0")  # nothing to do: no time while the job runs either
        clock.t += 2
        view.update(status({"a": {"done": 2, "total": 4}, "r": {"done": 0, "total": 0}}, "FAILED"))
        clock.t += 50
    a, r = out.getvalue().splitlines()[-2:]
    assert "✗" in a and a.rstrip().endswith("2.0s")  # its own run, up to the failure
    assert "skipped" in r and not r.rstrip().endswith("s")


def test_the_cli_tables_read_counters_with_a_unit():
    from shardfold.client.cli import _steps_summary, _steps_text

    counted = {"gather_part": {"done": 2, "total": 10}, "gathered_items": {"done": 4000, "total": 20000}}
    counted["gathered_items"]["unit"] = "items"
    assert _steps_text(counted) == "gather_part 2/10, gathered_items 4000/20000"
    assert _steps_summary(SimpleNamespace(steps=counted, state="RUNNING")) == "gather_part 2/10"


# --- the kinds' counters ------------------------------------------------------------------------------------

JOB = "getbatch-20260101T000000-abcdef"


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    r = store.uri.store_root()
    for i in range(5):
        store.put(store.uri.join(r, "data", f"obj-{i}.bin"), bytes([i]) * (100 * (i + 1)))
    return r


def test_getbatch_counts_items_and_bytes_part_by_part(root):
    spec = GetBatchSpec(items=[{"uri": f"data/obj-{i}.bin"} for i in range(5)], items_per_part=2)
    assert getbatch_progress(root, JOB) == {}  # nothing planned yet
    planned = getbatch.prepare(spec, JOB, root)
    assert getbatch_progress(root, JOB) == {
        "gathered_items": {"done": 0, "total": 5, "unit": "items"},
        "gathered_bytes": {"done": 0, "total": None, "unit": "bytes"},
    }
    getbatch.gather(spec, JOB, root, 1, planned["parts"], inline=True)  # items 2 and 3
    assert getbatch_progress(root, JOB) == {
        "gathered_items": {"done": 2, "total": 5, "unit": "items"},
        "gathered_bytes": {"done": 300 + 400, "total": None, "unit": "bytes"},
    }
    for part in (0, 2):
        getbatch.gather(spec, JOB, root, part, planned["parts"], inline=True)
    getbatch.assemble(spec, JOB, root, planned["parts"])  # the scratch goes: the result says it all
    assert getbatch_progress(root, JOB) == {
        "gathered_items": {"done": 5, "total": 5, "unit": "items"},
        "gathered_bytes": {"done": 1500, "total": 1500, "unit": "bytes"},
    }


def test_fedavg_counts_the_models_bytes_shard_by_shard(root):
    from safetensors.numpy import save

    from shardfold.functions.fedavg import core as fedavg
    from shardfold.functions.fedavg.progress import progress
    from shardfold.functions.fedavg.shardplan import Budget
    from shardfold.functions.fedavg.spec import FedAvgSpec

    job = "fedavg-20260101T000000-abcdef"
    rng = np.random.default_rng(1)
    uris = []
    for i in range(3):
        uris.append(store.uri.join(root, "round", f"c{i}.safetensors"))
        store.put(uris[-1], save({"w": rng.standard_normal(64).astype(np.float32)}))
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris], uniform=True, shards=4)
    assert progress(root, job) == {}
    planned = fedavg.prepare(spec, job, root, budget=Budget(min_shard_bytes=1, chunk_bytes=64))
    assert planned["shards"] == 4 and planned["bytes"] == 256
    assert progress(root, job) == {"aggregated_bytes": {"done": 0, "total": 256, "unit": "bytes"}}
    fedavg.aggregate(spec, job, root, 2)
    assert progress(root, job) == {"aggregated_bytes": {"done": 64, "total": 256, "unit": "bytes"}}
    for shard in (0, 1, 3):
        fedavg.aggregate(spec, job, root, shard)
    fedavg.commit(spec, job, root, planned["shards"])
    assert progress(root, job) == {"aggregated_bytes": {"done": 256, "total": 256, "unit": "bytes"}}


@pytest.mark.slow  # end to end: a job
def test_a_local_getbatch_jobs_status_carries_the_unit_counters(local_client):
    for i in range(7):
        store.put(local_client.uri(f"data/o{i}.bin"), b"x" * (10 + i))
    spec = {"kind": "getbatch", "items": [{"uri": f"data/o{i}.bin"} for i in range(7)], "items_per_part": 3}
    job = local_client.submit(spec)
    out = io.StringIO()
    final = job.wait(console=Console(file=out, width=120), timeout_s=120)
    assert final.state == "SUCCEEDED"
    want = {
        "gathered_items": {"done": 7, "total": 7, "unit": "items"},
        "gathered_bytes": {"done": 7 * 10 + 21, "total": 91, "unit": "bytes"},
    }
    assert {k: final.steps[k] for k in want} == want
    assert {k: job.status().steps[k] for k in want} == want
    assert final.steps["gather_part"] == {"done": 3, "total": 3}  # the executor's counts are unchanged
    bars = out.getvalue()
    assert "7/7 items" in bars and "91/91 B" in bars


def test_counters_not_there_yet_are_asked_again_soon_then_every_two_seconds(local_client, monkeypatch):
    # a counter's bar begins when its work is planned, not up to two seconds later (its clock starts there)
    from shardfold.client import sdk
    from shardfold.functions.getbatch import progress as module

    clock, asked = Clock(), []
    monkeypatch.setattr(sdk, "time", SimpleNamespace(monotonic=clock))
    monkeypatch.setattr(module, "progress", lambda root, job_id: asked.append(clock.t) or found)
    job = sdk.Job(local_client, JOB, "getbatch")

    def show() -> dict:
        return job._with_kind_progress(SimpleNamespace(steps={}, finished=False), throttle_s=2.0).steps

    found: dict = {}
    assert show() == {}
    clock.t += 0.1
    assert show() == {} and len(asked) == 1  # at most four times a second while there are none
    clock.t += 0.2
    found = {"gathered_items": {"done": 0, "total": 5, "unit": "items"}}
    assert show() == found and len(asked) == 2
    clock.t += 1.5
    found = {"gathered_items": {"done": 2, "total": 5, "unit": "items"}}
    assert show()["gathered_items"]["done"] == 0 and len(asked) == 2  # then every throttle_s
    clock.t += 0.5
    assert show() == found and len(asked) == 3
