"""An aggregate task's peak memory does not grow with the number of clients.

Each shard task runs in a fresh interpreter (``tests/memchild.py`` through ``bench/benchutil``'s
``Children``, as in tests/test_memory.py), the way a Lambda function would, on the same 16 MiB model for
N = 2, 16 and 64 clients (hard links of one file, so the page cache serves them all). The growth of the peak
resident size (VmHWM, reset after the imports) across the task, and the tracemalloc peak, must be the same
for N = 64 as for N = 2 within a small tolerance (median: N = 8 vs 32, once its N x chunk matrix has reached
its budget), and within what ``task_loads`` predicts. Memory, not time: a legitimate assertion. Linux only
(``/proc/self/clear_refs``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from shardfold.functions import store
from shardfold.functions.fedavg import core
from shardfold.functions.fedavg.shardplan import RUNTIME_BYTES, Budget, MiB, task_loads
from shardfold.functions.fedavg.spec import FedAvgSpec
from shardfold.functions.specs import dump_spec
from shardfold.functions.store.uri import join

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import benchutil  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc"),
]
MODEL_MIB = 16


@pytest.fixture(scope="module")
def children():
    kids = benchutil.Children(
        Path(__file__).with_name("memchild.py"), env={**os.environ, "POWERTOOLS_LOG_LEVEL": "WARNING"}
    )
    yield kids
    kids.close()


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("fedavg-mem")
    rng = np.random.default_rng(0)
    n = MODEL_MIB * MiB // 4
    tensors = {
        "a.weight": rng.standard_normal(n // 2, dtype=np.float32),
        "b.weight": rng.standard_normal(n // 2 - 1000, dtype=np.float32).reshape(-1, 8),
        "c.half": rng.standard_normal(2000).astype(np.float16),
    }
    path = d / "client-000.safetensors"
    save_file(tensors, str(path), metadata={"num_examples": "100"})
    for i in range(1, 64):
        os.link(path, d / f"client-{i:03d}.safetensors")
    return d


# 1 MiB reads, 8 in flight, a 16 MiB robust matrix: the model is many chunks even for N = 2, so every N fills
# the read window and the numbers compare like for like.
BUDGET = Budget(chunk_bytes=MiB, inflight_bytes=8 * MiB, robust_bytes=16 * MiB)


def run_task(children, model_dir: Path, n: int, aggregator: str) -> tuple[dict, int, int]:
    """Plan here, run shard 0 in a fresh interpreter; (its stats, predicted buffer bytes, data bytes)."""
    root = store.uri.store_root()
    uris = [f"file://{model_dir / f'client-{i:03d}.safetensors'}" for i in range(n)]
    spec = FedAvgSpec(clients=[{"uri": u} for u in uris], shards=1, aggregator=aggregator)
    job_id = f"fedavg-20260101T000000-{n:06x}"
    spec_uri = join(root, "jobs", job_id, "spec.json")
    store.put_json(spec_uri, dump_spec(spec))
    planned = core.prepare(spec, job_id, root, budget=BUDGET)
    plan = core.load_plan(root, job_id)
    predicted = task_loads(plan, on_s3=False)["aggregate"].peak_bytes - RUNTIME_BYTES
    item = store.get_json(planned["worklist"]["uri"])[0]
    event = {"job_id": job_id, "spec_uri": spec_uri, "store_root": root, "item": item, "index": 0}
    req = {
        "op": "task",
        "imports": ["shardfold.functions.fedavg.kind"],
        "handler": "shardfold.functions.fedavg.handlers:aggregate",
        "event": event,
        "tracemalloc": True,
    }
    run = children.run(req, timeout_s=120)
    assert run.ok, run.note
    stats = {
        **run.result["result"],
        "rss_growth": run.result["added_rss"],
        "traced": run.result["traced_peak"],
    }
    return stats, predicted, plan.data_bytes


@pytest.mark.parametrize(
    ("aggregator", "ns"),
    [
        ("mean", (2, 16, 64)),
        # median/trimmed_mean hold N x chunk values: the matrix grows with N until it reaches
        # Budget.robust_bytes (at N = 8 here), then the chunk shrinks instead: 4x the clients, as flat
        ("median", (8, 32)),
    ],
)
def test_shard_task_peak_memory_is_flat_in_n(children, model_file, tmp_path, monkeypatch, aggregator, ns):
    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    runs = {n: run_task(children, model_file, n, aggregator) for n in ns}
    for n, (stats, predicted, data_bytes) in runs.items():
        assert stats["read_bytes"] == n * data_bytes  # it did read all N clients' whole model
        # within what the plan predicts for the task's buffers (runtime excluded)
        assert stats["traced"] <= predicted, (n, stats, predicted)
        assert stats["rss_growth"] <= predicted + 16 * MiB, (n, stats, predicted)
    small, large = runs[ns[0]][0], runs[ns[-1]][0]
    assert large["traced"] <= small["traced"] * 1.10 + 2 * MiB, (small, large)
    # the resident size also holds what glibc keeps after free (its mmap threshold moves with the sizes
    # freed): median's growth measured 20-31 MiB over runs at N = 8, 16, 32 and 64, with no trend in N. A leak
    # of 1 MiB per client would still add 24 MiB from N = 8 to 32.
    assert large["rss_growth"] <= small["rss_growth"] * 1.10 + 12 * MiB, (small, large)
